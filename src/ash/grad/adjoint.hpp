#pragma once
// E2: adjoint sharding as in the paper (Xu et al. 2024, Prop. 2, Alg. 1-4).
//
// Forward in evaluation mode storing per layer A^t, h^{t-1}, γ^t, ŷ^t and the
// RMSNorm factor, plus g^t = ∂L/∂y_K^t. Then, per layer k and token i, the
// adjoint states of the window
//     λ^{t,i} ⊙ g^t:  v^{t,i}_pn = g^t_p γ^t_n Π_{j=i+1..t} A^j_pn,  t = i .. min(T, i+T̄-1)
// are formed as explicit products (O(T·T̄·P·N) per layer) and summed — VJPs are
// linear in the cotangent, so Σ_t VJP(v^{t,i}) = VJP(Σ_t v^{t,i}) — then the
// VJPs of the A-, B- and C-networks run per token, with the dense ones as GEMMs.
//
// Every layer uses the same g (the paper's formula), i.e. each layer's input
// is a constant: E2 equals E1 on the stop-gradient-inputs model; the embedding
// receives Σ g. T̄ = 0 or T̄ >= T is full adjoint sharding. A layer kind whose
// scan core is inside a block (grad/layer_kinds.hpp) gets the same window sums
// over its scan's channels with the scan output's cotangent for g, then its
// block's VJPs with the block's input detached.
#include "ash/grad/engine.hpp"
#include "ash/grad/workspace.hpp"

namespace ash {

// The buffers of one layer's backward on sh (the kind's scan_shape): μ =
// Σ_t v^{t,i} of every token and the cotangents (when the kind's
// window_cotangents; the window T̄ changes no size).
WorkspaceSpec adjoint_workspace(const EngineOptions& opts, const LayerShape& sh, bool cotangents = true);

template <class S>
class AdjointLayer final : public LayerAdjoint<S> {
 public:
  explicit AdjointLayer(const EngineOptions& opts);
  std::string name() const override;
  bool keeps_activations() const override { return true; }
  typename LayerAdjoint<S>::Store store() const override { return LayerActivations<S>::with_hprev_and_A; }
  bool detached() const override { return true; }
  ASH_LAYER_ADJOINT_OVERRIDES
  void release() override;

  // backward() of a layer of kind K: the window sums over the kind's scan core, the kind's VJPs (detached).
  template <class K>
  void backward_kind(const typename K::template Params<S>& p, const ModelDims& d, int k, ActivationStore<S>& store,
                     const View2<S>& g, const typename K::template Params<S>& grad);

 private:
  index_t truncate_;
  Workspace<S> work_;         // adjoint_workspace, kept from layer to layer of a pass
  KindScratches<S> scratch_;  // the kinds' own, kept likewise
};

namespace impl {
// The window sums μ^i = Σ_t v^{t,i} of one layer in either form: `host` (t
// loop outermost, running products in team scratch: cache-friendly on a CPU)
// or `device` (products and sums in registers per vector lane over n, no
// barrier: coalesced on a GPU). E2 uses the one that suits its backend; both
// accumulate in the same order, so they agree bitwise (tested).
enum class WindowForm { host, device };
template <class S>
void window_adjoint(WindowForm form, const SeqShape& s, const LayerActivations<S>& act, const View2<S>& g,
                    index_t Tbar, const View3<S>& mu, const ExecSpace& exec = ExecSpace());
// E2's μ of one layer's scan (any kind's scan core): window_adjoint in the
// form that suits the backend, with T̄ = truncate (0 or > T: the whole window)
// and gy the cotangent of the scan's output.
template <class S>
void e2_mu(const SeqShape& s, const LayerActivations<S>& act, const View2<S>& gy, index_t truncate,
           const View3<S>& mu, const ExecSpace& exec = ExecSpace());
}  // namespace impl

}  // namespace ash
