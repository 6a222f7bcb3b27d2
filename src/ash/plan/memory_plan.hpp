#pragma once
// The memory planner (docs/design.md §8): the predicted peak of the default
// memory space for a configuration, per component, from the allocations the
// engines make, and the check that refuses a run the machine cannot hold, so
// an absurd configuration is a clear error instead of a crash in the
// allocator. It sits above the engines (it reads their size rules: E3's wave,
// the block length, the head chunk, the embedding backward's segments).
#include <cstdint>
#include <string>
#include <vector>

#include "ash/core/config.hpp"

namespace ash {

// What a verb keeps in memory at once.
enum class Workload { init, grad, train };

// The predicted peak: parameters, optimizer, kept activations, per-layer and
// per-wave scratch, head chunk, validation forward, taken at the phase where
// their sum is largest. Per rank for dist.* layouts (layers K/R, tokens T/S).
// Checked against the measured Kokkos peak in unit_tests/test_memory_plan.cpp.
struct MemoryPlan {
  struct Item {
    std::string name;
    double bytes = 0;
  };
  std::string engine;  // what the plan is for, in words
  std::string phase;   // where the peak is
  std::vector<Item> items;
  double total() const;
  // One line per item and the total; `indent` before each line.
  std::string table(const std::string& indent = "  ") const;
};

// valid_windows: the windows `ash train` scores (at most 16; the planner
// cannot know the file, so 16 unless told). Sizes are summed in double (no
// overflow; Config::settings() has checked the integer products).
MemoryPlan plan_memory(const Settings& s, Workload w, std::size_t scalar_bytes, std::int64_t valid_windows = 16);
inline MemoryPlan plan_memory(const Config& cfg, Workload w, std::size_t scalar_bytes,
                              std::int64_t valid_windows = 16) {
  return plan_memory(cfg.settings(), w, scalar_bytes, valid_windows);
}

// What the engines' memory space holds, which check_memory and `ash plan`
// compare a plan with (0 when unknown; `what` names it for messages): 90 % of
// physical memory on a host backend, of the GPU's global memory on CUDA. The
// rest is the system's and the process's own (a plan at 97 % of a host's memory
// was killed by the kernel's out-of-memory killer, not refused).
constexpr double usable_memory_fraction = 0.9;
struct MemoryCapacity {
  std::uint64_t bytes = 0;
  std::string what;
};
MemoryCapacity memory_space_capacity();

// Throws ash::Error when the plan exceeds `limit` (0: memory_space_capacity()),
// quoting the plan.
void check_memory(const Settings& s, Workload w, std::size_t scalar_bytes, std::uint64_t limit = 0);
inline void check_memory(const Config& cfg, Workload w, std::size_t scalar_bytes, std::uint64_t limit = 0) {
  check_memory(cfg.settings(), w, scalar_bytes, limit);
}

}  // namespace ash
