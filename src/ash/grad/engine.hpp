#pragma once
// One interface for every gradient engine of docs/design.md §2 (E1 backprop,
// E2 adjoint, E3 adjoint-exact; E4 distributed in ash/distributed/). An engine is an
// orchestrator (forward over the layers, head, the layers' reverse mode in
// some order, embedding) around a per-layer method (LayerAdjoint).
#include <memory>
#include <string>
#include <vector>

#include "ash/core/config.hpp"
#include "ash/core/error.hpp"
#include "ash/grad/layer_adjoint.hpp"
#include "ash/grad/workspace.hpp"
#include "ash/model/embedding.hpp"
#include "ash/model/params.hpp"

namespace ash {


template <class S>
class GradientEngine {
 public:
  virtual ~GradientEngine() = default;
  virtual std::string name() const = 0;
  // Overwrites grad with ∂L/∂θ for the windows in x ([Bt, T]) and returns L.
  virtual double compute(const ParamSet<S>& params, const TokenView& x, const ParamSet<S>& grad) = 0;
  // Carried state (data.carry_state, truncated BPTT with state): when set,
  // layer k of every window starts from (*state)[k] ([Bt·P, N], a constant:
  // no gradient flows into it) and compute() leaves there the state after the
  // window's last token. nullptr: every window starts from h = 0.
  virtual void set_carried_state(std::vector<View2<S>>* state) {
    if (state) throw Error(name() + ": this engine does not carry state across windows");
  }
};

// One process, all layers: embedding, forward over [0, K) keeping what the
// layer method asks for, head (loss and g), then every layer's reverse mode
// from K-1 down to 0 (each layer's storage freed when done), embedding.
template <class S>
class LocalEngine final : public GradientEngine<S> {
 public:
  explicit LocalEngine(const EngineOptions& opts);
  std::string name() const override { return layer_->name(); }
  double compute(const ParamSet<S>& params, const TokenView& x, const ParamSet<S>& grad) override;

 private:
  EngineOptions opts_;
  std::unique_ptr<LayerAdjoint<S>> layer_;
  // Held between calls with opts_.keep_buffers only (else one call's).
  std::unique_ptr<ActivationStore<S>> store_;
  View2<S> g_;
};

// The buffers of one layer's backward with opts.method on whole windows of
// sh (backprop_workspace, adjoint_workspace, adjoint_exact_workspace): what
// the layer method allocates from and the memory planner sums.
WorkspaceSpec layer_workspace(const EngineOptions& opts, const LayerShape& sh);

// The local engine for opts.method (the BlockwiseEngine when opts.blockwise_levers()); throws ash::Error for
// options it does not support.
template <class S>
std::unique_ptr<GradientEngine<S>> make_engine(const EngineOptions& opts);

}  // namespace ash
