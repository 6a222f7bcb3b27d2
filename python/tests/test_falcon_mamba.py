"""model.arch = "falcon_mamba" against transformers' own FalconMambaForCausalLM
(docs/design.md §1; the Mamba's checks of test_mamba.py, test_hf_convert.py,
test_mamba_generate.py and test_torch_wrap.py, on the block with weightless RMSNorms
on x_proj's δ, B and C, of epsilon mixer_rms_eps):
  - the loss and every parameter's gradient of E1 and E3 (tied and untied, K 1..3,
    documents) to 1e-10 relative in float64, E2 and E3 detached against the model
    with each mixer's input detached;
  - `ash import-hf` of a save_pretrained folder (one file or shards), `ash export-hf`
    back: the same tensors bit for bit, transformers' config.json keys, and
    from_pretrained of the export giving the same logits; what is not built refused;
  - greedy generation (Python's generate and `ash generate`) equal to transformers';
  - adjoint_sharding.torch.wrap of a FalconMambaForCausalLM / FalconMambaModel:
    loss, logits and every .grad equal to the unwrapped model's.
mixer_rms_eps is 0.05 in most cases, where it moves every norm (x_proj's outputs
are O(0.5) here), so a mapping that dropped it would fail. The oracle is
transformers' slow path in float64 with its float32 casts removed
(test_mamba.py's float64_slow_path, which also keeps FalconMambaRMSNorm in float64
and turns the mixer norms' x.float() into the identity).
"""
import copy
import json
import subprocess

import numpy as np
import pytest

import adjoint_sharding as ash
from conftest import run_cli

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from adjoint_sharding.torch import wrap  # noqa: E402
from test_hf_convert import assert_bitwise, f64, fail_cli, load_tensors, shard  # noqa: E402
from test_mamba import (RTOL, ash_config, assert_close, assert_documents_match,  # noqa: E402,F401
                        detached_mixer_inputs, float64_slow_path, hf_loss_grads, hf_model, to_ash)
from test_mamba_generate import hf_greedy, lively  # noqa: E402
from test_torch_wrap import (assert_same, assert_wrapped_backbone, loss_and_grads, no_hf_blocks,  # noqa: E402
                             rel_err)

V, D, N, EXPAND, EPS, MIXER_EPS = 13, 6, 4, 2, 1e-5, 0.05


def falcon(K, Kc, R, tied, seed, mixer_eps=MIXER_EPS, V=V, D=D, N=N, expand=EXPAND):
    """A tiny FalconMambaForCausalLM in float64, its parameters moved off their special values."""
    model = hf_model(V, D, N, K, expand, Kc, R, tied, EPS, seed=seed, mixer_eps=mixer_eps)
    assert type(model).__name__ == "FalconMambaForCausalLM"
    return model


def saved_checkpoint(tmp_path, model, K, Kc, R, tied, mixer_eps=MIXER_EPS, V=V, D=D, N=N, expand=EXPAND, data=None):
    cfg = ash_config(V, D, N, K, expand, Kc, R, tied, EPS, mixer_eps)
    if data:
        cfg["data"] = data
    path = tmp_path / "m.h5"
    ash.save(path, to_ash(model, K, tied), cfg, "double")
    return path


# ---- (a) the loss and every gradient against transformers' autograd -------------------------

# (K, T, batch, conv kernel, dt_rank, tied, mixer_rms_eps)
CASES = [(1, 9, 2, 4, 2, True, MIXER_EPS), (2, 7, 1, 2, 3, False, MIXER_EPS), (3, 11, 2, 3, 2, False, 1e-6)]


@pytest.mark.parametrize("K,T,B,Kc,R,tied,mixer_eps", CASES)
def test_e1_and_e3_match_transformers(tmp_path, float64_slow_path, K, T, B, Kc, R, tied, mixer_eps):
    model = falcon(K, Kc, R, tied, seed=K * 100 + T, mixer_eps=mixer_eps)
    path = saved_checkpoint(tmp_path, model, K, Kc, R, tied, mixer_eps)
    ids = np.random.default_rng(T).integers(0, V, B * T)
    ref_loss, ref_grads = hf_loss_grads(model, ids.reshape(B, T), K, tied)
    for kw in (dict(engine="backprop"), dict(engine="adjoint-exact", set=["grad.chunk=2", "grad.wave=3"])):
        loss, grads = ash.grad(path, ids, seq_len=T, batch=B, **kw)
        assert_close(loss, grads, ref_loss, ref_grads)


def test_detached_match_transformers(tmp_path, float64_slow_path, detached_mixer_inputs):
    """E2 (full window) and E3 detached: the gradient of the model whose mixers see their input detached."""
    K, T, B, Kc, R, tied = 2, 9, 2, 3, 2, False
    model = falcon(K, Kc, R, tied, seed=17)
    path = saved_checkpoint(tmp_path, model, K, Kc, R, tied)
    ids = np.random.default_rng(4).integers(0, V, B * T)
    ref_loss, ref_grads = hf_loss_grads(model, ids.reshape(B, T), K, tied)
    for kw in (dict(engine="adjoint"), dict(engine="adjoint-exact", detach_inputs=True)):
        loss, grads = ash.grad(path, ids, seq_len=T, batch=B, set=["grad.chunk=4"], **kw)
        assert_close(loss, grads, ref_loss, ref_grads)
    # the detached model's gradient is not the exact one: the fixture changed something
    exact = ash.grad(path, ids, seq_len=T, batch=B, engine="backprop")[1]
    assert max(np.max(np.abs(exact[n] - r)) / np.max(np.abs(r)) for n, r in ref_grads.items()) > 1e-4


def test_documents_match_per_document_runs(tmp_path, float64_slow_path):
    """Three documents in one window (each ends with token 3): the target-weighted mean of each
    document's own loss and gradient, run alone through transformers."""
    K, Kc, R, tied = 2, 4, 2, True
    model = falcon(K, Kc, R, tied, seed=3, V=9, D=4, N=3)
    assert_documents_match(tmp_path, model, ash_config(9, 4, 3, K, EXPAND, Kc, R, tied, EPS, MIXER_EPS))


def test_the_mixer_norms_are_computed(tmp_path, float64_slow_path):
    """The same parameters as a Mamba (no norms), or with another mixer_rms_eps, give another
    loss: the comparisons above would see a block computed without its norms or its epsilon."""
    K, T, B, Kc, R, tied = 2, 9, 1, 3, 2, True
    model = falcon(K, Kc, R, tied, seed=29)
    ids = np.random.default_rng(6).integers(0, V, B * T)
    ref_loss, _ = hf_loss_grads(model, ids.reshape(B, T), K, tied)
    for mixer_eps in (None, 1e-6):
        (tmp_path / str(mixer_eps)).mkdir()
        path = saved_checkpoint(tmp_path / str(mixer_eps), model, K, Kc, R, tied, mixer_eps)
        loss = ash.grad(path, ids, seq_len=T, batch=B, engine="backprop")[0]
        assert abs(loss - ref_loss) > 1e-4 * ref_loss, (mixer_eps, loss, ref_loss)


# ---- (b) import-hf / export-hf ----------------------------------------------------------------

def logits_of(model, ids):
    with torch.no_grad():
        return model(input_ids=torch.tensor(ids, dtype=torch.long)).logits


@pytest.mark.parametrize("dtype,precision,tied", [(torch.float32, "float", True), (torch.float64, "double", False),
                                                  (torch.float32, "double", False)])
def test_import_export_round_trip(tmp_path, ash_cli, float64_slow_path, dtype, precision, tied):
    """save_pretrained, import-hf, export-hf (the checkpoint's precision, then the folder's dtype):
    the same tensors bit for bit, FalconMambaConfig's keys, and from_pretrained of the export
    giving the original's logits (float64 compute)."""
    K, Kc, R, T, B = 2, 3, 2, 9, 2
    model = falcon(K, Kc, R, tied, seed=11)
    src = tmp_path / "src"
    copy.deepcopy(model).to(dtype).save_pretrained(src)
    ck, out = tmp_path / "m.h5", tmp_path / "out"
    printed = run_cli(ash_cli, "import-hf", "--from", src, "--out", ck, "--precision", precision)
    assert "FalconMambaForCausalLM" in printed and f"mixer_rms_eps {MIXER_EPS:g}" in printed, printed
    stored = ash.load(ck).config["model"]
    assert stored["arch"] == "falcon_mamba" and stored["mixer_rms_eps"] == MIXER_EPS
    run_cli(ash_cli, "export-hf", "--checkpoint", ck, "--out", out,
            "--dtype", "float" if dtype == torch.float32 else "double")
    before = load_tensors(src)
    if tied:
        before.pop("lm_head.weight", None)  # a tied copy, if this saver kept one
    assert_bitwise(before, load_tensors(out))
    theirs, ours = (json.loads((d / "config.json").read_text()) for d in (src, out))
    assert ours["model_type"] == "falcon_mamba" and ours["architectures"] == ["FalconMambaForCausalLM"]
    for key in ("mixer_rms_eps", "hidden_size", "state_size", "num_hidden_layers", "vocab_size", "expand",
                "intermediate_size", "conv_kernel", "time_step_rank", "tie_word_embeddings", "layer_norm_epsilon",
                "use_bias", "use_conv_bias", "hidden_act", "dtype"):
        assert ours[key] == theirs[key], key
    loaded = transformers.FalconMambaForCausalLM.from_pretrained(out)
    assert loaded.config.mixer_rms_eps == MIXER_EPS and loaded.config.tie_word_embeddings == tied
    assert loaded.dtype == dtype
    ids = np.random.default_rng(2).integers(0, V, (B, T))
    want = logits_of(f64(transformers.FalconMambaForCausalLM.from_pretrained(src)), ids)
    # The same parameters bit for bit (above), so the same logits; within 1e-12 of their scale, not
    # bit for bit: two separately built torch models may take different CPU kernels (test_hf_convert.py).
    got = logits_of(f64(loaded), ids)
    assert (got - want).abs().max().item() <= 1e-12 * max(1.0, want.abs().max().item())
    # and ash's own loss of the imported checkpoint is transformers' (float64 compute)
    ref = torch.nn.functional.cross_entropy(want[:, :-1].reshape(-1, V), torch.tensor(ids)[:, 1:].reshape(-1))
    ev = ash.evaluate(ck, ids.reshape(-1), seq_len=T, batch=B, precision="double")
    assert abs(ev["loss"] - ref.item()) <= RTOL * ref.item(), (ev, ref)


def test_init_export_import_and_sharded_folder(tmp_path, ash_cli, float64_slow_path):
    """An `ash init` FalconMamba (mixer_rms_eps 1e-3), exported, loads in transformers with ash's loss;
    Python's import_hf of it as two shards and an index gives the parameters back bit for bit."""
    Vi, T, B = 37, 9, 2
    ck = tmp_path / "m.h5"
    run_cli(ash_cli, "init", "--out", ck, "--precision", "double", "--set", "model.arch=falcon_mamba",
            "--set", f"model.vocab={Vi}", "--set", "model.width=8", "--set", "model.state=3",
            "--set", "model.layers=2", "--set", "model.tie_embeddings=false", "--set", "model.dt_rank=2",
            "--set", "model.mixer_rms_eps=1e-3")
    w = ash.export_hf(ck, tmp_path / "hf")
    assert w["dtype"] == "F64"
    model = f64(transformers.FalconMambaForCausalLM.from_pretrained(tmp_path / "hf"))
    assert model.config.mixer_rms_eps == 1e-3
    ids = np.random.default_rng(8).integers(0, Vi, (B, T))
    logits = logits_of(model, ids)
    ref = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, Vi), torch.tensor(ids)[:, 1:].reshape(-1))
    ev = ash.evaluate(ck, ids.reshape(-1), seq_len=T, batch=B, precision="double")
    assert abs(ev["loss"] - ref.item()) <= RTOL * ref.item(), (ev, ref)
    # the export as shards (what save_pretrained writes for a large model)
    r = ash.import_hf(shard(tmp_path / "hf"), tmp_path / "back.h5")
    assert r["config"]["model"]["arch"] == "falcon_mamba" and r["config"]["model"]["mixer_rms_eps"] == 1e-3
    assert r["ignored"] == []
    a, b = ash.load(ck), ash.load(tmp_path / "back.h5")
    assert sorted(a) == sorted(b) and all(a[k].tobytes() == b[k].tobytes() for k in a)


@pytest.mark.parametrize("change,needle", [
    ({"use_bias": True}, "use_bias = true"),
    ({"use_conv_bias": False}, "use_conv_bias = false"),
    ({"hidden_act": "gelu"}, 'hidden_act "gelu" is not supported'),
    ({"intermediate_size": 7}, "intermediate_size 7 is not expand"),
    ({"mixer_rms_eps": 0}, '"mixer_rms_eps" is 0, not a positive number'),
    ({"mixer_rms_eps": "small"}, '"mixer_rms_eps" is "small"'),
    ({"architectures": ["MambaForCausalLM"]}, 'is not ["FalconMambaForCausalLM"] (model_type "falcon_mamba")'),
    ({"model_type": "mamba"}, 'architectures ["FalconMambaForCausalLM"] is not ["MambaForCausalLM"]'),
    ({"model_type": "falcon_mamba2"}, 'model_type "falcon_mamba2" is not "mamba", "falcon_mamba" or "mamba2"'),
])
def test_refusals(tmp_path, ash_cli, change, needle):
    """What a FalconMamba folder may hold that we do not build: exit 2 and ash.Error naming it."""
    src = tmp_path / "src"
    falcon(1, 2, 1, True, seed=2).to(torch.float32).save_pretrained(src)
    c = json.loads((src / "config.json").read_text())
    c.update(change)
    (src / "config.json").write_text(json.dumps(c))
    rc, err = fail_cli(ash_cli, "import-hf", "--from", src, "--out", tmp_path / "m.h5")
    assert rc == 2 and needle in err, err
    with pytest.raises(ash.Error, match="use_bias|use_conv_bias|hidden_act|intermediate|mixer_rms_eps|"
                                        "architectures|model_type"):
        ash.import_hf(src, tmp_path / "m.h5")
    assert not (tmp_path / "m.h5").exists()


def test_falcon_config_keys(tmp_path):
    """Without model_type, architectures says which model it is; use_falcon_mambapy (FalconMambaConfig's
    old name of use_mambapy) is FalconMamba's own key, not ignored; mixer_rms_eps absent is 1e-6."""
    src = tmp_path / "src"
    falcon(1, 2, 1, True, seed=2).to(torch.float32).save_pretrained(src)
    c = json.loads((src / "config.json").read_text())
    del c["model_type"], c["mixer_rms_eps"]
    c["use_falcon_mambapy"] = False
    (src / "config.json").write_text(json.dumps(c))
    r = ash.import_hf(src, tmp_path / "m.h5")
    assert r["config"]["model"]["arch"] == "falcon_mamba" and r["config"]["model"]["mixer_rms_eps"] == 1e-6
    assert r["ignored"] == []


# ---- (c) greedy generation -------------------------------------------------------------------

@pytest.mark.parametrize("K,Dg,Ng,expand,Kc,R,tied,seed", [(2, 8, 4, 2, 4, 2, True, 1), (3, 6, 3, 3, 3, 2, False, 0)])
def test_greedy_matches_transformers(tmp_path, float64_slow_path, K, Dg, Ng, expand, Kc, R, tied, seed):
    Vg = 256  # bytes are tokens
    model = lively(falcon(K, Kc, R, tied, seed, V=Vg, D=Dg, N=Ng, expand=expand))
    path = saved_checkpoint(tmp_path, model, K, Kc, R, tied, V=Vg, D=Dg, N=Ng, expand=expand)
    prompt, n = b"The selective scan", 24
    ours = [int(v) for v in ash.generate(path, list(prompt), n, temperature=0.0)]
    assert len(ours) == n and len(set(ours)) > 2, ours  # a sample that varies
    assert hf_greedy(model, prompt, n, use_cache=True) == ours
    assert hf_greedy(model, prompt, n, use_cache=False) == ours


def test_cli_generate_matches_transformers(tmp_path, ash_cli, float64_slow_path):
    """`ash generate --temperature 0` continues a prompt as transformers' greedy generate."""
    K, Kc, R, tied = 2, 4, 2, False
    model = lively(falcon(K, Kc, R, tied, seed=3, V=256, D=8, N=4))
    path = saved_checkpoint(tmp_path, model, K, Kc, R, tied, V=256, D=8, N=4)
    prompt, n = b"falcon", 20
    r = subprocess.run([ash_cli, "generate", "--checkpoint", str(path), "--prompt", prompt.decode(), "--tokens",
                        str(n), "--temperature", "0"], capture_output=True)
    assert r.returncode == 0, r.stderr.decode(errors="replace")
    sample = list(r.stdout[len(prompt):-1])
    assert r.stdout.startswith(prompt) and sample == hf_greedy(model, prompt, n, use_cache=True), r.stdout


# ---- (d) adjoint_sharding.torch.wrap ------------------------------------------------------------

@pytest.mark.parametrize("K,T,B,Kc,R,tied,kw", [(1, 9, 1, 4, 2, True, {}), (3, 11, 2, 3, 3, False, {}),
                                               (2, 13, 2, 2, 2, False, {"token_block": 4, "layer_checkpoint": 2})])
def test_wrap_equals_autograd(float64_slow_path, K, T, B, Kc, R, tied, kw):
    """wrap(FalconMambaForCausalLM): loss, logits and every .grad equal the unwrapped model's (float64);
    the memory levers (block-wise engine) too."""
    ref = falcon(K, Kc, R, tied, seed=K * 100 + T).train()
    model = no_hf_blocks(wrap(copy.deepcopy(ref), chunk=3, **kw))
    ids = torch.tensor(np.random.default_rng(T).integers(0, V, (B, T)))
    ref_out, ref_grads = loss_and_grads(ref, ids)
    out, grads = loss_and_grads(model, ids)
    assert out.logits.dtype == torch.float64
    assert_same(out, grads, ref_out, ref_grads, RTOL)
    with torch.no_grad():  # the C++ forward alone
        assert rel_err(model.eval()(input_ids=ids).logits, ref_out.logits.detach()) <= RTOL


def test_wrap_detached_and_falcon_model(float64_slow_path, detached_mixer_inputs):
    """A FalconMambaModel (no head) with inputs_embeds, detach_inputs=True: transformers' gradient of
    the model whose mixers see their input detached (the fixture), input gradient included."""
    ref = falcon(2, 3, 2, True, seed=31).backbone
    model = no_hf_blocks(wrap(copy.deepcopy(ref), detach_inputs=True, chunk=4))
    assert_wrapped_backbone(ref, model, D, "FalconMambaOutput")


def test_wrap_refusals():
    kw = dict(vocab_size=V, hidden_size=D, state_size=N, num_hidden_layers=2, expand=EXPAND, conv_kernel=3,
              time_step_rank=2, use_cache=False)
    for bad, needle in (({"use_bias": True}, "use_bias=True"), ({"hidden_act": "gelu"}, "hidden_act")):
        with pytest.raises(ash.Error, match=needle):
            wrap(transformers.FalconMambaForCausalLM(transformers.FalconMambaConfig(**kw, **bad)))
    model = transformers.FalconMambaForCausalLM(transformers.FalconMambaConfig(mixer_rms_eps=1e-4, **kw))
    model.backbone.layers[1].mixer.c_layernorm.eps = 1e-6  # one block's own norm: not the configured epsilon
    with pytest.raises(ash.Error, match="block 1's mixer.c_layernorm epsilon 1e-06 is not mixer_rms_eps 0.0001"):
        wrap(model)
    assert "forward" not in model.backbone.__dict__
    # a Mamba mixer in a FalconMamba model, and a FalconMamba mixer in a Mamba model
    mamba = transformers.MambaForCausalLM(transformers.MambaConfig(**kw))
    model.backbone.layers[1].mixer.c_layernorm.eps = 1e-4
    model.backbone.layers[0].mixer = mamba.backbone.layers[0].mixer
    with pytest.raises(ash.Error, match="block 0's mixer has no dt_layernorm"):
        wrap(model)
    mamba.backbone.layers[1].mixer = model.backbone.layers[1].mixer
    with pytest.raises(ash.Error, match="block 1's mixer has FalconMamba's mixer norms in a MambaModel"):
        wrap(mamba)

