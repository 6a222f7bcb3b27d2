"""adjoint_sharding.torch: the K residual SSM layers as a torch.nn.Module whose backward is E3.

    from adjoint_sharding.torch import SSMStack
    stack = SSMStack.from_checkpoint("model.h5", dtype=torch.float32)
    yK = stack(y0)            # y0 [B, T, P], e.g. from your torch embedding
    yK = stack(y0, cu_seqlens=starts)  # packed documents: the state restarts at each start
    loss = my_head(yK)...     # your head and loss in PyTorch
    loss.backward()           # E3 in C++: ∂L/∂y0 and every layer's gradient

The forward keeps nothing but y0 (autograd saves it); the backward recomputes
the layers from y0 inside the C++ pass, keeping only what E3 keeps (every m-th
layer input and the states at block starts), then runs E3's reverse pass from
g = ∂L/∂yK. docs/python.md has the options and the memory this saves.

    from adjoint_sharding.torch import wrap
    model = wrap(transformers.MambaForCausalLM.from_pretrained(...))   # in place; returns the model
    model(input_ids=ids, labels=ids).loss.backward()   # the blocks' forward and E3 backward in C++

wrap keeps the model's own parameters (read in place by the C++ pass, their
gradients accumulated into .grad by autograd as usual); embedding, final norm
and lm_head stay in PyTorch, and calls with a cache (generation) run
transformers' own blocks. A FalconMambaForCausalLM (or FalconMambaModel) wraps
alike, its blocks the FalconMamba kind (the mixer norms on δ, B and C), and a
Mamba2ForCausalLM (or Mamba2Model) as the Mamba-2 kind.
"""
import json as _json

import numpy as _np
import torch as _torch

from . import _core, load as _load, init as _init, _integer
from ._core import Error

__all__ = ["SSMStack", "SSMLayer", "wrap", "unwrap"]

# The device whose tensors the C++ passes read and write in place (no copies): the CPU,
# or the GPU of a CUDA build. Tensors elsewhere are refused by name.
DEVICE = _torch.device(_core.device())


def _check_device(t, where, what):
    if t.device != DEVICE:
        raise Error(f"{where}: {what} is on {t.device}; this build of adjoint_sharding runs on {DEVICE} "
                    f"(Kokkos {_core.backend}; adjoint_sharding.device())")


def _ready(t):
    """Before the C++ pass reads t: torch's queued work on t's GPU has finished (Kokkos
    runs on its own stream; the pass fences before it returns)."""
    if t.is_cuda:
        _torch.cuda.synchronize(t.device)

LAYER_TENSORS = ("norm", "W_delta", "b_delta", "A_log", "W_B", "W_C", "D")
_STACK_OPTIONS = ("detach_inputs", "truncate", "storage", "layer_checkpoint", "token_block", "chunk")


class SSMLayer(_torch.nn.Module):
    """One layer's parameters θ_k (docs/design.md §1), shaped as the checkpoint's /params/layers/kkk/*."""

    def __init__(self, width, state, dtype):
        super().__init__()
        shapes = {"norm": (width,), "W_delta": (width, width), "b_delta": (width,), "A_log": (width, state),
                  "W_B": (state, width), "W_C": (state, width), "D": (width,)}
        for name in LAYER_TENSORS:
            self.register_parameter(name, _torch.nn.Parameter(_torch.zeros(shapes[name], dtype=dtype)))


class _StackFunction(_torch.autograd.Function):
    @staticmethod
    def forward(ctx, stack, y0, cu_seqlens, *params):
        yK = _torch.empty_like(y0)
        arrays = stack._arrays(params)
        _ready(y0)
        _core.stack_forward(arrays, stack._options, y0.detach(), yK, cu_seqlens)
        ctx.stack = stack
        ctx.cu_seqlens = cu_seqlens
        ctx.save_for_backward(y0, *params)
        return yK

    @staticmethod
    def backward(ctx, gK):
        y0, *params = ctx.saved_tensors
        stack = ctx.stack
        # g is overwritten in place with ∂L/∂y0: a private contiguous copy of the cotangent.
        g = gK.detach().to(dtype=y0.dtype).contiguous().clone()
        _check_device(g, "SSMStack", "the cotangent ∂L/∂yK")
        arrays = stack._arrays(params)
        _ready(g)
        grads = _core.stack_backward(arrays, stack._options, y0.detach(), g, ctx.cu_seqlens)
        # The gradient comes back in host memory (O(parameters)), placed beside the parameters.
        out = [_torch.from_numpy(grads[name]).to(y0.device) for name in stack._names]
        return (None, g, None, *out)


class SSMStack(_torch.nn.Module):
    """The K residual SSM layers of docs/design.md §1 (no embedding, no head) on [B, T, P].

    Parameters are named layers.000.W_delta, layers.000.A_log, ... (the checkpoint's
    paths with dots) in the checkpoint's layouts. Options (fixed at construction,
    changeable through .set_options):
      detach_inputs: the paper's gradient (each layer's input detached in its branch);
      truncate: the window T̄ (needs detach_inputs; 0 = the whole window);
      storage: "float" (the compute type), "bf16" or "fp16" for the kept layer inputs;
      layer_checkpoint: keep every m-th layer input, recompute the rest;
      token_block: tokens per block of the block-wise pass (0: 4096);
      chunk: E3's chunk length C (also the scan's).
    """

    def __init__(self, width, state, layers, *, dtype=_torch.float32, seed=1234, detach_inputs=False, truncate=0,
                 storage="float", layer_checkpoint=1, token_block=0, chunk=64, _params=None):
        super().__init__()
        if dtype not in (_torch.float32, _torch.float64):
            raise Error(f"SSMStack: dtype must be torch.float32 or torch.float64, got {dtype}")
        self.width, self.state, self.num_layers, self.dtype = (_integer("width", width), _integer("state", state),
                                                               _integer("layers", layers), dtype)
        # The sizes and options are checked (as `ash grad` checks them) before any tensor exists.
        self.set_options(detach_inputs=detach_inputs, truncate=truncate, storage=storage,
                         layer_checkpoint=layer_checkpoint, token_block=token_block, chunk=chunk)
        self.layers = _torch.nn.ModuleDict({f"{k:03d}": SSMLayer(self.width, self.state, dtype)
                                            for k in range(self.num_layers)})
        self._names = [f"layers/{k:03d}/{n}" for k in range(self.num_layers) for n in LAYER_TENSORS]
        if _params is None:
            cfg = {"model": {"width": self.width, "state": self.state, "layers": self.num_layers,
                             "seed": int(seed)}}
            _params = _init(cfg, "double")
        self.load_arrays(_params)

    @classmethod
    def from_checkpoint(cls, path, dtype=_torch.float32, detach_inputs=False, truncate=0, storage="float",
                        layer_checkpoint=1, token_block=0, chunk=None):
        """The layers of an ash checkpoint (embedding and head are left out: ckpt = load(path) has them)."""
        ck = _load(path)
        m = ck.config["model"]
        if chunk is None:
            chunk = ck.config.get("grad", {}).get("chunk", 64)
        return cls(m["width"], m["state"], m["layers"], dtype=dtype, detach_inputs=detach_inputs,
                   truncate=truncate, storage=storage, layer_checkpoint=layer_checkpoint, token_block=token_block,
                   chunk=chunk, _params=ck)

    def set_options(self, *, detach_inputs=None, truncate=None, storage=None, layer_checkpoint=None,
                    token_block=None, chunk=None):
        """Changes the options given (None: unchanged); the whole set is checked here, as
        `ash grad` checks it, and a refused change leaves the stack's options as they were."""
        old = getattr(self, "_options", None)
        o = _core.StackOptions()
        for key in _STACK_OPTIONS:
            if old is not None:
                setattr(o, key, getattr(old, key))
        o.width, o.state, o.layers = self.width, self.state, self.num_layers
        if detach_inputs is not None:
            o.detach_inputs = bool(detach_inputs)
        for key, value in (("truncate", truncate), ("layer_checkpoint", layer_checkpoint),
                           ("token_block", token_block), ("chunk", chunk)):
            if value is not None:
                setattr(o, key, _integer(key, value))
        if storage is not None:
            o.storage = str(storage)
        _core.stack_check(o)
        self._options = o

    @_torch.no_grad()
    def load_arrays(self, params):
        """Copies layers/kkk/* from a dict of arrays (a Checkpoint from adjoint_sharding.load)."""
        for k in range(self.num_layers):
            layer = self.layers[f"{k:03d}"]
            for n in LAYER_TENSORS:
                key = f"layers/{k:03d}/{n}"
                if key not in params:
                    raise Error(f"SSMStack: parameter '{key}' is missing")
                src = _torch.as_tensor(_np.asarray(params[key]))
                dst = getattr(layer, n)
                if tuple(src.shape) != tuple(dst.shape):
                    raise Error(f"SSMStack: '{key}' has shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
                dst.copy_(src)

    def arrays(self):
        """The parameters as a dict of numpy arrays keyed by checkpoint path (layers/kkk/name)."""
        return {name: p.detach().cpu().numpy() for name, p in zip(self._names, self._params())}

    def _params(self):
        return [getattr(self.layers[f"{k:03d}"], n) for k in range(self.num_layers) for n in LAYER_TENSORS]

    def _arrays(self, params):
        out = {}
        for name, p in zip(self._names, params):
            t = p.detach()
            _check_device(t, "SSMStack", f"parameter '{name}'")
            if t.dtype != self.dtype:
                raise Error(f"SSMStack: parameter '{name}' is {t.dtype}, the stack is {self.dtype}")
            # CPU: numpy arrays, as ever; a CUDA build reads the tensors on the GPU (DLPack).
            out[name] = t.contiguous().numpy() if t.device.type == "cpu" else t.contiguous()
        return out

    def _check_input(self, y0):
        if not isinstance(y0, _torch.Tensor):
            raise Error(f"SSMStack: y0 must be a torch.Tensor, got {type(y0).__name__}")
        _check_device(y0, "SSMStack", "y0")
        if y0.dtype != self.dtype:
            raise Error(f"SSMStack: y0 is {y0.dtype}, the stack is {self.dtype} (convert with .to({self.dtype}))")
        if y0.dim() != 3 or y0.shape[2] != self.width:
            raise Error(f"SSMStack: y0 must be [B, T, P={self.width}], got {list(y0.shape)}")
        if y0.shape[0] < 1 or y0.shape[1] < 1:
            raise Error(f"SSMStack: y0 must have B >= 1 and T >= 1, got {list(y0.shape)}")
        if not y0.is_contiguous():
            raise Error("SSMStack: y0 is not contiguous (call .contiguous() first; the library reads it in place)")

    def forward(self, y0, cu_seqlens=None):
        """y_K for y0 [B, T, P]. cu_seqlens (optional): document starts as flat
        offsets b*T + t into the B*T tokens, cu_seqlens style (e.g. [0, 5, 12, ..., B*T];
        the closing B*T marks nothing): every layer's state restarts from zero at
        each start and no gradient crosses it (docs/design.md §1)."""
        self._check_input(y0)
        cu = self._check_starts(cu_seqlens, y0)
        params = self._params()
        if _torch.is_grad_enabled() and (y0.requires_grad or any(p.requires_grad for p in params)):
            return _StackFunction.apply(self, y0, cu, *params)
        yK = _torch.empty_like(y0)
        arrays = self._arrays(params)
        _ready(y0)
        _core.stack_forward(arrays, self._options, y0.detach(), yK, cu)
        return yK

    @staticmethod
    def _check_starts(cu_seqlens, y0):
        if cu_seqlens is None:
            return []
        cu = _np.asarray(cu_seqlens.cpu() if isinstance(cu_seqlens, _torch.Tensor) else cu_seqlens)
        if cu.ndim != 1 or (cu.size and not _np.issubdtype(cu.dtype, _np.integer)):
            raise Error(f"SSMStack: cu_seqlens must be a 1-D sequence of integers, got shape {list(cu.shape)} "
                        f"of {cu.dtype}")
        n = y0.shape[0] * y0.shape[1]
        if cu.size and (cu.min() < 0 or cu.max() > n):
            raise Error(f"SSMStack: cu_seqlens must lie in [0, B*T = {n}], got {int(cu.min())}..{int(cu.max())}")
        return [int(v) for v in cu]

    def extra_repr(self):
        o = self._options
        mode = "exact" if not o.detach_inputs else ("paper, T̄=%d" % o.truncate if o.truncate else "paper")
        return (f"width={self.width}, state={self.state}, layers={self.num_layers}, dtype={self.dtype}, {mode}, "
                f"storage={o.storage}, layer_checkpoint={o.layer_checkpoint}, chunk={o.chunk}")


# ---------------------------------------------------------------------------
# transformers' MambaForCausalLM / MambaModel with its blocks run by ash::StackAdjoint (Mamba kind),
# FalconMambaForCausalLM / FalconMambaModel by the FalconMamba kind (the same tensors), and
# Mamba2ForCausalLM / Mamba2Model by the Mamba-2 kind (its own tensors).

# One block's tensors in the order _core.mamba_stack_forward takes them (the
# checkpoint's names): transformers' MambaBlock attribute paths.
MAMBA_TENSORS = (("norm", "norm.weight"), ("in_proj", "mixer.in_proj.weight"), ("conv_weight", "mixer.conv1d.weight"),
                 ("conv_bias", "mixer.conv1d.bias"), ("x_proj", "mixer.x_proj.weight"),
                 ("dt_proj", "mixer.dt_proj.weight"), ("dt_bias", "mixer.dt_proj.bias"), ("A_log", "mixer.A_log"),
                 ("D", "mixer.D"), ("out_proj", "mixer.out_proj.weight"))
# A Mamba-2 block's (Mamba2Block): mixer.norm is the gated RMSNorm.
MAMBA2_TENSORS = (("norm", "norm.weight"), ("in_proj", "mixer.in_proj.weight"),
                  ("conv_weight", "mixer.conv1d.weight"), ("conv_bias", "mixer.conv1d.bias"),
                  ("dt_bias", "mixer.dt_bias"), ("A_log", "mixer.A_log"), ("D", "mixer.D"),
                  ("gated_norm", "mixer.norm.weight"), ("out_proj", "mixer.out_proj.weight"))
_WRAP_ATTR = "_adjoint_sharding_wrap"


def _attr(module, path):
    for part in path.split("."):
        module = getattr(module, part)
    return module


def _modeling():
    """transformers' Mamba, FalconMamba and Mamba-2 modelling modules."""
    try:
        from transformers.models.falcon_mamba import modeling_falcon_mamba as _fm
        from transformers.models.mamba import modeling_mamba as _mm
        from transformers.models.mamba2 import modeling_mamba2 as _m2
    except ImportError as e:  # pragma: no cover - transformers is what wrap is for
        raise Error(f"adjoint_sharding.torch.wrap needs transformers ({e})") from None
    return _mm, _fm, _m2


def _backbone(model):
    """model.backbone of a (Falcon)MambaForCausalLM or Mamba2ForCausalLM, or the backbone itself."""
    _mm, _fm, _m2 = _modeling()
    if isinstance(model, (_mm.MambaForCausalLM, _fm.FalconMambaForCausalLM, _m2.Mamba2ForCausalLM)):
        return model.backbone
    if isinstance(model, (_mm.MambaModel, _fm.FalconMambaModel, _m2.Mamba2Model)):
        return model
    raise Error(f"adjoint_sharding.torch.wrap takes a transformers MambaForCausalLM or MambaModel, a "
                f"FalconMambaForCausalLM or FalconMambaModel, or a Mamba2ForCausalLM or Mamba2Model, got "
                f"{type(model).__name__}")


def _arch(backbone):
    """Our model.arch of a backbone _backbone returned."""
    _mm, _fm, _m2 = _modeling()
    if isinstance(backbone, _fm.FalconMambaModel):
        return "falcon_mamba"
    return "mamba2" if isinstance(backbone, _m2.Mamba2Model) else "mamba"


def _block_tensors(dims):
    """A block's (our name, transformers' attribute path) pairs for the stack's kind."""
    return MAMBA2_TENSORS if dims["arch"] == "mamba2" else MAMBA_TENSORS


def _conv_channels(dims):
    """The conv's channels: E, or a Mamba-2's E + 2·G·N (x, then B and C of its n_groups groups)."""
    E = dims["width"] * dims["expand"]
    return E + 2 * dims["n_groups"] * dims["state"] if dims["arch"] == "mamba2" else E


# A FalconMamba mixer's weightless RMSNorms (on δ, B and C), each with its own epsilon.
_MIXER_NORMS = ("dt_layernorm", "b_layernorm", "c_layernorm")


def _mamba_dims(backbone):
    """The stack's sizes from the configuration, every block checked against them;
    what the C++ block does not compute is refused by its setting's name."""
    cfg = backbone.config
    where = "adjoint_sharding.torch.wrap"
    if getattr(cfg, "use_bias", False):
        raise Error(f"{where}: use_bias=True (biases of in_proj and out_proj) is not supported")
    if not getattr(cfg, "use_conv_bias", True):
        raise Error(f"{where}: use_conv_bias=False is not supported (the conv1d has a bias)")
    if getattr(cfg, "hidden_act", "silu") != "silu":
        raise Error(f"{where}: hidden_act={cfg.hidden_act!r} is not supported (only 'silu')")
    if _arch(backbone) == "mamba2":
        return _mamba2_dims(backbone, where)
    D, E = int(cfg.hidden_size), int(cfg.intermediate_size)
    if E % D:
        raise Error(f"{where}: intermediate_size {E} is not a multiple of hidden_size {D}")
    dims = {"arch": _arch(backbone), "width": D, "state": int(cfg.state_size), "layers": len(backbone.layers),
            "expand": E // D, "conv_kernel": int(cfg.conv_kernel), "dt_rank": int(cfg.time_step_rank),
            "norm_eps": float(cfg.layer_norm_epsilon)}
    if dims["arch"] == "falcon_mamba":
        dims["mixer_rms_eps"] = float(cfg.mixer_rms_eps)
    _check_blocks(backbone, dims)
    return dims


def _mamba2_dims(backbone, where):
    """_mamba_dims of a Mamba2Model: Mamba2Config's sizes (n_groups must divide num_heads)."""
    cfg = backbone.config
    if int(cfg.n_groups) < 1 or int(cfg.num_heads) % int(cfg.n_groups):
        raise Error(f"{where}: n_groups={cfg.n_groups} does not divide num_heads={cfg.num_heads}")
    D, E = int(cfg.hidden_size), int(cfg.expand * cfg.hidden_size)
    if E % D:
        raise Error(f"{where}: expand {cfg.expand} is not an integer")
    lo, hi = (float(v) for v in cfg.time_step_limit)
    if not (0 <= lo < hi):
        raise Error(f"{where}: time_step_limit {tuple(cfg.time_step_limit)} is not (min, max) with 0 <= min < max")
    dims = {"arch": "mamba2", "width": D, "state": int(cfg.state_size), "layers": len(backbone.layers),
            "expand": E // D, "conv_kernel": int(cfg.conv_kernel), "head_dim": int(cfg.head_dim),
            "heads": int(cfg.num_heads), "n_groups": int(cfg.n_groups), "norm_eps": float(cfg.layer_norm_epsilon),
            "time_step_limit_min": lo, "time_step_limit_max": 0.0 if hi == float("inf") else hi}
    if dims["heads"] * dims["head_dim"] != E:
        raise Error(f"{where}: num_heads × head_dim = {dims['heads'] * dims['head_dim']} is not expand × hidden_size "
                    f"= {E}")
    _check_blocks(backbone, dims)
    return dims


def _check_mamba2_block(k, block, dims, where):
    """_check_blocks for a Mamba-2 block: its mixer's own heads, groups, norms and Δ clamp."""
    m = block.mixer
    if not isinstance(m, _modeling()[2].Mamba2Mixer):
        raise Error(f"{where}: block {k}'s mixer is a {type(m).__name__}, not a Mamba2Mixer")
    E = dims["width"] * dims["expand"]
    G = dims["n_groups"]
    if (m.num_heads, m.head_dim, m.n_groups) != (dims["heads"], dims["head_dim"], G) or m.norm.group_size != E // G:
        raise Error(f"{where}: block {k}'s mixer has {m.num_heads} heads of {m.head_dim} in {m.n_groups} groups; "
                    f"the configuration {dims['heads']} heads of {dims['head_dim']} in {G} groups")
    if float(m.norm.variance_epsilon) != dims["norm_eps"]:
        raise Error(f"{where}: block {k}'s mixer.norm (gated) epsilon {m.norm.variance_epsilon} is not "
                    f"layer_norm_epsilon {dims['norm_eps']}")
    hi = dims["time_step_limit_max"] or float("inf")
    if tuple(float(v) for v in m.time_step_limit) != (dims["time_step_limit_min"], hi):
        raise Error(f"{where}: block {k}'s time_step_limit {tuple(m.time_step_limit)} is not the configuration's "
                    f"({dims['time_step_limit_min']}, {hi})")


def _check_blocks(backbone, dims):
    """Each block's own settings (a block may differ from the configuration): what the
    C++ block does not compute is refused, naming the block and the value."""
    where = "adjoint_sharding.torch.wrap"
    C = _conv_channels(dims)
    for k, block in enumerate(backbone.layers):
        if dims["arch"] == "mamba2":
            _check_mamba2_block(k, block, dims, where)
        m = block.mixer
        # transformers' mixer applies its own `activation` (after the conv and to the gate);
        # the C++ block computes SiLU.
        activation = getattr(m, "activation", "silu")
        if activation != "silu":
            raise Error(f"{where}: block {k}'s mixer.activation is {activation!r}; the wrapped blocks compute only "
                        f"'silu'")
        if m.in_proj.bias is not None or m.out_proj.bias is not None:
            raise Error(f"{where}: block {k} has an in_proj or out_proj bias (use_bias=True) — not supported")
        if m.conv1d.bias is None:
            raise Error(f"{where}: block {k}'s conv1d has no bias (use_conv_bias=False) — not supported")
        if float(block.norm.variance_epsilon) != dims["norm_eps"]:
            raise Error(f"{where}: block {k}'s norm epsilon {block.norm.variance_epsilon} is not "
                        f"layer_norm_epsilon {dims['norm_eps']}")
        if tuple(m.conv1d.weight.shape) != (C, 1, dims["conv_kernel"]) or m.conv1d.padding != (dims["conv_kernel"] - 1,):
            raise Error(f"{where}: block {k}'s conv1d is not the depthwise causal conv of conv_kernel "
                        f"{dims['conv_kernel']}")
        # The mixer norms the C++ block computes (a FalconMamba's, with its one epsilon) or not (a Mamba's):
        # a mixer of the other kind, or a norm of another epsilon, would be computed as something else.
        if dims["arch"] == "mamba2":
            continue
        norms = [getattr(m, n, None) for n in _MIXER_NORMS]
        if "mixer_rms_eps" not in dims:
            if any(n is not None for n in norms):
                raise Error(f"{where}: block {k}'s mixer has FalconMamba's mixer norms in a MambaModel")
            continue
        for name, norm in zip(_MIXER_NORMS, norms):
            if norm is None:
                raise Error(f"{where}: block {k}'s mixer has no {name} (a Mamba mixer in a FalconMambaModel)")
            if float(norm.eps) != dims["mixer_rms_eps"]:
                raise Error(f"{where}: block {k}'s mixer.{name} epsilon {norm.eps} is not mixer_rms_eps "
                            f"{dims['mixer_rms_eps']}")


def _stack_options(state):
    o = _core.MambaStackOptions()
    for key, value in {**state["dims"], **state["options"]}.items():
        setattr(o, key, value)
    return o


def _block_arrays(tensors, dims):
    """Lists of each block's detached tensors (_block_tensors' order; conv weight [C, 1, Kc] viewed as
    [C, Kc]): the same memory."""
    n = len(_block_tensors(dims))
    out = []
    for k in range(0, len(tensors), n):
        block = [t.detach() for t in tensors[k:k + n]]
        block[2] = block[2].view(_conv_channels(dims), dims["conv_kernel"])
        out.append(block)
    return out


class _MambaStackFunction(_torch.autograd.Function):
    @staticmethod
    def forward(ctx, state, y0, *params):
        yK = _torch.empty_like(y0)
        _ready(y0)
        _core.mamba_stack_forward(_block_arrays(params, state["dims"]), _stack_options(state), y0.detach(), yK)
        ctx.state = state
        ctx.save_for_backward(y0, *params)
        return yK

    @staticmethod
    @_torch.autograd.function.once_differentiable  # the C++ backward is not itself differentiable
    def backward(ctx, gK):
        y0, *params = ctx.saved_tensors
        state, d = ctx.state, ctx.state["dims"]
        # g is overwritten in place with ∂L/∂y0: a private contiguous copy of the cotangent.
        g = gK.detach().to(dtype=y0.dtype).contiguous().clone()
        _check_device(g, "adjoint_sharding.torch.wrap", "the cotangent of the hidden states")
        grads = [_torch.empty_like(p, memory_format=_torch.contiguous_format) for p in params]
        _ready(g)
        _core.mamba_stack_backward(_block_arrays(params, d), _block_arrays(grads, d), _stack_options(state),
                                   y0.detach(), g)
        need = ctx.needs_input_grad
        return (None, g if need[1] else None, *[gp if need[2 + i] else None for i, gp in enumerate(grads)])


def _block_tensor(block, name, path, y0):
    """One of a block's tensors; a dt_proj without a bias (transformers computes it so) is a
    zero bias, which the C++ block computes exactly (its gradient is not kept)."""
    t = _attr(block, path)
    if t is None and name == "dt_bias":
        return _torch.zeros(block.mixer.dt_proj.out_features, dtype=y0.dtype, device=y0.device)
    return t


def _run_blocks(backbone, y0):
    """y_K = the blocks of backbone.layers on y0 [B, T, D], in C++ (autograd: E3)."""
    state = getattr(backbone, _WRAP_ATTR)
    _check_blocks(backbone, state["dims"])  # a block changed since wrap is refused too, never run as SiLU
    tensors = _block_tensors(state["dims"])
    params = [_block_tensor(block, name, path, y0) for block in backbone.layers for name, path in tensors]
    if y0.dim() != 3 or y0.shape[0] < 1 or y0.shape[1] < 1:
        raise Error(f"adjoint_sharding.torch.wrap: the hidden states must be [B >= 1, T >= 1, D], got {list(y0.shape)}")
    for name, t in [("the hidden states", y0)] + [(f"parameter {n}", p) for n, p in zip(
            (f"layers.{k}.{path}" for k in range(len(backbone.layers)) for _, path in tensors), params)]:
        _check_device(t, "adjoint_sharding.torch.wrap", name)
        if t.dtype not in (_torch.float32, _torch.float64):
            raise Error(f"adjoint_sharding.torch.wrap: {name} is {t.dtype}; the wrapped blocks run in torch.float32 "
                        f"or torch.float64")
        if t.dtype != y0.dtype:
            raise Error(f"adjoint_sharding.torch.wrap: {name} is {t.dtype}, the hidden states are {y0.dtype} "
                        f"(one dtype for the whole stack)")
    # Parameters are read in place; a non-contiguous one (none of transformers') is read from a copy.
    params = [p if p.is_contiguous() else p.contiguous() for p in params]
    y0 = y0.contiguous()
    if _torch.is_grad_enabled() and (y0.requires_grad or any(p.requires_grad for p in params)):
        return _MambaStackFunction.apply(state, y0, *params)
    yK = _torch.empty_like(y0)
    _ready(y0)
    _core.mamba_stack_forward(_block_arrays(params, state["dims"]), _stack_options(state), y0.detach(), yK)
    return yK


def _wrapped_forward(self, input_ids=None, inputs_embeds=None, cache=None, use_cache=None, output_hidden_states=None,
                     return_dict=None, attention_mask=None, **kwargs):
    """(Falcon)Mamba(2)Model.forward with the blocks in C++; transformers' own forward whenever a
    cache is passed or asked for, or every block's hidden states are."""
    original = type(self).forward.__get__(self)
    hidden_all = output_hidden_states if output_hidden_states is not None else self.config.output_hidden_states
    if cache is not None or kwargs.get("cache_params") is not None or use_cache or hidden_all:
        return original(input_ids=input_ids, inputs_embeds=inputs_embeds, cache=cache, use_cache=use_cache,
                        output_hidden_states=output_hidden_states, return_dict=return_dict,
                        attention_mask=attention_mask, **kwargs)
    _mm, _fm, _m2 = _modeling()
    output = {"falcon_mamba": _fm.FalconMambaOutput, "mamba2": _m2.Mamba2Output}.get(_arch(self), _mm.MambaOutput)
    return_dict = return_dict if return_dict is not None else self.config.return_dict
    if (input_ids is None) ^ (inputs_embeds is not None):
        raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
    if attention_mask is not None and not bool((attention_mask == 1).all()):
        raise Error("adjoint_sharding.torch.wrap: an attention_mask with zeros (padding) is not supported by the "
                    "wrapped blocks; pad on the right with label -100 and pass no mask, or unwrap(model)")
    if inputs_embeds is None:
        inputs_embeds = self.embeddings(input_ids)
    hidden_states = self.norm_f(_run_blocks(self, inputs_embeds))
    if not return_dict:
        return (hidden_states,)
    return output(last_hidden_state=hidden_states, cache=None, hidden_states=None)


class _WrappedForward:
    """The backbone's forward while wrapped: a plain object (not a bound method), so that a
    wrapped model deep-copies and pickles with its wrap."""

    def __init__(self, backbone):
        self.backbone = backbone

    def __call__(self, input_ids=None, inputs_embeds=None, cache=None, use_cache=None, output_hidden_states=None,
                 return_dict=None, attention_mask=None, **kwargs):
        return _wrapped_forward(self.backbone, input_ids=input_ids, inputs_embeds=inputs_embeds, cache=cache,
                                use_cache=use_cache, output_hidden_states=output_hidden_states,
                                return_dict=return_dict, attention_mask=attention_mask, **kwargs)


def wrap(model, *, detach_inputs=False, chunk=64, truncate=0, storage="float", layer_checkpoint=1, token_block=0):
    """Runs the blocks of a transformers MambaForCausalLM (or MambaModel) in C++:
    forward and E3 backward (ash::StackAdjoint of the Mamba kind), on the model's own parameters.
    A FalconMambaForCausalLM (or FalconMambaModel) alike: the FalconMamba kind, its mixer_rms_eps;
    a Mamba2ForCausalLM (or Mamba2Model): the Mamba-2 kind (its heads, head_dim, n_groups,
    time_step_limit).

    The model is changed in place (its backbone's forward) and returned; its
    parameters, state_dict, embedding, final norm, lm_head and loss are untouched,
    and calls with a cache (cache=..., use_cache=True: generation) or with
    output_hidden_states run transformers' own blocks. Options:
      detach_inputs: the paper's gradient (each block's input detached in its branch);
      chunk: E3's chunk length C;
      truncate: the paper's window T̄ (needs detach_inputs; 0 = the whole window);
      storage, layer_checkpoint, token_block: the memory levers, as SSMStack's
        ("bf16"/"fp16" kept block inputs, keep every m-th, tokens per block): the
        backward then runs the block-wise engine over the stack.
    Wrapping a wrapped model sets its options anew. docs/python.md has the details."""
    backbone = _backbone(model)
    dims = _mamba_dims(backbone)
    for name, p in backbone.layers.named_parameters():
        _check_device(p, "adjoint_sharding.torch.wrap", f"parameter layers.{name}")
        if p.dtype not in (_torch.float32, _torch.float64):
            raise Error(f"adjoint_sharding.torch.wrap: parameter layers.{name} is {p.dtype}; the wrapped blocks run in "
                        f"torch.float32 or torch.float64")
    state = {"dims": dims, "options": {"detach_inputs": bool(detach_inputs), "chunk": _integer("chunk", chunk),
                                       "truncate": _integer("truncate", truncate), "storage": str(storage),
                                       "layer_checkpoint": _integer("layer_checkpoint", layer_checkpoint),
                                       "token_block": _integer("token_block", token_block)}}
    _core.mamba_stack_check(_stack_options(state))  # the refusals, before the model is changed
    setattr(backbone, _WRAP_ATTR, state)
    backbone.forward = _WrappedForward(backbone)
    return model


def unwrap(model):
    """Undoes wrap: transformers' own forward again. Returns the model."""
    backbone = _backbone(model)
    if hasattr(backbone, _WRAP_ATTR):
        delattr(backbone, _WRAP_ATTR)
        backbone.__dict__.pop("forward", None)
    return model
