#pragma once
// The per-layer half of every gradient engine (docs/design.md §2): given a
// layer's input and activations (from an ActivationStore) and g_k = ∂L/∂y_k,
// add θ_k's gradient and turn g_k into g_{k-1} (unless the layer input is
// detached, the paper's mode, where g is left as it is). Orchestrators (the
// local engine, the MPI layer pipeline) decide the order of layers and ranks;
// the methods E1, E2, E3 live behind this interface. A layer is either
// architecture's (LayerRef): a Mamba block runs mamba_gate_backward (g → ∂L/∂s),
// the method's own μ on the scan core over E channels, then the mixer's VJPs.
#include <functional>
#include <memory>
#include <string>

#include "ash/model/forward.hpp"

namespace ash {

struct EngineOptions;

// What the reverse pass over token blocks (the block-wise engine, the MPI
// pipeline's reverse wavefront) carries from one block into the one before
// it: μ and A at the first token of the later block, per (sequence, channel,
// state), [Bt, P, N].
template <class S>
struct ExactCarry {
  View3<S> mu, A;
  bool valid = false;  // false: the later block does not exist (end of the window)
};

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
  // Reverse mode of layer k (global index) over the whole window. g is g_k on
  // entry and g_{k-1} on return (unchanged when detached(): for a Mamba the
  // stop-gradient on the block's input into norm and mixer, the residual
  // passing g on). p and grad: an SSM-ResNet layer or a Mamba block, as the store's.
  virtual void backward(const LayerRef<S>& p, int k, ActivationStore<S>& store, const View2<S>& g,
                        const LayerRef<S>& grad) = 0;
  // Frees the scratch kept between layers (called at the end of a pass).
  virtual void release() {}
  // The block and range forms, for methods that have them (E3); else nullptr.
  virtual BlockAdjoint<S>* block_adjoint() { return nullptr; }
  // The execution-space instance the layer's kernels run on (the default one).
  const ExecSpace& execution_space() const { return exec_; }

 protected:
  ExecSpace exec_;
};

// A Mamba block's cotangents for `rows` tokens (scan_partials as
// MambaCotangents), allocated on first use and kept from block to block of a
// pass in the method's `c` (its release() resets it).
template <class S>
const MambaCotangents<S>& mamba_cotangents(std::unique_ptr<MambaCotangents<S>>& c, index_t rows, const ModelDims& d,
                                           bool scan_partials) {
  if (!c || index_t(c->gs.extent(0)) != rows) {
    c.reset();  // the old ones freed first: the peak holds one set
    c = std::make_unique<MambaCotangents<S>>(rows, d, scan_partials);
  }
  return *c;
}

// E1 backprop, E2 adjoint or E3 adjoint-exact by opts.method; throws
// ash::Error for options it does not support.
template <class S>
std::unique_ptr<LayerAdjoint<S>> make_layer_adjoint(const EngineOptions& opts);

}  // namespace ash
