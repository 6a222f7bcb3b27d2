"""grad(checkpoint, ids=...): a 2-D (B, L) batch of windows with transformers' loss
convention (docs/python.md): row b predicts ids[b, 1:] from ids[b, :-1] and the loss
is the mean over all B·(L−1) targets. On a Mamba checkpoint, the loss and every
parameter's gradient equal transformers' `model(input_ids=ids, labels=ids).loss` and
its autograd gradients in float64 (the float32 casts removed as in test_mamba.py) to
1e-10 relative; on an SSM-ResNet checkpoint, grad(ids=) is grad(tokens=) of the same
windows, bit for bit.
"""
import numpy as np
import pytest

import adjoint_sharding as ash

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from test_mamba import ash_config, assert_close, float64_slow_path, hf_model, to_ash, to_ash_grads  # noqa: E402,F401


def hf_labels_loss_grads(model, ids, K, tied):
    """transformers' own loss (labels=ids: its shift, its mean) and autograd gradients."""
    model.zero_grad()
    t = torch.tensor(ids, dtype=torch.long)
    out = model(input_ids=t, labels=t)
    assert out.logits.dtype == torch.float64
    out.loss.backward()
    return out.loss.item(), to_ash_grads({n: p.grad for n, p in model.named_parameters()}, K, tied)


# (K, B, L, conv kernel, dt_rank, tied, the checkpoint's data.separator)
CASES = [(2, 3, 7, 4, 2, True, ""), (1, 1, 10, 3, 1, False, ""), (3, 2, 5, 2, 3, False, "\\u0003")]


@pytest.mark.parametrize("K,B,L,Kc,R,tied,sep", CASES)
def test_mamba_ids_match_transformers_labels_loss(tmp_path, float64_slow_path, K, B, L, Kc, R, tied, sep):  # noqa: F811
    V, D, N, expand, eps = 13, 6, 4, 2, 1e-5
    model = hf_model(V, D, N, K, expand, Kc, R, tied, eps, seed=K * 7 + L)
    cfg = ash_config(V, D, N, K, expand, Kc, R, tied, eps)
    if sep:  # a model trained on documents: rows of ids are whole sequences all the same
        cfg["data"] = {"separator": sep}
    path = tmp_path / "m.h5"
    ash.save(path, to_ash(model, K, tied), cfg, "double")
    ids = np.random.default_rng(L).integers(0, V, (B, L))
    if sep:
        ids[:, 2] = 3  # the separator inside every row: its next token is still a target
    loss, grads = ash.grad(path, ids=ids, engine="backprop")
    ref_loss, ref_grads = hf_labels_loss_grads(model, ids, K, tied)
    assert_close(loss, grads, ref_loss, ref_grads)
    assert "layers/000/in_proj" in grads
    # seq_len and batch may be given when they match the shape
    again, _ = ash.grad(path, ids=ids.astype(np.uint16), seq_len=L, batch=B, engine="backprop")
    assert again == loss


def test_ssm_resnet_ids_equal_flat_tokens(tmp_path):
    ck = ash.init({"model": {"vocab": 17, "width": 8, "state": 4, "layers": 2, "seed": 3}, "grad": {"chunk": 4}},
                  "double")
    rng = np.random.default_rng(4)
    for k, v in ck.items():
        ck[k] = v + 0.3 * rng.uniform(-1, 1, v.shape)
    path = tmp_path / "m.h5"
    ash.save(path, ck)
    B, L = 3, 11
    ids = rng.integers(0, 17, (B, L))
    for engine, kw in [("adjoint-exact", {}), ("backprop", {}), ("adjoint-exact", {"token_block": 4})]:
        loss, grads = ash.grad(path, ids=ids, engine=engine, **kw)
        ref_loss, ref = ash.grad(path, ids.reshape(-1), seq_len=L, batch=B, engine=engine, **kw)
        assert loss == ref_loss and sorted(grads) == sorted(ref)
        for name in ref:
            assert np.array_equal(grads[name], ref[name]), (engine, name)
        assert "layers/001/W_delta" in grads


def test_ids_are_checked(tmp_path):
    path = tmp_path / "m.h5"
    ash.save(path, ash.init({"model": {"vocab": 17, "width": 8, "state": 4, "layers": 1}}, "double"))
    ids = np.arange(20).reshape(4, 5) % 17
    for call, msg in [
        (lambda: ash.grad(path, ids=ids.reshape(2, 2, 5)), "ids must be a 2-D array"),
        (lambda: ash.grad(path, ids=ids[0]), "ids must be a 2-D array"),
        (lambda: ash.grad(path, ids=ids, seq_len=4), r"seq_len=4 does not match ids of shape \(4, 5\)"),
        (lambda: ash.grad(path, ids=ids, batch=2), r"batch=2 does not match ids of shape \(4, 5\)"),
        (lambda: ash.grad(path, ids.reshape(-1), ids=ids), "not both"),
        (lambda: ash.grad(path), "needs tokens"),
        # no seq_len or batch: the checkpoint's (256, 4), as `ash grad` without --set
        (lambda: ash.grad(path, ids.reshape(-1)), r"need 1024 tokens for 4 window\(s\) of T = 256"),
        (lambda: ash.grad(path, ids=ids.astype(np.float64)), "must hold integers"),
        (lambda: ash.grad(path, ids=ids + 17), ">= vocab"),
        (lambda: ash.grad(path, ids=ids[:, :1]), "data.seq_len must be >= 2"),
    ]:
        with pytest.raises(ash.Error, match=msg):
            call()
