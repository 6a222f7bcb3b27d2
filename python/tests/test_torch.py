"""adjoint_sharding.torch.SSMStack against plain PyTorch autograd of the same
layers in float64 (the model of perf_tests/torch_baseline.py): exact, the
paper's (stop-gradient on each layer's input in its branch), the paper's with a
window T̄ (autograd with the state detached T̄ steps back), and the levers."""
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed in this venv (docs/python.md)")

import adjoint_sharding as ash  # noqa: E402
from adjoint_sharding.torch import SSMStack  # noqa: E402
from conftest import SOURCE_DIR  # noqa: E402

sys.path.insert(0, str(SOURCE_DIR / "perf_tests"))
import torch_baseline as tb  # noqa: E402

F = torch.nn.functional


def oracle_model(stack):
    """torch_baseline's model (embedding and head unused) holding the stack's layers in float64."""
    m = tb.SSMModel(17, stack.width, stack.state, stack.num_layers, torch.float64, 4)
    with torch.no_grad():
        for name, arr in stack.arrays().items():
            m[name].copy_(torch.from_numpy(arr).to(torch.float64))
    return m


def truncated_branch(m, y, k, Tbar):
    """The layer's branch ỹ with the state's gradient cut T̄ steps back (docs/design.md §2, E2):
    output t sees steps i in [t-T̄+1, t]; h before step t-T̄+1 enters as a constant."""
    L = f"layers/{k:03d}/"
    yh = tb.rms_norm(y, m[L + "norm"])
    delta = F.softplus(yh @ m[L + "W_delta"].T + m[L + "b_delta"])
    A = torch.exp(delta[..., None] * -torch.exp(m[L + "A_log"]))
    beta = yh @ m[L + "W_B"].T
    gamma = yh @ m[L + "W_C"].T
    u = (delta * yh)[..., None] * beta[:, :, None, :]
    B, T, P, N = A.shape
    with torch.no_grad():  # the states the forward sees
        hs, h = [], torch.zeros(B, P, N, dtype=y.dtype)
        for t in range(T):
            h = A[:, t] * h + u[:, t]
            hs.append(h)
    outs = []
    for t in range(T):
        s0 = max(0, t - Tbar + 1)
        h = hs[s0 - 1].detach() if s0 > 0 else torch.zeros(B, P, N, dtype=y.dtype)
        for s in range(s0, t + 1):
            h = A[:, s] * h + u[:, s]
        outs.append((h @ gamma[:, t, :, None])[..., 0])
    return torch.stack(outs, 1) + m[L + "D"] * yh


def oracle_grads(stack, y0, W, mode, Tbar=0):
    m = oracle_model(stack)
    y0 = y0.detach().clone().requires_grad_(True)
    y = y0
    for k in range(stack.num_layers):
        if mode == "exact":
            y = m.layer(y, k)
        elif mode == "paper":
            yd = y.detach()
            y = y + (m.layer(yd, k) - yd)
        else:
            y = y + truncated_branch(m, y.detach(), k, Tbar)
    (W * y).sum().backward()
    names = [f"layers/{k:03d}/{n}" for k in range(stack.num_layers)
             for n in ("norm", "W_delta", "b_delta", "A_log", "W_B", "W_C", "D")]
    return y.detach(), y0.grad, {n: m[n].grad for n in names}


def stack_grads(stack, y0, W):
    y0 = y0.detach().clone().requires_grad_(True)
    stack.zero_grad(set_to_none=True)
    yK = stack(y0)
    (W * yK).sum().backward()
    return yK.detach(), y0.grad, {n.replace(".", "/"): p.grad for n, p in stack.named_parameters()}


def rel(a, b):
    return float((a - b).abs().max() / max(float(b.abs().max()), 1e-300))


def make_stack(K, **kw):
    s = SSMStack(8, 4, K, dtype=torch.float64, seed=K, chunk=4, **kw)
    g = torch.Generator().manual_seed(K)
    with torch.no_grad():  # off the special values (norm = 1, D = 1, ...)
        for p in s.parameters():
            p.add_(0.3 * (2 * torch.rand(p.shape, generator=g, dtype=torch.float64) - 1))
    return s


MODES = [("exact", {}), ("paper", {"detach_inputs": True}), ("window", {"detach_inputs": True, "truncate": 4})]


@pytest.mark.parametrize("K", [1, 2, 3])
@pytest.mark.parametrize("B,T", [(1, 13), (2, 9)])
@pytest.mark.parametrize("mode,opts", MODES, ids=[m for m, _ in MODES])
def test_gradients_equal_autograd_float64(K, B, T, mode, opts):
    stack = make_stack(K, **opts)
    g = torch.Generator().manual_seed(100 * K + T)
    y0 = torch.randn(B, T, 8, dtype=torch.float64, generator=g)
    W = torch.randn(B, T, 8, dtype=torch.float64, generator=g)
    yK, gy0, gp = stack_grads(stack, y0, W)
    ryK, rgy0, rgp = oracle_grads(stack, y0, W, mode, opts.get("truncate", 0))
    assert rel(yK, ryK) <= 1e-12
    assert rel(gy0, rgy0) <= 1e-9, "dL/dy0"
    for n in rgp:
        assert rel(gp[n], rgp[n]) <= 1e-9, n


@pytest.mark.parametrize("levers", [{"layer_checkpoint": 2}, {"token_block": 8}, {"layer_checkpoint": 3, "token_block": 12}])
def test_levers_equal_autograd(levers):
    stack = make_stack(3, **levers)
    g = torch.Generator().manual_seed(7)
    y0 = torch.randn(2, 29, 8, dtype=torch.float64, generator=g)
    W = torch.randn(2, 29, 8, dtype=torch.float64, generator=g)
    _, gy0, gp = stack_grads(stack, y0, W)
    _, rgy0, rgp = oracle_grads(stack, y0, W, "exact")
    assert rel(gy0, rgy0) <= 1e-9
    for n in rgp:
        assert rel(gp[n], rgp[n]) <= 1e-9, n


def test_bf16_storage_is_close():
    stack = make_stack(3, storage="bf16", layer_checkpoint=1)
    g = torch.Generator().manual_seed(8)
    y0 = torch.randn(1, 21, 8, dtype=torch.float64, generator=g)
    W = torch.randn(1, 21, 8, dtype=torch.float64, generator=g)
    _, gy0, gp = stack_grads(stack, y0, W)
    _, rgy0, rgp = oracle_grads(stack, y0, W, "exact")
    assert rel(gy0, rgy0) <= 3e-2
    for n in rgp:
        assert rel(gp[n], rgp[n]) <= 5e-2, n


def test_float32_is_close_to_float64():
    s64 = make_stack(2)
    s32 = SSMStack(8, 4, 2, dtype=torch.float32, chunk=4, _params=s64.arrays())
    g = torch.Generator().manual_seed(9)
    y0 = torch.randn(2, 17, 8, dtype=torch.float64, generator=g)
    W = torch.randn(2, 17, 8, dtype=torch.float64, generator=g)
    _, gy0, gp = stack_grads(s64, y0, W)
    _, gy0f, gpf = stack_grads(s32, y0.float(), W.float())
    assert gy0f.dtype == torch.float32 and rel(gy0f.double(), gy0) <= 1e-4
    for n in gp:
        assert rel(gpf[n].double(), gp[n]) <= 1e-4, n


def test_from_checkpoint_names_and_layouts(tiny_model):
    ckpt = tiny_model[0]
    s = SSMStack.from_checkpoint(ckpt, dtype=torch.float64)
    ck = ash.load(ckpt)
    names = [n for n, _ in s.named_parameters()]
    assert names[:2] == ["layers.000.norm", "layers.000.W_delta"] and len(names) == 7 * 3
    for n, p in s.named_parameters():
        assert np.array_equal(p.detach().numpy(), ck[n.replace(".", "/")]), n
    assert set(s.state_dict()) == set(names)


def test_stack_gradient_equals_the_models_layers(tiny_model):
    """Embedding and head in PyTorch around the stack: the layers' gradient and the
    embedding's equal grad() of the same checkpoint (E3 in C++ both, head in torch)."""
    ckpt, _, ids = tiny_model
    ck = ash.load(ckpt)
    for kw in ({}, {"detach_inputs": True}, {"detach_inputs": True, "truncate": 5}):
        s = SSMStack.from_checkpoint(ckpt, dtype=torch.float64, **kw)
        E = torch.tensor(ck["embedding"], requires_grad=True)
        head, wf = torch.tensor(ck["head"], requires_grad=True), torch.tensor(ck["final_norm"], requires_grad=True)
        x = torch.from_numpy(ids[:74].astype(np.int64)).reshape(2, 37)
        yK = s(E[x])
        logits = tb.rms_norm(yK, wf) @ head.T
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, 17), x[:, 1:].reshape(-1))
        loss.backward()
        rloss, ref = ash.grad(ckpt, ids, seq_len=37, batch=2, engine="adjoint-exact", **kw)
        assert abs(loss.item() - rloss) <= 1e-12
        assert rel(E.grad, torch.from_numpy(ref["embedding"])) <= 1e-10
        assert rel(head.grad, torch.from_numpy(ref["head"])) <= 1e-10
        for n, p in s.named_parameters():
            assert rel(p.grad, torch.from_numpy(ref[n.replace(".", "/")])) <= 1e-10, (n, kw)


def test_bad_inputs_raise_clear_errors():
    s = make_stack(2)
    y = torch.zeros(2, 5, 8, dtype=torch.float64)
    with pytest.raises(ash.Error, match="float32"):
        s(y.float())
    with pytest.raises(ash.Error, match=r"\[B, T, P=8\]"):
        s(torch.zeros(2, 5, 7, dtype=torch.float64))
    with pytest.raises(ash.Error, match=r"\[B, T, P=8\]"):
        s(torch.zeros(10, 8, dtype=torch.float64))
    with pytest.raises(ash.Error, match="not contiguous"):
        s(torch.zeros(2, 8, 5, dtype=torch.float64).transpose(1, 2))
    with pytest.raises(ash.Error, match="meta"):
        s(torch.zeros(2, 5, 8, dtype=torch.float64, device="meta"))
    with pytest.raises(ash.Error, match="B >= 1"):
        s(torch.zeros(0, 5, 8, dtype=torch.float64))
    with pytest.raises(ash.Error, match="torch.Tensor"):
        s(np.zeros((2, 5, 8)))
    with pytest.raises(ash.Error, match="dtype"):
        SSMStack(8, 4, 1, dtype=torch.float16)
    with pytest.raises(ash.Error, match="detach"):  # a window without detach_inputs: at construction
        make_stack(1, truncate=4)
    with torch.no_grad():
        s.layers["000"].W_delta.data = s.layers["000"].W_delta.data.float()
    with pytest.raises(ash.Error, match="float32"):
        s(y)
    # a non-contiguous cotangent is fine (made contiguous inside backward)
    s2 = make_stack(1)
    y0 = torch.randn(1, 6, 8, dtype=torch.float64, requires_grad=True)
    out = s2(y0)
    out.backward(torch.ones(8, 6, 1, dtype=torch.float64).expand(8, 6, 1).permute(2, 1, 0))
    assert torch.isfinite(y0.grad).all()


def test_optimizer_step_trains():
    torch.manual_seed(0)
    s = SSMStack(16, 4, 2, dtype=torch.float32, chunk=8)
    emb = torch.nn.Embedding(32, 16)
    head = torch.nn.Linear(16, 32)
    opt = torch.optim.AdamW([*s.parameters(), *emb.parameters(), *head.parameters()], lr=1e-2)
    x = torch.arange(64).remainder(7).reshape(2, 32)
    losses = []
    for _ in range(30):
        opt.zero_grad()
        loss = F.cross_entropy(head(s(emb(x)))[:, :-1].reshape(-1, 32), x[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


@pytest.mark.parametrize("mode,opts", MODES[:2] + [("exact", {"token_block": 8, "layer_checkpoint": 2})],
                         ids=["exact", "paper", "levers"])
def test_cu_seqlens_equal_each_document_alone(mode, opts):
    """Packed documents (cu_seqlens): y_K and every gradient equal autograd run on
    each document as its own sequence, summed (docs/design.md §1)."""
    stack = make_stack(3, **opts)
    g = torch.Generator().manual_seed(21)
    B, T = 2, 13
    y0 = torch.randn(B, T, 8, dtype=torch.float64, generator=g)
    W = torch.randn(B, T, 8, dtype=torch.float64, generator=g)
    cu = [0, 4, 5, 13, 19, 26]  # row 0: 4, 1, 8 tokens; row 1: 6, 7 (flat offsets b*T + t)
    y = y0.detach().clone().requires_grad_(True)
    stack.zero_grad(set_to_none=True)
    yK = stack(y, cu_seqlens=torch.tensor(cu))
    (W * yK).sum().backward()
    gp = {n.replace(".", "/"): p.grad for n, p in stack.named_parameters()}
    ref_y = torch.zeros_like(y0)
    ref_g = torch.zeros_like(y0)
    ref_p = None
    for s, e in zip(cu[:-1], cu[1:]):
        b, t0, t1 = s // T, s % T, s % T + (e - s)
        ry, rgy, rgp = oracle_grads(stack, y0[b:b + 1, t0:t1], W[b:b + 1, t0:t1], mode)
        ref_y[b, t0:t1] = ry[0]
        ref_g[b, t0:t1] = rgy[0]
        ref_p = rgp if ref_p is None else {n: ref_p[n] + rgp[n] for n in rgp}
    assert rel(yK.detach(), ref_y) <= 1e-12
    assert rel(y.grad, ref_g) <= 1e-9, "dL/dy0"
    for n in ref_p:
        assert rel(gp[n], ref_p[n]) <= 1e-9, n
    # Without the starts the result differs (the state runs across documents).
    assert rel(stack(y0.clone()).detach(), ref_y) > 1e-3
    with pytest.raises(ash.Error, match="cu_seqlens must lie in"):
        stack(y0, cu_seqlens=[0, 27])
