// adjoint_sharding._core: the library's Python binding (nanobind). Stateless
// functions: parameters cross as dicts of numpy arrays (copied into a
// ParamSet per call: O(parameters)); the per-token arrays of the layer stack
// (y_0, y_K, g: O(B·T·P)) cross without copies, as views of the caller's
// buffer (numpy through the buffer protocol, torch through DLPack).
// No Kokkos object outlives a call, so Kokkos can be finalised at exit
// (docs/python.md).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "ash/ash.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

static_assert(Kokkos::SpaceAccessibility<Kokkos::HostSpace, ash::MemSpace>::accessible,
              "the Python binding needs a host-accessible Kokkos memory space (Serial, OpenMP, Threads)");

bool g_we_initialized = false;

bool kokkos_finalized() {
#if KOKKOS_VERSION >= 30700
  return Kokkos::is_finalized();
#else
  return false;  // Kokkos 3.4-3.6 cannot say; this module finalises only what it started, once
#endif
}

void finalize_kokkos() {
  if (g_we_initialized && Kokkos::is_initialized() && !kokkos_finalized()) Kokkos::finalize();
  g_we_initialized = false;
}

template <class S>
using Array = nb::ndarray<nb::numpy, S>;

// A numpy array (owned by Python) holding a copy of `n` values at src with `shape`.
template <class S>
nb::object to_numpy(const S* src, const std::vector<std::int64_t>& shape) {
  std::size_t n = 1;
  std::vector<std::size_t> sh;
  for (auto d : shape) {
    n *= std::size_t(d);
    sh.push_back(std::size_t(d));
  }
  S* buf = new S[n > 0 ? n : 1];
  if (n) std::memcpy(buf, src, n * sizeof(S));
  nb::capsule owner(buf, [](void* p) noexcept { delete[] static_cast<S*>(p); });
  return nb::cast(Array<S>(buf, sh.size(), sh.data(), owner));
}

template <class S>
nb::dict paramset_to_dict(const ash::ParamSet<S>& ps) {
  nb::dict out;
  Kokkos::fence();
  for (const auto& t : ps.tensors()) out[t.name.c_str()] = to_numpy<S>(ps.data().data() + t.offset, t.shape);
  return out;
}

// Copies every tensor of ps's layout from `params` (a mapping name -> array of
// that shape; any float dtype, converted by numpy on the Python side).
template <class S>
void dict_to_paramset(const nb::dict& params, const ash::ParamSet<S>& ps) {
  for (const auto& t : ps.tensors()) {
    ash::require(params.contains(t.name.c_str()), "parameter '" + t.name + "' is missing");
    nb::ndarray<S, nb::c_contig, nb::device::cpu> a;
    ash::require(nb::try_cast(params[t.name.c_str()], a),
                 "parameter '" + t.name + "' must be a C-contiguous " + (sizeof(S) == 8 ? "float64" : "float32") +
                     " CPU array");
    std::string want = "[", got = "[";
    bool same = a.ndim() == t.shape.size();
    for (std::size_t i = 0; i < t.shape.size(); ++i) {
      want += (i ? ", " : "") + std::to_string(t.shape[i]);
      if (same && std::int64_t(a.shape(i)) != t.shape[i]) same = false;
    }
    for (std::size_t i = 0; i < a.ndim(); ++i) got += (i ? ", " : "") + std::to_string(a.shape(i));
    ash::require(same, "parameter '" + t.name + "' has shape " + got + "], expected " + want + "]");
    if (t.size()) std::memcpy(ps.data().data() + t.offset, a.data(), std::size_t(t.size()) * sizeof(S));
  }
}

using Ids = nb::ndarray<const std::uint32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
std::vector<std::uint32_t> ids_of(const Ids& a) { return std::vector<std::uint32_t>(a.data(), a.data() + a.shape(0)); }


// Keyword options of grad(): the same keys `ash grad` sets.
struct GradOptions {
  std::int64_t seq_len = 0, batch = 1;
  std::string engine = "adjoint-exact";
  std::int64_t truncate = 0;
  bool detach_inputs = false;
  std::string storage;                        // "" : the checkpoint's run.storage
  std::optional<std::int64_t> layer_checkpoint;  // none: the checkpoint's (any value is checked as --set)
  std::optional<std::int64_t> token_block;
  std::vector<std::string> sets;      // extra key=value assignments (--set)
};

template <class S>
std::pair<double, nb::dict> grad_impl(const std::string& ckpt, const std::vector<std::uint32_t>& tokens,
                                      const ash::Config& cfg, std::size_t) {
  const ash::Settings st = cfg.settings();
  ash::require_mamba_supported(st);
  ash::check_memory(st, ash::Workload::grad, sizeof(S), 0);
  const auto x = ash::first_windows(tokens, st);  // as `ash grad` cuts them
  const auto params = ash::load_checkpoint<S>(ckpt);
  ash::ParamSet<S> grad(st.model);
  auto engine = ash::make_engine<S>(st.grad);
  double loss;
  {
    nb::gil_scoped_release nogil;
    loss = engine->compute(params, x, grad);
    Kokkos::fence();
  }
  ash::require(std::isfinite(loss), "the loss is not finite (" + std::to_string(loss) + "): nothing written");
  return {loss, paramset_to_dict(grad)};
}

std::pair<double, nb::dict> grad(const std::string& ckpt, const Ids& tokens,
                                 const GradOptions& o, const std::string& precision) {
  const ash::CheckpointInfo info = ash::inspect_checkpoint(ckpt);
  ash::Config cfg = ash::checkpoint_run_config(info.config, o.sets);
  cfg.merge(nlohmann::json{{"grad", {{"engine", o.engine}}}}, "--engine");
  cfg.set("data.seq_len=" + std::to_string(o.seq_len));
  cfg.set("data.batch=" + std::to_string(o.batch));
  cfg.set("grad.truncate=" + std::to_string(o.truncate));
  if (o.detach_inputs) cfg.set("grad.detach_inputs=true");
  if (!o.storage.empty()) cfg.set("run.storage=" + o.storage);
  if (o.layer_checkpoint) cfg.set("grad.layer_checkpoint=" + std::to_string(*o.layer_checkpoint));
  if (o.token_block) cfg.set("grad.token_block=" + std::to_string(*o.token_block));
  const std::string prec = precision.empty() ? info.precision : precision;
  ash::require(prec == "float" || prec == "double", "precision must be 'float' or 'double', got '" + prec + "'");
  return prec == "float" ? grad_impl<float>(ckpt, ids_of(tokens), cfg, 4) : grad_impl<double>(ckpt, ids_of(tokens), cfg, 8);
}

// {config (JSON text), precision, step, data_cursor, params}
nb::dict load(const std::string& path) {
  ash::CheckpointInfo info = ash::inspect_checkpoint(path);
  nb::dict out;
  out["config"] = info.config.json().dump();
  out["precision"] = info.precision;
  out["step"] = info.step;
  out["data_cursor"] = info.data_cursor;
  if (info.precision == "float")
    out["params"] = paramset_to_dict(ash::load_checkpoint<float>(path));
  else
    out["params"] = paramset_to_dict(ash::load_checkpoint<double>(path));
  return out;
}

template <class S>
void save_impl(const std::string& path, const ash::Config& cfg, const nb::dict& params, std::int64_t step) {
  ash::ParamSet<S> ps(cfg.model());
  dict_to_paramset(params, ps);
  ash::save_checkpoint(path, cfg, ps, step);
}

// A configuration dict's JSON over the defaults, parsed and validated as `ash --config`.
ash::Config config_from(const std::string& config_json) { return ash::train_config(nullptr, "", config_json, {}); }

void save(const std::string& path, const std::string& config_json, const nb::dict& params,
          const std::string& precision, std::int64_t step) {
  const ash::Config cfg = config_from(config_json);
  ash::require(precision == "float" || precision == "double",
               "precision must be 'float' or 'double', got '" + precision + "'");
  if (precision == "float")
    save_impl<float>(path, cfg, params, step);
  else
    save_impl<double>(path, cfg, params, step);
}



nb::dict init_params(const std::string& config_json, const std::string& precision) {
  const ash::Config cfg = config_from(config_json);
  ash::require(precision == "float" || precision == "double",
               "precision must be 'float' or 'double', got '" + precision + "'");
  ash::check_memory(cfg, ash::Workload::init, precision == "float" ? 4 : 8, 0);  // as `ash init`
  if (precision == "float") {
    ash::ParamSet<float> ps(cfg.model());
    ash::initialize(ps, cfg.model().seed);
    return paramset_to_dict(ps);
  }
  ash::ParamSet<double> ps(cfg.model());
  ash::initialize(ps, cfg.model().seed);
  return paramset_to_dict(ps);
}

// Loss over consecutive windows of a token array (`ash eval`): (nats/token, bits/token, targets).
template <class S>
std::tuple<double, double, std::int64_t> evaluate_impl(const std::string& ckpt, const std::vector<std::uint32_t>& ids,
                                                       std::int64_t T, std::int64_t B, const ash::Config& cfg) {
  const auto params = ash::load_checkpoint<S>(ckpt);
  ash::require(ids.size() >= 2, "the token array has " + std::to_string(ids.size()) + " token(s): nothing to predict");
  ash::EvalTotals tot;
  {
    nb::gil_scoped_release nogil;
    const auto st = cfg.settings();
    const auto document = ash::document_starts(ids, st.data.separator);  // as `ash eval`
    tot = ash::evaluate_windows(params, ids, T, B, st.grad.head_chunk, {}, document.documents());
  }
  return {tot.nats / double(tot.targets), tot.bits_per_token(), std::int64_t(tot.targets)};
}

std::tuple<double, double, std::int64_t> evaluate(const std::string& ckpt, const Ids& tokens,
                                                  std::int64_t seq_len, std::int64_t batch,
                                                  const std::string& precision) {
  const ash::CheckpointInfo info = ash::inspect_checkpoint(ckpt);
  ash::Config cfg = ash::checkpoint_run_config(
      info.config, {"data.seq_len=" + std::to_string(seq_len), "data.batch=" + std::to_string(batch)});
  cfg.validate();
  const std::string prec = precision.empty() ? info.precision : precision;
  ash::require(prec == "float" || prec == "double", "precision must be 'float' or 'double', got '" + prec + "'");
  const auto ids = ids_of(tokens);
  return prec == "float" ? evaluate_impl<float>(ckpt, ids, seq_len, batch, cfg)
                         : evaluate_impl<double>(ckpt, ids, seq_len, batch, cfg);
}

// A FILE* whose lines go to a Python callable (train's progress).
struct LineSink {
  nb::object callback;
  std::string pending;
  bool failed = false;
  std::optional<nb::python_error> error;  // the callback's exception, re-raised after train
};

ssize_t sink_write(void* cookie, const char* buf, size_t size) {
  auto* s = static_cast<LineSink*>(cookie);
  s->pending.append(buf, size);
  std::size_t nl;
  while ((nl = s->pending.find('\n')) != std::string::npos) {
    const std::string line = s->pending.substr(0, nl);
    s->pending.erase(0, nl + 1);
    if (s->failed || !s->callback.is_valid() || s->callback.is_none()) continue;
    nb::gil_scoped_acquire gil;
    try {
      s->callback(line);
    } catch (nb::python_error& e) {
      s->failed = true;
      s->error.emplace(e);
    }
  }
  return ssize_t(size);
}

nb::dict train(const std::string& config_json, nb::object progress, const std::string& resume, std::int64_t until) {
  ash::Config cfg = config_from(config_json);
  if (!resume.empty()) {
    const ash::Config resumed = ash::inspect_checkpoint(resume).config;
    cfg = ash::train_config(&resumed, "", config_json, {});
  }
  ash::check_memory(cfg, ash::Workload::train, cfg.settings().run.scalar_bytes(), 0);
  LineSink sink{progress};
  cookie_io_functions_t fns{nullptr, sink_write, nullptr, nullptr};
  std::FILE* log = fopencookie(&sink, "w", fns);
  ash::require(log != nullptr, "train: cannot open the progress stream");
  std::setvbuf(log, nullptr, _IOLBF, 0);
  ash::TrainSummary s;
  try {
    nb::gil_scoped_release nogil;
    s = ash::train(cfg, resume, log, until);
  } catch (...) {
    std::fclose(log);
    throw;
  }
  std::fclose(log);
  if (sink.error) throw nb::python_error(*sink.error);
  nb::dict out;
  out["first_step"] = s.first_step;
  out["last_step"] = s.last_step;
  out["last_loss"] = s.last_loss;
  out["val_loss"] = s.val_loss;
  out["val_bits"] = s.val_bits;
  out["uniform_bits"] = s.uniform_bits;
  out["unigram_bits"] = s.unigram_bits;
  out["checkpoint"] = s.checkpoint;
  out["peak_bytes"] = s.peak_bytes;
  out["signal"] = s.signal;
  return out;
}

std::vector<std::uint32_t> generate(const std::string& ckpt, const Ids& prompt_ids, std::int64_t n,
                                    double temperature, std::uint64_t seed) {
  const auto prompt = ids_of(prompt_ids);
  ash::require(!prompt.empty(), "--prompt must not be empty");
  ash::require(n >= 0 && n <= ash::max_generate_tokens,
               "n must be in [0, 2^30] (ash generate --tokens), got " + std::to_string(n));
  ash::require(std::isfinite(temperature) && temperature >= 0,
               "--temperature must be a finite number >= 0 (0: greedy), got " + std::to_string(temperature));
  ash::CheckpointInfo info;
  const auto params = ash::load_checkpoint<double>(ckpt, &info);
  for (auto v : prompt)
    ash::require(std::int64_t(v) < info.dims.vocab,
                 "prompt token " + std::to_string(v) + " >= vocab " + std::to_string(info.dims.vocab));
  std::vector<std::uint32_t> out;
  nb::gil_scoped_release nogil;
  ash::Generator<double> gen(params);
  gen.feed(prompt);
  std::mt19937_64 rng(seed);
  for (std::int64_t i = 0; i < n; ++i) out.push_back(gen.sample(temperature, rng));
  return out;
}

nb::dict plan(const std::string& config_json, const std::string& workload, const std::string& precision) {
  const ash::Config cfg = config_from(config_json);
  ash::require(workload == "train" || workload == "grad", "workload must be 'train' or 'grad', got '" + workload + "'");
  const std::string prec = precision.empty() ? cfg.settings().run.precision() : precision;
  ash::require(prec == "float" || prec == "double", "precision must be 'float' or 'double', got '" + prec + "'");
  const auto p = ash::plan_memory(cfg.settings(), workload == "train" ? ash::Workload::train : ash::Workload::grad,
                                  prec == "double" ? 8 : 4);
  nb::dict items;
  for (const auto& it : p.items) items[it.name.c_str()] = it.bytes;
  const auto cap = ash::memory_space_capacity();
  nb::dict out;
  out["engine"] = p.engine;
  out["phase"] = p.phase;
  out["items"] = items;
  out["total"] = p.total();
  out["capacity"] = cap.bytes;
  out["capacity_what"] = cap.what;
  out["table"] = p.table("  ");
  return out;
}

// ---- the layer stack (StackAdjoint) ---------------------------------------

struct StackOptions {
  std::int64_t vocab = 256, width = 0, state = 0, layers = 0;
  bool detach_inputs = false;
  std::int64_t truncate = 0, chunk = 64, layer_checkpoint = 1, token_block = 0;
  std::string storage = "float";
};

// The stack's options as a configuration, so that every one is checked as `ash grad`
// checks it (sizes included: no narrowing of a layer count past 2^31, no negative width).
ash::Config stack_config(const StackOptions& o, std::int64_t T) {
  ash::Config cfg;
  cfg.set("model.vocab=" + std::to_string(o.vocab));
  cfg.set("model.width=" + std::to_string(o.width));
  cfg.set("model.state=" + std::to_string(o.state));
  cfg.set("model.layers=" + std::to_string(o.layers));
  cfg.set("data.seq_len=" + std::to_string(T < 2 ? 2 : T));
  cfg.set("data.batch=1");
  cfg.set("grad.engine=adjoint-exact");
  cfg.set("grad.truncate=" + std::to_string(o.truncate));
  cfg.set("grad.chunk=" + std::to_string(o.chunk));
  cfg.set(std::string("grad.detach_inputs=") + (o.detach_inputs ? "true" : "false"));
  cfg.set("grad.layer_checkpoint=" + std::to_string(o.layer_checkpoint));
  cfg.set("grad.token_block=" + std::to_string(o.token_block));
  cfg.set("run.storage=" + o.storage);
  cfg.validate();
  return cfg;
}

ash::ModelDims stack_dims(const StackOptions& o) { return stack_config(o, 2).model(); }
ash::EngineOptions stack_engine(const StackOptions& o, std::int64_t T) { return stack_config(o, T).settings().grad; }

template <class S>
using Tensor3 = nb::ndarray<S, nb::ndim<3>, nb::c_contig, nb::device::cpu>;

template <class S>
ash::View2<S> rows_view(const Tensor3<S>& a) {
  return ash::View2<S>(const_cast<S*>(a.data()), a.shape(0) * a.shape(1), a.shape(2));
}

template <class S>
void check_shape(const Tensor3<S>& a, const char* what, std::size_t B, std::size_t T, std::size_t P) {
  ash::require(a.shape(0) == B && a.shape(1) == T && a.shape(2) == P,
               std::string(what) + " has shape [" + std::to_string(a.shape(0)) + ", " + std::to_string(a.shape(1)) +
                   ", " + std::to_string(a.shape(2)) + "], expected [" + std::to_string(B) + ", " +
                   std::to_string(T) + ", " + std::to_string(P) + "]");
}

// The shape of y0 [B, T, P] with document starts from cu_seqlens (flat offsets
// b·T + t of the B·T rows, docs/design.md §1; empty: none).
ash::SeqShape stack_shape(std::int64_t B, std::int64_t T, const std::vector<std::int64_t>& cu_seqlens) {
  ash::SeqShape s{ash::index_t(B), ash::index_t(T)};
  if (cu_seqlens.empty()) return s;
  Kokkos::View<ash::index_t*, ash::MemSpace> starts("ash::py::cu_seqlens", cu_seqlens.size());
  auto h = Kokkos::create_mirror_view(starts);
  for (std::size_t i = 0; i < cu_seqlens.size(); ++i) h(i) = ash::index_t(cu_seqlens[i]);
  Kokkos::deep_copy(starts, h);
  const ash::TokenView x("ash::py::document_starts", B, T);
  ash::set_document_starts(x, starts);
  s.docs = ash::DocStarts(x);
  return s;
}

template <class S>
void stack_forward(const nb::dict& params, const StackOptions& o, Tensor3<S> y0, Tensor3<S> yK,
                   const std::vector<std::int64_t>& cu_seqlens) {
  const auto d = stack_dims(o);
  ash::require(std::int64_t(y0.shape(2)) == d.width, "y0's last dimension is " + std::to_string(y0.shape(2)) +
                                                         ", expected the width P = " + std::to_string(d.width));
  check_shape(yK, "yK", y0.shape(0), y0.shape(1), y0.shape(2));
  ash::require(y0.data() != yK.data(), "yK must not be y0");
  const ash::SeqShape s = stack_shape(y0.shape(0), y0.shape(1), cu_seqlens);
  ash::StackAdjoint<S> stack(stack_engine(o, s.T));
  ash::ParamSet<S> ps(d, ash::StackAdjoint<S>::range(d));
  dict_to_paramset(params, ps);
  nb::gil_scoped_release nogil;
  stack.forward(ps, s, rows_view(y0), rows_view(yK));
  Kokkos::fence();
}

template <class S>
nb::dict stack_backward(const nb::dict& params, const StackOptions& o, Tensor3<S> y0, Tensor3<S> g,
                        const std::vector<std::int64_t>& cu_seqlens) {
  const auto d = stack_dims(o);
  ash::require(std::int64_t(y0.shape(2)) == d.width, "y0's last dimension is " + std::to_string(y0.shape(2)) +
                                                         ", expected the width P = " + std::to_string(d.width));
  check_shape(g, "g", y0.shape(0), y0.shape(1), y0.shape(2));
  ash::require(y0.data() != g.data(), "g must not be y0");
  const ash::SeqShape s = stack_shape(y0.shape(0), y0.shape(1), cu_seqlens);
  ash::StackAdjoint<S> stack(stack_engine(o, s.T));
  ash::ParamSet<S> ps(d, ash::StackAdjoint<S>::range(d));
  dict_to_paramset(params, ps);
  ash::ParamSet<S> grad(d, ash::StackAdjoint<S>::range(d));
  {
    nb::gil_scoped_release nogil;
    stack.backward(ps, s, rows_view(y0), rows_view(g), grad);
    Kokkos::fence();
  }
  return paramset_to_dict(grad);
}

std::vector<std::pair<std::string, std::vector<std::int64_t>>> stack_layout(const StackOptions& o) {
  const auto d = stack_dims(o);
  std::vector<std::pair<std::string, std::vector<std::int64_t>>> out;
  for (const auto& t : ash::param_layout(d, ash::StackAdjoint<double>::range(d))) out.push_back({t.name, t.shape});
  return out;
}

}  // namespace

NB_MODULE(_core, m) {
  m.doc() = "AdjointSharding's C++ library (docs/python.md); use the adjoint_sharding package, not this module.";
  // Kokkos once per process: a second import of the package (or another
  // extension that started Kokkos) finds it running and leaves it alone.
  if (!Kokkos::is_initialized() && !kokkos_finalized()) {
    Kokkos::initialize();
    g_we_initialized = true;
    ash::MemoryTracker::install();
  }
  nb::module_::import_("atexit").attr("register")(nb::cpp_function(&finalize_kokkos));
  // Objects a torch module keeps until interpreter shutdown are not leaks worth a warning.
  nb::set_leak_warnings(false);
  m.attr("backend") = ash::ExecSpace::name();
  nb::exception<ash::Error>(m, "Error", PyExc_ValueError);

  nb::class_<GradOptions>(m, "GradOptions")
      .def(nb::init<>())
      .def_rw("seq_len", &GradOptions::seq_len)
      .def_rw("batch", &GradOptions::batch)
      .def_rw("engine", &GradOptions::engine)
      .def_rw("truncate", &GradOptions::truncate)
      .def_rw("detach_inputs", &GradOptions::detach_inputs)
      .def_rw("storage", &GradOptions::storage)
      .def_rw("layer_checkpoint", &GradOptions::layer_checkpoint)
      .def_rw("token_block", &GradOptions::token_block)
      .def_rw("sets", &GradOptions::sets);
  nb::class_<StackOptions>(m, "StackOptions")
      .def(nb::init<>())
      .def_rw("vocab", &StackOptions::vocab)
      .def_rw("width", &StackOptions::width)
      .def_rw("state", &StackOptions::state)
      .def_rw("layers", &StackOptions::layers)
      .def_rw("detach_inputs", &StackOptions::detach_inputs)
      .def_rw("truncate", &StackOptions::truncate)
      .def_rw("chunk", &StackOptions::chunk)
      .def_rw("layer_checkpoint", &StackOptions::layer_checkpoint)
      .def_rw("token_block", &StackOptions::token_block)
      .def_rw("storage", &StackOptions::storage);

  m.def("grad", &grad, "checkpoint"_a, "tokens"_a, "options"_a, "precision"_a);
  m.def("load", &load, "path"_a);
  m.def("save", &save, "path"_a, "config_json"_a, "params"_a, "precision"_a, "step"_a);
  m.def("init_params", &init_params, "config_json"_a, "precision"_a);
  m.def("evaluate", &evaluate, "checkpoint"_a, "tokens"_a, "seq_len"_a, "batch"_a, "precision"_a);
  m.def("train", &train, "config_json"_a, "progress"_a.none(), "resume"_a, "until"_a);
  m.def("generate", &generate, "checkpoint"_a, "prompt"_a, "n"_a, "temperature"_a, "seed"_a);
  m.def("plan", &plan, "config_json"_a, "workload"_a, "precision"_a);
  m.def("default_config", []() { return ash::Config::defaults().dump(); });
  m.def("stack_layout", &stack_layout, "options"_a);
  m.def("stack_forward", &stack_forward<float>, "params"_a, "options"_a, "y0"_a.noconvert(), "yK"_a.noconvert(),
        "cu_seqlens"_a = std::vector<std::int64_t>());
  m.def("stack_forward", &stack_forward<double>, "params"_a, "options"_a, "y0"_a.noconvert(), "yK"_a.noconvert(),
        "cu_seqlens"_a = std::vector<std::int64_t>());
  m.def("stack_backward", &stack_backward<float>, "params"_a, "options"_a, "y0"_a.noconvert(), "g"_a.noconvert(),
        "cu_seqlens"_a = std::vector<std::int64_t>());
  m.def("stack_backward", &stack_backward<double>, "params"_a, "options"_a, "y0"_a.noconvert(), "g"_a.noconvert(),
        "cu_seqlens"_a = std::vector<std::int64_t>());
}
