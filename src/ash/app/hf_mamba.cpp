#include "ash/app/hf_mamba.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <limits>
#include <set>
#include <utility>

#include "ash/core/config.hpp"
#include "ash/core/error.hpp"
#include "ash/core/sizes.hpp"
#include "ash/io/atomic_write.hpp"  // AtomicFolder: the export as one step

namespace fs = std::filesystem;

namespace ash {

namespace {

std::string dumped(const nlohmann::json& v) { return v.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace); }

// A positive integer key of `j` (or `fallback` when absent and fallback > 0).
std::int64_t positive_int(const nlohmann::json& j, const char* key, std::int64_t fallback, const std::string& origin) {
  if (!j.contains(key)) {
    require(fallback > 0, origin + " has no \"" + key + "\"");
    return fallback;
  }
  const auto& v = j.at(key);
  // (a parsed 16 is unsigned in nlohmann, a 16 set from C++ a signed integer)
  const bool ok = v.is_number_unsigned() ? v.get<std::uint64_t>() >= 1 && v.get<std::uint64_t>() <= std::uint64_t(INT64_MAX)
                                         : v.is_number_integer() && v.get<std::int64_t>() >= 1;
  require(ok, origin + ": \"" + key + "\" is " + dumped(v) + ", not a positive integer");
  return v.get<std::int64_t>();
}

bool bool_key(const nlohmann::json& j, const char* key, bool fallback, const std::string& origin) {
  if (!j.contains(key)) return fallback;
  require(j.at(key).is_boolean(), origin + ": \"" + key + "\" is " + dumped(j.at(key)) + ", not true or false");
  return j.at(key).get<bool>();
}

double eps_key(const nlohmann::json& j, const char* key, const std::string& origin, double fallback = 1e-5) {
  if (!j.contains(key)) return fallback;
  const auto& v = j.at(key);
  require(v.is_number() && std::isfinite(v.get<double>()) && v.get<double>() > 0,
          origin + ": \"" + key + "\" is " + dumped(v) + ", not a positive number");
  return v.get<double>();
}

// MambaConfig's keys (transformers 5.x) and PretrainedConfig's common ones that
// a saved config.json holds: accepted without a note when they change nothing we
// compute. Anything else is accepted too, and listed as ignored.
const std::set<std::string>& known_hf_keys() {
  static const std::set<std::string> k = {
      "architectures", "model_type", "hidden_size", "state_size", "num_hidden_layers", "vocab_size", "expand",
      "conv_kernel", "time_step_rank", "tie_word_embeddings", "layer_norm_epsilon", "use_bias", "use_conv_bias",
      "hidden_act", "intermediate_size", "residual_in_fp32", "pad_token_id", "bos_token_id", "eos_token_id",
      "initializer_range", "time_step_scale", "time_step_min", "time_step_max", "time_step_init_scheme",
      "time_step_floor", "rescale_prenorm_residual", "use_cache", "use_mambapy", "use_associative_scan", "dtype",
      "torch_dtype", "transformers_version", "_name_or_path", "rms_norm", "fused_add_norm"};
  return k;
}

// FalconMambaConfig's own keys: mixer_rms_eps (read) and use_falcon_mambapy (its
// constructor's old name of use_mambapy, a fallback strategy of transformers').
const std::set<std::string>& falcon_hf_keys() {
  static const std::set<std::string> k = {"mixer_rms_eps", "use_falcon_mambapy"};
  return k;
}

// Mamba2Config's keys (transformers 5.x) and the common ones a saved config.json holds.
const std::set<std::string>& mamba2_hf_keys() {
  static const std::set<std::string> k = {
      "architectures", "model_type", "hidden_size", "state_size", "num_hidden_layers", "vocab_size", "expand",
      "conv_kernel", "head_dim", "num_heads", "n_groups", "tie_word_embeddings", "layer_norm_epsilon", "use_bias",
      "use_conv_bias", "hidden_act", "residual_in_fp32", "pad_token_id", "bos_token_id", "eos_token_id",
      "initializer_range", "time_step_rank", "time_step_min", "time_step_max", "time_step_floor", "time_step_limit",
      "rescale_prenorm_residual", "use_cache", "chunk_size", "dtype", "torch_dtype", "transformers_version",
      "_name_or_path"};
  return k;
}

enum class HfArch { mamba, falcon_mamba, mamba2 };

// Which model config.json describes: by model_type, or without one by
// architectures; either, when present, must name one we read, and the two must agree.
HfArch hf_arch(const nlohmann::json& hf, const std::string& origin) {
  const auto mamba = nlohmann::json::array({"MambaForCausalLM"}),
             falcon = nlohmann::json::array({"FalconMambaForCausalLM"}),
             mamba2 = nlohmann::json::array({"Mamba2ForCausalLM"});
  HfArch a = HfArch::mamba;
  if (hf.contains("model_type")) {
    const auto& t = hf["model_type"];
    require(t == "mamba" || t == "falcon_mamba" || t == "mamba2",
            origin + ": model_type " + dumped(t) +
                " is not \"mamba\", \"falcon_mamba\" or \"mamba2\" (only transformers' MambaForCausalLM, "
                "FalconMambaForCausalLM and Mamba2ForCausalLM are read)");
    a = t == "falcon_mamba" ? HfArch::falcon_mamba : t == "mamba2" ? HfArch::mamba2 : HfArch::mamba;
  } else if (hf.contains("architectures")) {
    a = hf["architectures"] == falcon ? HfArch::falcon_mamba
        : hf["architectures"] == mamba2 ? HfArch::mamba2 : HfArch::mamba;
  }
  if (hf.contains("architectures") && hf.contains("model_type")) {
    const auto& want = a == HfArch::falcon_mamba ? falcon : a == HfArch::mamba2 ? mamba2 : mamba;
    require(hf["architectures"] == want, origin + ": architectures " + dumped(hf["architectures"]) + " is not " +
                                             dumped(want) + " (model_type " + dumped(hf["model_type"]) + ")");
  } else if (hf.contains("architectures")) {
    require(a != HfArch::mamba || hf["architectures"] == mamba,
            origin + ": architectures " + dumped(hf["architectures"]) + " is not " + dumped(mamba) + ", " +
                dumped(falcon) + " or " + dumped(mamba2));
  }
  return a;
}

// Python's json writes an infinite float as a bare Infinity (older transformers'
// config.json did so; 5.x writes {"__float__": "Infinity"}): such tokens outside
// strings become that tagged object, which nlohmann parses.
std::string tag_python_floats(const std::string& text) {
  std::string out;
  out.reserve(text.size());
  bool in_string = false;
  for (std::size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      out += c;
      if (c == '\\' && i + 1 < text.size()) out += text[++i];
      else if (c == '"') in_string = false;
      continue;
    }
    if (c == '"') in_string = true;
    bool tagged = false;
    for (const char* word : {"-Infinity", "Infinity", "NaN"}) {
      const std::size_t n = std::strlen(word);
      if (text.compare(i, n, word) == 0) {
        out += std::string("{\"__float__\": \"") + word + "\"}";
        i += n - 1;
        tagged = true;
        break;
      }
    }
    if (!tagged) out += c;
  }
  return out;
}

// time_step_limit [min, max] as our (min, max): max Infinity (tagged) is 0, no limit.
std::pair<double, double> time_step_limit(const nlohmann::json& hf, const std::string& origin) {
  if (!hf.contains("time_step_limit")) return {0, 0};  // Mamba2Config's (0.0, inf)
  const auto& v = hf["time_step_limit"];
  const std::string bad = origin + ": \"time_step_limit\" is " + dumped(v) + ", not [min, max] with 0 <= min < max";
  require(v.is_array() && v.size() == 2, bad);
  const auto value = [&](const nlohmann::json& x) {
    if (x.is_object() && x.size() == 1 && x.contains("__float__") && x["__float__"] == "Infinity")
      return std::numeric_limits<double>::infinity();
    require(x.is_number() && std::isfinite(x.get<double>()), bad);
    return x.get<double>();
  };
  const double lo = value(v[0]), hi = value(v[1]);
  require(std::isfinite(lo) && lo >= 0 && hi > lo, bad);
  return {lo, std::isinf(hi) ? 0.0 : hi};
}

// The sizes every Mamba config.json names alike (hidden_size, ... conv_kernel; the
// defaults those of MambaConfig and Mamba2Config) as our model keys.
nlohmann::json hf_sizes(const nlohmann::json& hf, const std::string& origin) {
  nlohmann::json m;
  m["width"] = positive_int(hf, "hidden_size", 0, origin);
  m["state"] = positive_int(hf, "state_size", 0, origin);
  m["layers"] = positive_int(hf, "num_hidden_layers", 0, origin);
  m["vocab"] = positive_int(hf, "vocab_size", 0, origin);
  m["expand"] = positive_int(hf, "expand", 2, origin);
  m["conv_kernel"] = positive_int(hf, "conv_kernel", 4, origin);
  return m;
}

// Mamba2Config's keys as ours (hf_mamba_config_to_ash for model_type "mamba2").
nlohmann::json hf_mamba2_config_to_ash(const nlohmann::json& hf, const std::string& origin,
                                       std::vector<std::string>* ignored) {
  nlohmann::json m = hf_sizes(hf, origin);
  m["arch"] = "mamba2";
  m["head_dim"] = positive_int(hf, "head_dim", 64, origin);
  m["heads"] = positive_int(hf, "num_heads", 128, origin);
  m["n_groups"] = positive_int(hf, "n_groups", 8, origin);  // Mamba2Config's default is 8
  m["tie_embeddings"] = bool_key(hf, "tie_word_embeddings", false, origin);  // Mamba2Config's default: untied
  m["norm_eps"] = eps_key(hf, "layer_norm_epsilon", origin);
  const auto limit = time_step_limit(hf, origin);
  m["time_step_limit_min"] = limit.first;
  m["time_step_limit_max"] = limit.second;
  nlohmann::json out;
  out["model"] = m;
  {  // transformers refuses such a configuration too; named here in its keys
    const std::string s = origin + ": the tensor sizes";
    const std::int64_t hp = checked_mul(m["heads"].get<std::int64_t>(), m["head_dim"].get<std::int64_t>(), s),
                       e = checked_mul(m["expand"].get<std::int64_t>(), m["width"].get<std::int64_t>(), s);
    require(hp == e, origin + ": num_heads × head_dim = " + std::to_string(hp) + " is not expand × hidden_size = " +
                         std::to_string(e));
    const std::int64_t heads = m["heads"].get<std::int64_t>(), groups = m["n_groups"].get<std::int64_t>();
    require(heads % groups == 0, origin + ": n_groups " + std::to_string(groups) + " does not divide num_heads " +
                                     std::to_string(heads));
  }
  (void)mamba_dims(out, origin);  // sizes and products checked
  if (ignored)
    for (auto it = hf.begin(); it != hf.end(); ++it)
      if (!mamba2_hf_keys().count(it.key())) ignored->push_back(it.key());
  return out;
}

std::string layer_prefix(std::int64_t k) {  // as model/params.cpp names a layer's group
  char buf[32];
  std::snprintf(buf, sizeof buf, "layers/%03lld/", static_cast<long long>(k));
  return buf;
}

std::string shape_text(const std::vector<std::int64_t>& s) {
  std::string t = "[";
  for (std::size_t i = 0; i < s.size(); ++i) t += (i ? ", " : "") + std::to_string(s[i]);
  return t + "]";
}

std::string read_small_file(const std::string& path, const std::string& what) {
  std::error_code ec;
  const auto size = fs::file_size(path, ec);
  require(!ec && size <= max_config_bytes,
          what + " is " + std::to_string(size) + " bytes; at most " + std::to_string(max_config_bytes) + " are read");
  std::ifstream in(path, std::ios::binary);
  require(in.good(), "cannot open " + what);
  std::string text;
  try {
    text.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  } catch (const std::ios_base::failure& e) {
    throw Error("error while reading " + what + ": " + e.code().message());
  }
  require(text.size() <= max_config_bytes, what + " grew while being read");
  return text;
}

// Every tensor name of the configuration, in order (globals, then layer by
// layer), handed to f; f may throw to stop.
template <class F>
void for_each_name(const MambaDims& d, F&& f) {
  for (const auto& n : hf_mamba_global_names(d)) f(n);
  for (std::int64_t k = 0; k < d.layers; ++k)
    for (const auto& n : hf_mamba_layer_names(d, k)) f(n);
}

std::int64_t count_of(const std::vector<std::int64_t>& shape) {
  std::int64_t n = 1;
  for (const auto s : shape) n *= s;  // checked by mamba_dims
  return n;
}

const char* torch_dtype(TensorDtype t) {
  switch (t) {
    case TensorDtype::f64: return "float64";
    case TensorDtype::f32: return "float32";
    case TensorDtype::bf16: return "bfloat16";
    case TensorDtype::f16: return "float16";
  }
  return "float32";
}

std::string tied_head_differs(const std::string& where) {
  return where + ": tensor 'lm_head.weight' differs from backbone.embeddings.weight, but config.json ties them "
                 "(tie_word_embeddings = true)";
}

}  // namespace

nlohmann::json hf_mamba_config_to_ash(const nlohmann::json& hf, const std::string& origin,
                                      std::vector<std::string>* ignored) {
  require(hf.is_object(), origin + " is not a JSON object");
  const HfArch arch = hf_arch(hf, origin);
  const bool falcon = arch == HfArch::falcon_mamba;
  // What we do not implement, refused by name rather than read as something else.
  require(!bool_key(hf, "use_bias", false, origin), origin + ": use_bias = true (biases of in_proj and out_proj) is not supported");
  require(bool_key(hf, "use_conv_bias", true, origin), origin + ": use_conv_bias = false is not supported (the conv1d has a bias)");
  (void)bool_key(hf, "residual_in_fp32", true, origin);  // a precision of transformers' residual: ours is the compute type
  if (hf.contains("hidden_act"))
    require(hf["hidden_act"] == "silu", origin + ": hidden_act " + dumped(hf["hidden_act"]) + " is not supported (only \"silu\")");
  if (arch == HfArch::mamba2) return hf_mamba2_config_to_ash(hf, origin, ignored);
  require(bool_key(hf, "rms_norm", true, origin), origin + ": rms_norm = false (mamba-ssm's LayerNorm) is not supported");

  nlohmann::json m = hf_sizes(hf, origin);
  m["arch"] = falcon ? "falcon_mamba" : "mamba";
  if (!hf.contains("time_step_rank") || hf["time_step_rank"] == "auto")
    m["dt_rank"] = 0;
  else
    m["dt_rank"] = positive_int(hf, "time_step_rank", 0, origin);
  m["tie_embeddings"] = bool_key(hf, "tie_word_embeddings", true, origin);
  m["norm_eps"] = eps_key(hf, "layer_norm_epsilon", origin);
  if (falcon) m["mixer_rms_eps"] = eps_key(hf, "mixer_rms_eps", origin, MambaDims().mixer_rms_eps);
  nlohmann::json out;
  out["model"] = m;
  const MambaDims d = mamba_dims(out, origin);  // sizes and products checked
  if (hf.contains("intermediate_size")) {
    const std::int64_t e = positive_int(hf, "intermediate_size", 0, origin);
    require(e == d.inner(), origin + ": intermediate_size " + std::to_string(e) + " is not expand × hidden_size = " +
                                std::to_string(d.inner()) + " (transformers recomputes it so; such a model is not supported)");
  }
  if (ignored)
    for (auto it = hf.begin(); it != hf.end(); ++it)
      if (!known_hf_keys().count(it.key()) && !(falcon && falcon_hf_keys().count(it.key())))
        ignored->push_back(it.key());
  return out;
}

MambaDims mamba_dims(const nlohmann::json& ash_config, const std::string& origin) {
  require(ash_config.is_object() && ash_config.contains("model") && ash_config["model"].is_object(),
          origin + ": no \"model\" object");
  const auto& m = ash_config["model"];
  const std::string o = origin + ": model";
  if (m.contains("arch"))
    require(m["arch"] == "mamba" || m["arch"] == "falcon_mamba" || m["arch"] == "mamba2",
            origin + ": model.arch " + dumped(m["arch"]) + " is not \"mamba\", \"falcon_mamba\" or \"mamba2\"");
  MambaDims d;
  d.falcon = m.contains("arch") && m["arch"] == "falcon_mamba";
  d.mamba2 = m.contains("arch") && m["arch"] == "mamba2";
  if (d.falcon) d.mixer_rms_eps = eps_key(m, "mixer_rms_eps", o, d.mixer_rms_eps);
  d.width = positive_int(m, "width", 0, o);
  d.state = positive_int(m, "state", 0, o);
  d.layers = positive_int(m, "layers", 0, o);
  d.vocab = positive_int(m, "vocab", 0, o);
  d.expand = positive_int(m, "expand", 2, o);
  d.conv_kernel = positive_int(m, "conv_kernel", 4, o);
  if (m.contains("dt_rank") && m["dt_rank"] != 0) d.dt_rank = positive_int(m, "dt_rank", 0, o);
  d.tie_embeddings = bool_key(m, "tie_embeddings", true, o);
  d.norm_eps = eps_key(m, "norm_eps", o);
  require(d.layers <= max_layers, origin + ": model.layers " + std::to_string(d.layers) + " is above " +
                                      std::to_string(max_layers));
  require(d.vocab <= std::int64_t(INT32_MAX), origin + ": model.vocab " + std::to_string(d.vocab) + " is above 2^31 - 1");
  // Every size the tensors take, checked once here so the shapes below multiply freely.
  const std::string s = origin + ": the tensor sizes";
  if (d.mamba2) {
    require(d.dt_rank == 0, origin + ": model.dt_rank applies to a Mamba-1 block only (a Mamba-2 projects one Δ per head)");
    d.head_dim = positive_int(m, "head_dim", 64, o);
    if (m.contains("heads") && m["heads"] != 0) d.heads = positive_int(m, "heads", 0, o);
    d.n_groups = m.contains("n_groups") ? positive_int(m, "n_groups", 0, o) : 1;
    for (auto* key : {"time_step_limit_min", "time_step_limit_max"}) {
      if (!m.contains(key)) continue;
      const auto& v = m[key];
      require(v.is_number() && std::isfinite(v.get<double>()) && v.get<double>() >= 0,
              o + ": \"" + key + "\" is " + dumped(v) + ", not a finite number >= 0");
    }
    d.time_step_limit_min = m.value("time_step_limit_min", 0.0);
    d.time_step_limit_max = m.value("time_step_limit_max", 0.0);
    require(d.time_step_limit_max == 0 || d.time_step_limit_max > d.time_step_limit_min,
            origin + ": model.time_step_limit_max must be 0 (no limit) or above model.time_step_limit_min");
    const std::int64_t e = checked_mul(d.expand, d.width, s);
    require(checked_mul(d.head_count(), d.head_dim, s) == e,
            origin + ": model.heads × model.head_dim is not model.expand × model.width = " + std::to_string(e));
    require(d.head_count() % d.n_groups == 0, origin + ": model.n_groups " + std::to_string(d.n_groups) +
                                                  " does not divide the " + std::to_string(d.head_count()) + " heads");
    const std::int64_t c = checked_add(e, checked_mul(2, checked_mul(d.n_groups, d.state, s), s), s);
    const std::int64_t rows = checked_add(checked_add(e, c, s), d.head_count(), s);
    for (const auto& p : {std::pair<std::int64_t, std::int64_t>{d.vocab, d.width}, {rows, d.width},
                          {c, d.conv_kernel}, {d.width, e}})
      (void)checked_mul(p.first, p.second, s);
    return d;
  }
  const std::int64_t e = checked_mul(d.expand, d.width, s), r = d.rank();
  const std::int64_t xr = checked_add(r, checked_mul(2, d.state, s), s);
  for (const auto& p : {std::pair<std::int64_t, std::int64_t>{d.vocab, d.width}, {checked_mul(2, e, s), d.width},
                        {e, d.conv_kernel}, {xr, e}, {e, r}, {e, d.state}, {d.width, e}})
    (void)checked_mul(p.first, p.second, s);
  return d;
}

namespace {
// Mamba2Config's keys for a Mamba-2 (ash_config_to_hf_mamba).
nlohmann::json mamba2_hf_config(const MambaDims& d, TensorDtype dtype) {
  nlohmann::json j;  // sorted keys, as transformers writes
  j["architectures"] = {d.hf_class()};
  j["model_type"] = d.arch();
  j["hidden_size"] = d.width;
  j["state_size"] = d.state;
  j["num_hidden_layers"] = d.layers;
  j["vocab_size"] = d.vocab;
  j["expand"] = d.expand;
  j["conv_kernel"] = d.conv_kernel;
  j["head_dim"] = d.head_dim;
  j["num_heads"] = d.head_count();
  j["n_groups"] = d.n_groups;
  j["tie_word_embeddings"] = d.tie_embeddings;
  j["layer_norm_epsilon"] = d.norm_eps;
  // no upper limit: transformers' inf, as save_pretrained writes it
  const nlohmann::json inf = {{"__float__", "Infinity"}};
  j["time_step_limit"] = {d.time_step_limit_min, d.time_step_limit_max > 0 ? nlohmann::json(d.time_step_limit_max) : inf};
  j["hidden_act"] = "silu";
  j["use_bias"] = false;
  j["use_conv_bias"] = true;
  j["residual_in_fp32"] = dtype != TensorDtype::f64;
  j["dtype"] = torch_dtype(dtype);
  // Mamba2Config's defaults for what we do not configure (initialisation, generation, the
  // chunked scan's block); time_step_rank as its __post_init__ resolves "auto" (unused by the block).
  j["time_step_rank"] = d.width / 16 + (d.width % 16 != 0);
  j["chunk_size"] = 256;
  j["pad_token_id"] = 1;
  j["bos_token_id"] = 0;
  j["eos_token_id"] = 2;
  j["initializer_range"] = 0.1;
  j["rescale_prenorm_residual"] = false;
  j["time_step_floor"] = 1e-4;
  j["time_step_max"] = 0.1;
  j["time_step_min"] = 0.001;
  j["use_cache"] = true;
  return j;
}
}  // namespace

nlohmann::json ash_config_to_hf_mamba(const nlohmann::json& ash_config, TensorDtype dtype) {
  const MambaDims d = mamba_dims(ash_config, "configuration");
  if (d.mamba2) return mamba2_hf_config(d, dtype);
  nlohmann::json j;  // an object's keys are sorted: json.dumps(sort_keys=True) as transformers writes
  j["architectures"] = {d.hf_class()};
  j["model_type"] = d.arch();
  if (d.falcon) j["mixer_rms_eps"] = d.mixer_rms_eps;
  j["hidden_size"] = d.width;
  j["state_size"] = d.state;
  j["num_hidden_layers"] = d.layers;
  j["vocab_size"] = d.vocab;
  j["expand"] = d.expand;
  j["intermediate_size"] = d.inner();
  j["conv_kernel"] = d.conv_kernel;
  if (d.dt_rank > 0)
    j["time_step_rank"] = d.dt_rank;
  else
    j["time_step_rank"] = "auto";  // transformers resolves it to ceil(D/16) as we do
  j["tie_word_embeddings"] = d.tie_embeddings;
  j["layer_norm_epsilon"] = d.norm_eps;
  j["hidden_act"] = "silu";
  j["use_bias"] = false;
  j["use_conv_bias"] = true;
  j["residual_in_fp32"] = dtype != TensorDtype::f64;
  j["dtype"] = torch_dtype(dtype);
  // MambaConfig's defaults for what we do not configure (initialisation, generation).
  j["pad_token_id"] = 0;
  j["bos_token_id"] = 0;
  j["eos_token_id"] = 0;
  j["initializer_range"] = 0.1;
  j["rescale_prenorm_residual"] = false;
  j["time_step_floor"] = 1e-4;
  j["time_step_init_scheme"] = "random";
  j["time_step_max"] = 0.1;
  j["time_step_min"] = 0.001;
  j["time_step_scale"] = 1.0;
  j["use_cache"] = true;
  j["use_mambapy"] = false;
  j["use_associative_scan"] = true;
  return j;
}

std::vector<HfName> hf_mamba_global_names(const MambaDims& d) {
  std::vector<HfName> n = {{"backbone.embeddings.weight", "embedding", {d.vocab, d.width}, {d.vocab, d.width}},
                           {"backbone.norm_f.weight", "final_norm", {d.width}, {d.width}}};
  if (!d.tie_embeddings) n.push_back({"lm_head.weight", "head", {d.vocab, d.width}, {d.vocab, d.width}});
  return n;
}

std::vector<HfName> hf_mamba_layer_names(const MambaDims& d, std::int64_t layer) {
  const std::string h = "backbone.layers." + std::to_string(layer) + ".", a = layer_prefix(layer);
  if (d.mamba2) {  // in model/params.cpp's order
    const std::int64_t D = d.width, E = d.inner(), C = d.conv_dim(), H = d.head_count(), K = d.conv_kernel;
    return {
        {h + "norm.weight", a + "norm", {D}, {D}},
        {h + "mixer.in_proj.weight", a + "in_proj", {E + C + H, D}, {E + C + H, D}},
        {h + "mixer.conv1d.weight", a + "conv_weight", {C, 1, K}, {C, K}},
        {h + "mixer.conv1d.bias", a + "conv_bias", {C}, {C}},
        {h + "mixer.dt_bias", a + "dt_bias", {H}, {H}},
        {h + "mixer.A_log", a + "A_log", {H}, {H}},
        {h + "mixer.D", a + "D", {H}, {H}},
        {h + "mixer.norm.weight", a + "gated_norm", {E}, {E}},
        {h + "mixer.out_proj.weight", a + "out_proj", {D, E}, {D, E}},
    };
  }
  const std::int64_t D = d.width, E = d.inner(), N = d.state, R = d.rank(), K = d.conv_kernel;
  return {
      {h + "norm.weight", a + "norm", {D}, {D}},
      {h + "mixer.in_proj.weight", a + "in_proj", {2 * E, D}, {2 * E, D}},
      {h + "mixer.conv1d.weight", a + "conv_weight", {E, 1, K}, {E, K}},
      {h + "mixer.conv1d.bias", a + "conv_bias", {E}, {E}},
      {h + "mixer.x_proj.weight", a + "x_proj", {R + 2 * N, E}, {R + 2 * N, E}},
      {h + "mixer.dt_proj.weight", a + "dt_proj", {E, R}, {E, R}},
      {h + "mixer.dt_proj.bias", a + "dt_bias", {E}, {E}},
      {h + "mixer.A_log", a + "A_log", {E, N}, {E, N}},
      {h + "mixer.D", a + "D", {E}, {E}},
      {h + "mixer.out_proj.weight", a + "out_proj", {D, E}, {D, E}},
  };
}

HfMambaFolder open_hf_mamba(const std::string& dir) {
  HfMambaFolder out;
  const std::string cpath = file_in_folder(dir, "config.json", "config");
  const std::string corigin = "'" + cpath + "'";
  out.config = hf_mamba_config_to_ash(parse_json_strict(tag_python_floats(read_small_file(cpath, corigin)), corigin),
                                      corigin, &out.ignored);
  const MambaDims d = mamba_dims(out.config, corigin);
  out.set = SafetensorsSet::folder(dir);
  out.where = std::string(d.kind()) + " folder '" + dir + "'";
  const SafetensorsSet& set = out.set;
  const std::string& where = out.where;

  // Names and shapes from the headers: no tensor is read from a folder that fails.
  std::set<std::string> expected;
  for_each_name(d, [&](const HfName& n) {
    require(set.contains(n.hf), where + ": tensor '" + n.hf + "' (" + n.ash + ") is missing; config.json implies " +
                                    std::to_string(d.layers) + " layers" +
                                    (d.tie_embeddings ? "" : " and an untied lm_head"));
    const auto& e = set.at(n.hf);
    require(e.shape == n.hf_shape, where + ": tensor '" + n.hf + "' has shape " + shape_text(e.shape) +
                                       "; config.json implies " + shape_text(n.hf_shape));
    expected.insert(n.hf);
    out.names.push_back(n);
  });
  for (const auto& name : set.names()) {
    if (expected.count(name)) continue;
    if (name == "lm_head.weight" && d.tie_embeddings) {  // a tied copy some savers keep: only if it is one
      require(set.at(name).shape == std::vector<std::int64_t>{d.vocab, d.width}, tied_head_differs(where));
      out.tied_copy = true;
      continue;
    }
    throw Error(where + ": unexpected tensor '" + name + "' (not part of the " + d.hf_class() +
                " config.json describes)");
  }
  return out;
}

template <class T>
void read_hf_mamba_values(const HfMambaFolder& f, const std::function<T*(const HfName&)>& dest) {
  const SafetensorsSet& set = f.set;
  if (f.tied_copy) {  // compared a block at a time: memory stays two blocks, whatever the vocabulary
    const auto& head = set.file_of("lm_head.weight");
    const auto& emb = set.file_of("backbone.embeddings.weight");
    const std::size_t n = std::size_t(set.at("lm_head.weight").elements);
    constexpr std::size_t block = 1 << 16;
    std::vector<double> a(std::min(block, n)), b(a.size());
    for (std::size_t i = 0; i < n; i += block) {
      const std::size_t m = std::min(block, n - i);
      head.read("lm_head.weight", a.data(), i, m);
      emb.read("backbone.embeddings.weight", b.data(), i, m);
      // bit for bit (memcmp, not ==): a -0.0 against a 0.0 is no copy, the export could not give it back
      require(std::memcmp(a.data(), b.data(), m * sizeof(double)) == 0, tied_head_differs(f.where));
    }
  }
  for (const auto& n : f.names)
    set.file_of(n.hf).read(n.hf, dest(n), 0, std::size_t(set.at(n.hf).elements));
}
template void read_hf_mamba_values<float>(const HfMambaFolder&, const std::function<float*(const HfName&)>&);
template void read_hf_mamba_values<double>(const HfMambaFolder&, const std::function<double*(const HfName&)>&);

HfMambaModel read_hf_mamba(const std::string& dir) {
  const HfMambaFolder f = open_hf_mamba(dir);
  HfMambaModel out;
  out.config = f.config;
  out.ignored = f.ignored;
  read_hf_mamba_values<double>(f, [&](const HfName& n) {
    HfTensor& t = out.tensors[n.ash];
    t.shape = n.ash_shape;
    t.dtype = f.set.at(n.hf).dtype;
    t.values.resize(std::size_t(count_of(n.ash_shape)));
    return t.values.data();
  });
  return out;
}

void write_hf_mamba(const std::string& dir, const nlohmann::json& ash_config, const HfTensors& tensors,
                    TensorDtype dtype) {
  const MambaDims d = mamba_dims(ash_config, "configuration");
  const std::string where = std::string("writing ") + d.kind() + " folder '" + dir + "'";
  std::vector<TensorToWrite> list;
  for_each_name(d, [&](const HfName& n) {
    const auto it = tensors.find(n.ash);
    require(it != tensors.end(), where + ": tensor '" + n.ash + "' is missing");
    require(it->second.shape == n.ash_shape, where + ": tensor '" + n.ash + "' has shape " + shape_text(it->second.shape) +
                                                 "; the configuration implies " + shape_text(n.ash_shape));
    require(it->second.values.size() == std::size_t(count_of(n.ash_shape)),
            where + ": tensor '" + n.ash + "' holds " + std::to_string(it->second.values.size()) + " values, its shape " +
                std::to_string(count_of(n.ash_shape)));
    list.emplace_back(n.hf, dtype, n.hf_shape, it->second.values);
  });
  if (list.size() != tensors.size()) {
    std::set<std::string> used;
    for_each_name(d, [&](const HfName& n) { used.insert(n.ash); });
    for (const auto& t : tensors)
      require(used.count(t.first), where + ": tensor '" + t.first + "' is not part of this configuration");
  }
  // Both files in a new folder swapped in as one step: never new weights beside an old config.
  io::AtomicFolder folder(dir, {"model.safetensors", "config.json"});
  write_safetensors(folder.path("model.safetensors"), list, torch_metadata());
  write_file_atomically(folder.path("config.json"), ash_config_to_hf_mamba(ash_config, dtype).dump(2) + "\n");
  folder.commit();
}

}  // namespace ash
