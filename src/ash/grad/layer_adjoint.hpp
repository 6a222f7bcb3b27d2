#pragma once
// The per-layer half of every gradient engine (docs/design.md §2): given a
// layer's input and activations (from an ActivationStore) and g_k = ∂L/∂y_k,
// add θ_k's gradient and turn g_k into g_{k-1} (unless the layer input is
// detached, the paper's mode, where g is left as it is). Orchestrators (the
// local engine, the MPI layer pipeline) decide the order of layers and ranks;
// the methods E1, E2, E3 live behind this interface. A layer is of a kind
// (grad/layer_kinds.hpp): backward() is overloaded by the kind's parameter
// type, one overload per kind of the registry; a method forms μ of the kind's
// scan core its own way and the kind runs its dense VJPs around it.
#include <functional>
#include <memory>
#include <string>

#include "ash/grad/kind_interface.hpp"
#include "ash/grad/layer_kinds.hpp"
#include "ash/model/forward.hpp"

namespace ash {

struct EngineOptions;

// The reverse mode of one layer on a piece of the window (E3 only:
// docs/design.md §2, §8): a token block with the carry from the block after
// it, or one sequence rank's token range with the carry exchanged between ranges.
template <class S>
class BlockAdjoint {
 public:
  virtual ~BlockAdjoint() = default;
  // One token block of every sequence, blocks taken from the last to the
  // first: sb.T tokens per sequence (a multiple of the chunk but for the last
  // block), y_blk and g_blk [Bt·sb.T, P] in block-row order (g_k in, g_{k-1}
  // out), h0 [Bt·P, N] the state before the block's first token (empty:
  // zero), carry in: from the block after, out: for the block before. Exact
  // or detached mode; a window (T̄) needs the whole window as one block, with
  // carry == nullptr.
  virtual void backward_block(const LayerParams<S>& p, const SeqShape& sb, const View2<S>& y_blk,
                              const View2<S>& g_blk, const View2<S>& h0, ExactCarry<S>* carry,
                              const LayerParams<S>& grad) = 0;
  // The carry between token ranges: given a range's map c_before = M ⊙ c_after + v
  // ([Bt, P, N] each; c = A μ at a range's first token), returns c_after, the
  // carry from the later ranges (empty: zero).
  using Exchange = std::function<View3<S>(const View3<S>&, const View3<S>&)>;
  // One token range of a longer window (context parallelism; exact or
  // detached, no window): g (g_k of the range) in, g_{k-1} out; h0 the state
  // before the range (empty: zero).
  virtual void backward_range(const LayerParams<S>& p, int k, ActivationStore<S>& store, const View2<S>& g,
                              const View2<S>& h0, const Exchange& exchange, const LayerParams<S>& grad) = 0;
  // The paper's window T̄ (detached) on one token range of a longer window:
  // y_ext and g_ext hold the range's own_T tokens per sequence and after them
  // the next range's first tokens (up to T̄ - 1, the halo μ_T̄ reads); only
  // the own tokens contribute to grad. g_ext's halo rows are overwritten.
  virtual void backward_window_range(const LayerParams<S>& p, const SeqShape& s_ext, const View2<S>& y_ext,
                                     const View2<S>& g_ext, const View2<S>& h0, index_t own_T,
                                     const LayerParams<S>& grad) = 0;
  // The carry map of one token block (exact or detached, no window): its
  // c_before = M ⊙ c_after + v ([Bt, P, N] each), from y_blk and g_blk; a
  // range in blocks composes its blocks' maps (the levers on sequence ranks).
  virtual void block_carry_map(const LayerParams<S>& p, const SeqShape& sb, const View2<S>& y_blk,
                               const View2<S>& g_blk, const View3<S>& M, const View3<S>& v) = 0;
};

template <class S>
class LayerAdjoint {
 public:
  using Store = typename LayerActivations<S>::Store;
  virtual ~LayerAdjoint() = default;
  virtual std::string name() const = 0;
  // What the forward must keep of every layer: keeps_activations() false means
  // only the layer inputs (the activations are recomputed on request).
  virtual bool keeps_activations() const = 0;
  virtual Store store() const = 0;
  // True when every layer input is detached: layers are independent given g
  // (paper mode: no communication between layer ranks after g).
  virtual bool detached() const = 0;
  // Reverse mode of layer k (global index) of kind K over the whole window:
  // backward(K::Params p, d, k, store, g, K::Params grad). g is g_k on entry
  // and g_{k-1} on return (unchanged when detached(): the stop-gradient on
  // the layer's input into its branch, the residual passing g on). p, grad
  // and the store's activations are the kind's.
#define ASH_LAYER_ADJOINT_BACKWARD(K)                                                                    \
  virtual void backward(const typename K::template Params<S>& p, const ModelDims& d, int k,               \
                        ActivationStore<S>& store, const View2<S>& g, const typename K::template Params<S>& grad) = 0;
  ASH_FOR_EACH_LAYER_KIND(ASH_LAYER_ADJOINT_BACKWARD)
#undef ASH_LAYER_ADJOINT_BACKWARD
  // Frees the scratch kept between layers (called at the end of a pass).
  virtual void release() {}
  // The block and range forms, for methods that have them (E3); else nullptr.
  virtual BlockAdjoint<S>* block_adjoint() { return nullptr; }
  // The execution-space instance the layer's kernels run on (the default one).
  const ExecSpace& execution_space() const { return exec_; }

 protected:
  ExecSpace exec_;
};

// A method's overrides of backward(), one per kind, each calling its member
// template backward_kind<K>(p, d, k, store, g, grad).
#define ASH_LAYER_ADJOINT_OVERRIDE(K)                                                                     \
  void backward(const typename K::template Params<S>& p, const ModelDims& d, int k, ActivationStore<S>& store, \
                const View2<S>& g, const typename K::template Params<S>& grad) override {                    \
    this->template backward_kind<K>(p, d, k, store, g, grad);                                                \
  }
#define ASH_LAYER_ADJOINT_OVERRIDES ASH_FOR_EACH_LAYER_KIND(ASH_LAYER_ADJOINT_OVERRIDE)

// E1 backprop, E2 adjoint or E3 adjoint-exact by opts.method; throws
// ash::Error for options it does not support.
template <class S>
std::unique_ptr<LayerAdjoint<S>> make_layer_adjoint(const EngineOptions& opts);

}  // namespace ash
