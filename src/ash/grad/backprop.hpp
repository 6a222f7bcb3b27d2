#pragma once
// E1: plain reverse mode that keeps every intermediate of every layer and
// token, the way autograd does. The reference and the memory baseline.
#include "ash/grad/engine.hpp"

namespace ash {

template <class S>
class BackpropEngine final : public GradientEngine<S> {
 public:
  explicit BackpropEngine(const EngineOptions& opts) : opts_(opts) {}
  std::string name() const override { return opts_.detach_inputs ? "backprop (detached inputs)" : "backprop"; }
  double compute(const ParamSet<S>& params, const TokenView& x, const ParamSet<S>& grad) override;

 private:
  EngineOptions opts_;
};

}  // namespace ash
