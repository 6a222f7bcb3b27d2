#include "ash/app/hf_convert.hpp"

#include <filesystem>
#include <map>
#include <set>

#include <nlohmann/json.hpp>

#include "ash/app/hf_mamba.hpp"
#include "ash/core/error.hpp"
#include "ash/io/checkpoint.hpp"
#include "ash/io/run_lock.hpp"
#include "ash/plan/memory_plan.hpp"

namespace ash {
namespace {

namespace fs = std::filesystem;

// The folder's files a checkpoint or a folder file may not replace.
std::vector<std::pair<std::string, std::string>> folder_files(const std::string& dir, const std::string& flag) {
  std::vector<std::pair<std::string, std::string>> files;
  for (const char* name : {"config.json", "model.safetensors", "model.safetensors.index.json"})
    files.emplace_back(flag, (fs::path(dir) / name).string());
  return files;
}

// Every file import-hf reads from `dir`: folder_files and the shards an index
// names (headers only). A folder whose weights do not open is refused by
// open_hf_mamba, naming what is wrong; its three names stay protected here.
std::vector<std::pair<std::string, std::string>> input_files(const std::string& dir, const std::string& flag) {
  auto files = folder_files(dir, flag);
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return files;
  const auto add = [&](const SafetensorsSet& set) {
    for (const auto& f : set.files()) files.emplace_back(flag, f.path());
  };
  try {
    add(SafetensorsSet::folder(dir));
    // The index's shards too when model.safetensors is what transformers reads.
    if (fs::exists(fs::symlink_status(fs::path(dir) / "model.safetensors", ec)) &&
        fs::exists(fs::symlink_status(fs::path(dir) / "model.safetensors.index.json", ec)))
      add(SafetensorsSet::index(dir));
  } catch (const Error&) {
  }
  return files;
}

template <class S>
std::int64_t write_imported(const HfMambaFolder& f, const Config& cfg, const std::string& out,
                            std::uint64_t max_memory) {
  // Before any tensor is read: the sizes come from config.json and the headers,
  // and the values go straight into the parameters (no copy of the folder in double).
  check_memory(cfg, Workload::init, sizeof(S), max_memory);
  ParamSet<S> params(cfg.model());
  auto host = Kokkos::create_mirror_view(params.data());
  std::map<std::string, const TensorInfo*> layout;
  for (const auto& t : params.tensors()) layout[t.name] = &t;
  // open_hf_mamba lists exactly the tensors this configuration's layout holds
  // (test_safetensors checks the two agree); a disagreement is a bug, not a user error.
  const auto disagree = [](const std::string& name) {
    return std::logic_error("import-hf: the folder mapping and the parameter layout disagree on '" + name + "'");
  };
  if (f.names.size() != layout.size()) throw disagree("the tensor count");
  read_hf_mamba_values<S>(f, [&](const HfName& n) {
    const auto it = layout.find(n.ash);
    if (it == layout.end() || it->second->shape != n.ash_shape) throw disagree(n.ash);
    return host.data() + it->second->offset;
  });
  Kokkos::deep_copy(params.data(), host);
  const auto lock = RunLock::for_output(out);  // a run directory: not while its train runs
  save_checkpoint(out, cfg, params);
  return params.size();
}

}  // namespace

HfImport import_hf(const std::string& dir, const std::string& out, const std::string& precision,
                   std::uint64_t max_memory) {
  require(precision == "float" || precision == "double",
          "--precision must be float or double (got '" + precision + "')");
  require_distinct_output(out, input_files(dir, "a file of --from"));
  const HfMambaFolder f = open_hf_mamba(dir);
  HfImport r;
  r.config.merge(f.config, "'" + (fs::path(dir) / "config.json").string() + "'");
  r.config.set("run.precision=" + precision);
  r.config.validate();
  std::set<std::string> dtypes;
  for (const auto& n : f.names) dtypes.insert(dtype_name(f.set.at(n.hf).dtype));
  for (const auto& d : dtypes) r.source_dtypes += (r.source_dtypes.empty() ? "" : ", ") + d;
  r.ignored = f.ignored;
  r.parameters = precision == "float" ? write_imported<float>(f, r.config, out, max_memory)
                                      : write_imported<double>(f, r.config, out, max_memory);
  return r;
}

HfExport export_hf(const std::string& checkpoint, const std::string& dir, const std::string& dtype,
                   const CheckpointReader& read) {
  require(dtype.empty() || dtype == "float" || dtype == "double",
          "--dtype must be float or double (got '" + dtype + "')");
  for (const auto& [flag, path] : folder_files(dir, "")) {
    (void)flag;
    require(!same_file(path, checkpoint), "--out '" + dir + "' holds --checkpoint '" + checkpoint +
                                              "' as " + fs::path(path).filename().string() + ", which export-hf writes");
  }
  const CheckpointInfo head = read ? read(checkpoint) : inspect_checkpoint(checkpoint);
  require(head.dims.mamba(), "'" + checkpoint + "' is a model.arch = " + arch_name(head.dims.arch) +
                                 " checkpoint: export-hf writes only a model.arch = mamba, falcon_mamba or mamba2 model "
                                 "(as a Hugging Face MambaForCausalLM, FalconMambaForCausalLM or Mamba2ForCausalLM "
                                 "folder)");
  require_complete(checkpoint, head);
  HfExport r;
  r.dims = head.dims;
  const std::string prec = dtype.empty() ? head.precision : dtype;
  const TensorDtype out_dtype = prec == "double" ? TensorDtype::f64 : TensorDtype::f32;
  r.dtype = dtype_name(out_dtype);
  // In double: a float checkpoint converts exactly, and F32 written from it is its bits.
  CheckpointInfo info;
  const auto params = load_checkpoint<double>(checkpoint, &info);
  const auto host = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), params.data());
  HfTensors tensors;
  for (const auto& t : params.tensors()) {
    HfTensor h;
    h.shape = t.shape;
    h.values.assign(host.data() + t.offset, host.data() + t.offset + t.size());
    tensors.emplace(t.name, std::move(h));
  }
  r.parameters = params.size();
  const auto lock = RunLock::for_output((fs::path(dir) / "model.safetensors").string());
  write_hf_mamba(dir, info.config.json(), tensors, out_dtype);
  return r;
}

}  // namespace ash
