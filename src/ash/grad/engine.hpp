#pragma once
// One interface for every gradient engine of DESIGN.md §2 (E1 backprop,
// E2 adjoint, E3 adjoint-exact, E4 distributed).
#include <memory>
#include <string>

#include "ash/core/config.hpp"
#include "ash/model/embedding.hpp"
#include "ash/model/params.hpp"

namespace ash {

struct EngineOptions {
  std::string engine = "backprop";  // backprop | adjoint | adjoint-exact
  index_t truncate = 0;             // T̄; 0 = the full window T
  bool detach_inputs = false;       // stop-gradient on every layer input
  index_t chunk = 64;               // E3 chunk length C
  index_t wave = 1024;              // E3: tokens whose A, h, μ are recomputed at once
  index_t head_chunk = 1024;        // tokens per head chunk (T×V logits never whole)

  static EngineOptions from_config(const Config& cfg);
};

template <class S>
class GradientEngine {
 public:
  virtual ~GradientEngine() = default;
  virtual std::string name() const = 0;
  // Overwrites grad with ∂L/∂θ for the windows in x ([Bt, T]) and returns L.
  virtual double compute(const ParamSet<S>& params, const TokenView& x, const ParamSet<S>& grad) = 0;
};

// Throws ash::Error for an unknown engine or options it does not support.
template <class S>
std::unique_ptr<GradientEngine<S>> make_engine(const EngineOptions& opts);

}  // namespace ash
