#pragma once
// The K residual SSM layers alone (docs/design.md §1 without embedding and
// head): y_K = layers(y_0) and, given g = ∂L/∂y_K from whatever sits on top
// (a PyTorch head, an HPC code's own loss), E3's reverse pass: every layer's
// gradient and ∂L/∂y_0 (docs/python.md: the PyTorch module's backward).
// The backward runs the block-wise E3 pass of BlockwiseEngine on the layer
// range [0, K) without embedding and head: the forward is recomputed from
// y_0 keeping only what E3 keeps (every m-th layer input, in the storage
// format, and the states at block starts), so between forward and backward
// the caller keeps nothing but y_0. Every E3 mode: exact, detached (the
// paper's), detached with a window T̄; the levers run.storage,
// grad.layer_checkpoint, grad.token_block.
//
// MambaStackAdjoint is the same for K Mamba blocks (model.arch = "mamba",
// docs/design.md §1; transformers' MambaModel.layers): forward y_K from y_0
// keeping nothing; backward recomputes the block inputs from y_0 and runs E3
// over the whole window, block by block, through the engines' own per-layer
// method (AdjointExactLayer): exact, detached or windowed
// (T̄). The blocks' parameters are
// MambaLayerParams views, so they may be a ParamSet's or a caller's own
// tensors (the PyTorch wrap reads the model's parameters in place).
#include <vector>

#include "ash/grad/blockwise_engine.hpp"
#include "ash/grad/layer_adjoint.hpp"

namespace ash {

template <class S>
class StackAdjoint {
 public:
  // Throws ash::Error unless opts.method is adjoint-exact (and for what BlockwiseEngine refuses).
  explicit StackAdjoint(const EngineOptions& opts);
  // The range a stack's parameters and gradient cover: layers [0, K), no embedding or head.
  static LayerRange range(const ModelDims& d) { return LayerRange{0, int(d.layers), false, false}; }
  // y_K from y_0, both [Bt·T, P] with row b·T + t (y_K must not alias y_0); nothing is kept.
  void forward(const ParamSet<S>& layers, const SeqShape& s, const View2<S>& y0, const View2<S>& yK);
  // grad (the same range) is overwritten with ∂L/∂θ_k of every layer; g is
  // ∂L/∂y_K on entry and ∂L/∂y_0 on return. y_0 is read, not changed.
  void backward(const ParamSet<S>& layers, const SeqShape& s, const View2<S>& y0, const View2<S>& g,
                const ParamSet<S>& grad);
  const EngineOptions& options() const { return opts_; }

 private:
  EngineOptions opts_;
  BlockwiseEngine<S> engine_;
};

template <class S>
class MambaStackAdjoint {
 public:
  using Blocks = std::vector<MambaLayerParams<S>>;
  // d: a Mamba's sizes (model.layers = K blocks). Throws ash::Error unless
  // opts.method is adjoint-exact; exact, detached (grad.detach_inputs: each
  // block's input detached in its branch, g_k = g_K for every block) or
  // windowed (grad.truncate = T̄ with detach_inputs); the memory levers
  // run.storage, grad.layer_checkpoint and grad.token_block run backward through
  // the block-wise engine (BlockwiseEngine::compute_range on the whole stack as
  // a layer range); data.carry_state is refused by name. grad.chunk, grad.wave
  // and run.matmul apply.
  MambaStackAdjoint(const ModelDims& d, const EngineOptions& opts);
  static LayerRange range(const ModelDims& d) { return StackAdjoint<S>::range(d); }
  // A ParamSet's blocks (its range must be range(d)).
  static Blocks blocks(const ParamSet<S>& layers);
  // y_K from y_0, both [Bt·T, D] with row b·T + t (y_K must not alias y_0); nothing is kept.
  void forward(const Blocks& blocks, const SeqShape& s, const View2<S>& y0, const View2<S>& yK) const;
  // grad (K blocks, the parameters' shapes) is overwritten with ∂L/∂θ_k of every
  // block; g is ∂L/∂y_K on entry and ∂L/∂y_0 on return. y_0 is read, not changed.
  // Memory without a lever: the K block inputs [M, D] (a copy of y_0, then
  // the recomputed ones, each freed once its block is done) and one block's E3
  // buffers (MambaActivations without h and A, MambaCotangents, the scan's
  // waves). With one, the block-wise engine's (design.md §8) and a copy of the
  // parameters and of their gradient.
  void backward(const Blocks& blocks, const SeqShape& s, const View2<S>& y0, const View2<S>& g,
                const Blocks& grad) const;
  const ModelDims& dims() const { return dims_; }
  const EngineOptions& options() const { return opts_; }

 private:
  // Whether a memory lever is set (the backward is then backward_blockwise).
  bool levers() const;
  void backward_blockwise(const Blocks& blocks, const SeqShape& s, const View2<S>& y0, const View2<S>& g,
                          const Blocks& grad) const;
  ModelDims dims_;
  EngineOptions opts_;
};

}  // namespace ash
