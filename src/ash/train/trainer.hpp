#pragma once
// `ash train`: AdamW on windows of a token file with any gradient engine,
// progress lines, JSON-lines metrics, periodic and final HDF5 checkpoints,
// exact resume.
#include <cstdio>
#include <string>
#include <vector>

#include "ash/core/config.hpp"

namespace ash {

struct TrainSummary {
  std::int64_t first_step = 0, last_step = 0;  // steps run: [first_step, last_step)
  double last_loss = 0;
  double val_loss = 0;          // nats/token on the validation windows (NaN if none)
  double val_bits = 0;          // bits/token (= bits/byte for a byte vocabulary)
  double uniform_bits = 0;      // log2 V
  double unigram_bits = 0;      // training-unigram cross-entropy of the same validation targets
  std::string checkpoint;       // the last checkpoint written
  std::uint64_t peak_bytes = 0; // Kokkos peak of the default memory space, the largest of any rank
  std::vector<std::uint64_t> rank_peak_bytes;  // each world rank's (one entry without MPI)
  int signal = 0;               // SIGINT / SIGTERM that stopped the run (a checkpoint was written), else 0
};

// Runs `ash train` for the configuration (validated here). resume: a checkpoint
// to continue from (its model sizes and precision must match). Progress goes to
// `log` (may be null). Throws ash::Error on bad input or a non-finite loss; the
// last good checkpoint is never replaced by a bad one.
// until > 0 stops after that step (with a checkpoint), leaving the schedule of
// optim.steps unchanged, so a later --resume continues the same run.
TrainSummary train(const Config& cfg, const std::string& resume, std::FILE* log, std::int64_t until = 0);

}  // namespace ash
