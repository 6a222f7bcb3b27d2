#pragma once
// Time per kernel, measured in process through the Kokkos Tools callbacks
// (docs/design.md §6): every parallel_for/reduce/scan by its label, and the
// dense products as the region "ash::gemm". Kernels of one label add up.
// On a GPU, Kokkos 4 fences at the end of each kernel while a tool is
// active, and the profiler fences around its own regions (the cuBLAS calls),
// so the times are kernel times there too (plus launch overhead).
#include <cstdint>
#include <string>
#include <vector>

namespace ash {

class KernelProfiler {
 public:
  struct Entry {
    std::string name;
    std::uint64_t calls = 0;
    double seconds = 0;
  };
  // Clears the tallies and starts timing (after Kokkos::initialize).
  static void start();
  // Stops timing; the tallies stay readable.
  static void stop();
  // Tallies, longest first.
  static std::vector<Entry> entries();
  // A table of the entries with their share of `total_seconds`.
  static std::string table(double total_seconds);
};

}  // namespace ash
