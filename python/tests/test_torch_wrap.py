"""adjoint_sharding.torch.wrap(model) against the same transformers MambaForCausalLM
unwrapped (docs/python.md): the loss, the logits and every parameter's .grad after
loss.backward() in float64 to 1e-10 relative (K 1..3, odd T, batch 1 and 2, tied and
untied, conv kernels 2..4, dt ranks 1..3), the detached mode against transformers
with each mixer's input detached, an AdamW loop, gradient accumulation, float32,
what autograd keeps, the calls left to transformers (cache, generation) and the
refusals.

The float64 oracle is transformers' slow path with its float32 casts removed
(test_mamba.py's float64_slow_path fixture, which both models see)."""
import copy
import pickle

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed in this venv (docs/python.md)")
transformers = pytest.importorskip("transformers")

import adjoint_sharding as ash  # noqa: E402
from adjoint_sharding.torch import unwrap, wrap  # noqa: E402
from test_mamba import float64_slow_path, hf_model  # noqa: E402,F401  (the fixture is used by name)
from transformers.models.mamba import modeling_mamba  # noqa: E402

RTOL = 1e-10
V, D, N, EXPAND, EPS = 13, 6, 4, 2, 1e-5


def rel_err(got, ref):
    return float((got - ref).abs().max() / max(float(ref.abs().max()), 1e-300))


def no_hf_blocks(model):
    """Makes transformers' own MambaBlock.forward fail on this model: the wrapped forward must not call it."""
    def fail(*args, **kwargs):
        raise AssertionError("transformers' MambaBlock ran inside the wrapped forward")
    for block in getattr(model, "backbone", model).layers:
        block.forward = fail
    return model


def loss_and_grads(model, ids, **kw):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids, **kw)
    out.loss.backward()
    return out, {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def assert_same(out, grads, ref_out, ref_grads, rtol):
    assert rel_err(out.loss.detach(), ref_out.loss.detach()) <= rtol
    assert rel_err(out.logits.detach(), ref_out.logits.detach()) <= rtol
    assert sorted(grads) == sorted(ref_grads)
    for n, ref in ref_grads.items():
        assert grads[n].dtype == ref.dtype and grads[n].shape == ref.shape, n
        assert rel_err(grads[n], ref) <= rtol, (n, rel_err(grads[n], ref))


# (K, T, batch, conv kernel, dt_rank, tied) as test_mamba.py's CASES
CASES = [(1, 9, 1, 4, 1, True), (2, 7, 2, 2, 2, False), (3, 11, 2, 3, 3, True), (2, 13, 1, 4, 3, False),
         (3, 5, 1, 2, 1, False)]


@pytest.mark.parametrize("K,T,B,Kc,R,tied", CASES)
def test_wrapped_equals_transformers_float64(float64_slow_path, K, T, B, Kc, R, tied):
    ref = hf_model(V, D, N, K, EXPAND, Kc, R, tied, EPS, seed=K * 100 + T).train()
    model = no_hf_blocks(wrap(copy.deepcopy(ref), chunk=3))
    ids = torch.tensor(np.random.default_rng(T).integers(0, V, (B, T)))
    ref_out, ref_grads = loss_and_grads(ref, ids)
    out, grads = loss_and_grads(model, ids)
    assert out.logits.dtype == torch.float64
    assert_same(out, grads, ref_out, ref_grads, RTOL)
    # eval mode, no labels, no gradient: the same logits through the C++ forward
    with torch.no_grad():
        logits = model.eval()(input_ids=ids).logits
    assert rel_err(logits, ref_out.logits.detach()) <= RTOL


@pytest.mark.parametrize("K,T,B,Kc,R,tied", [(2, 13, 1, 4, 3, False), (3, 11, 2, 3, 3, True)])
def test_memory_levers_equal_transformers(float64_slow_path, K, T, B, Kc, R, tied):
    # Token blocks and layer checkpointing (the block-wise engine under the wrapped
    # stack) give transformers' gradient to RTOL; bf16 kept inputs are within bf16's
    # rounding of it, and off it (the lever is on).
    ref = hf_model(V, D, N, K, EXPAND, Kc, R, tied, EPS, seed=K * 100 + T).train()
    ids = torch.tensor(np.random.default_rng(T).integers(0, V, (B, T)))
    ref_out, ref_grads = loss_and_grads(ref, ids)
    for kw in ({"token_block": 3}, {"token_block": 4, "layer_checkpoint": 2}, {"layer_checkpoint": 2}):
        out, grads = loss_and_grads(no_hf_blocks(wrap(copy.deepcopy(ref), chunk=3, **kw)), ids)
        assert_same(out, grads, ref_out, ref_grads, RTOL)
    out, grads = loss_and_grads(no_hf_blocks(wrap(copy.deepcopy(ref), chunk=3, storage="bf16", token_block=4)), ids)
    errs = [rel_err(grads[n], ref_grads[n]) for n in ref_grads if "layers" in n]
    assert max(errs) <= 3e-2 and max(errs) > 1e-6, errs


def test_parameters_are_shared_not_copied(float64_slow_path):
    """The wrapped model reads its parameters at every call: a change made in place is seen."""
    ref = hf_model(V, D, N, 2, EXPAND, 3, 2, True, EPS, seed=3)
    model = no_hf_blocks(wrap(copy.deepcopy(ref)))
    ids = torch.tensor(np.random.default_rng(1).integers(0, V, (2, 9)))
    with torch.no_grad():
        for m in (ref, model):
            m.backbone.layers[1].mixer.x_proj.weight.mul_(1.7)
            m.backbone.layers[0].mixer.A_log.add_(0.3)
    ref_out, ref_grads = loss_and_grads(ref, ids)
    out, grads = loss_and_grads(model, ids)
    assert_same(out, grads, ref_out, ref_grads, RTOL)
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in ref.named_parameters()]


def test_wrapped_model_deepcopies_and_pickles(float64_slow_path):
    """A copy of a wrapped model is wrapped and runs on its own parameters."""
    ref = hf_model(V, D, N, 2, EXPAND, 2, 1, False, EPS, seed=5)
    model = wrap(copy.deepcopy(ref))
    ids = torch.tensor(np.random.default_rng(2).integers(0, V, (1, 9)))
    ref_out, ref_grads = loss_and_grads(ref, ids)
    for other in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert other.backbone.forward.backbone is other.backbone
        out, grads = loss_and_grads(no_hf_blocks(other), ids)
        assert_same(out, grads, ref_out, ref_grads, RTOL)
        assert model.backbone.layers[0].mixer.D.grad is None  # the original's parameters were not used


def detached_block_forward(self, hidden_states, cache=None, attention_mask=None, **kwargs):
    """MambaBlock with its input detached into norm -> mixer (the residual keeps its gradient)."""
    mixed = self.mixer(self.norm(hidden_states.detach()), cache=cache, attention_mask=attention_mask)
    return hidden_states + mixed


@pytest.mark.parametrize("K,T,B,Kc,R,tied", [(1, 9, 1, 4, 1, True), (3, 11, 2, 3, 3, False)])
def test_detached_equals_transformers_with_detached_inputs(float64_slow_path, monkeypatch, K, T, B, Kc, R, tied):
    ref = hf_model(V, D, N, K, EXPAND, Kc, R, tied, EPS, seed=K * 10 + T)
    model = no_hf_blocks(wrap(copy.deepcopy(ref), detach_inputs=True, chunk=4))
    ids = torch.tensor(np.random.default_rng(T + 2).integers(0, V, (B, T)))
    out, grads = loss_and_grads(model, ids)
    exact_out, exact_grads = loss_and_grads(ref, ids)
    monkeypatch.setattr(modeling_mamba.MambaBlock, "forward", detached_block_forward)
    ref_out, ref_grads = loss_and_grads(ref, ids)
    assert_same(out, grads, ref_out, ref_grads, RTOL)
    if K > 1:  # the oracle differs from the exact gradient, so the comparison above can fail
        assert rel_err(exact_grads["backbone.layers.0.mixer.in_proj.weight"],
                       ref_grads["backbone.layers.0.mixer.in_proj.weight"]) > 1e-3


def test_adamw_steps_equal_unwrapped(float64_slow_path):
    ref = hf_model(V, D, N, 2, EXPAND, 4, 2, False, EPS, seed=11).train()
    model = no_hf_blocks(wrap(copy.deepcopy(ref)))
    rng = np.random.default_rng(4)
    batches = [torch.tensor(rng.integers(0, V, (2, 9))) for _ in range(4)]
    for m in (ref, model):
        opt = torch.optim.AdamW(m.parameters(), lr=3e-2, weight_decay=0.1)
        for ids in batches:
            opt.zero_grad(set_to_none=True)
            m(input_ids=ids, labels=ids).loss.backward()
            opt.step()
    moved = 0.0
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert rel_err(p.detach(), q.detach()) <= 1e-9, n
    for (n, p), (_, q) in zip(ref.named_parameters(), hf_model(V, D, N, 2, EXPAND, 4, 2, False, EPS,
                                                               seed=11).named_parameters()):
        moved = max(moved, rel_err(p.detach(), q.detach()))
    assert moved > 1e-2  # the steps changed the parameters


def test_gradient_accumulates_over_two_backward_calls(float64_slow_path):
    ref = hf_model(V, D, N, 3, EXPAND, 2, 1, True, EPS, seed=21)
    model = no_hf_blocks(wrap(copy.deepcopy(ref)))
    rng = np.random.default_rng(8)
    a, b = (torch.tensor(rng.integers(0, V, (2, 7))) for _ in range(2))
    for m in (ref, model):
        m.zero_grad(set_to_none=True)
        m(input_ids=a, labels=a).loss.backward()
        (0.5 * m(input_ids=b, labels=b).loss).backward()
    one = {n: p.grad.clone() for n, p in model.named_parameters()}
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert rel_err(p.grad, q.grad) <= RTOL, n
    model.zero_grad(set_to_none=True)
    model(input_ids=a, labels=a).loss.backward()
    assert rel_err(one["backbone.layers.1.mixer.D"], model.backbone.layers[1].mixer.D.grad) > 1e-6


def test_frozen_parameters_get_no_gradient(float64_slow_path):
    ref = hf_model(V, D, N, 2, EXPAND, 3, 2, True, EPS, seed=23)
    model = no_hf_blocks(wrap(copy.deepcopy(ref)))
    ids = torch.tensor(np.random.default_rng(3).integers(0, V, (2, 7)))
    for m in (ref, model):
        m.backbone.layers[0].mixer.x_proj.weight.requires_grad_(False)
        m.backbone.layers[1].norm.weight.requires_grad_(False)
        m(input_ids=ids, labels=ids).loss.backward()
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        if not q.requires_grad:
            assert p.grad is None and q.grad is None, n
        else:
            assert rel_err(p.grad, q.grad) <= RTOL, n


def test_mamba_model_and_inputs_embeds(float64_slow_path):
    """A MambaModel (no head) wraps too; inputs_embeds and a torch loss on the hidden states."""
    ref = hf_model(V, D, N, 2, EXPAND, 3, 2, True, EPS, seed=31).backbone
    model = no_hf_blocks(wrap(copy.deepcopy(ref)))
    x = torch.randn(2, 9, D, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    w = torch.randn(2, 9, D, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    grads = []
    for m in (ref, model):
        xi = x.clone().requires_grad_(True)
        h = m(inputs_embeds=xi, use_cache=False).last_hidden_state
        (w * h).sum().backward()
        grads.append((h.detach(), xi.grad, {n: p.grad for n, p in m.named_parameters() if p.grad is not None}))
    (h0, gx0, g0), (h1, gx1, g1) = grads
    assert rel_err(h1, h0) <= RTOL and rel_err(gx1, gx0) <= RTOL
    assert sorted(g1) == sorted(g0)
    for n in g0:
        assert rel_err(g1[n], g0[n]) <= RTOL, n


def assert_wrapped_backbone(ref, model, width, output):
    """A backbone (no head) with inputs_embeds and a torch loss on its hidden states: `model`'s output
    class, hidden states, input gradient and parameter gradients equal `ref`'s (float64, RTOL)."""
    x = torch.randn(2, 9, width, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    w = torch.randn(2, 9, width, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    got = []
    for m in (ref, model):
        xi = x.clone().requires_grad_(True)
        out = m(inputs_embeds=xi, use_cache=False)
        (w * out.last_hidden_state).sum().backward()
        got.append((type(out).__name__, out.last_hidden_state.detach(), xi.grad,
                    {n: p.grad for n, p in m.named_parameters() if p.grad is not None}))
    (c0, h0, gx0, g0), (c1, h1, gx1, g1) = got
    assert c0 == c1 == output
    assert rel_err(h1, h0) <= RTOL and rel_err(gx1, gx0) <= RTOL and sorted(g1) == sorted(g0)
    for n in g0:
        assert rel_err(g1[n], g0[n]) <= RTOL, n


def test_float32_is_close():
    ref = hf_model(V, D, N, 2, EXPAND, 4, 2, True, EPS, seed=41).to(torch.float32).train()
    model = no_hf_blocks(wrap(copy.deepcopy(ref)))
    ids = torch.tensor(np.random.default_rng(6).integers(0, V, (2, 33)))
    ref_out, ref_grads = loss_and_grads(ref, ids)
    out, grads = loss_and_grads(model, ids)
    assert out.logits.dtype == torch.float32
    assert_same(out, grads, ref_out, ref_grads, 2e-4)


def saved_bytes(model, ids):
    """Bytes of the tensors autograd saves for backward in one forward, parameters left out."""
    params = {p.data_ptr() for p in model.parameters()}
    total = [0]

    def pack(t):
        if t.data_ptr() not in params:
            total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, labels=ids).loss.backward()
    return total[0]


def test_autograd_keeps_no_block_activations(float64_slow_path):
    """What autograd saves: the wrapped model's is the same for 1 and 3 blocks (the blocks keep
    nothing between forward and backward but y0); transformers' keeps every block's activations."""
    B, T = 2, 64
    ids = torch.tensor(np.random.default_rng(9).integers(0, V, (B, T)))
    ours = []
    for K in (1, 3):
        ref = hf_model(V, D, N, K, EXPAND, 4, 2, True, EPS, seed=51)
        ours.append(saved_bytes(wrap(copy.deepcopy(ref)), ids))
        theirs = saved_bytes(ref, ids)
    assert ours[0] == ours[1], ours
    # y0, norm_f, lm_head, the logits and the loss: O(B·T·(D + V))
    assert ours[1] <= 8 * B * T * (8 * D + 3 * V), ours
    assert theirs >= 8 * 3 * B * T * EXPAND * D * N, theirs  # at least one [B, E, T, N] per block


def test_cache_generation_and_hidden_states_run_transformers(float64_slow_path, monkeypatch):
    """Calls with a cache or every block's hidden states are transformers' own (documented);
    the others run no transformers block."""
    ref = hf_model(V, D, N, 2, EXPAND, 3, 2, True, EPS, seed=61).eval()
    model = wrap(copy.deepcopy(ref))
    calls = []
    block_forward = modeling_mamba.MambaBlock.forward

    def counted(self, *args, **kwargs):
        calls.append(self.layer_idx)
        return block_forward(self, *args, **kwargs)

    monkeypatch.setattr(modeling_mamba.MambaBlock, "forward", counted)
    ids = torch.tensor([[1, 5, 2, 7, 3]])
    with torch.no_grad():
        assert torch.equal(model.generate(ids, max_new_tokens=6, do_sample=False),
                           ref.generate(ids, max_new_tokens=6, do_sample=False))
        calls.clear()
        assert model(input_ids=ids, use_cache=True).cache is not None and calls == [0, 1]
        calls.clear()
        assert len(model(input_ids=ids, output_hidden_states=True).hidden_states) == 3 and calls == [0, 1]
        calls.clear()
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids))  # a mask of ones changes nothing
        assert out.cache is None and calls == []
        assert rel_err(out.logits, ref(input_ids=ids).logits) <= RTOL
        unwrap(model)
        calls.clear()
        model(input_ids=ids)
        assert calls == [0, 1]


def test_refusals(float64_slow_path):
    def cfg(**kw):
        base = dict(vocab_size=V, hidden_size=D, state_size=N, num_hidden_layers=2, expand=EXPAND, conv_kernel=3,
                    time_step_rank=2, use_cache=False)
        return transformers.MambaConfig(**{**base, **kw})

    with pytest.raises(ash.Error, match="use_bias=True"):
        wrap(transformers.MambaForCausalLM(cfg(use_bias=True)))
    with pytest.raises(ash.Error, match="use_conv_bias=False"):
        wrap(transformers.MambaForCausalLM(cfg(use_conv_bias=False)))
    with pytest.raises(ash.Error, match="hidden_act"):
        wrap(transformers.MambaForCausalLM(cfg(hidden_act="gelu")))
    with pytest.raises(ash.Error, match="MambaForCausalLM or MambaModel"):
        wrap(torch.nn.Linear(2, 2))
    model = transformers.MambaForCausalLM(cfg()).to(torch.float64)
    for kw, key in [({"storage": "half"}, "run.storage"), ({"layer_checkpoint": -1}, "grad.layer_checkpoint"),
                    ({"token_block": -1}, "grad.token_block"), ({"truncate": 4}, "grad.truncate needs"),
                    ({"chunk": 0}, "chunk")]:
        with pytest.raises(ash.Error, match=key):
            wrap(model, **kw)
    assert "forward" not in model.backbone.__dict__  # a refused wrap leaves the model alone
    with pytest.raises(ash.Error, match="float32 or torch.float64"):
        wrap(copy.deepcopy(model).to(torch.bfloat16))
    # A device other than the build's (adjoint_sharding.device()) is refused by name; on a
    # CPU build a meta model stands in where no GPU is.
    device = "cpu" if ash.device() != "cpu" else "cuda" if torch.cuda.is_available() else "meta"
    refused = rf"is on {device}(:0)?; this build of adjoint_sharding runs on {ash.device()}"
    with pytest.raises(ash.Error, match=refused):
        wrap(copy.deepcopy(model).to(device))
    wrap(model)
    ids = torch.tensor([[1, 2, 3, 4]])
    with pytest.raises(ash.Error, match="attention_mask"):
        model(input_ids=ids, attention_mask=torch.tensor([[0, 1, 1, 1]]))
    model.to(device)
    with pytest.raises(ash.Error, match=refused):
        model(input_ids=ids.to(device))


def test_each_blocks_own_activation_is_read(float64_slow_path):
    """A block's mixer.activation is what transformers applies: one the C++ block does not
    compute (it computes SiLU) is refused by block and value, at wrap and at a forward
    after the block was changed; never computed as SiLU."""
    model = hf_model(V, D, N, 3, EXPAND, 3, 2, False, EPS, seed=7)
    model.backbone.layers[1].mixer.activation = "gelu"
    with pytest.raises(ash.Error, match="block 1's mixer.activation is 'gelu'"):
        wrap(model)
    assert "forward" not in model.backbone.__dict__
    model.backbone.layers[1].mixer.activation = "silu"
    wrap(model)
    model.backbone.layers[2].mixer.activation = "relu"
    with pytest.raises(ash.Error, match="block 2's mixer.activation is 'relu'"):
        model(input_ids=torch.tensor([[1, 2, 3, 4]]))


def test_dt_proj_without_bias_equals_transformers(float64_slow_path):
    """A dt_proj without a bias (transformers computes it so) is the C++ block with a zero
    bias: loss, logits and every .grad equal transformers' to 1e-10 (its eval-mode path: the
    training one reads dt_proj.bias unguarded)."""
    ref = hf_model(V, D, N, 2, EXPAND, 3, 2, False, EPS, seed=11)
    ref.backbone.layers[0].mixer.dt_proj.bias = None
    model = no_hf_blocks(wrap(copy.deepcopy(ref), chunk=3))
    ids = torch.tensor(np.random.default_rng(5).integers(0, V, (2, 9)))
    ref_out, ref_grads = loss_and_grads(ref, ids)
    out, grads = loss_and_grads(model, ids)
    assert "backbone.layers.0.mixer.dt_proj.bias" not in grads
    assert_same(out, grads, ref_out, ref_grads, RTOL)
