// adjoint_sharding._core's verbs: the library forms of src/ash/app/ (what `ash
// grad`, `eval`, `init`, `train`, `generate`, `plan`, `import-hf`, `export-hf` call) with Python's
// arguments converted in and the results converted out. The GIL is released while
// the library runs: it calls no Python (train's progress callback takes it back).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstdio>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "convert.hpp"

namespace ash_py {

using namespace nb::literals;

namespace {

// state: None, or the carried state [K, B·rows, cols] in the compute type, read
// and overwritten in place (the layers' views alias it: on the library's device).
template <class S>
std::pair<double, nb::dict> grad_impl(const std::string& ckpt, const std::vector<std::uint32_t>& tokens,
                                      const ash::Config& cfg, const nb::object& state) {
  ash::TokenSource source;
  source.ids = &tokens;
  std::vector<ash::View2<S>> carried;
  if (!state.is_none()) {
    // No conversion: the state is written back in place, so a copy would lose it.
    const auto a = device_array<S, nb::ndim<3>>(
        state, "grad: state [layers, batch x rows, columns] in the compute precision", "writable 3-D ");
    const std::size_t R = a.shape(1), C = a.shape(2);
    for (std::size_t k = 0; k < a.shape(0); ++k) carried.emplace_back(a.data() + k * R * C, R, C);
  }
  const auto r = [&] {
    nb::gil_scoped_release nogil;
    return ash::grad_file<S>(ckpt, cfg, source, {}, state.is_none() ? nullptr : &carried);  // as `ash grad`
  }();
  Kokkos::fence();
  return {r.loss, paramset_to_dict(r.grad)};
}

// o: grad()'s keywords as typed options (ash::checkpoint_run_config's rule: unset keeps the
// checkpoint's value); a carried state selects the block-wise engine's carried form.
std::pair<double, nb::dict> grad(const std::string& ckpt, const Ids& tokens, ash::RunOverrides o,
                                 const std::string& precision, const nb::object& state) {
  const ash::CheckpointInfo info = ash::inspect_checkpoint(ckpt);
  if (!state.is_none()) o.carry_state = true;
  const ash::Config cfg = ash::checkpoint_run_config(info.config, o);
  const std::string prec = precision_or(precision, info.precision);
  return prec == "float" ? grad_impl<float>(ckpt, ids_of(tokens), cfg, state)
                         : grad_impl<double>(ckpt, ids_of(tokens), cfg, state);
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

// ash::save_file's refusals (the step, the run lock) come before the parameters are converted.
template <class S>
void save_impl(const std::string& path, const ash::Config& cfg, const nb::dict& params, std::int64_t step) {
  ash::save_file<S>(path, cfg, step, [&](const ash::ParamSet<S>& ps) { dict_to_paramset(params, ps); });
}

// A configuration dict's JSON over the defaults, parsed and validated as `ash --config`.
ash::Config config_from(const std::string& config_json) { return ash::train_config(nullptr, "", config_json, {}); }

void save(const std::string& path, const std::string& config_json, const nb::dict& params,
          const std::string& precision, std::int64_t step) {
  const ash::Config cfg = config_from(config_json);
  if (precision_or(precision, "") == "float")
    save_impl<float>(path, cfg, params, step);
  else
    save_impl<double>(path, cfg, params, step);
}

nb::dict init_params(const std::string& config_json, const std::string& precision) {
  const ash::Config cfg = config_from(config_json);
  if (precision_or(precision, "") == "float") return paramset_to_dict(ash::init_params<float>(cfg));  // as `ash init`
  return paramset_to_dict(ash::init_params<double>(cfg));
}

// Loss over consecutive windows of a token array (`ash eval`): (nats/token, bits/token, targets).
template <class S>
std::tuple<double, double, std::int64_t> evaluate_impl(const std::string& ckpt, const std::vector<std::uint32_t>& ids,
                                                       const ash::Config& cfg) {
  ash::TokenSource source;
  source.ids = &ids;
  const auto r = [&] {
    nb::gil_scoped_release nogil;
    return ash::eval_file<S>(ckpt, cfg, source);
  }();
  return {r.totals.nats / double(r.totals.targets), r.totals.bits_per_token(), std::int64_t(r.totals.targets)};
}

std::tuple<double, double, std::int64_t> evaluate(const std::string& ckpt, const Ids& tokens,
                                                  const ash::RunOverrides& o, const std::string& precision) {
  const ash::CheckpointInfo info = ash::inspect_checkpoint(ckpt);
  const ash::Config cfg = ash::checkpoint_run_config(info.config, o);
  const std::string prec = precision_or(precision, info.precision);
  const auto ids = ids_of(tokens);
  return prec == "float" ? evaluate_impl<float>(ckpt, ids, cfg) : evaluate_impl<double>(ckpt, ids, cfg);
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
  ash::TrainRequest req;
  req.config_json = config_json;
  req.resume = resume;
  req.until = until;
  LineSink sink{progress};
  cookie_io_functions_t fns{nullptr, sink_write, nullptr, nullptr};
  std::FILE* log = fopencookie(&sink, "w", fns);
  ash::require(log != nullptr, "train: cannot open the progress stream");
  std::setvbuf(log, nullptr, _IOLBF, 0);
  ash::TrainSummary s;
  try {
    nb::gil_scoped_release nogil;
    s = ash::train_run(req, log, [](const std::string& path) { return ash::inspect_checkpoint(path); });
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

std::vector<std::uint32_t> generate(const std::string& ckpt, const Ids& prompt_ids, std::int64_t n, double temperature,
                                    std::uint64_t seed) {
  const auto prompt = ids_of(prompt_ids);
  ash::require(!prompt.empty(), "--prompt must not be empty");
  ash::require(n >= 0 && n <= ash::max_generate_tokens,
               "n must be in [0, 2^30] (ash generate --tokens), got " + std::to_string(n));
  ash::GenerateOptions opts;
  opts.tokens = n;
  opts.temperature = temperature;
  opts.seed = seed;
  opts.documents = false;  // n tokens after the prompt, whatever the model's data.separator
  nb::gil_scoped_release nogil;
  return ash::generate_tokens(ckpt, prompt, opts, [](const std::string& path) {
           return ash::inspect_checkpoint(path, ash::Verify::header);
         }).ids;
}

nb::dict plan(const std::string& config_json, const std::string& workload, const std::string& precision) {
  const auto r = ash::plan_run(config_from(config_json), workload, precision);
  nb::dict items;
  for (const auto& it : r.plan.items) items[it.name.c_str()] = it.bytes;
  nb::dict out;
  out["engine"] = r.plan.engine;
  out["phase"] = r.plan.phase;
  out["items"] = items;
  out["total"] = r.plan.total();
  out["capacity"] = r.capacity.bytes;
  out["capacity_what"] = r.capacity.what;
  out["table"] = r.plan.table("  ");
  return out;
}

// `ash import-hf`: {config (JSON text), source_dtypes, ignored, parameters}.
nb::dict import_hf(const std::string& dir, const std::string& out, const std::string& precision) {
  const auto r = [&] {
    nb::gil_scoped_release nogil;
    return ash::import_hf(dir, out, precision);
  }();
  nb::dict d;
  d["config"] = r.config.json().dump();
  d["source_dtypes"] = r.source_dtypes;
  d["ignored"] = r.ignored;
  d["parameters"] = r.parameters;
  return d;
}

// `ash export-hf`: {dtype, parameters}.
nb::dict export_hf(const std::string& ckpt, const std::string& dir, const std::string& dtype) {
  const auto r = [&] {
    nb::gil_scoped_release nogil;
    return ash::export_hf(ckpt, dir, dtype);
  }();
  nb::dict d;
  d["dtype"] = r.dtype;
  d["parameters"] = r.parameters;
  return d;
}

}  // namespace

void bind_verbs(nb::module_& m) {
  // grad()'s keywords, typed; None: the checkpoint's value (docs/python.md).
  nb::class_<ash::RunOverrides>(m, "RunOverrides")
      .def(nb::init<>())
      .def_rw("sets", &ash::RunOverrides::sets)
      .def_rw("rows_are_sequences", &ash::RunOverrides::rows_are_sequences)
      .def_rw("engine", &ash::RunOverrides::engine)
      .def_rw("truncate", &ash::RunOverrides::truncate)
      .def_rw("detach_inputs", &ash::RunOverrides::detach_inputs)
      .def_rw("chunk", &ash::RunOverrides::chunk)
      .def_rw("layer_checkpoint", &ash::RunOverrides::layer_checkpoint)
      .def_rw("token_block", &ash::RunOverrides::token_block)
      .def_rw("storage", &ash::RunOverrides::storage)
      .def_rw("seq_len", &ash::RunOverrides::seq_len)
      .def_rw("batch", &ash::RunOverrides::batch);
  m.def("grad", &grad, "checkpoint"_a, "tokens"_a, "options"_a, "precision"_a, "state"_a.none() = nb::none());
  m.def("load", &load, "path"_a);
  m.def("save", &save, "path"_a, "config_json"_a, "params"_a, "precision"_a, "step"_a);
  m.def("init_params", &init_params, "config_json"_a, "precision"_a);
  m.def("evaluate", &evaluate, "checkpoint"_a, "tokens"_a, "options"_a, "precision"_a);
  m.def("train", &train, "config_json"_a, "progress"_a.none(), "resume"_a, "until"_a);
  m.def("generate", &generate, "checkpoint"_a, "prompt"_a, "n"_a, "temperature"_a, "seed"_a);
  m.def("plan", &plan, "config_json"_a, "workload"_a, "precision"_a);
  m.def("import_hf", &import_hf, "dir"_a, "out"_a, "precision"_a);
  m.def("export_hf", &export_hf, "checkpoint"_a, "dir"_a, "dtype"_a);
  m.def("default_config", []() { return ash::Config::defaults().dump(); });
  // A configuration's JSON text over the defaults, parsed strictly (duplicate keys refused) and validated.
  m.def("full_config", [](const std::string& config_json) { return config_from(config_json).json().dump(); });
}

}  // namespace ash_py
