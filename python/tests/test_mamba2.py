"""model.arch = "mamba2" against transformers' own Mamba2ForCausalLM (n_groups 1, 2
and 4, docs/design.md §1):
  - the loss and every parameter's gradient of E1 and E3 (tied and untied, K 1..3,
    a time_step_limit that clamps Δ from below and above on some tokens, chunk_size
    below T so transformers' chunked scan crosses chunks) to 1e-10 relative in
    float64; E2 and E3 detached against the model with each mixer's input detached;
    documents against each document run alone;
  - `ash import-hf` of a save_pretrained folder (one file or shards), `ash export-hf`
    back: the same tensors bit for bit, Mamba2Config's keys, from_pretrained of the
    export giving the same logits; what is not built refused by name;
  - greedy generation (Python's generate and `ash generate`) equal to transformers';
  - adjoint_sharding.torch.wrap of a Mamba2ForCausalLM / Mamba2Model: loss, logits and
    every .grad equal to the unwrapped model's.
The oracle is transformers' torch path (no CUDA kernels: causal_conv1d_fn,
mamba2_chunk_scan, mamba2_selective_state_update fall back to their PyTorch code) in
float64 with its float32 casts removed: inside these tests, and only there,
torch.Tensor.float is the identity, Mamba2RMSNorm and MambaRMSNormGated keep the
input's dtype, and residual_in_fp32 is off. Nothing else of the model is changed.
dt_bias is raised by 4 so that Δ is O(0.04..1.4) and the scan carries state across
the window (transformers' initial Δ of 1e-3..1e-1 would make every test weaker).
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
from transformers.models.mamba2 import modeling_mamba2  # noqa: E402
from test_hf_convert import assert_bitwise, fail_cli, load_tensors, shard  # noqa: E402
from test_mamba import RTOL, assert_close, max_rel  # noqa: E402
from test_mamba_generate import hf_greedy, lively  # noqa: E402
from test_torch_wrap import (assert_same, assert_wrapped_backbone, loss_and_grads, no_hf_blocks,  # noqa: E402
                             rel_err)

V, D, N, EXPAND, P, EPS = 13, 8, 4, 2, 4, 1e-5  # E = 16: H = 4 heads of P = 4
INF = float("inf")
LIMIT = (0.08, 0.8)  # Δ spans about 0.04..1.4 here: some tokens clamped below, some above


@pytest.fixture
def float64_mamba2(monkeypatch):
    """transformers' Mamba-2 torch path with its float32 casts removed (see the module docstring)."""
    def rms_norm_f64(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))

    def gated_norm_f64(self, hidden_states, gate=None):
        if gate is not None:
            hidden_states = hidden_states * torch.nn.functional.silu(gate)
        *prefix, last = hidden_states.shape
        g = hidden_states.view(*prefix, last // self.group_size, self.group_size)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * g.view(*prefix, last)

    monkeypatch.setattr(torch.Tensor, "float", lambda self, *a, **k: self)
    monkeypatch.setattr(modeling_mamba2.Mamba2RMSNorm, "forward", rms_norm_f64)
    monkeypatch.setattr(modeling_mamba2.MambaRMSNormGated, "forward", gated_norm_f64)
    torch.manual_seed(0)


@pytest.fixture
def detached_mixer_inputs(monkeypatch):
    """The stop-gradient-inputs model (E2's, and E3's with grad.detach_inputs): each block's
    input reaches norm and mixer detached, the residual not."""
    def block_forward(self, hidden_states, *args, **kwargs):
        return hidden_states + self.mixer(self.norm(hidden_states.detach()), *args, **kwargs)

    monkeypatch.setattr(modeling_mamba2.Mamba2Block, "forward", block_forward)


def mamba2(K, Kc, tied, seed, limit=(0.0, INF), chunk_size=256, V=V, D=D, N=N, expand=EXPAND, head_dim=P,
           eps=EPS, groups=1, **kw):
    """A tiny Mamba2ForCausalLM in float64, its parameters moved off their special values."""
    cfg = transformers.Mamba2Config(vocab_size=V, hidden_size=D, state_size=N, num_hidden_layers=K, expand=expand,
                                    conv_kernel=Kc, head_dim=head_dim, num_heads=expand * D // head_dim, n_groups=groups,
                                    tie_word_embeddings=tied, layer_norm_epsilon=eps, residual_in_fp32=False,
                                    use_cache=False, time_step_limit=limit, chunk_size=chunk_size, **kw)
    torch.manual_seed(seed)
    model = transformers.Mamba2ForCausalLM(cfg).to(torch.float64).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_((4.0 if "dt_bias" in name else 0.0) + (0.3 if "embeddings" not in name else 0.5) *
                   (2 * torch.rand(p.shape, generator=g, dtype=p.dtype) - 1))
    return model


# Our tensor names (docs/file_format.md) and transformers' attribute paths in a block.
LAYER_NAMES = [("norm", "norm.weight"), ("in_proj", "mixer.in_proj.weight"), ("conv_bias", "mixer.conv1d.bias"),
               ("dt_bias", "mixer.dt_bias"), ("A_log", "mixer.A_log"), ("D", "mixer.D"),
               ("gated_norm", "mixer.norm.weight"), ("out_proj", "mixer.out_proj.weight")]


def to_ash(named, K, tied):
    """Our names from transformers' (a state dict or the parameters' gradients), as numpy arrays."""
    t = {k: v.detach().numpy().copy() for k, v in named.items()}
    out = {"embedding": t["backbone.embeddings.weight"], "final_norm": t["backbone.norm_f.weight"]}
    if not tied:
        out["head"] = t["lm_head.weight"]
    for k in range(K):
        h, o = f"backbone.layers.{k}.", f"layers/{k:03d}/"
        for ours, theirs in LAYER_NAMES:
            out[o + ours] = t[h + theirs]
        out[o + "conv_weight"] = t[h + "mixer.conv1d.weight"][:, 0, :]
    return out


def ash_config(model):
    c = model.config
    lo, hi = c.time_step_limit
    return {"model": {"arch": "mamba2", "vocab": c.vocab_size, "width": c.hidden_size, "state": c.state_size,
                      "layers": c.num_hidden_layers, "expand": c.expand, "conv_kernel": c.conv_kernel,
                      "head_dim": c.head_dim, "heads": c.num_heads, "n_groups": c.n_groups,
                      "tie_embeddings": c.tie_word_embeddings,
                      "norm_eps": c.layer_norm_epsilon, "time_step_limit_min": lo,
                      "time_step_limit_max": 0.0 if hi == INF else hi},
            "grad": {"engine": "backprop", "chunk": 3}}


def saved_checkpoint(path, model, cfg=None):
    cfg = cfg or ash_config(model)
    ash.save(path, to_ash(model.state_dict(), model.config.num_hidden_layers, model.config.tie_word_embeddings),
             cfg, "double")
    return path


def hf_loss_grads(model, rows):
    """Loss (mean over every row's targets) and its gradient by torch autograd, keyed like ash's."""
    model.zero_grad()
    ids = torch.tensor(np.asarray(rows), dtype=torch.long)
    logits = model(input_ids=ids).logits
    assert logits.dtype == torch.float64
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    loss.backward()
    c = model.config
    return loss.item(), to_ash({n: p.grad for n, p in model.named_parameters()}, c.num_hidden_layers,
                               c.tie_word_embeddings)


# ---- (a) the loss and every gradient against transformers' autograd -------------------------

# (K, T, batch, conv kernel, tied, time_step_limit, chunk_size, n_groups)
CASES = [(1, 9, 2, 4, True, (0.0, INF), 256, 1), (2, 7, 1, 2, False, LIMIT, 3, 1), (3, 11, 2, 3, False, LIMIT, 256, 1),
         (2, 10, 2, 3, True, (0.3, INF), 4, 1), (2, 9, 2, 3, False, LIMIT, 4, 2), (1, 8, 1, 4, True, (0.0, INF), 256, 4),
         # past ash's SSD chunk of 64 tokens (E3's chunked form: three chunks, the last of 22)
         (2, 150, 2, 3, False, LIMIT, 32, 2)]


@pytest.mark.parametrize("K,T,B,Kc,tied,limit,chunk_size,groups", CASES)
def test_e1_and_e3_match_transformers(tmp_path, float64_mamba2, K, T, B, Kc, tied, limit, chunk_size, groups):
    model = mamba2(K, Kc, tied, seed=K * 100 + T, limit=limit, chunk_size=chunk_size, groups=groups)
    path = saved_checkpoint(tmp_path / "m.h5", model)
    ids = np.random.default_rng(T).integers(0, V, B * T)
    ref_loss, ref_grads = hf_loss_grads(model, ids.reshape(B, T))
    blocks = [dict(engine="adjoint-exact", token_block=100)] if T > 100 else []  # SSD chunks within blocks
    for kw in [dict(engine="backprop"), dict(engine="adjoint-exact", set=["grad.chunk=2", "grad.wave=3"]),
               dict(engine="adjoint-exact", token_block=4, layer_checkpoint=2)] + blocks:
        loss, grads = ash.grad(path, ids, seq_len=T, batch=B, **kw)
        assert_close(loss, grads, ref_loss, ref_grads)


def test_the_time_step_limit_is_applied(tmp_path, float64_mamba2):
    """The same parameters without the limit, or with one of its two ends, give another loss and
    gradient: the comparisons above see both ends of the clamp."""
    K, T, B, Kc, tied = 2, 9, 2, 3, False
    model = mamba2(K, Kc, tied, seed=41, limit=LIMIT)
    ids = np.random.default_rng(6).integers(0, V, B * T)
    ref_loss, ref_grads = hf_loss_grads(model, ids.reshape(B, T))
    for lo, hi in ((0.0, 0.0), (LIMIT[0], 0.0), (0.0, LIMIT[1])):
        cfg = ash_config(model)
        cfg["model"].update(time_step_limit_min=lo, time_step_limit_max=hi)
        path = saved_checkpoint(tmp_path / f"{lo}_{hi}.h5", model, cfg)
        loss, grads = ash.grad(path, ids, seq_len=T, batch=B, engine="backprop")
        assert abs(loss - ref_loss) > 1e-6 * ref_loss and max_rel(grads, ref_grads) > 1e-4, (lo, hi, loss, ref_loss)


def test_detached_match_transformers(tmp_path, float64_mamba2, detached_mixer_inputs):
    """E2 (full window) and E3 detached: the gradient of the model whose mixers see their input detached."""
    K, T, B, Kc, tied = 2, 9, 2, 3, False
    model = mamba2(K, Kc, tied, seed=17, limit=LIMIT)
    path = saved_checkpoint(tmp_path / "m.h5", model)
    ids = np.random.default_rng(4).integers(0, V, B * T)
    ref_loss, ref_grads = hf_loss_grads(model, ids.reshape(B, T))
    for kw in (dict(engine="adjoint"), dict(engine="adjoint-exact", detach_inputs=True)):
        loss, grads = ash.grad(path, ids, seq_len=T, batch=B, set=["grad.chunk=4"], **kw)
        assert_close(loss, grads, ref_loss, ref_grads)
    # the detached model's gradient is not the exact one: the fixture changed something
    exact = ash.grad(path, ids, seq_len=T, batch=B, engine="backprop")[1]
    assert max_rel(exact, ref_grads) > 1e-4


def test_documents_match_per_document_runs(tmp_path, float64_mamba2):
    """Three documents in one window (each ends with token 3): the target-weighted mean of each
    document's own loss and gradient, run alone through transformers (the scan and the conv see
    nothing before a start)."""
    model = mamba2(2, 4, True, seed=3, V=9)
    path = saved_checkpoint(tmp_path / "m.h5", model)
    body = [x for x in np.random.default_rng(5).integers(0, 9, 40) if x != 3]
    docs = [body[0:5] + [3], body[5:7] + [3], body[7:16]]  # lengths 6, 3, 9: one shorter than Kc
    ids = np.array(sum(docs, []))
    loss, grads = ash.grad(path, ids, seq_len=len(ids), batch=1, engine="backprop", set=["data.separator=\\u0003"])
    ref_loss, ref_grads, total = 0.0, {}, 0
    for d in docs:
        l_i, g_i = hf_loss_grads(model, [d])
        ref_loss += (len(d) - 1) * l_i
        for k, v in g_i.items():
            ref_grads[k] = ref_grads.get(k, 0) + (len(d) - 1) * v
        total += len(d) - 1
    assert_close(loss, grads, ref_loss / total, {k: v / total for k, v in ref_grads.items()})


# ---- (b) import-hf / export-hf ----------------------------------------------------------------

def logits_of(model, ids):
    with torch.no_grad():
        return model(input_ids=torch.tensor(ids, dtype=torch.long)).logits


def f64(model):
    """A loaded model in float64, residual_in_fp32 off (the oracle keeps the residual in float64)."""
    for layer in model.backbone.layers:
        layer.residual_in_fp32 = False
    return model.to(torch.float64).eval()


@pytest.mark.parametrize("dtype,precision,tied,limit,groups", [(torch.float32, "float", True, LIMIT, 1),
                                                               (torch.float64, "double", False, (0.0, INF), 2),
                                                               (torch.float32, "double", False, (0.02, INF), 1)])
def test_import_export_round_trip(tmp_path, ash_cli, float64_mamba2, dtype, precision, tied, limit, groups):
    """save_pretrained, import-hf, export-hf (the folder's dtype): the same tensors bit for bit,
    Mamba2Config's keys, and from_pretrained of the export giving the original's logits."""
    K, Kc, T, B = 2, 3, 9, 2
    model = mamba2(K, Kc, tied, seed=11, limit=limit, groups=groups)
    src = tmp_path / "src"
    copy.deepcopy(model).to(dtype).save_pretrained(src)
    ck, out = tmp_path / "m.h5", tmp_path / "out"
    printed = run_cli(ash_cli, "import-hf", "--from", src, "--out", ck, "--precision", precision)
    assert "Mamba2ForCausalLM" in printed and "4 heads of 4" in printed, printed
    stored = ash.load(ck).config["model"]
    assert stored["arch"] == "mamba2" and stored["heads"] == 4 and stored["head_dim"] == P
    assert stored["n_groups"] == groups
    assert (stored["time_step_limit_min"], stored["time_step_limit_max"] or INF) == limit
    run_cli(ash_cli, "export-hf", "--checkpoint", ck, "--out", out,
            "--dtype", "float" if dtype == torch.float32 else "double")
    before = load_tensors(src)
    if tied:
        before.pop("lm_head.weight", None)  # a tied copy, if this saver kept one
    assert_bitwise(before, load_tensors(out))
    theirs, ours = (json.loads((d / "config.json").read_text()) for d in (src, out))
    assert ours["model_type"] == "mamba2" and ours["architectures"] == ["Mamba2ForCausalLM"]
    # every key transformers wrote, with its value: but its version, and use_cache and
    # residual_in_fp32 (this model's own; ours are transformers' defaults, the latter off for F64)
    assert ours.pop("use_cache") is True and ours.pop("residual_in_fp32") == (dtype != torch.float64)
    assert {k: v for k, v in theirs.items() if k not in ("transformers_version", "use_cache", "residual_in_fp32")} == ours
    loaded = transformers.Mamba2ForCausalLM.from_pretrained(out)
    assert tuple(loaded.config.time_step_limit) == limit and loaded.config.tie_word_embeddings == tied
    assert loaded.dtype == dtype
    ids = np.random.default_rng(2).integers(0, V, (B, T))
    want = logits_of(f64(transformers.Mamba2ForCausalLM.from_pretrained(src)), ids)
    # The same parameters bit for bit (above), so the same logits within 1e-12 of their scale (two
    # separately built torch models may take different CPU kernels, test_hf_convert.py).
    got = logits_of(f64(loaded), ids)
    assert (got - want).abs().max().item() <= 1e-12 * max(1.0, want.abs().max().item())
    # and ash's own loss of the imported checkpoint is transformers' (float64 compute)
    ref = torch.nn.functional.cross_entropy(want[:, :-1].reshape(-1, V), torch.tensor(ids)[:, 1:].reshape(-1))
    ev = ash.evaluate(ck, ids.reshape(-1), seq_len=T, batch=B, precision="double")
    assert abs(ev["loss"] - ref.item()) <= RTOL * ref.item(), (ev, ref)


def test_init_export_import_and_sharded_folder(tmp_path, ash_cli, float64_mamba2):
    """An `ash init` Mamba-2 (head_dim 8, a time-step limit), exported, loads in transformers with
    ash's loss; Python's import_hf of it as two shards and an index gives the parameters back bit
    for bit; a config.json with Python's bare Infinity (older transformers) reads as no limit."""
    Vi, T, B = 37, 9, 2
    ck = tmp_path / "m.h5"
    run_cli(ash_cli, "init", "--out", ck, "--precision", "double", "--set", "model.arch=mamba2",
            "--set", f"model.vocab={Vi}", "--set", "model.width=8", "--set", "model.state=3",
            "--set", "model.layers=2", "--set", "model.tie_embeddings=false", "--set", "model.head_dim=8",
            "--set", "model.time_step_limit_min=0.002", "--set", "model.time_step_limit_max=0.05")
    w = ash.export_hf(ck, tmp_path / "hf")
    assert w["dtype"] == "F64"
    model = f64(transformers.Mamba2ForCausalLM.from_pretrained(tmp_path / "hf"))
    assert model.config.num_heads == 2 and tuple(model.config.time_step_limit) == (0.002, 0.05)
    ids = np.random.default_rng(8).integers(0, Vi, (B, T))
    logits = logits_of(model, ids)
    ref = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, Vi), torch.tensor(ids)[:, 1:].reshape(-1))
    ev = ash.evaluate(ck, ids.reshape(-1), seq_len=T, batch=B, precision="double")
    assert abs(ev["loss"] - ref.item()) <= RTOL * ref.item(), (ev, ref)
    # the export as shards (what save_pretrained writes for a large model)
    r = ash.import_hf(shard(tmp_path / "hf"), tmp_path / "back.h5")
    m = r["config"]["model"]
    assert m["arch"] == "mamba2" and (m["time_step_limit_min"], m["time_step_limit_max"]) == (0.002, 0.05)
    assert r["ignored"] == []
    a, b = ash.load(ck), ash.load(tmp_path / "back.h5")
    assert sorted(a) == sorted(b) and all(a[k].tobytes() == b[k].tobytes() for k in a)
    # Python's json.dumps writes inf as a bare Infinity, which json.loads (and we) read
    cfg = tmp_path / "hf" / "config.json"
    c = json.loads(cfg.read_text())
    c["time_step_limit"] = [0.002, INF]
    cfg.write_text(json.dumps(c))
    assert "Infinity" in cfg.read_text()
    m = ash.import_hf(tmp_path / "hf", tmp_path / "inf.h5")["config"]["model"]
    assert (m["time_step_limit_min"], m["time_step_limit_max"]) == (0.002, 0)


@pytest.mark.parametrize("change,needle", [
    ({"n_groups": 3}, "n_groups 3 does not divide num_heads 4"),
    ({"use_bias": True}, "use_bias = true"),
    ({"use_conv_bias": False}, "use_conv_bias = false"),
    ({"hidden_act": "gelu"}, 'hidden_act "gelu" is not supported'),
    ({"num_heads": 2}, "num_heads × head_dim = 8 is not expand × hidden_size = 16"),
    ({"time_step_limit": [0.5, 0.1]}, '"time_step_limit" is [0.5,0.1], not [min, max] with 0 <= min < max'),
    ({"time_step_limit": [-1.0, 0.1]}, '"time_step_limit" is [-1.0,0.1]'),
    ({"time_step_limit": [0.0, {"__float__": "NaN"}]}, '"time_step_limit" is [0.0,{"__float__":"NaN"}]'),
    ({"architectures": ["MambaForCausalLM"]}, 'is not ["Mamba2ForCausalLM"] (model_type "mamba2")'),
    ({"model_type": "mamba"}, 'architectures ["Mamba2ForCausalLM"] is not ["MambaForCausalLM"]'),
    ({"model_type": "mamba3"}, 'model_type "mamba3" is not "mamba", "falcon_mamba" or "mamba2"'),
])
def test_refusals(tmp_path, ash_cli, change, needle):
    """What a Mamba2 folder may hold that we do not build: exit 2 and ash.Error naming it."""
    src = tmp_path / "src"
    mamba2(1, 2, True, seed=2).to(torch.float32).save_pretrained(src)
    c = json.loads((src / "config.json").read_text())
    c.update(change)
    (src / "config.json").write_text(json.dumps(c))
    rc, err = fail_cli(ash_cli, "import-hf", "--from", src, "--out", tmp_path / "m.h5")
    assert rc == 2 and needle in err, err
    with pytest.raises(ash.Error, match="n_groups|use_bias|use_conv_bias|hidden_act|num_heads|time_step_limit|"
                                        "architectures|model_type"):
        ash.import_hf(src, tmp_path / "m.h5")
    assert not (tmp_path / "m.h5").exists()


def test_mamba2_config_defaults(tmp_path):
    """Keys absent take Mamba2Config's defaults: untied (tie_word_embeddings False), no time-step
    limit; n_groups absent is its 8, refused here (4 heads); intermediate_size (no Mamba2Config key)
    is ignored."""
    src = tmp_path / "src"
    mamba2(1, 2, False, seed=2).to(torch.float32).save_pretrained(src)
    c = json.loads((src / "config.json").read_text())
    for key in ("tie_word_embeddings", "time_step_limit", "chunk_size", "time_step_rank"):
        del c[key]
    c["intermediate_size"] = 7
    (src / "config.json").write_text(json.dumps(c))
    r = ash.import_hf(src, tmp_path / "m.h5")
    m = r["config"]["model"]
    assert m["tie_embeddings"] is False and (m["time_step_limit_min"], m["time_step_limit_max"]) == (0, 0)
    assert r["ignored"] == ["intermediate_size"]
    del c["n_groups"]
    (src / "config.json").write_text(json.dumps(c))
    with pytest.raises(ash.Error, match="n_groups 8 does not divide num_heads 4"):
        ash.import_hf(src, tmp_path / "n.h5")


# ---- (c) greedy generation -------------------------------------------------------------------

@pytest.mark.parametrize("K,Dg,Ng,Kc,tied,limit,seed", [(2, 8, 4, 4, True, (0.0, INF), 1), (3, 8, 3, 3, False, LIMIT, 0)])
def test_greedy_matches_transformers(tmp_path, float64_mamba2, K, Dg, Ng, Kc, tied, limit, seed):
    model = lively(mamba2(K, Kc, tied, seed, limit=limit, V=256, D=Dg, N=Ng))
    path = saved_checkpoint(tmp_path / "m.h5", model)
    prompt, n = b"The state space dual", 24
    ours = [int(v) for v in ash.generate(path, list(prompt), n, temperature=0.0)]
    assert len(ours) == n and len(set(ours)) > 2, ours  # a sample that varies
    # transformers' full forward at every step, and without a time-step limit its recurrent
    # step (its cache) too
    assert hf_greedy(model, prompt, n, use_cache=False) == ours
    if limit == (0.0, INF):
        assert hf_greedy(model, prompt, n, use_cache=True) == ours


def test_transformers_cached_step_ignores_the_limit(tmp_path, float64_mamba2):
    """transformers' recurrent step (mamba2_selective_state_update, as mamba-ssm's Mamba2.step) does
    not clamp Δ to time_step_limit, which its chunked forward does: with a limit that clamps, its
    cached greedy generate departs from its own uncached one. Ours clamps in both (the model that
    trained is the model that samples), so it follows the uncached forward (above); should
    transformers' cached step start clamping, this test fails and the one above can compare it too."""
    model = lively(mamba2(3, 3, False, 0, limit=LIMIT, V=256, D=8, N=3))
    prompt, n = b"The state space dual", 24
    assert hf_greedy(model, prompt, n, use_cache=True) != hf_greedy(model, prompt, n, use_cache=False)


def test_cli_generate_matches_transformers(tmp_path, ash_cli, float64_mamba2):
    """`ash generate --temperature 0` continues a prompt as transformers' greedy generate."""
    model = lively(mamba2(2, 4, False, seed=3, limit=LIMIT, V=256))
    path = saved_checkpoint(tmp_path / "m.h5", model)
    prompt, n = b"mamba two", 20
    r = subprocess.run([ash_cli, "generate", "--checkpoint", str(path), "--prompt", prompt.decode(), "--tokens",
                        str(n), "--temperature", "0"], capture_output=True)
    assert r.returncode == 0, r.stderr.decode(errors="replace")
    sample = list(r.stdout[len(prompt):-1])
    assert r.stdout.startswith(prompt) and sample == hf_greedy(model, prompt, n, use_cache=False), r.stdout


# ---- (d) adjoint_sharding.torch.wrap ------------------------------------------------------------

@pytest.mark.parametrize("K,T,B,Kc,tied,limit,kw", [(1, 9, 1, 4, True, (0.0, INF), {}),
                                                    (3, 11, 2, 3, False, LIMIT, {}),
                                                    (2, 13, 2, 2, False, LIMIT, {"token_block": 4,
                                                                                 "layer_checkpoint": 2}),
                                                    (2, 9, 2, 3, True, LIMIT, {"groups": 2})])
def test_wrap_equals_autograd(float64_mamba2, K, T, B, Kc, tied, limit, kw):
    """wrap(Mamba2ForCausalLM): loss, logits and every .grad equal the unwrapped model's (float64);
    the memory levers (block-wise engine) and two groups of B and C too."""
    kw = dict(kw)
    ref = mamba2(K, Kc, tied, seed=K * 100 + T, limit=limit, groups=kw.pop("groups", 1)).train()
    model = no_hf_blocks(wrap(copy.deepcopy(ref), chunk=3, **kw))
    ids = torch.tensor(np.random.default_rng(T).integers(0, V, (B, T)))
    ref_out, ref_grads = loss_and_grads(ref, ids)
    out, grads = loss_and_grads(model, ids)
    assert out.logits.dtype == torch.float64
    assert_same(out, grads, ref_out, ref_grads, RTOL)
    with torch.no_grad():  # the C++ forward alone
        assert rel_err(model.eval()(input_ids=ids).logits, ref_out.logits.detach()) <= RTOL


def test_wrap_detached_and_mamba2_model(float64_mamba2, detached_mixer_inputs):
    """A Mamba2Model (no head) with inputs_embeds, detach_inputs=True: transformers' gradient of
    the model whose mixers see their input detached (the fixture), input gradient included."""
    ref = mamba2(2, 3, True, seed=31, limit=LIMIT).backbone
    model = no_hf_blocks(wrap(copy.deepcopy(ref), detach_inputs=True, chunk=4))
    assert_wrapped_backbone(ref, model, D, "Mamba2Output")


def test_wrap_refusals():
    kw = dict(vocab_size=V, hidden_size=D, state_size=N, num_hidden_layers=2, expand=EXPAND, conv_kernel=3,
              head_dim=P, num_heads=4, use_cache=False)
    for bad, needle in (({"n_groups": 3}, "n_groups=3 does not divide num_heads=4"), ({"use_bias": True}, "use_bias=True"),
                        ({"hidden_act": "gelu", "n_groups": 1}, "hidden_act")):
        with pytest.raises(ash.Error, match=needle):
            wrap(transformers.Mamba2ForCausalLM(transformers.Mamba2Config(**{"n_groups": 1, **kw, **bad})))
    model = transformers.Mamba2ForCausalLM(transformers.Mamba2Config(n_groups=1, time_step_limit=(0.0, 1.0), **kw))
    model.backbone.layers[1].mixer.norm.variance_epsilon = 1e-3  # one block's gated norm: not the configured epsilon
    with pytest.raises(ash.Error, match=r"block 1's mixer.norm \(gated\) epsilon 0.001 is not layer_norm_epsilon"):
        wrap(model)
    model.backbone.layers[1].mixer.norm.variance_epsilon = 1e-5
    model.backbone.layers[0].mixer.time_step_limit = (0.0, 2.0)
    with pytest.raises(ash.Error, match=r"block 0's time_step_limit \(0.0, 2.0\) is not the configuration's"):
        wrap(model)
    assert "forward" not in model.backbone.__dict__
    # a Mamba mixer in a Mamba2 model
    mamba = transformers.MambaForCausalLM(transformers.MambaConfig(vocab_size=V, hidden_size=D, state_size=N,
                                                                   num_hidden_layers=2))
    model.backbone.layers[0].mixer = mamba.backbone.layers[0].mixer
    with pytest.raises(ash.Error, match="block 0's mixer is a MambaMixer, not a Mamba2Mixer"):
        wrap(model)
