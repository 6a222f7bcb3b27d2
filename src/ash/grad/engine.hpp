#pragma once
// One interface for every gradient engine of docs/design.md §2 (E1 backprop,
// E2 adjoint, E3 adjoint-exact; E4 distributed in ash/dist/). An engine is an
// orchestrator (forward over the layers, head, the layers' reverse mode in
// some order, embedding) around a per-layer method (LayerAdjoint).
#include <memory>
#include <string>
#include <vector>

#include "ash/core/config.hpp"
#include "ash/core/error.hpp"
#include "ash/core/half.hpp"
#include "ash/core/resources.hpp"
#include "ash/grad/layer_adjoint.hpp"
#include "ash/model/embedding.hpp"
#include "ash/model/params.hpp"

namespace ash {

struct EngineOptions {
  std::string engine = "backprop";  // backprop | adjoint | adjoint-exact
  index_t truncate = 0;             // T̄; 0 = the full window T
  bool detach_inputs = false;       // stop-gradient on every layer input
  index_t chunk = 64;               // E3 chunk length C
  index_t wave = 0;                 // E3: tokens whose A, h, μ are recomputed at once; 0: auto (e3_wave_length)
  index_t head_chunk = 0;           // tokens per head chunk (T×V logits never whole); 0: auto (head_chunk_rows)
  // E3's h replay (C++ API only; docs/design.md §6): chunk-parallel from the
  // chunk-boundary states (a GPU's form), or sequential through each
  // sequence's waves from a running state (a host's form: no boundary pass).
  // Defaults to the backend's form; tests run the other one too.
  bool e3_chunked_h = !host_backend;
  // The memory levers of docs/design.md §8 (E3 only; any of them selects the
  // LowMemoryEngine of ash/grad/low_memory_engine.hpp):
  Storage storage = Storage::full;  // how kept layer inputs are stored (run.storage)
  index_t layer_checkpoint = 1;     // keep every m-th layer input, recompute the rest (resolved: >= 1)
  index_t token_block = 0;          // tokens per block of the block-wise pass (0: auto)
  bool carry_state = false;         // windows start from the previous window's state (data.carry_state)

  bool low_memory() const {
    return storage != Storage::full || layer_checkpoint != 1 || token_block > 0 || carry_state;
  }
  static EngineOptions from_config(const Config& cfg);
};

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
};

// The local engine for opts.engine (the LowMemoryEngine when opts.low_memory()); throws ash::Error for an unknown engine or
// options it does not support.
template <class S>
std::unique_ptr<GradientEngine<S>> make_engine(const EngineOptions& opts);

}  // namespace ash
