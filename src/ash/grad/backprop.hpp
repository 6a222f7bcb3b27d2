#pragma once
// E1: plain reverse mode that keeps every intermediate of every layer and
// token, the way autograd does. The reference and the memory baseline.
#include "ash/grad/engine.hpp"
#include "ash/grad/workspace.hpp"

namespace ash {

// The buffers of one layer's backward on sh: μ of every token, the
// cotangents, and the chunked reverse scan's carries (and, with several
// chunks, each chunk's local carry-out and product of A).
WorkspaceSpec backprop_workspace(const EngineOptions& opts, const LayerShape& sh);

template <class S>
class BackpropLayer final : public LayerAdjoint<S> {
 public:
  explicit BackpropLayer(const EngineOptions& opts);
  std::string name() const override { return opts_.detach_inputs ? "backprop (detached inputs)" : "backprop"; }
  bool keeps_activations() const override { return true; }
  typename LayerAdjoint<S>::Store store() const override { return LayerActivations<S>::with_hprev_and_A; }
  bool detached() const override { return opts_.detach_inputs; }
  void backward(const LayerParams<S>& p, int k, ActivationStore<S>& store, const View2<S>& g,
                const LayerParams<S>& grad) override;
  void release() override;

 private:
  EngineOptions opts_;  // grad.chunk: tokens per chunk of the reverse scan
  Workspace<S> work_;   // backprop_workspace, kept from layer to layer of a pass
};

}  // namespace ash
