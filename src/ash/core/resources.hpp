#pragma once
// Sizes before allocation (docs/design.md §7): products of configuration
// sizes are computed with overflow checks, and the memory a run will need is
// predicted and refused when the machine cannot hold it, so an absurd
// configuration is a clear error instead of a crash in the allocator.
#include <cstdint>
#include <string>
#include <vector>

#include "ash/core/config.hpp"

namespace ash {

// a * b, or ash::Error naming `what` when the product overflows int64 (or an
// operand is negative).
std::int64_t checked_mul(std::int64_t a, std::int64_t b, const std::string& what);
std::int64_t checked_add(std::int64_t a, std::int64_t b, const std::string& what);

// Parameter count of a model, overflow-checked (parameter_count() is not).
std::int64_t checked_parameter_count(const ModelDims& d);

// What a verb keeps in memory at once (an estimate, not a measurement).
enum class Workload { init, grad, train };

struct MemoryEstimate {
  std::uint64_t params = 0;       // one copy of the parameters
  std::uint64_t state = 0;        // gradient, Adam moments, file image
  std::uint64_t activations = 0;  // what the engine keeps for the backward pass
  std::uint64_t total() const { return params + state + activations; }
};

// A coarse bound formed entirely in overflow-checked integer products: its
// job is the "sizes overflow" error before anything else multiplies sizes
// (Config::validate, check_memory, ash plan). The prediction a run is checked
// against is plan_memory's. Per process: in a layer-sharded run
// (dist.layer_ranks = R) each rank holds about 1/R of the layers' share, with
// sequence ranks (dist.seq_ranks = S) 1/S of the tokens.
MemoryEstimate estimate_memory(const Config& cfg, Workload w, std::size_t scalar_bytes);

// The memory planner (docs/design.md §8): the predicted peak of the default
// memory space for a configuration, per component, from the allocations the
// engines make (parameters, optimizer, kept activations, per-layer and
// per-wave scratch, head chunk, validation forward), taken at the phase where
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
// cannot know the file, so 16 unless told).
MemoryPlan plan_memory(const Config& cfg, Workload w, std::size_t scalar_bytes, std::int64_t valid_windows = 16);

// grad.layer_checkpoint as m >= 1: 0 ("auto") gives round(sqrt(K)).
std::int64_t resolve_layer_checkpoint(std::int64_t m, std::int64_t layers);

// Physical memory of the machine (sysconf), 0 when unknown.
std::uint64_t physical_memory_bytes();

// What the engines' memory space holds, which check_memory and `ash plan`
// compare a plan with: physical memory on a host backend, the GPU's global
// memory on CUDA (0 when unknown). `what` names it for messages.
struct MemoryCapacity {
  std::uint64_t bytes = 0;
  std::string what;
};
MemoryCapacity memory_space_capacity();

// Throws ash::Error when the estimate exceeds `limit` (0: physical memory),
// quoting the estimate.
void check_memory(const Config& cfg, Workload w, std::size_t scalar_bytes, std::uint64_t limit = 0);

}  // namespace ash
