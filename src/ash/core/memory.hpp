#pragma once
// Peak memory, measured: Kokkos Tools allocation callbacks see every View
// (library temporaries included), per memory space; the process high-water
// mark (VmHWM) covers everything else on the host.
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace ash {

struct SpaceUsage {
  std::string space;   // Kokkos memory space name ("Host", "Cuda", ...)
  std::uint64_t current = 0;
  std::uint64_t peak = 0;
  std::uint64_t allocations = 0;      // Views allocated so far (a workspace that is reused adds none)
  std::uint64_t allocated_bytes = 0;  // their bytes, summed
};

class MemoryTracker {
 public:
  // Registers the allocation callbacks; idempotent. Call after Kokkos::initialize
  // (ash::ScopeGuard does it) and before the allocations to be counted.
  static void install();
  static bool installed();
  static std::vector<SpaceUsage> usage();
  static std::uint64_t current(const std::string& space);
  static std::uint64_t peak(const std::string& space);
  // Allocations (count and bytes) in the space since the process started.
  static std::uint64_t allocations(const std::string& space);
  static std::uint64_t allocated_bytes(const std::string& space);
  // Peak := current, for measuring one phase.
  static void reset_peak();
  // The live bytes per allocation label at the space's peak (since the last
  // reset_peak), largest first, at most `top` rows: what a peak is made of.
  static std::vector<std::pair<std::string, std::uint64_t>> peak_breakdown(const std::string& space,
                                                                            std::size_t top = 8);
  // Process resident-set high-water mark (VmHWM, bytes); 0 where /proc is absent.
  static std::uint64_t process_hwm_bytes();
  // One line: "Host peak 1.2 MiB, process HWM 15.3 MiB".
  static std::string summary();
};

std::string format_bytes(std::uint64_t bytes);

// Physical memory of the machine (sysconf), 0 when unknown.
std::uint64_t physical_memory_bytes();

// Under an address-space limit (ulimit -v, RLIMIT_AS), what is left of it for new
// allocations: the limit less what the process has mapped now and the buffers its
// BLAS threads reserve on their first product (OpenBLAS retries a refused buffer
// forever: a run that cannot fit them must not start). ~0 (no bound) without a limit.
std::uint64_t address_space_headroom();

}  // namespace ash
