#include "ash/app/train_run.hpp"

#include "ash/app/run_config.hpp"
#include "ash/plan/memory_plan.hpp"

namespace ash {

TrainSummary train_run(const TrainRequest& req, std::FILE* log, const CheckpointReader& read) {
  Config cfg = train_config(nullptr, req.config_file, req.config_json, req.sets);
  if (!req.resume.empty()) {
    const Config resumed = read(req.resume).config;
    cfg = train_config(&resumed, req.config_file, req.config_json, req.sets);
  }
  check_memory(cfg, Workload::train, cfg.settings().run.scalar_bytes(), req.max_memory);
  return train(cfg, req.resume, log, req.until);
}

}  // namespace ash
