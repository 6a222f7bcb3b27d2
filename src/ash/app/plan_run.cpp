#include "ash/app/plan_run.hpp"

#include "ash/core/error.hpp"

namespace ash {

PlanReport plan_run(const Config& cfg, const std::string& workload, const std::string& precision,
                    std::uint64_t max_memory) {
  PlanReport r;
  require(workload == "train" || workload == "grad", "workload must be 'train' or 'grad', got '" + workload + "'");
  r.settings = cfg.settings();  // overflow checks
  r.workload = workload;
  r.precision = precision.empty() ? r.settings.run.precision() : precision;
  require(r.precision == "float" || r.precision == "double",
          "precision must be 'float' or 'double', got '" + r.precision + "'");
  r.plan = plan_memory(r.settings, workload == "train" ? Workload::train : Workload::grad,
                       r.precision == "double" ? 8 : 4);
  r.capacity = memory_space_capacity();
  r.budget = max_memory > 0 ? max_memory : r.capacity.bytes;
  r.per_token = r.plan.total() / double(r.settings.data.seq_len * r.settings.data.batch);
  r.fits = r.budget == 0 || r.plan.total() <= double(r.budget);
  return r;
}

}  // namespace ash
