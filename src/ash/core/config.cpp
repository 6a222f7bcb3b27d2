#include "ash/core/config.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <utility>
#include <vector>

#include "ash/core/documents.hpp"
#include "ash/core/error.hpp"
#include "ash/core/sizes.hpp"

namespace ash {

nlohmann::json Config::defaults() {
  return nlohmann::json::parse(R"({
    "model": {"vocab": 256, "width": 64, "state": 16, "layers": 2, "seed": 1234, "arch": "ssm-resnet",
              "expand": 2, "conv_kernel": 4, "dt_rank": 0, "tie_embeddings": true, "norm_eps": 1e-5,
              "mixer_rms_eps": 1e-6, "head_dim": 64, "heads": 0, "n_groups": 1, "time_step_limit_min": 0.0,
              "time_step_limit_max": 0.0},
    "data":  {"train": "", "valid_fraction": 0.05, "seq_len": 256, "batch": 4, "sequential": false,
              "carry_state": false, "separator": "", "pack": false},
    "grad":  {"engine": "backprop", "truncate": 0, "detach_inputs": false, "chunk": 64, "wave": 0, "head_chunk": 0,
              "layer_checkpoint": 1, "token_block": 0},
    "optim": {"lr": 0.003, "weight_decay": 0.1, "warmup": 50, "steps": 1000, "clip": 1.0,
              "beta1": 0.9, "beta2": 0.95},
    "run":   {"out_dir": "run", "log_every": 10, "eval_every": 100, "ckpt_every": 200, "precision": "float",
              "storage": "float", "matmul": "fp32"},
    "dist":  {"layer_ranks": 1, "data_ranks": 0, "seq_ranks": 1, "pipeline_blocks": 0}
  })");
}

Config::Config() : j_(defaults()) {}

namespace {

bool same_kind(const nlohmann::json& a, const nlohmann::json& b) {
  if (a.is_number() && b.is_number()) {
    // An integer key must stay integral (3.0 is rejected for model.layers);
    // a float key takes an integer (10 == 10.0).
    if (a.is_number_integer() || a.is_number_unsigned()) return b.is_number_integer() || b.is_number_unsigned();
    return true;
  }
  return a.type() == b.type();
}

void merge_into(nlohmann::json& dst, const nlohmann::json& src, const std::string& prefix,
                const std::string& origin) {
  require(src.is_object(), origin + ": '" + (prefix.empty() ? std::string("<root>") : prefix) +
                               "' must be a JSON object");
  for (auto it = src.begin(); it != src.end(); ++it) {
    const std::string key = prefix.empty() ? it.key() : prefix + "." + it.key();
    require(dst.contains(it.key()), origin + ": unknown config key '" + key + "'");
    auto& d = dst[it.key()];
    if ((key == "grad.layer_checkpoint" || key == "grad.wave" || key == "grad.head_chunk") && it.value() == "auto") {  // integer keys with a named value
      d = 0;
      continue;
    }
    if (d.is_object()) {
      merge_into(d, it.value(), key, origin);
    } else {
      // (dump with replacement: a value that is not valid UTF-8 must not throw from the message)
      require(same_kind(d, it.value()), origin + ": config key '" + key + "' expects a " +
                                            std::string(d.type_name()) + ", got " +
                                            it.value().dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
      if (it.value().is_string()) {  // stored as JSON in checkpoints: it must serialise
        try {
          (void)it.value().dump();
        } catch (const nlohmann::json::exception&) {
          throw Error(origin + ": config key '" + key + "' is not valid UTF-8");
        }
      }
      if (it.value().is_number_float())
        require(std::isfinite(it.value().get<double>()), origin + ": config key '" + key + "' is not finite");
      // A float key stays a float, so a stored 0 compares by value with 0.05
      // on resume instead of turning the key into an integer one.
      if (d.is_number_float())
        d = it.value().get<double>();
      else
        d = it.value();
    }
  }
}

}  // namespace

void Config::merge(const nlohmann::json& doc, const std::string& origin) {
  nlohmann::json tmp = j_;  // all-or-nothing
  merge_into(tmp, doc, "", origin);
  j_ = std::move(tmp);
}

std::size_t json_depth(const std::string& text) {
  std::size_t depth = 0, deepest = 0;
  bool in_string = false, escaped = false;
  for (const char c : text) {
    if (in_string) {
      if (escaped)
        escaped = false;
      else if (c == '\\')
        escaped = true;
      else if (c == '"')
        in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '{' || c == '[') {
      deepest = std::max(deepest, ++depth);
    } else if ((c == '}' || c == ']') && depth > 0) {
      --depth;
    }
  }
  return deepest;
}

namespace {

// nlohmann's SAX events built into a document, as its own DOM parser does, with
// a duplicate key an error at the key. Not parse() with a callback: that parser
// rescans the parent object at every object's end, quadratic in the members of
// one object (a 200,000-tensor safetensors header took over a minute). Each
// event is O(log n) (the key lookup); the nesting is bounded before parsing.
class StrictDocument {
 public:
  using json = nlohmann::json;
  StrictDocument(json& root, const std::string& origin) : root_(root), origin_(origin) {}

  bool null() { return put(json(nullptr)); }
  bool boolean(bool v) { return put(json(v)); }
  bool number_integer(json::number_integer_t v) { return put(json(v)); }
  bool number_unsigned(json::number_unsigned_t v) { return put(json(v)); }
  bool number_float(json::number_float_t v, const json::string_t&) { return put(json(v)); }
  bool string(json::string_t& v) { return put(json(std::move(v))); }
  bool binary(json::binary_t& v) { return put(json::binary(std::move(v))); }  // not in JSON text
  bool start_object(std::size_t) { return open(json::value_t::object); }
  bool start_array(std::size_t) { return open(json::value_t::array); }
  bool end_object() { return close(); }
  bool end_array() { return close(); }
  bool key(json::string_t& k) {
    auto& members = open_.back()->get_ref<json::object_t&>();
    const auto it = members.find(k);
    require(it == members.end(), origin_ + ": duplicate key '" + k + "'");  // nlohmann would keep the last
    member_ = &members.emplace(std::move(k), nullptr).first->second;
    return true;
  }
  bool parse_error(std::size_t, const std::string&, const nlohmann::json::exception& e) {
    throw Error(origin_ + " is not valid JSON: " + e.what());
  }

 private:
  // A value where the parser is: the root, the next element of the open array,
  // or the member whose key came last. Pointers on the stack stay valid: an open
  // container's parent gets no other element until it closes.
  json* place(json&& v) {
    if (open_.empty()) {
      root_ = std::move(v);
      return &root_;
    }
    if (open_.back()->is_array()) {
      auto& elements = open_.back()->get_ref<json::array_t&>();
      elements.push_back(std::move(v));
      return &elements.back();
    }
    *member_ = std::move(v);
    return member_;
  }
  bool put(json&& v) {
    (void)place(std::move(v));
    return true;
  }
  bool open(json::value_t t) {
    open_.push_back(place(json(t)));
    return true;
  }
  bool close() {
    open_.pop_back();
    return true;
  }
  json& root_;
  const std::string& origin_;
  std::vector<json*> open_;
  json* member_ = nullptr;
};

}  // namespace

nlohmann::json parse_json_strict(const std::string& text, const std::string& origin) {
  // RFC 8259 forbids a byte order mark; nlohmann would skip it, Python's json
  // (and so transformers reading config.json) refuses it.
  require(text.compare(0, 3, "\xEF\xBB\xBF") != 0,
          origin + " is not valid JSON: it starts with a UTF-8 byte order mark");
  // nlohmann's lexer takes a NUL byte for the end of the input and would ignore
  // what follows; JSON text holds none (in a string it is written \u0000).
  const auto nul = text.find('\0');
  require(nul == std::string::npos,
          origin + " is not valid JSON: a NUL byte at offset " + std::to_string(nul) + " (JSON text holds none)");
  // The document's destructor recurses per level: bound the nesting before
  // parsing (the keys of §4 are 2 levels deep).
  const std::size_t depth = json_depth(text);
  require(depth <= max_json_depth, origin + " is nested " + std::to_string(depth) + " levels deep (at most " +
                                       std::to_string(max_json_depth) + ")");
  nlohmann::json doc;
  StrictDocument sax(doc, origin);
  // strict: anything after the document but whitespace is an error (parse_error above).
  const bool parsed = nlohmann::json::sax_parse(text, &sax, nlohmann::json::input_format_t::json, true);
  require(parsed, origin + " is not valid JSON");  // every event above returns true or throws
  return doc;
}

void Config::merge_file(const std::string& path) {
  // A regular file of bounded size: /dev/zero or a FIFO would be read forever.
  std::error_code ec;
  const auto st = std::filesystem::status(path, ec);
  require(!ec && std::filesystem::exists(st), "cannot open config file '" + path + "'");
  require(std::filesystem::is_regular_file(st), "config file '" + path + "' is not a regular file");
  const auto size = std::filesystem::file_size(path, ec);
  require(!ec && size <= max_config_bytes, "config file '" + path + "' is " + std::to_string(size) +
                                               " bytes; a configuration is at most " +
                                               std::to_string(max_config_bytes));
  std::ifstream in(path, std::ios::binary);
  require(in.good(), "cannot open config file '" + path + "'");
  std::string text;
  try {  // libstdc++ reports a read error (EIO) by throwing from the stream buffer
    text.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  } catch (const std::ios_base::failure& e) {
    throw Error("error while reading config file '" + path + "': " + e.code().message());
  }
  merge(parse_json_strict(text, "config file '" + path + "'"), path);
}

void Config::set(const std::string& assignment) {
  const auto eq = assignment.find('=');
  require(eq != std::string::npos && eq > 0, "--set expects key=value, got '" + assignment + "'");
  const std::string key = assignment.substr(0, eq);
  const std::string text = assignment.substr(eq + 1);
  // Valid JSON is parsed strictly (duplicate keys are an error); anything
  // else is a bare string, which needs no quotes.
  // A value in double quotes is a JSON string and must parse as one (an
  // invalid escape is an error, not a bare string with quotes in it);
  // data.separator's bare value is a JSON string's contents ("\n%\n" works
  // unquoted too).
  const bool quoted = !text.empty() && text.front() == '"';
  nlohmann::json value;
  if (json_depth(text) > max_json_depth || nlohmann::json::accept(text) || quoted) {
    value = parse_json_strict(text, "--set " + key);
  } else if (key == "data.separator") {
    value = parse_json_strict("\"" + text + "\"", "--set " + key);
  } else {
    value = nlohmann::json(text);
  }
  // Build {"a": {"b": value}} and merge it, so the same key/type checks apply.
  // Every key is section.name: a longer dotted path is refused before it is
  // split (a key of 60,000 parts would build 60,000 nested objects).
  const auto dots = std::count(key.begin(), key.end(), '.');
  require(dots <= 1, "--set " + key.substr(0, 80) + (key.size() > 80 ? "..." : "") + ": unknown config key (" +
                         std::to_string(dots + 1) + " dotted parts; keys are section.name, e.g. model.width)");
  nlohmann::json doc = value;
  std::vector<std::string> parts;
  std::stringstream ss(key);
  for (std::string p; std::getline(ss, p, '.');) parts.push_back(p);
  for (auto it = parts.rbegin(); it != parts.rend(); ++it) doc = nlohmann::json{{*it, doc}};
  merge(doc, "--set " + key);
}

void Config::reset_section(const std::string& section) {
  const auto d = defaults();
  require(d.contains(section), "unknown config section '" + section + "'");
  j_[section] = d[section];
}

const nlohmann::json& Config::at(const std::string& dotted) const {
  const nlohmann::json* node = &j_;
  std::stringstream ss(dotted);
  for (std::string p; std::getline(ss, p, '.');) {
    require(node->is_object() && node->contains(p), "unknown config key '" + dotted + "'");
    node = &(*node)[p];
  }
  return *node;
}

ModelDims Config::model() const {
  ModelDims d;
  d.vocab = get<std::int64_t>("model.vocab");
  d.width = get<std::int64_t>("model.width");
  d.state = get<std::int64_t>("model.state");
  d.layers = get<std::int64_t>("model.layers");
  d.seed = get<std::uint64_t>("model.seed");
  d.arch = parse_arch(get<std::string>("model.arch"));
  d.expand = get<std::int64_t>("model.expand");
  d.conv_kernel = get<std::int64_t>("model.conv_kernel");
  d.dt_rank = get<std::int64_t>("model.dt_rank");
  d.tie_embeddings = get<bool>("model.tie_embeddings");
  d.norm_eps = get<double>("model.norm_eps");
  d.mixer_rms_eps = get<double>("model.mixer_rms_eps");
  d.head_dim = get<std::int64_t>("model.head_dim");
  d.heads = get<std::int64_t>("model.heads");
  d.n_groups = get<std::int64_t>("model.n_groups");
  d.time_step_limit_min = get<double>("model.time_step_limit_min");
  d.time_step_limit_max = get<double>("model.time_step_limit_max");
  return d;
}

nlohmann::json Config::stored_json() const {
  // An SSM-ResNet's stored configuration is what it was before model.arch
  // existed (its Mamba keys are the defaults, check_model_dims), so its files
  // stay byte for byte what they were; a file without the keys loads as
  // ssm-resnet.
  // Likewise a Mamba's leaves out the FalconMamba key (its files are as before that key).
  const ModelDims d = model();
  nlohmann::json j = j_;
  if (!d.mixer_norms()) j["model"].erase("mixer_rms_eps");
  if (!d.mamba2())
    for (const char* k : mamba2_model_keys) j["model"].erase(k);
  if (d.mamba()) return j;
  for (const char* k : mamba_model_keys) j["model"].erase(k);
  j["model"].erase("arch");
  return j;
}

std::string arch_name(Arch a) {
  return a == Arch::mamba ? "mamba" : a == Arch::falcon_mamba ? "falcon_mamba" : a == Arch::mamba2 ? "mamba2" : "ssm-resnet";
}

Arch parse_arch(const std::string& s) {
  if (s == "ssm-resnet") return Arch::ssm_resnet;
  if (s == "mamba") return Arch::mamba;
  if (s == "falcon_mamba") return Arch::falcon_mamba;
  if (s == "mamba2") return Arch::mamba2;
  throw Error("model.arch must be ssm-resnet, mamba, falcon_mamba or mamba2 (got '" + s + "')");
}

std::string method_name(Method m) {
  return m == Method::adjoint ? "adjoint" : m == Method::adjoint_exact ? "adjoint-exact" : "backprop";
}

Method parse_method(const std::string& s) {
  if (s == "backprop") return Method::backprop;
  if (s == "adjoint") return Method::adjoint;
  if (s == "adjoint-exact") return Method::adjoint_exact;
  throw Error("grad.engine must be backprop, adjoint or adjoint-exact (got '" + s + "')");
}

Storage parse_storage(const std::string& s) {
  if (s == "float") return Storage::full;
  if (s == "bf16") return Storage::bf16;
  if (s == "fp16") return Storage::fp16;
  throw Error("run.storage must be float, bf16 or fp16 (got '" + s + "')");
}

std::string storage_name(Storage s) {
  return s == Storage::bf16 ? "bf16" : s == Storage::fp16 ? "fp16" : "float";
}

Matmul parse_matmul(const std::string& s) {
  if (s == "fp32") return Matmul::fp32;
  if (s == "tf32") return Matmul::tf32;
  if (s == "bf16") return Matmul::bf16;
  throw Error("run.matmul must be fp32, tf32 or bf16 (got '" + s + "')");
}

std::string matmul_name(Matmul m) { return m == Matmul::tf32 ? "tf32" : m == Matmul::bf16 ? "bf16" : "fp32"; }

EngineOptions EngineOptions::from_config(const Config& cfg) { return cfg.settings().grad; }
AdamWOptions AdamWOptions::from_config(const Config& cfg) { return cfg.settings().optim; }

// data.separator names bytes: each character of the JSON string, U+0000 to U+00FF,
// is that byte value ("\u00dd" is the byte 0xDD, not its UTF-8 encoding C3 9D).
std::string separator_bytes(const std::string& utf8) {
  std::string out;
  for (std::size_t i = 0; i < utf8.size();) {
    const auto c = static_cast<unsigned char>(utf8[i]);
    const int len = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xE ? 3 : (c >> 3) == 0x1E ? 4 : 0;
    require(len > 0 && i + std::size_t(len) <= utf8.size(), "data.separator is not valid UTF-8 text");
    std::uint32_t cp = len == 1 ? c : c & (0x3F >> (len - 1));
    for (int k = 1; k < len; ++k) {
      const auto cc = static_cast<unsigned char>(utf8[i + std::size_t(k)]);
      require((cc >> 6) == 0x2, "data.separator is not valid UTF-8 text");
      cp = (cp << 6) | (cc & 0x3F);
    }
    char hex[16];
    std::snprintf(hex, sizeof hex, "U+%04X", unsigned(cp));
    require(cp <= 0xFF, std::string("data.separator holds the character ") + hex +
                            ", which is not a byte: it names bytes, \\u0000 to \\u00ff (one character each)");
    out.push_back(static_cast<char>(cp));
    i += std::size_t(len);
  }
  return out;
}

DataOptions Config::data_options() const {
  DataOptions da;
  da.train = get<std::string>("data.train");
  da.valid_fraction = get<double>("data.valid_fraction");
  da.seq_len = get<std::int64_t>("data.seq_len");
  da.batch = get<std::int64_t>("data.batch");
  da.sequential = get<bool>("data.sequential");
  da.carry_state = get<bool>("data.carry_state");
  da.separator = separator_bytes(get<std::string>("data.separator"));
  da.pack = get<bool>("data.pack");
  require(da.seq_len >= 2, "data.seq_len must be >= 2: a window of T tokens has T-1 targets (got " +
                               std::to_string(da.seq_len) + ")");
  require(da.batch >= 1, "data.batch must be >= 1 (got " + std::to_string(da.batch) + ")");
  require(da.valid_fraction >= 0.0 && da.valid_fraction < 1.0, "data.valid_fraction must be in [0, 1)");
  check_separator(da.separator.size(), da.seq_len, da.pack);
  return da;
}

EngineOptions Config::engine_options(const ModelDims& d, const DataOptions& da) const {
  EngineOptions g;
  g.truncate = get<std::int64_t>("grad.truncate");
  g.detach_inputs = get<bool>("grad.detach_inputs");
  g.chunk = get<std::int64_t>("grad.chunk");
  g.wave = get<std::int64_t>("grad.wave");
  g.head_chunk = get<std::int64_t>("grad.head_chunk");
  g.token_block = get<std::int64_t>("grad.token_block");
  g.carry_state = da.carry_state;
  check_grad_numbers(g);
  g.method = parse_method(get<std::string>("grad.engine"));
  g.storage = parse_storage(get<std::string>("run.storage"));
  g.matmul = parse_matmul(get<std::string>("run.matmul"));
  const auto m = get<std::int64_t>("grad.layer_checkpoint");
  g.layer_checkpoint = resolve_layer_checkpoint(m, d.layers);  // checks m >= 0
  require(g.token_block >= 0, "grad.token_block must be >= 0 (0: 4096 tokens)");
  require(!da.carry_state || da.sequential,
          "data.carry_state needs data.sequential = true: a carried state continues the same stream");
  return g;
}

RunOptions Config::run_options() const {
  RunOptions r;
  const auto prec = get<std::string>("run.precision");
  require(prec == "float" || prec == "double", "run.precision must be float or double (got '" + prec + "')");
  r.double_precision = prec == "double";
  r.out_dir = get<std::string>("run.out_dir");
  r.log_every = get<std::int64_t>("run.log_every");
  r.eval_every = get<std::int64_t>("run.eval_every");
  r.ckpt_every = get<std::int64_t>("run.ckpt_every");
  for (const char* k : {"run.log_every", "run.eval_every", "run.ckpt_every"})
    require(get<std::int64_t>(k) >= 0, std::string(k) + " must be >= 0, got " + std::to_string(get<std::int64_t>(k)));
  return r;
}

AdamWOptions Config::adamw_options() const {
  AdamWOptions o;
  o.lr = get<double>("optim.lr");
  o.weight_decay = get<double>("optim.weight_decay");
  o.beta1 = get<double>("optim.beta1");
  o.beta2 = get<double>("optim.beta2");
  o.clip = get<double>("optim.clip");
  o.warmup = get<std::int64_t>("optim.warmup");
  o.steps = get<std::int64_t>("optim.steps");
  require(o.steps >= 0 && o.warmup >= 0, "optim.steps and optim.warmup must be >= 0");
  require(o.lr > 0, "optim.lr must be > 0");
  require(o.beta1 >= 0 && o.beta1 < 1 && o.beta2 >= 0 && o.beta2 < 1, "optim.beta1 and optim.beta2 must be in [0, 1)");
  require(o.clip >= 0, "optim.clip must be >= 0 (0: no clipping)");
  require(o.weight_decay >= 0, "optim.weight_decay must be >= 0");
  return o;
}

DistOptions Config::dist_options(const ModelDims& d) const {
  DistOptions ds;
  ds.layer_ranks = get<std::int64_t>("dist.layer_ranks");
  ds.seq_ranks = get<std::int64_t>("dist.seq_ranks");
  ds.data_ranks = get<std::int64_t>("dist.data_ranks");
  ds.pipeline_blocks = get<std::int64_t>("dist.pipeline_blocks");
  require(ds.layer_ranks >= 1 && ds.seq_ranks >= 1, "dist.layer_ranks and dist.seq_ranks must be >= 1");
  for (const auto& [key, v] : {std::pair<const char*, index_t>{"dist.layer_ranks", ds.layer_ranks},
                               {"dist.seq_ranks", ds.seq_ranks}, {"dist.data_ranks", ds.data_ranks}})
    require(v <= max_ranks, std::string(key) + " must be at most " + std::to_string(max_ranks) +
                                " (a count of MPI ranks), got " + std::to_string(v));
  require(ds.data_ranks >= 0, "dist.data_ranks must be >= 0 (0: world size / (layer_ranks · seq_ranks))");
  require(ds.pipeline_blocks >= 0, "dist.pipeline_blocks must be >= 0 (0: 4 token blocks per layer rank)");
  require(ds.layer_ranks <= d.layers, "dist.layer_ranks (" + std::to_string(ds.layer_ranks) +
                                          ") must not exceed model.layers (" + std::to_string(d.layers) + ")");
  return ds;
}

Settings Config::settings() const {
  Settings st;
  const auto d = st.model = model();
  check_model_dims(d);
  st.data = data_options();
  st.grad = engine_options(d, st.data);
  st.run = run_options();
  st.optim = adamw_options();
  st.dist = dist_options(d);
  // Every product of sizes the tool will form, overflow-checked before any
  // allocation (docs/design.md §7); the memory limit itself is checked by the
  // caller, who knows the workload and precision (ash/plan/memory_plan.hpp).
  check_size_products(d, st.data.batch, st.data.seq_len);
  return st;
}

}  // namespace ash
