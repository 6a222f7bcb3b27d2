#pragma once
// `ash plan` and Python's plan as one library call (the use-case floor,
// docs/architecture.md): the memory planner's prediction for a configuration,
// against the machine's memory (or a given budget).
#include <cstdint>
#include <string>

#include "ash/core/config.hpp"
#include "ash/plan/memory_plan.hpp"

namespace ash {

struct PlanReport {
  Settings settings;         // the configuration's, validated
  std::string workload;      // "train" or "grad"
  std::string precision;     // "float" or "double"
  MemoryPlan plan;
  MemoryCapacity capacity;   // the machine's memory space
  std::uint64_t budget = 0;  // max_memory when given, else capacity.bytes (0: unknown)
  double per_token = 0;      // plan total / (batch · T)
  bool fits = true;          // total <= budget, or the budget unknown
};

// workload: "train" or "grad"; precision: "float", "double" or "" (run.precision);
// max_memory: the budget to compare with (0: the machine's memory space).
PlanReport plan_run(const Config& cfg, const std::string& workload, const std::string& precision,
                    std::uint64_t max_memory = 0);

}  // namespace ash
