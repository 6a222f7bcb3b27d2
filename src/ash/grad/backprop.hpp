#pragma once
// E1: plain reverse mode that keeps every intermediate of every layer and
// token, the way autograd does. The reference and the memory baseline.
#include "ash/grad/engine.hpp"
#include "ash/grad/workspace.hpp"

namespace ash {

// The carries of E1's chunked reverse scan over sh (grad.chunk = chunk): the
// carry into each chunk and, with several chunks, each chunk's local
// carry-out and product of A ([Bt·nc, P, N] each).
WorkspaceSpec e1_scan_workspace(index_t chunk, const LayerShape& sh);
// The buffers of one layer's backward on sh (the kind's scan_shape): μ of
// every token, the cotangents (when the kind's window_cotangents: a kind may
// hold its scan's cotangents itself) and the scan's carries (e1_scan_workspace).
WorkspaceSpec backprop_workspace(const EngineOptions& opts, const LayerShape& sh, bool cotangents = true);

template <class S>
class BackpropLayer final : public LayerAdjoint<S> {
 public:
  explicit BackpropLayer(const EngineOptions& opts);
  std::string name() const override { return opts_.detach_inputs ? "backprop (detached inputs)" : "backprop"; }
  bool keeps_activations() const override { return true; }
  typename LayerAdjoint<S>::Store store() const override { return LayerActivations<S>::with_hprev_and_A; }
  bool detached() const override { return opts_.detach_inputs; }
  ASH_LAYER_ADJOINT_OVERRIDES
  void release() override;

  // backward() of a layer of kind K: the reverse scan over the kind's scan core, the kind's VJPs.
  template <class K>
  void backward_kind(const typename K::template Params<S>& p, const ModelDims& d, int k, ActivationStore<S>& store,
                     const View2<S>& g, const typename K::template Params<S>& grad);

 private:
  EngineOptions opts_;       // grad.chunk: tokens per chunk of the reverse scan
  Workspace<S> work_;        // backprop_workspace, kept from layer to layer of a pass
  KindScratches<S> scratch_;  // the kinds' own, kept likewise
};

}  // namespace ash
