#include "ash/grad/engine.hpp"

#include "ash/core/error.hpp"
#include "ash/grad/adjoint.hpp"
#include "ash/grad/adjoint_exact.hpp"
#include "ash/grad/backprop.hpp"

namespace ash {

EngineOptions EngineOptions::from_config(const Config& cfg) {
  EngineOptions o;
  o.engine = cfg.get<std::string>("grad.engine");
  o.truncate = cfg.get<index_t>("grad.truncate");
  o.detach_inputs = cfg.get<bool>("grad.detach_inputs");
  o.chunk = cfg.get<index_t>("grad.chunk");
  return o;
}

template <class S>
std::unique_ptr<GradientEngine<S>> make_engine(const EngineOptions& opts) {
  require(opts.truncate >= 0, "--truncate must be >= 0");
  require(opts.chunk >= 1, "--chunk must be >= 1");
  if (opts.engine == "backprop") {
    require(opts.truncate == 0, "engine 'backprop' has no window: --truncate applies to adjoint engines only");
    return std::make_unique<BackpropEngine<S>>(opts);
  }
  if (opts.engine == "adjoint") return std::make_unique<AdjointEngine<S>>(opts);
  if (opts.engine == "adjoint-exact") return std::make_unique<AdjointExactEngine<S>>(opts);
  throw Error("unknown engine '" + opts.engine + "' (expected backprop, adjoint or adjoint-exact)");
}

template std::unique_ptr<GradientEngine<float>> make_engine<float>(const EngineOptions&);
template std::unique_ptr<GradientEngine<double>> make_engine<double>(const EngineOptions&);

}  // namespace ash
