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
#include "ash/grad/blockwise_engine.hpp"

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

}  // namespace ash
