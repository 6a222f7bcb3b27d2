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
"""
import json as _json

import numpy as _np
import torch as _torch

from . import _core, load as _load, init as _init
from ._core import Error

__all__ = ["SSMStack", "SSMLayer"]

LAYER_TENSORS = ("norm", "W_delta", "b_delta", "A_log", "W_B", "W_C", "D")


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
        _core.stack_forward(stack._arrays(params), stack._options, y0.detach(), yK, cu_seqlens)
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
        grads = _core.stack_backward(stack._arrays(params), stack._options, y0.detach(), g, ctx.cu_seqlens)
        out = [_torch.from_numpy(grads[name]) for name in stack._names]
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
        self.width, self.state, self.num_layers, self.dtype = int(width), int(state), int(layers), dtype
        self.layers = _torch.nn.ModuleDict({f"{k:03d}": SSMLayer(self.width, self.state, dtype)
                                            for k in range(self.num_layers)})
        self._names = [f"layers/{k:03d}/{n}" for k in range(self.num_layers) for n in LAYER_TENSORS]
        self.set_options(detach_inputs=detach_inputs, truncate=truncate, storage=storage,
                         layer_checkpoint=layer_checkpoint, token_block=token_block, chunk=chunk)
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
        o = getattr(self, "_options", None) or _core.StackOptions()
        o.width, o.state, o.layers = self.width, self.state, self.num_layers
        if detach_inputs is not None:
            o.detach_inputs = bool(detach_inputs)
        if truncate is not None:
            o.truncate = int(truncate)
        if storage is not None:
            o.storage = str(storage)
        if layer_checkpoint is not None:
            o.layer_checkpoint = int(layer_checkpoint)
        if token_block is not None:
            o.token_block = int(token_block)
        if chunk is not None:
            o.chunk = int(chunk)
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
            if t.device.type != "cpu":
                raise Error(f"SSMStack: parameter '{name}' is on {t.device}; this build runs on the CPU")
            if t.dtype != self.dtype:
                raise Error(f"SSMStack: parameter '{name}' is {t.dtype}, the stack is {self.dtype}")
            out[name] = t.contiguous().numpy()
        return out

    def _check_input(self, y0):
        if not isinstance(y0, _torch.Tensor):
            raise Error(f"SSMStack: y0 must be a torch.Tensor, got {type(y0).__name__}")
        if y0.device.type != "cpu":
            raise Error(f"SSMStack: y0 is on {y0.device}; this build of adjoint_sharding runs on the CPU "
                        f"(Kokkos {_core.backend})")
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
        _core.stack_forward(self._arrays(params), self._options, y0.detach(), yK, cu)
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
