#pragma once
// E1: plain reverse mode that keeps every intermediate of every layer and
// token, the way autograd does. The reference and the memory baseline.
#include "ash/grad/engine.hpp"

namespace ash {

namespace impl {
// E1's h-adjoint over the whole window: μ^t = gy^t ⊗ γ^t + A^{t+1} μ^{t+1}
// ([rows, P, N]) from the A^t and γ^t that act stored, as a chunked reverse
// scan (chunks of `chunk` tokens). Shared by the SSM-ResNet and the Mamba E1.
template <class S>
void e1_reverse_scan(const SeqShape& s, const LayerActivations<S>& act, const View2<S>& gy, const View3<S>& mu,
                     index_t chunk, const ExecSpace& exec);
}  // namespace impl

template <class S>
class BackpropLayer final : public LayerAdjoint<S> {
 public:
  explicit BackpropLayer(const EngineOptions& opts);
  std::string name() const override { return detach_ ? "backprop (detached inputs)" : "backprop"; }
  bool keeps_activations() const override { return true; }
  typename LayerAdjoint<S>::Store store() const override { return LayerActivations<S>::with_hprev_and_A; }
  bool detached() const override { return detach_; }
  void backward(const LayerParams<S>& p, int k, ActivationStore<S>& store, const View2<S>& g,
                const LayerParams<S>& grad) override;
  void release() override;

 private:
  bool detach_;
  index_t chunk_;  // grad.chunk: tokens per chunk of the reverse scan
  WindowScratch<S> work_;  // h-adjoint of every token
};

}  // namespace ash
