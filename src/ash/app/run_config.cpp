#include "ash/app/run_config.hpp"

#include <nlohmann/json.hpp>

#include "ash/core/error.hpp"

namespace ash {

namespace {

// `section.key` = value when the option is given, through Config's own type checks.
template <class T>
void override_key(Config& cfg, const char* section, const char* key, const std::optional<T>& value) {
  if (value) cfg.merge(nlohmann::json{{section, {{key, *value}}}}, std::string(section) + "." + key);
}

}  // namespace

Config checkpoint_run_config(Config stored, const RunOverrides& o) {
  stored.reset_section("dist");
  const ModelDims dims = stored.model();
  if (o.rows_are_sequences) stored.merge(nlohmann::json{{"data", {{"separator", ""}}}}, "ids");
  stored.set_all(o.sets);
  require(stored.model() == dims, "--set may not change the model sizes of a checkpoint (model.*)");
  override_key(stored, "grad", "engine", o.engine);
  override_key(stored, "grad", "truncate", o.truncate);
  override_key(stored, "grad", "detach_inputs", o.detach_inputs);
  override_key(stored, "grad", "chunk", o.chunk);
  override_key(stored, "grad", "layer_checkpoint", o.layer_checkpoint);
  override_key(stored, "grad", "token_block", o.token_block);
  override_key(stored, "run", "storage", o.storage);
  override_key(stored, "data", "seq_len", o.seq_len);
  override_key(stored, "data", "batch", o.batch);
  override_key(stored, "data", "carry_state", o.carry_state);
  if (o.carry_state.value_or(false)) override_key(stored, "data", "sequential", o.carry_state);  // one stream
  stored.validate();
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
