#pragma once
// JSON configuration with the canonical keys of docs/design.md §4.
// Every key has a default; a key that is not in the defaults is an error,
// and so is a value whose type differs from the default's. settings() parses
// and validates the document into the typed structs of core/options.hpp,
// which is all that code below the CLI reads.
#include <nlohmann/json.hpp>
#include <cstdint>
#include <string>
#include <vector>

#include "ash/core/options.hpp"

namespace ash {


// Every JSON the tool reads (config files, --set values, a checkpoint's
// /config) is nested at most this deep, and a config file is at most this big.
constexpr std::size_t max_json_depth = 64;
constexpr std::uintmax_t max_config_bytes = std::uintmax_t(1) << 20;

// The deepest nesting of brackets in JSON text (outside strings).
std::size_t json_depth(const std::string& text);

// JSON parse that rejects duplicate keys (nlohmann keeps the last silently)
// and nesting deeper than max_json_depth; throws ash::Error naming `origin`.
nlohmann::json parse_json_strict(const std::string& text, const std::string& origin);

// data.separator's characters (UTF-8, as JSON decodes them) as the bytes they name:
// U+0000 to U+00FF are the byte values 0x00 to 0xFF; anything above is an ash::Error.
std::string separator_bytes(const std::string& utf8);

// The model keys that only a Mamba has (an SSM-ResNet must leave them at their defaults).
constexpr const char* mamba_model_keys[] = {"expand", "conv_kernel", "dt_rank", "tie_embeddings", "norm_eps"};
// The model keys that only a Mamba-2 has (stored for a Mamba-2 only).
constexpr const char* mamba2_model_keys[] = {"head_dim", "heads", "n_groups", "time_step_limit_min",
                                             "time_step_limit_max"};

class Config {
 public:
  Config();  // all defaults
  static nlohmann::json defaults();

  // Merge a JSON document (file contents); unknown keys and wrong types throw ash::Error.
  void merge(const nlohmann::json& doc, const std::string& origin);
  void merge_file(const std::string& path);
  // "a.b=value"; value is parsed as JSON when it parses, else taken as a string.
  void set(const std::string& assignment);
  void set_all(const std::vector<std::string>& assignments) {
    for (const auto& a : assignments) set(a);
  }

  // Back to the defaults for one top-level section ("dist"): a checkpoint's
  // stored rank layout describes the run that wrote it, not the next one.
  void reset_section(const std::string& section);

  // Every key parsed into its type and validated (V >= 2, P, N, K >= 1,
  // seq_len >= 2, batch >= 1, ..., and every product of sizes the tool forms
  // checked for overflow); throws ash::Error naming the key.
  Settings settings() const;
  void validate() const { (void)settings(); }

  ModelDims model() const;
  const nlohmann::json& json() const { return j_; }
  // What a file stores (a checkpoint's /config): json(), less the Mamba-only
  // model keys of an SSM-ResNet (model.arch and those of mamba_model_keys),
  // model.mixer_rms_eps of any model but a FalconMamba and mamba2_model_keys of
  // any but a Mamba-2.
  nlohmann::json stored_json() const;
  std::string dump() const { return j_.dump(2); }

 private:
  // The sections of settings(), each parsed and validated.
  DataOptions data_options() const;
  EngineOptions engine_options(const ModelDims& d, const DataOptions& data) const;
  RunOptions run_options() const;
  AdamWOptions adamw_options() const;
  DistOptions dist_options(const ModelDims& d) const;
  template <class T>
  T get(const std::string& dotted) const {
    return at(dotted).get<T>();
  }
  const nlohmann::json& at(const std::string& dotted) const;
  nlohmann::json j_;
};

}  // namespace ash
