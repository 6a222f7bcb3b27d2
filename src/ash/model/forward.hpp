#pragma once
// The forward pass of docs/design.md §1 (the paper's Alg. 1, evaluation mode),
// as a driver over a range of layers [k0, k1) with an activation store that
// decides what is kept of each layer for the backward.
#include <vector>

#include "ash/model/head.hpp"
#include "ash/model/mamba2_layer.hpp"

namespace ash {

// What the forward keeps of the layers [k0, k1): every layer input y_{k-1}
// (and the range's output y_{k1-1}), and per layer the activations `keep` asks
// for when keep_acts (E1 and E2 keep h^{t-1} and A; E3 keeps only the inputs
// and has the projections recomputed on request). A Mamba's (d.mamba()) are
// MambaActivations, whose scan part over E channels is what `keep` asks for.
template <class S>
class ActivationStore {
 public:
  using Store = typename LayerActivations<S>::Store;
  ActivationStore() = default;
  ActivationStore(const SeqShape& s, const ModelDims& d, int k0, int k1, Store keep, bool keep_acts);

  const SeqShape& shape() const { return s_; }
  int k0() const { return k0_; }
  int k1() const { return k1_; }
  // y_{k-1}, the input of layer k (k0 <= k <= k1; input(k1) is the range's output).
  View2<S> input(int k) const { return ys_.at(k - k0_); }
  View2<S> output() const { return input(k1_); }
  bool keeps_acts() const { return !acts_.empty() || !mamba_acts_.empty(); }
  // Layer k's kept activations (keeps_acts() only).
  const LayerActivations<S>& kept(int k) const { return acts_.at(k - k0_); }
  // Layer k's activations: the kept ones, or its projections recomputed from
  // y_{k-1} into one scratch shared by all layers of the store.
  const LayerActivations<S>& activations(const LayerParams<S>& p, int k, const ExecSpace& exec = ExecSpace());
  // Whether the store's buffers hold windows of s's shape for layers [k0, k1)
  // of d (every buffer still allocated): then rebind(s) lets another call
  // with windows of that shape reuse them (EngineOptions::keep_buffers).
  bool fits(const SeqShape& s, const ModelDims& d, int k0, int k1) const;
  void rebind(const SeqShape& s);
  // Frees y_{k-1} and what is kept of layer k (the backward is done with it).
  void release(int k);
  void release_output() { ys_.back() = View2<S>(); }
  // The scratch used by activations() and forward_layers() when nothing is kept.
  const LayerActivations<S>& scratch();

  // A Mamba's (d.mamba()): block k's kept activations (keeps_acts() only);
  // the kept ones or block k's activations computed again from y_{k-1}, as
  // far as `upto` (mamba_layer_activations: no out_proj, no residual), into
  // one scratch shared by all blocks; the scratch forward_layers() uses when
  // nothing is kept.
  bool mamba() const { return d_.mamba(); }
  const MambaActivations<S>& kept_mamba(int k) const { return mamba_acts_.at(k - k0_); }
  // (P: a Mamba-1 or Mamba-2 block's parameters.)
  template <class P>
  const MambaActivations<S>& mamba_activations(const P& p, int k, const ExecSpace& exec = ExecSpace(),
                                               MambaUpTo upto = MambaUpTo::gate) {
    if (keeps_acts()) return kept_mamba(k);
    const auto& act = mamba_scratch();
    mamba_layer_activations(p, d_, s_, input(k), act, upto, exec);
    return act;
  }
  const MambaActivations<S>& mamba_scratch();

 private:
  SeqShape s_;
  ModelDims d_;
  int k0_ = 0, k1_ = 0;
  std::vector<View2<S>> ys_;
  std::vector<LayerActivations<S>> acts_;
  LayerActivations<S> scratch_;
  bool has_scratch_ = false;
  std::vector<MambaActivations<S>> mamba_acts_;
  MambaActivations<S> mamba_scratch_;
  bool has_mamba_scratch_ = false;
};

// Runs layers [store.k0(), store.k1()) from store.input(k0), which the caller
// has filled (the embedding, or what the previous rank sent), through to
// store.output(), keeping what the store keeps.
template <class S>
void forward_layers(const ParamSet<S>& params, ActivationStore<S>& store, const ExecSpace& exec = ExecSpace());

// Loss only, one layer's activations alive at a time (the memory floor of a forward).
template <class S>
double forward_loss(const ParamSet<S>& params, const TokenView& x, index_t head_chunk = 1024);

// The same with a carried state (streaming a long document window by window):
// state (one view per layer, check_carried_state's shape: an SSM-ResNet's h, a
// Mamba's conv state and h) is the state before x's first token on entry and
// after its last on return; x_head is what the head scores (x, or x with the
// next window's first token appended per sequence, so no target is lost between
// windows) and targets the count the loss is the mean over (head_loss's rule).
template <class S>
double forward_loss(const ParamSet<S>& params, const TokenView& x, index_t head_chunk, std::vector<View2<S>>& state,
                    const TokenView& x_head, index_t targets);

// A Mamba block's carried state (data.carry_state, /train/carry_state) is one
// [Bt·E, Kc−1+N] view per layer (ModelDims::carry_rows/cols): row b·E + e holds
// MambaState's conv row (Kc−1 columns, oldest first), then its ssm row (N).
// These copy it into the MambaState a block runs from and back.
template <class S>
void mamba_state_from_carried(const View2<S>& carried, const MambaState<S>& st, const ExecSpace& exec = ExecSpace());
template <class S>
void mamba_state_to_carried(const MambaState<S>& st, const View2<S>& carried, const ExecSpace& exec = ExecSpace());
// Throws ash::Error unless state holds `layers` views of [batch·carry_rows, carry_cols].
template <class S>
void check_carried_state(const std::vector<View2<S>>& state, const ModelDims& d, index_t layers, index_t batch);

// The whole model's forward for a full ParamSet: embedding, every layer, head.
template <class S>
struct ForwardTape {
  std::vector<View2<S>> ys;                  // y_0 .. y_K, [M, P] each
  std::vector<LayerActivations<S>> acts;     // per layer (empty unless kept)
  View2<S> g;                                // g^t = ∂L/∂y_K^t [M, P] (0 on each window's last token)
  double loss = 0;
};

// Forward storing every y_k, and per layer the activations `store` asks for
// when keep_acts; the head adds ∂L/∂Ω and ∂L/∂w_f to *head_grad.
template <class S>
ForwardTape<S> forward_tape(const ParamSet<S>& params, const TokenView& x, const GlobalParams<S>* head_grad,
                            typename LayerActivations<S>::Store store, bool keep_acts, index_t head_chunk = 1024);

}  // namespace ash
