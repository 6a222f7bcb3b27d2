"""model.arch = "mamba" against transformers' own MambaForCausalLM (docs/design.md §1,
§10): the loss and every parameter's gradient of E1 (grad.engine=backprop) and E3 (adjoint-exact) to 1e-10
relative; E2 (adjoint, full window) and E3 detached against the same model with each
mixer's input detached; E2 truncated against E3 windowed with the same T-bar; documents
against per-document runs, the carried state (data.carry_state) against transformers'
cache, the checkpoint layout and the initialisation, and the refusal of what a Mamba
does not run yet.

The oracle is transformers' pure-PyTorch slow path in float64 on the CPU. That path
casts to float32 in places (A_log.float(), D.float(), dt_proj.bias.float(), B.float(),
the scan input .float(), MambaRMSNorm's .to(torch.float32), residual_in_fp32, the
logits' .float()); inside these tests, and only there, `torch.Tensor.float` is the
identity, MambaRMSNorm.forward keeps the input's dtype and residual_in_fp32 is off,
so every number stays in float64. Nothing else of the model is changed. The same
holds for FalconMambaForCausalLM (test_falcon_mamba.py), whose FalconMambaRMSNorm is
patched alike and whose weightless mixer norms cast by .float().
"""
import numpy as np
import pytest

import adjoint_sharding as ash
from conftest import run_cli

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from transformers.models.falcon_mamba import modeling_falcon_mamba  # noqa: E402
from transformers.models.mamba import modeling_mamba  # noqa: E402

RTOL = 1e-10


@pytest.fixture
def float64_slow_path(monkeypatch):
    """transformers' slow path with its float32 casts removed (see the module docstring)."""
    def rms_norm_f64(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))

    monkeypatch.setattr(torch.Tensor, "float", lambda self, *a, **k: self)
    monkeypatch.setattr(modeling_mamba.MambaRMSNorm, "forward", rms_norm_f64)
    monkeypatch.setattr(modeling_falcon_mamba.FalconMambaRMSNorm, "forward", rms_norm_f64)
    torch.manual_seed(0)


def hf_model(V, D, N, K, expand, Kc, R, tied, eps, seed, mixer_eps=None):
    """A MambaForCausalLM, or with mixer_eps a FalconMambaForCausalLM (its mixer_rms_eps)."""
    kw = dict(vocab_size=V, hidden_size=D, state_size=N, num_hidden_layers=K, expand=expand, conv_kernel=Kc,
              time_step_rank=R, tie_word_embeddings=tied, layer_norm_epsilon=eps, residual_in_fp32=False,
              use_cache=False, use_mambapy=False)
    if mixer_eps is None:
        cls, cfg = transformers.MambaForCausalLM, transformers.MambaConfig(**kw)
    else:
        cls, cfg = transformers.FalconMambaForCausalLM, transformers.FalconMambaConfig(mixer_rms_eps=mixer_eps, **kw)
    torch.manual_seed(seed)
    model = cls(cfg).to(torch.float64).eval()
    # Every parameter moved off its special value (D = 1, norms = 1, zero conv bias).
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_((0.3 if "embeddings" not in name else 0.5) * (2 * torch.rand(p.shape, generator=g,
                                                                               dtype=p.dtype) - 1))
    return model


@pytest.fixture
def detached_mixer_inputs(monkeypatch):
    """The stop-gradient-inputs model (E2's, and E3's with grad.detach_inputs): each
    block's input reaches norm and mixer detached, the residual not (g_{k-1} = g_k)."""
    def block_forward(self, hidden_states, *args, **kwargs):
        return hidden_states + self.mixer(self.norm(hidden_states.detach()), *args, **kwargs)

    monkeypatch.setattr(modeling_mamba.MambaBlock, "forward", block_forward)
    monkeypatch.setattr(modeling_falcon_mamba.FalconMambaBlock, "forward", block_forward)


def to_ash(model, K, tied):
    """The checkpoint tensors (docs/file_format.md) from transformers' state dict."""
    sd = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    out = {"embedding": sd["backbone.embeddings.weight"], "final_norm": sd["backbone.norm_f.weight"]}
    if not tied:
        out["head"] = sd["lm_head.weight"]
    for k in range(K):
        h, o = f"backbone.layers.{k}.", f"layers/{k:03d}/"
        out[o + "norm"] = sd[h + "norm.weight"]
        out[o + "in_proj"] = sd[h + "mixer.in_proj.weight"]
        out[o + "conv_weight"] = sd[h + "mixer.conv1d.weight"][:, 0, :]
        out[o + "conv_bias"] = sd[h + "mixer.conv1d.bias"]
        out[o + "x_proj"] = sd[h + "mixer.x_proj.weight"]
        out[o + "dt_proj"] = sd[h + "mixer.dt_proj.weight"]
        out[o + "dt_bias"] = sd[h + "mixer.dt_proj.bias"]
        out[o + "A_log"] = sd[h + "mixer.A_log"]
        out[o + "D"] = sd[h + "mixer.D"]
        out[o + "out_proj"] = sd[h + "mixer.out_proj.weight"]
    return out


def hf_loss_grads(model, rows, K, tied):
    """Loss (mean over every row's targets) and its gradient by torch autograd, keyed like ash's."""
    model.zero_grad()
    ids = torch.tensor(np.asarray(rows), dtype=torch.long)
    logits = model(input_ids=ids).logits
    assert logits.dtype == torch.float64
    V = logits.shape[-1]
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1))
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    # the tied head is the embedding's parameter: its gradient holds both uses
    return loss.item(), to_ash_grads(grads, K, tied)


def to_ash_grads(g, K, tied):
    out = {"embedding": g["backbone.embeddings.weight"], "final_norm": g["backbone.norm_f.weight"]}
    if not tied:
        out["head"] = g["lm_head.weight"]
    for k in range(K):
        h, o = f"backbone.layers.{k}.", f"layers/{k:03d}/"
        for ours, theirs in [("norm", "norm.weight"), ("in_proj", "mixer.in_proj.weight"),
                             ("conv_bias", "mixer.conv1d.bias"), ("x_proj", "mixer.x_proj.weight"),
                             ("dt_proj", "mixer.dt_proj.weight"), ("dt_bias", "mixer.dt_proj.bias"),
                             ("A_log", "mixer.A_log"), ("D", "mixer.D"), ("out_proj", "mixer.out_proj.weight")]:
            out[o + ours] = g[h + theirs]
        out[o + "conv_weight"] = g[h + "mixer.conv1d.weight"][:, 0, :]
    return {k: v.detach().numpy() for k, v in out.items()}


def ash_config(V, D, N, K, expand, Kc, R, tied, eps, mixer_eps=None):
    """hf_model's configuration in our keys (with mixer_eps: model.arch = falcon_mamba)."""
    cfg = {"model": {"arch": "mamba", "vocab": V, "width": D, "state": N, "layers": K, "expand": expand,
                     "conv_kernel": Kc, "dt_rank": R, "tie_embeddings": tied, "norm_eps": eps},
           "grad": {"engine": "backprop", "chunk": 3}}
    if mixer_eps is not None:
        cfg["model"].update(arch="falcon_mamba", mixer_rms_eps=mixer_eps)
    return cfg


def assert_close(loss, grads, ref_loss, ref_grads):
    assert abs(loss - ref_loss) <= RTOL * abs(ref_loss), (loss, ref_loss)
    assert sorted(grads) == sorted(ref_grads)
    for n, ref in ref_grads.items():
        got = grads[n]
        assert got.dtype == np.float64 and got.shape == ref.shape, n
        err = np.max(np.abs(got - ref)) / max(np.max(np.abs(ref)), 1e-300)
        assert err <= RTOL, (n, err)


# (K, T, batch, conv kernel, dt_rank, tied): every K in 1..3, odd T, both batches,
# conv kernels 2..4, dt ranks 1..3, tied and untied.
CASES = [(1, 9, 1, 4, 1, True), (2, 7, 2, 2, 2, False), (3, 11, 2, 3, 3, True), (2, 13, 1, 4, 3, False),
         (3, 5, 1, 2, 1, False)]


@pytest.mark.parametrize("K,T,B,Kc,R,tied", CASES)
def test_e1_matches_transformers(tmp_path, float64_slow_path, K, T, B, Kc, R, tied):
    V, D, N, expand, eps = 13, 6, 4, 2, 1e-5
    model = hf_model(V, D, N, K, expand, Kc, R, tied, eps, seed=K * 100 + T)
    path = tmp_path / "m.h5"
    ash.save(path, to_ash(model, K, tied), ash_config(V, D, N, K, expand, Kc, R, tied, eps), "double")
    rng = np.random.default_rng(T)
    ids = rng.integers(0, V, B * T)
    loss, grads = ash.grad(path, ids, seq_len=T, batch=B, engine="backprop")
    ref_loss, ref_grads = hf_loss_grads(model, ids.reshape(B, T), K, tied)
    assert_close(loss, grads, ref_loss, ref_grads)


@pytest.mark.parametrize("K,T,B,Kc,R,tied,chunk,wave", [(3, 11, 2, 3, 2, False, 2, 4), (2, 9, 1, 4, 1, True, 3, 0)])
def test_e3_matches_transformers(tmp_path, float64_slow_path, K, T, B, Kc, R, tied, chunk, wave):
    """E3 (grad.engine=adjoint-exact, exact) on a Mamba: chunks and waves that split the window."""
    V, D, N, expand, eps = 13, 6, 4, 2, 1e-5
    model = hf_model(V, D, N, K, expand, Kc, R, tied, eps, seed=K * 100 + T + 7)
    path = tmp_path / "m.h5"
    ash.save(path, to_ash(model, K, tied), ash_config(V, D, N, K, expand, Kc, R, tied, eps), "double")
    ids = np.random.default_rng(T + 1).integers(0, V, B * T)
    loss, grads = ash.grad(path, ids, seq_len=T, batch=B, engine="adjoint-exact",
                           set=[f"grad.chunk={chunk}", f"grad.wave={wave}"])
    ref_loss, ref_grads = hf_loss_grads(model, ids.reshape(B, T), K, tied)
    assert_close(loss, grads, ref_loss, ref_grads)


# (K, T, batch, conv kernel, dt_rank, tied, chunk, wave): K 1..3, odd T, both batches,
# conv kernels 2..4, dt ranks 1..3, tied and untied; E3's chunks and waves split the window.
DETACHED_CASES = [(1, 9, 2, 4, 1, True, 3, 0), (2, 7, 1, 2, 2, False, 2, 4), (3, 11, 2, 3, 3, True, 4, 4),
                  (2, 13, 2, 4, 3, False, 64, 0)]


@pytest.mark.parametrize("K,T,B,Kc,R,tied,chunk,wave", DETACHED_CASES)
def test_detached_match_transformers(tmp_path, float64_slow_path, detached_mixer_inputs, K, T, B, Kc, R, tied, chunk,
                                     wave):
    """E2 over the full window (T-bar 0 and T-bar >= T), E3 detached and E1 detached: each
    the gradient of the model whose mixers see their input detached."""
    V, D, N, expand, eps = 13, 6, 4, 2, 1e-5
    model = hf_model(V, D, N, K, expand, Kc, R, tied, eps, seed=K * 100 + T + 11)
    path = tmp_path / "m.h5"
    ash.save(path, to_ash(model, K, tied), ash_config(V, D, N, K, expand, Kc, R, tied, eps), "double")
    ids = np.random.default_rng(T + 2).integers(0, V, B * T)
    ref_loss, ref_grads = hf_loss_grads(model, ids.reshape(B, T), K, tied)
    runs = [dict(engine="adjoint"), dict(engine="adjoint", truncate=T + 2),
            dict(engine="adjoint-exact", detach_inputs=True), dict(engine="backprop", detach_inputs=True)]
    for kw in runs:
        loss, grads = ash.grad(path, ids, seq_len=T, batch=B, set=[f"grad.chunk={chunk}", f"grad.wave={wave}"], **kw)
        assert_close(loss, grads, ref_loss, ref_grads)
    # with K >= 2 the detached model's gradient is not the exact one: the fixture changed something
    if K >= 2:
        exact = ash.grad(path, ids, seq_len=T, batch=B, engine="backprop")[1]
        err = max(np.max(np.abs(exact[n] - r)) / np.max(np.abs(r)) for n, r in ref_grads.items())
        assert err > 1e-4, err


def max_rel(a, b):
    return max(np.max(np.abs(a[n] - b[n])) / max(np.max(np.abs(b[n])), 1e-300) for n in b)


@pytest.mark.parametrize("K,T,B,Kc,R,tied,Tbar,chunk,wave",
                         [(2, 11, 2, 3, 2, False, 3, 2, 3), (3, 9, 1, 4, 1, True, 4, 3, 8), (1, 13, 2, 2, 3, True, 5, 5, 0)])
def test_truncated_e2_equals_windowed_e3(tmp_path, K, T, B, Kc, R, tied, Tbar, chunk, wave):
    """E2 truncated at T-bar and E3 windowed at the same T-bar agree to 1e-10 in double, and
    differ from the full window's gradient (T-bar is not ignored). Both against a brute-force
    window sum: unit_tests/test_mamba_engines.cpp (MambaWindow)."""
    V, D, N, expand, eps = 13, 6, 4, 2, 1e-5
    path = tmp_path / "m.h5"
    cfg = ash_config(V, D, N, K, expand, Kc, R, tied, eps)
    ck = ash.init(cfg, "double")
    rng = np.random.default_rng(K + T)
    for n in ck:  # Δ moved to O(1), so state reaches across T-bar tokens and the window matters
        ck[n] = ck[n] + (4.5 if n.endswith("dt_bias") else 0.0)
    ash.save(path, ck, cfg, "double")
    ids = rng.integers(0, V, B * T)
    common = dict(seq_len=T, batch=B, set=[f"grad.chunk={chunk}", f"grad.wave={wave}"])
    l2, e2 = ash.grad(path, ids, engine="adjoint", truncate=Tbar, **common)
    l3, e3 = ash.grad(path, ids, engine="adjoint-exact", detach_inputs=True, truncate=Tbar, **common)
    _, full = ash.grad(path, ids, engine="adjoint", **common)
    assert abs(l2 - l3) <= 1e-14 * abs(l3)
    assert max_rel(e3, e2) <= RTOL
    assert max_rel(e2, full) > 1e-6


def test_cli_grad_and_eval_match_transformers(tmp_path, ash_cli, float64_slow_path):
    """`ash grad` (E1) and `ash eval` on a Mamba checkpoint, expand 3, norm_eps 1e-3."""
    import h5py
    V, D, N, K, expand, Kc, R, tied, eps, T, B = 11, 5, 3, 2, 3, 3, 2, False, 1e-3, 9, 2
    model = hf_model(V, D, N, K, expand, Kc, R, tied, eps, seed=7)
    path = tmp_path / "m.h5"
    ash.save(path, to_ash(model, K, tied), ash_config(V, D, N, K, expand, Kc, R, tied, eps), "double")
    ids = np.random.default_rng(1).integers(0, V, B * T).astype("<u4")
    tokens = tmp_path / "t.u32"
    ids.tofile(tokens)
    out = tmp_path / "g.h5"
    run_cli(ash_cli, "grad", "--checkpoint", path, "--tokens", tokens, "--set", f"data.seq_len={T}",
            "--set", f"data.batch={B}", "--engine", "backprop", "--out", out)
    ref_loss, ref_grads = hf_loss_grads(model, ids.reshape(B, T), K, tied)
    with h5py.File(out) as f:
        grads = {}
        f["/grad"].visititems(lambda n, o: grads.__setitem__(n, o[...]) if isinstance(o, h5py.Dataset) else None)
        assert_close(float(f["/loss"][()]), grads, ref_loss, ref_grads)
    # the forward alone: Python's evaluate to 1e-10, `ash eval`'s printed 6 decimals
    ev = ash.evaluate(path, ids, seq_len=T, batch=B)
    assert abs(ev["loss"] - ref_loss) <= RTOL * ref_loss, (ev, ref_loss)
    out = run_cli(ash_cli, "eval", "--checkpoint", path, "--tokens", tokens, "--set", f"data.seq_len={T}",
                  "--set", f"data.batch={B}")
    printed = float(out.split("loss ")[1].split(" nats")[0])
    assert abs(printed - ref_loss) <= 1e-6, (out, ref_loss)
    # --carry-state: the file as one stream in windows of 4 (conv state and h carried) is
    # transformers' forward over the whole sequence (bits/token printed to 4 decimals)
    whole = hf_loss_grads(model, ids.reshape(1, B * T), K, tied)[0] / np.log(2)
    out = run_cli(ash_cli, "eval", "--checkpoint", path, "--tokens", tokens, "--set", "data.seq_len=4",
                  "--carry-state")
    carried = float(out.split("carried state: ")[1].split(" bits")[0])
    fresh = float(out.split("each window from h = 0: ")[1].split(" bits")[0])
    assert abs(carried - whole) <= 6e-5 < abs(fresh - whole), (out, whole)


def test_documents_match_per_document_runs(tmp_path, float64_slow_path):
    """A window of three documents (each ends with token 3): the loss and gradient are the
    target-weighted mean of each document's own, run alone through transformers (the scan
    and the conv see nothing before a start)."""
    V, D, N, K, expand, Kc, R, tied, eps = 9, 4, 3, 2, 2, 4, 2, True, 1e-5
    model = hf_model(V, D, N, K, expand, Kc, R, tied, eps, seed=3)
    assert_documents_match(tmp_path, model, ash_config(V, D, N, K, expand, Kc, R, tied, eps))


def assert_documents_match(tmp_path, model, cfg):
    """test_documents_match_per_document_runs for transformers' `model` and our configuration `cfg` of it."""
    V, K, tied = cfg["model"]["vocab"], cfg["model"]["layers"], cfg["model"]["tie_embeddings"]
    path = tmp_path / "m.h5"
    ash.save(path, to_ash(model, K, tied), cfg, "double")
    rng = np.random.default_rng(5)
    body = [x for x in rng.integers(0, V, 40) if x != 3]
    docs = [body[0:5] + [3], body[5:7] + [3], body[7:16]]  # lengths 6, 3, 9: one shorter than Kc
    ids = np.array(sum(docs, []))
    loss, grads = ash.grad(path, ids, seq_len=len(ids), batch=1, engine="backprop",
                           set=["data.separator=\\u0003"])
    ref_loss, ref_grads, total = 0.0, {}, 0
    for d in docs:
        n = len(d) - 1
        l_i, g_i = hf_loss_grads(model, [d], K, tied)
        ref_loss += n * l_i
        for k, v in g_i.items():
            ref_grads[k] = ref_grads.get(k, 0) + n * v
        total += n
    assert_close(loss, grads, ref_loss / total, {k: v / total for k, v in ref_grads.items()})


def test_layout_and_initialisation():
    """ash init's Mamba: transformers' tensor shapes, and its initialisation rules."""
    V, D, N, K, expand, Kc = 50, 32, 8, 2, 2, 4
    cfg = ash_config(V, D, N, K, expand, Kc, 0, False, 1e-5)
    ck = ash.init(cfg, "double")
    E, R = expand * D, 2  # dt_rank 0: ceil(32 / 16)
    hf = transformers.MambaConfig(vocab_size=V, hidden_size=D, state_size=N, num_hidden_layers=K, expand=expand,
                                  conv_kernel=Kc, tie_word_embeddings=False)
    ref = {k: tuple(v.shape) for k, v in to_ash(transformers.MambaForCausalLM(hf), K, False).items()}
    assert {k: v.shape for k, v in ck.items()} == ref
    lay = "layers/001/"
    assert np.array_equal(ck[lay + "A_log"], np.log(np.tile(np.arange(1, N + 1), (E, 1))))
    assert np.all(ck[lay + "D"] == 1) and np.all(ck[lay + "norm"] == 1) and np.all(ck["final_norm"] == 1)
    assert np.all(ck[lay + "conv_bias"] == 0)
    dt = np.log1p(np.exp(ck[lay + "dt_bias"]))  # softplus(dt_bias) = Δ0 in [1e-3, 0.1]
    assert dt.min() >= 1e-3 * (1 - 1e-9) and dt.max() <= 0.1 * (1 + 1e-9) and dt.max() / dt.min() > 10
    assert np.abs(ck[lay + "dt_proj"]).max() <= R ** -0.5 and np.abs(ck[lay + "conv_weight"]).max() <= Kc ** -0.5
    assert np.abs(ck[lay + "out_proj"]).max() <= E ** -0.5
    for name in ("embedding", "head", lay + "in_proj", lay + "x_proj"):  # N(0, 0.1²)
        assert abs(np.std(ck[name]) - 0.1) < 0.01, name
    tied = ash.init(ash_config(V, D, N, K, expand, Kc, 0, True, 1e-5), "double")
    assert "head" not in tied and np.array_equal(tied["embedding"], ck["embedding"])


# (K, T, batch, conv kernel, dt_rank, tied, chunk, token_block)
CARRY_CASES = [(2, 7, 2, 4, 2, False, 2, 0), (3, 6, 1, 3, 1, True, 3, 2), (1, 9, 2, 2, 3, False, 64, 4)]


@pytest.mark.parametrize("K,T,B,Kc,R,tied,chunk,token_block", CARRY_CASES)
def test_carried_state_matches_transformers_cache(tmp_path, float64_slow_path, monkeypatch, K, T, B, Kc, R, tied, chunk,
                                                  token_block):
    """data.carry_state (docs/design.md §8): grad(state=) over the first T tokens leaves the
    state transformers' cache holds after them (conv_states' last Kc−1 columns, ssm_states),
    and over the next T tokens from that state gives the loss and gradient of transformers
    fed those tokens one at a time from the cache (its recurrent step: the state a
    constant, no gradient into the first half). The state's conv part or h zeroed gives
    another gradient: both are carried."""
    # The recurrent step reads the cached h through .float() and then overwrites it in
    # place; .float() as a copy (still float64) keeps autograd's saved value intact.
    monkeypatch.setattr(torch.Tensor, "float", lambda self, *a, **k: self.clone())
    V, D, N, expand, eps = 13, 6, 4, 2, 1e-5
    E = expand * D
    model = hf_model(V, D, N, K, expand, Kc, R, tied, eps, seed=K * 100 + T + 23)
    path = tmp_path / "m.h5"
    ash.save(path, to_ash(model, K, tied), ash_config(V, D, N, K, expand, Kc, R, tied, eps), "double")
    ids = np.random.default_rng(T + 5).integers(0, V, (B, 2 * T))
    sets = [f"grad.chunk={chunk}", f"grad.token_block={token_block}"]
    state = np.zeros((K, B * E, Kc - 1 + N))
    ash.grad(path, ids=ids[:, :T], state=state, set=sets, engine="adjoint-exact")
    first = np.array(state)
    loss, grads = ash.grad(path, ids=ids[:, T:], state=state, set=sets, engine="adjoint-exact")

    t_ids = torch.tensor(ids, dtype=torch.long)
    with torch.no_grad():
        cache = model(input_ids=t_ids[:, :T], use_cache=True).cache
    for k in range(K):
        conv = cache.get_conv_state(k, state_idx=0).numpy()  # [B, E, Kc]: the last Kc inputs
        ssm = cache.get_recurrent_state(k, state_idx=0).numpy()  # [B, E, N]
        ours = first[k].reshape(B, E, Kc - 1 + N)
        for name, a, b in [("conv", ours[..., :Kc - 1], conv[..., 1:]), ("ssm", ours[..., Kc - 1:], ssm)]:
            err = np.max(np.abs(a - b)) / np.max(np.abs(b))
            assert err <= RTOL, (k, name, err)
    model.zero_grad()
    logits = torch.stack([model(input_ids=t_ids[:, t:t + 1], cache=cache, use_cache=True).logits[:, -1]
                          for t in range(T, 2 * T)], 1)
    ref = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, V), t_ids[:, T + 1:].reshape(-1))
    ref.backward()
    ref_grads = to_ash_grads({n: p.grad for n, p in model.named_parameters()}, K, tied)
    assert_close(loss, grads, ref.item(), ref_grads)
    # The check fails when either part of the state is not carried.
    for part in (slice(0, Kc - 1), slice(Kc - 1, None)):
        other = np.array(first)
        other[:, :, part] = 0
        g = ash.grad(path, ids=ids[:, T:], state=other, set=sets, engine="adjoint-exact")[1]
        assert max_rel(g, ref_grads) > 1e-6


def test_carried_state_is_checked(tmp_path):
    path = tmp_path / "m.h5"
    ash.save(path, ash.init(ash_config(11, 4, 2, 2, 2, 4, 0, True, 1e-5), "double"))
    ids = np.arange(20) % 11
    with pytest.raises(ash.Error, match=r"expected \[batch·E, Kc-1\+N\]"):  # an SSM-ResNet's [B·D, N]
        ash.grad(path, ids, seq_len=10, batch=1, engine="adjoint-exact", state=np.zeros((2, 4, 2)))
    with pytest.raises(ash.Error, match="need grad.engine = adjoint-exact"):
        ash.grad(path, ids, seq_len=10, batch=1, engine="backprop", state=np.zeros((2, 8, 5)))
    with pytest.raises(ash.Error, match="state .* must be a C-contiguous writable 3-D float64 array on "):  # a copy would lose it
        ash.grad(path, ids, seq_len=10, batch=1, engine="adjoint-exact", state=np.zeros((2, 8, 5), np.float32))
    state = np.zeros((2, 8, 5))
    ash.grad(path, ids, seq_len=10, batch=1, engine="adjoint-exact", state=state)
    assert np.any(state != 0)  # the state after the window, written in place


@pytest.mark.parametrize("kw", [{"token_block": 3}, {"token_block": 2, "layer_checkpoint": 2},
                                {"token_block": 4, "storage": "bf16"}])
def test_levers_run(tmp_path, kw):
    # E3's memory levers on a Mamba (docs/design.md §8): token blocks and checkpoints give
    # the whole window's gradient (1e-12 in double); bf16 storage within its rounding.
    path = tmp_path / "m.h5"
    ash.save(path, ash.init(ash_config(11, 4, 2, 2, 2, 4, 0, True, 1e-5), "double"))
    ids = np.arange(20) % 11
    l0, g0 = ash.grad(path, ids, seq_len=10, batch=1, engine="adjoint-exact", set=["grad.chunk=1"])
    l1, g1 = ash.grad(path, ids, seq_len=10, batch=1, engine="adjoint-exact", set=["grad.chunk=1"], **kw)
    tol = 2e-2 if "storage" in kw else 1e-12
    assert abs(l1 - l0) <= tol * abs(l0)
    for name in g0:
        assert np.linalg.norm(g1[name] - g0[name]) <= tol * np.linalg.norm(g0[name]), name


@pytest.mark.parametrize("kw", [{"engine": "backprop", "token_block": 4}, {"engine": "backprop", "storage": "bf16"},
                                {"engine": "backprop", "layer_checkpoint": 2}])
def test_levers_need_adjoint_exact(tmp_path, kw):
    path = tmp_path / "m.h5"
    ash.save(path, ash.init(ash_config(11, 4, 2, 2, 2, 4, 0, True, 1e-5), "double"))
    with pytest.raises(ash.Error, match="need grad.engine = adjoint-exact"):
        ash.grad(path, np.arange(20) % 11, seq_len=10, **kw)


def test_ssm_resnet_refuses_mamba_keys():
    with pytest.raises(ash.Error, match="model.arch=mamba, falcon_mamba or mamba2 only"):
        ash.init({"model": {"expand": 3}})
