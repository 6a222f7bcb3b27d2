#pragma once
// What the MPI pipeline measures of one gradient (ash grad prints it).
#include <cstdint>

#include "ash/core/types.hpp"

namespace ash::dist {

// Measured on the last compute(); the same on every rank of a layer group.
struct PipelineStats {
  index_t blocks = 1;            // token blocks of the pipeline (1: whole windows)
  double wall_s = 0;             // slowest rank's compute() time
  double busy_fraction = 0;      // Σ over ranks of (wall - time in MPI) / (R · wall)
  std::uint64_t bytes_sent = 0;  // this rank's bytes sent in compute()
  std::uint64_t max_bytes_sent = 0;
};

}  // namespace ash::dist
