#include "ash/app/run_config.hpp"

#include <nlohmann/json.hpp>

#include "ash/core/error.hpp"

namespace ash {

Config checkpoint_run_config(Config stored, const std::vector<std::string>& sets) {
  stored.reset_section("dist");
  const ModelDims dims = stored.model();
  stored.set_all(sets);
  require(stored.model() == dims, "--set may not change the model sizes of a checkpoint (model.*)");
  return stored;
}

Config train_config(const Config* resumed, const std::string& config_file, const std::string& config_json,
                    const std::vector<std::string>& sets) {
  Config cfg;
  if (resumed) {
    cfg = *resumed;             // the base; the file and the assignments override it
    cfg.reset_section("dist");  // resharding: the layout is this run's
  }
  if (!config_file.empty()) cfg.merge_file(config_file);
  if (!config_json.empty()) cfg.merge(parse_json_strict(config_json, "config"), "config");
  cfg.set_all(sets);
  cfg.validate();
  return cfg;
}

}  // namespace ash
