#pragma once
// `ash train` and Python's train as one library call (the use-case floor,
// docs/architecture.md): the configuration (resumed or not), the memory check,
// the training loop of train/trainer.
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "ash/app/run_checks.hpp"
#include "ash/train/trainer.hpp"

namespace ash {

struct TrainRequest {
  std::string config_file;        // a JSON configuration file ("" for none)
  std::string config_json;        // JSON text ("" for none)
  std::vector<std::string> sets;  // key=value assignments
  std::string resume;             // continue from this checkpoint ("" for none)
  std::int64_t until = 0;         // stop after this step (0: optim.steps)
  std::uint64_t max_memory = 0;   // check_memory's limit (0: the machine's)
};

// The configuration is validated on its own first, then (resume) over the resumed
// checkpoint's (read through `read`); progress lines go to log.
TrainSummary train_run(const TrainRequest& req, std::FILE* log, const CheckpointReader& read);

}  // namespace ash
