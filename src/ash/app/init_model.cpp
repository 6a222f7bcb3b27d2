#include "ash/app/init_model.hpp"

#include "ash/app/run_checks.hpp"
#include "ash/core/error.hpp"
#include "ash/io/checkpoint.hpp"
#include "ash/io/run_lock.hpp"
#include "ash/plan/memory_plan.hpp"

namespace ash {

template <class S>
ParamSet<S> init_params(const Config& cfg, std::uint64_t max_memory) {
  check_memory(cfg, Workload::init, sizeof(S), max_memory);
  ParamSet<S> params(cfg.model());
  initialize(params, cfg.model().seed);
  return params;
}

template <class S>
ParamSet<S> init_file(const Config& cfg, const std::string& config_file, const std::string& out,
                      std::uint64_t max_memory) {
  require_distinct_output(out, {{"--config", config_file}});
  auto params = init_params<S>(cfg, max_memory);
  const auto lock = RunLock::for_output(out);  // a run directory: not while its train runs
  save_checkpoint(out, cfg, params);
  return params;
}

template <class S>
void save_file(const std::string& out, const Config& cfg, std::int64_t step,
               const std::function<void(const ParamSet<S>&)>& fill) {
  require(step >= 0, "step must be >= 0 (every reader refuses a negative step), got " + std::to_string(step));
  const auto lock = RunLock::for_output(out);
  const ParamSet<S> params(cfg.model());
  fill(params);
  save_checkpoint(out, cfg, params, step);
}

template ParamSet<float> init_params<float>(const Config&, std::uint64_t);
template ParamSet<double> init_params<double>(const Config&, std::uint64_t);
template ParamSet<float> init_file<float>(const Config&, const std::string&, const std::string&, std::uint64_t);
template ParamSet<double> init_file<double>(const Config&, const std::string&, const std::string&, std::uint64_t);
template void save_file<float>(const std::string&, const Config&, std::int64_t,
                               const std::function<void(const ParamSet<float>&)>&);
template void save_file<double>(const std::string&, const Config&, std::int64_t,
                                const std::function<void(const ParamSet<double>&)>&);

}  // namespace ash
