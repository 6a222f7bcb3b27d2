#pragma once
// The K layers of a model alone (docs/design.md §1 without embedding and
// head), of one layer kind K (grad/layer_kinds.hpp): y_K = layers(y_0) and,
// given g = ∂L/∂y_K from whatever sits on top (a PyTorch head, an HPC code's
// own loss), E3's reverse pass: every layer's gradient and ∂L/∂y_0
// (docs/python.md: SSMStack's backward and adjoint_sharding.torch.wrap's).
// Between forward and backward the caller keeps nothing but y_0: the
// backward recomputes the layer inputs from it. Every E3 mode: exact,
// detached (the paper's), detached with a window T̄; the memory levers
// run.storage, grad.layer_checkpoint, grad.token_block.
//
// The layers' parameters are the kind's views (K::Params<S>), so they may be
// a ParamSet's or a caller's own tensors (the PyTorch wrap reads a model's
// parameters in place); the ParamSet overloads take a ParamSet's as they are.
// The backward runs one of two strategies, the kind's choice
// (K::stack_whole_window, which keeps each kind's numbers):
//   - block-wise: the block-wise E3 pass of BlockwiseEngine on the layer range
//     [0, K) without embedding and head, the forward recomputed from y_0
//     keeping only what E3 keeps (every m-th layer input in the storage
//     format, the states at block starts). Blocks that are not a ParamSet's
//     are copied into one and their gradient out of it (O(parameters)).
//   - whole window (a kind with stack_whole_window, unless a memory lever is
//     set): the layer inputs y_0 .. y_{K-1} recomputed, then E3 over the whole
//     window layer by layer through the engines' own per-layer method
//     (AdjointExactLayer).
#include <vector>

#include "ash/grad/blockwise_engine.hpp"
#include "ash/grad/layer_adjoint.hpp"

namespace ash {

template <class S, class K>
class StackAdjoint {
 public:
  using Params = typename K::template Params<S>;
  using Blocks = std::vector<Params>;  // layer k's parameters at [k]
  // d: the layers' sizes (model.layers = K layers; model.arch must be K's).
  // Throws ash::Error unless opts.method is adjoint-exact; grad.truncate needs
  // grad.detach_inputs; data.carry_state is refused (every call starts from a
  // zero state). grad.chunk, grad.wave and run.matmul apply.
  StackAdjoint(const ModelDims& d, const EngineOptions& opts);
  // The range a stack's parameters and gradient cover: layers [0, K), no embedding or head.
  static LayerRange range(const ModelDims& d) { return LayerRange{0, int(d.layers), false, false}; }
  // A ParamSet's layers as views (its range must be range(d)).
  static Blocks blocks(const ParamSet<S>& layers);
  // y_K from y_0, both [Bt·T, width] with row b·T + t (y_K must not alias y_0); nothing is kept.
  void forward(const Blocks& blocks, const SeqShape& s, const View2<S>& y0, const View2<S>& yK) const;
  void forward(const ParamSet<S>& layers, const SeqShape& s, const View2<S>& y0, const View2<S>& yK) const;
  // grad (K layers, the parameters' shapes) is overwritten with ∂L/∂θ_k of
  // every layer; g is ∂L/∂y_K on entry and ∂L/∂y_0 on return. y_0 is read, not
  // changed. Memory: the block-wise engine's (design.md §8); over the whole
  // window, the K layer inputs (each freed once its layer is done) and one
  // layer's E3 buffers.
  void backward(const Blocks& blocks, const SeqShape& s, const View2<S>& y0, const View2<S>& g,
                const Blocks& grad) const;
  void backward(const ParamSet<S>& layers, const SeqShape& s, const View2<S>& y0, const View2<S>& g,
                const ParamSet<S>& grad) const;
  const ModelDims& dims() const { return dims_; }
  const EngineOptions& options() const { return opts_; }

 private:
  // Whether the backward runs the block-wise engine (else the whole window).
  bool blockwise() const;
  void check(const Blocks& blocks, const SeqShape& s, const View2<S>& y0, const View2<S>& y, const char* y_name,
             const char* what) const;
  void check(const ParamSet<S>& layers, const char* what) const;
  void backward_window(const Blocks& blocks, const SeqShape& s, const View2<S>& y0, const View2<S>& g,
                       const Blocks& grad) const;
  void backward_blockwise(const ParamSet<S>& layers, const SeqShape& s, const View2<S>& y0, const View2<S>& g,
                          const ParamSet<S>& grad) const;
  ModelDims dims_;
  EngineOptions opts_;
};

}  // namespace ash
