#include "ash/io/checkpoint.hpp"

#include <cmath>
#include <type_traits>

#include "ash/core/error.hpp"
#include "ash/core/resources.hpp"
#include "ash/io/hdf5.hpp"

namespace ash {

using namespace io;  // the HDF5 plumbing (hdf5.hpp); this file is the schema

namespace {

template <class S>
void write_paramset(hid_t file, const std::string& group, const ParamSet<S>& ps) {
  auto host = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), ps.data());
  const hid_t mem_type = std::is_same<S, double>::value ? H5T_NATIVE_DOUBLE : H5T_NATIVE_FLOAT;
  const hid_t file_type = std::is_same<S, double>::value ? H5T_IEEE_F64LE : H5T_IEEE_F32LE;
  Handle lcpl(link_create_plist(), H5Pclose);
  for (const auto& t : ps.tensors()) {
    std::vector<hsize_t> dims(t.shape.begin(), t.shape.end());
    Handle sp(H5Screate_simple(int(dims.size()), dims.data(), nullptr), H5Sclose);
    const std::string path = group + "/" + t.name;
    Handle dcpl = checksummed_dcpl(dims, sizeof(S));
    Handle ds(H5Dcreate2(file, path.c_str(), file_type, sp, lcpl, dcpl, H5P_DEFAULT), H5Dclose);
    require(ds.ok(), "HDF5: cannot create dataset " + path);
    check(H5Dwrite(ds, mem_type, H5S_ALL, H5S_ALL, H5P_DEFAULT, host.data() + t.offset), "writing " + path);
  }
}

template <class S>
void read_paramset(hid_t file, const std::string& group, const ParamSet<S>& ps, const std::string& fname,
                   int version) {
  auto host = Kokkos::create_mirror_view(ps.data());
  const hid_t mem_type = std::is_same<S, double>::value ? H5T_NATIVE_DOUBLE : H5T_NATIVE_FLOAT;
  for (const auto& t : ps.tensors()) {
    const std::string path = group + "/" + t.name;
    require(H5Lexists(file, group.c_str(), H5P_DEFAULT) > 0 && H5Oexists_by_name(file, path.c_str(), H5P_DEFAULT) > 0,
            "'" + fname + "' lacks dataset " + path);
    Handle ds(H5Dopen2(file, path.c_str(), H5P_DEFAULT), H5Dclose);
    require(ds.ok(), "'" + fname + "': cannot open dataset " + path);
    Handle sp(H5Dget_space(ds), H5Sclose);
    const int rank = H5Sget_simple_extent_ndims(sp);
    std::vector<hsize_t> dims(rank > 0 ? rank : 0);
    if (rank > 0) H5Sget_simple_extent_dims(sp, dims.data(), nullptr);
    std::vector<std::int64_t> got(dims.begin(), dims.end());
    auto shape_str = [](const std::vector<std::int64_t>& s) {
      std::string o = "[";
      for (std::size_t i = 0; i < s.size(); ++i) o += (i ? "," : "") + std::to_string(s[i]);
      return o + "]";
    };
    require(got == t.shape, "'" + fname + "': dataset " + path + " has shape " + shape_str(got) + ", expected " +
                                shape_str(t.shape) + " from the model sizes");
    Handle ft(H5Dget_type(ds), H5Tclose);
    require(ft.ok() && is_f32_or_f64(ft), "'" + fname + "': dataset " + path + " is " +
                                              (ft.ok() ? dtype_name(ft) : std::string("unreadable")) +
                                              "; checkpoints hold float32 or float64");
    // Format 2 always checksums; a dataset without the filter was altered.
    const bool sum = has_fletcher32(ds);
    require(version < 2 || sum, "'" + fname + "': dataset " + path + " has no Fletcher-32 checksum (format 2 has one)");
    require(H5Dread(ds, mem_type, H5S_ALL, H5S_ALL, H5P_DEFAULT, host.data() + t.offset) >= 0,
            sum ? "checksum mismatch in dataset " + path + " of '" + fname + "' (the file is corrupt)"
                : "cannot read dataset " + path + " of '" + fname + "' (the file is corrupt)");
    const S* v = host.data() + t.offset;
    for (index_t i = 0; i < t.size(); ++i)
      require(std::isfinite(v[i]), "dataset " + path + " of '" + fname + "' holds a non-finite value (" +
                                       std::to_string(double(v[i])) + " at index " + std::to_string(i) + ")");
  }
  Kokkos::deep_copy(ps.data(), host);
}

template <class S>
void write_carried_state(hid_t file, const std::vector<View2<S>>& state) {
  const hsize_t K = state.size(), R = state[0].extent(0), N = state[0].extent(1);
  std::vector<S> host(std::size_t(K * R * N));
  for (hsize_t k = 0; k < K; ++k) {
    Kokkos::View<S**, Kokkos::LayoutRight, Kokkos::HostSpace, Kokkos::MemoryTraits<Kokkos::Unmanaged>> h(
        host.data() + k * R * N, R, N);
    Kokkos::deep_copy(h, state[k]);
  }
  std::vector<hsize_t> dims{K, R, N};
  Handle sp(H5Screate_simple(3, dims.data(), nullptr), H5Sclose);
  Handle lcpl(link_create_plist(), H5Pclose);
  Handle dcpl = checksummed_dcpl(dims, sizeof(S));
  const hid_t mem_type = std::is_same<S, double>::value ? H5T_NATIVE_DOUBLE : H5T_NATIVE_FLOAT;
  const hid_t file_type = std::is_same<S, double>::value ? H5T_IEEE_F64LE : H5T_IEEE_F32LE;
  Handle ds(H5Dcreate2(file, "/train/carry_state", file_type, sp, lcpl, dcpl, H5P_DEFAULT), H5Dclose);
  require(ds.ok(), "HDF5: cannot create dataset /train/carry_state");
  check(H5Dwrite(ds, mem_type, H5S_ALL, H5S_ALL, H5P_DEFAULT, host.data()), "writing /train/carry_state");
}

template <class S>
void write_header(hid_t file, const Config& cfg, const ModelDims& d, std::int64_t step, std::int64_t cursor) {
  write_attr_i64(file, "format_version", checkpoint_format_version);
  write_attr_i64(file, "vocab", d.vocab);
  write_attr_i64(file, "width", d.width);
  write_attr_i64(file, "state", d.state);
  write_attr_i64(file, "layers", d.layers);
  write_attr_i64(file, "seed", std::int64_t(d.seed));
  write_attr_str(file, "precision", std::is_same<S, double>::value ? "double" : "float");
  write_attr_i64(file, "step", step);
  write_attr_i64(file, "data_cursor", cursor);
  // Batches are a pure function of (model.seed, step) and the cursor (see
  // TokenDataset), so this names the generator state rather than dumping one.
  write_attr_str(file, "rng_state", "splitmix64(seed=" + std::to_string(d.seed) + ", step=" + std::to_string(step) + ")");
  write_attr_str(file, "engine", cfg.get<std::string>("grad.engine"));
  write_attr_str(file, "config", cfg.json().dump());
}

CheckpointInfo read_header(hid_t file, const std::string& path) {
  CheckpointInfo info;
  require(has_attr(file, "format_version"), "'" + path + "' is not an AdjointSharding checkpoint (no format_version)");
  const auto version = read_attr_i64(file, "format_version", path);
  // Version 1 (no checksums) still loads; see docs/file_format.md.
  require(version == checkpoint_format_version || version == 1,
          "'" + path + "' has checkpoint format version " + std::to_string(version) +
              "; this build reads versions 1 and " + std::to_string(checkpoint_format_version));
  info.format_version = int(version);
  info.dims.vocab = read_attr_i64(file, "vocab", path);
  info.dims.width = read_attr_i64(file, "width", path);
  info.dims.state = read_attr_i64(file, "state", path);
  info.dims.layers = read_attr_i64(file, "layers", path);
  info.dims.seed = std::uint64_t(read_attr_i64(file, "seed", path));
  info.precision = read_attr_str(file, "precision", path);
  require(info.precision == "float" || info.precision == "double",
          "'" + path + "': precision '" + info.precision + "' is not float or double");
  info.step = read_attr_i64(file, "step", path);
  require(info.step >= 0, "'" + path + "': step " + std::to_string(info.step) + " is negative");
  info.data_cursor = read_attr_i64(file, "data_cursor", path);
  require(info.data_cursor >= 0, "'" + path + "': data_cursor " + std::to_string(info.data_cursor) + " is negative");
  info.config.merge(parse_json_strict(read_attr_str(file, "config", path), "'" + path + "': config attribute"),
                    path + " (config attribute)");

  const auto cd = info.config.model();
  require(cd == info.dims, "'" + path + "': model sizes in the attributes and in the stored config disagree");
  require(info.dims.vocab >= 2 && info.dims.vocab < (std::int64_t(1) << 31) && info.dims.width >= 1 &&
              info.dims.state >= 1 && info.dims.layers >= 1,
          "'" + path + "': invalid model sizes");
  // Sizes from a file are checked before they size an allocation. (The rest
  // of the stored configuration is validated by whoever uses it, after
  // --config / --set, so an old file with a since-tightened value still loads.)
  try {
    checked_parameter_count(info.dims);
  } catch (const Error& e) {
    throw Error("'" + path + "': " + e.what());
  }
  return info;
}

}  // namespace

template <class S>
void save_checkpoint(const std::string& path, const Config& cfg, const ParamSet<S>& params, std::int64_t step,
                     std::int64_t data_cursor, const OptimizerState<S>& opt) {
  require(cfg.model() == params.dims(), "save_checkpoint: config sizes differ from the parameters'");
  write_atomically(path, [&](hid_t file) {
    write_header<S>(file, cfg, params.dims(), step, data_cursor);
    write_paramset(file, "/params", params);
    if (opt.m && opt.v) {
      write_paramset(file, "/optimizer/m", *opt.m);
      write_paramset(file, "/optimizer/v", *opt.v);
      Handle g(H5Gopen2(file, "/optimizer", H5P_DEFAULT), H5Gclose);
      write_attr_i64(g, "step", opt.step);
    }
    if (opt.carry && !opt.carry->empty()) write_carried_state(file, *opt.carry);
  });
}

template <class S>
bool load_carried_state(const std::string& path, const std::vector<View2<S>>& state) {
  Handle file = open_for_read(path, "checkpoint");
  read_header(file, path);
  const char* name = "/train/carry_state";
  if (H5Lexists(file, "/train", H5P_DEFAULT) <= 0 || H5Oexists_by_name(file, name, H5P_DEFAULT) <= 0) return false;
  require(!state.empty(), "'" + path + "' holds a carried state but this run carries none");
  const hsize_t K = state.size(), R = state[0].extent(0), N = state[0].extent(1);
  Handle ds(H5Dopen2(file, name, H5P_DEFAULT), H5Dclose);
  require(ds.ok(), "'" + path + "': cannot open " + name);
  Handle sp(H5Dget_space(ds), H5Sclose);
  hsize_t dims[3] = {0, 0, 0};
  require(H5Sget_simple_extent_ndims(sp) == 3 && H5Sget_simple_extent_dims(sp, dims, nullptr) == 3 &&
              dims[0] == K && dims[1] == R && dims[2] == N,
          "'" + path + "': " + name + " does not match this run's layers, batch and sizes [" + std::to_string(K) +
              "," + std::to_string(R) + "," + std::to_string(N) + "]");
  std::vector<S> host(std::size_t(K * R * N));
  const hid_t mem_type = std::is_same<S, double>::value ? H5T_NATIVE_DOUBLE : H5T_NATIVE_FLOAT;
  require(H5Dread(ds, mem_type, H5S_ALL, H5S_ALL, H5P_DEFAULT, host.data()) >= 0,
          "checksum mismatch in " + std::string(name) + " of '" + path + "' (the file is corrupt)");
  for (S v : host) require(std::isfinite(v), "'" + path + "': " + name + " holds a non-finite value");
  for (hsize_t k = 0; k < K; ++k) {
    Kokkos::View<S**, Kokkos::LayoutRight, Kokkos::HostSpace, Kokkos::MemoryTraits<Kokkos::Unmanaged>> h(
        host.data() + k * R * N, R, N);
    Kokkos::deep_copy(state[k], h);
  }
  return true;
}

template <class S>
bool load_optimizer_state(const std::string& path, const ParamSet<S>& m, const ParamSet<S>& v, std::int64_t* step) {
  Handle file = open_for_read(path, "checkpoint");
  const auto info = read_header(file, path);
  if (H5Lexists(file, "/optimizer", H5P_DEFAULT) <= 0) return false;
  read_paramset(file, "/optimizer/m", m, path, info.format_version);
  read_paramset(file, "/optimizer/v", v, path, info.format_version);
  Handle g(H5Gopen2(file, "/optimizer", H5P_DEFAULT), H5Gclose);
  require(g.ok(), "'" + path + "': cannot open /optimizer (corrupt file)");
  const auto s = read_attr_i64(g, "step", path);
  require(s >= 0, "'" + path + "': /optimizer step " + std::to_string(s) + " is negative");
  if (step) *step = s;
  return true;
}

CheckpointInfo inspect_checkpoint(const std::string& path) {
  Handle file = open_for_read(path, "checkpoint");
  CheckpointInfo info = read_header(file, path);
  for (const auto& t : param_layout(info.dims)) {
    const std::string p = "/params/" + t.name;
    CheckpointInfo::Dataset d{p, {}, "missing"};
    if (H5Lexists(file, "/params", H5P_DEFAULT) > 0 && H5Oexists_by_name(file, p.c_str(), H5P_DEFAULT) > 0) {
      Handle ds(H5Dopen2(file, p.c_str(), H5P_DEFAULT), H5Dclose);
      require(ds.ok(), "'" + path + "': cannot open dataset " + p + " (corrupt file)");
      Handle sp(H5Dget_space(ds), H5Sclose);
      const int rank = H5Sget_simple_extent_ndims(sp);
      std::vector<hsize_t> dims(rank > 0 ? rank : 0);
      if (rank > 0) H5Sget_simple_extent_dims(sp, dims.data(), nullptr);
      d.shape.assign(dims.begin(), dims.end());
      Handle ft(H5Dget_type(ds), H5Tclose);
      d.dtype = ft.ok() ? dtype_name(ft) : "unreadable";
    }
    info.datasets.push_back(d);
  }
  return info;
}

template <class S>
ParamSet<S> load_checkpoint(const std::string& path, CheckpointInfo* info_out) {
  return load_checkpoint<S>(path, LayerRange{}, info_out);
}

template <class S>
ParamSet<S> load_checkpoint(const std::string& path, const LayerRange& range, CheckpointInfo* info_out) {
  Handle file = open_for_read(path, "checkpoint");
  CheckpointInfo info = read_header(file, path);
  // LayerRange{} (k1 = 0, no layers) stands for the whole model.
  const LayerRange r = range.k1 == 0 ? LayerRange::all(info.dims) : range;
  require(r.k1 <= info.dims.layers, "'" + path + "' has " + std::to_string(info.dims.layers) +
                                        " layers; this rank owns layers up to " + std::to_string(r.k1 - 1));
  ParamSet<S> params(info.dims, r);
  read_paramset(file, "/params", params, path, info.format_version);
  if (info_out) *info_out = info;
  return params;
}

template <class S>
void save_gradients(const std::string& path, const Config& cfg, double loss, const ParamSet<S>& grad) {
  write_atomically(path, [&](hid_t file) {
    write_header<S>(file, cfg, grad.dims(), 0, 0);
    Handle sp(H5Screate(H5S_SCALAR), H5Sclose);
    // A scalar cannot be chunked (no filter); compact layout keeps the value
    // inside the object header, which the 1.10 format checksums.
    Handle dcpl(H5Pcreate(H5P_DATASET_CREATE), H5Pclose);
    check(H5Pset_layout(dcpl, H5D_COMPACT), "compact layout for /loss");
    Handle ds(H5Dcreate2(file, "/loss", H5T_IEEE_F64LE, sp, H5P_DEFAULT, dcpl, H5P_DEFAULT), H5Dclose);
    require(ds.ok(), "HDF5: cannot create /loss");
    check(H5Dwrite(ds, H5T_NATIVE_DOUBLE, H5S_ALL, H5S_ALL, H5P_DEFAULT, &loss), "writing /loss");
    write_paramset(file, "/grad", grad);
  });
}

ParamSet<double> load_gradients(const std::string& path, const ModelDims& dims, double* loss) {
  Handle file = open_for_read(path, "gradient file");
  const auto info = read_header(file, path);
  require(info.dims == dims, "'" + path + "' holds gradients of other model sizes");
  ParamSet<double> g(dims);
  read_paramset(file, "/grad", g, path, info.format_version);
  if (loss) {
    require(H5Lexists(file, "/loss", H5P_DEFAULT) > 0, "'" + path + "' lacks /loss");
    Handle ds(H5Dopen2(file, "/loss", H5P_DEFAULT), H5Dclose);
    require(ds.ok(), "'" + path + "': cannot open /loss (corrupt file)");
    require(H5Dread(ds, H5T_NATIVE_DOUBLE, H5S_ALL, H5S_ALL, H5P_DEFAULT, loss) >= 0 && std::isfinite(*loss),
            "'" + path + "': /loss is unreadable or not finite");
  }
  return g;
}

template void save_checkpoint<float>(const std::string&, const Config&, const ParamSet<float>&, std::int64_t,
                                     std::int64_t, const OptimizerState<float>&);
template void save_checkpoint<double>(const std::string&, const Config&, const ParamSet<double>&, std::int64_t,
                                      std::int64_t, const OptimizerState<double>&);
template bool load_optimizer_state<float>(const std::string&, const ParamSet<float>&, const ParamSet<float>&,
                                          std::int64_t*);
template bool load_optimizer_state<double>(const std::string&, const ParamSet<double>&, const ParamSet<double>&,
                                           std::int64_t*);
template bool load_carried_state<float>(const std::string&, const std::vector<View2<float>>&);
template bool load_carried_state<double>(const std::string&, const std::vector<View2<double>>&);
template ParamSet<float> load_checkpoint<float>(const std::string&, CheckpointInfo*);
template ParamSet<double> load_checkpoint<double>(const std::string&, CheckpointInfo*);
template ParamSet<float> load_checkpoint<float>(const std::string&, const LayerRange&, CheckpointInfo*);
template ParamSet<double> load_checkpoint<double>(const std::string&, const LayerRange&, CheckpointInfo*);
template void save_gradients<float>(const std::string&, const Config&, double, const ParamSet<float>&);
template void save_gradients<double>(const std::string&, const Config&, double, const ParamSet<double>&);

}  // namespace ash
