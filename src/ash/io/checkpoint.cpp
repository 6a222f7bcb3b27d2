#include "ash/io/checkpoint.hpp"

#include <hdf5.h>
#include <unistd.h>

#include <cstdio>
#include <type_traits>

#include "ash/core/error.hpp"

namespace ash {

namespace {

// RAII for hid_t handles.
class Handle {
 public:
  using Closer = herr_t (*)(hid_t);
  Handle(hid_t id, Closer c) : id_(id), close_(c) {}
  Handle(const Handle&) = delete;
  Handle& operator=(const Handle&) = delete;
  Handle(Handle&& o) noexcept : id_(o.id_), close_(o.close_) { o.id_ = -1; }
  ~Handle() {
    if (id_ >= 0) close_(id_);
  }
  operator hid_t() const { return id_; }
  bool ok() const { return id_ >= 0; }

 private:
  hid_t id_;
  Closer close_;
};

struct QuietHdf5 {  // our messages replace HDF5's error stack dumps
  QuietHdf5() { H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr); }
};
const QuietHdf5 quiet_hdf5;

void check(herr_t rc, const std::string& what) { require(rc >= 0, "HDF5: " + what + " failed"); }

void write_attr_i64(hid_t loc, const char* name, std::int64_t v) {
  Handle sp(H5Screate(H5S_SCALAR), H5Sclose);
  Handle a(H5Acreate2(loc, name, H5T_NATIVE_INT64, sp, H5P_DEFAULT, H5P_DEFAULT), H5Aclose);
  require(a.ok(), std::string("HDF5: cannot create attribute ") + name);
  check(H5Awrite(a, H5T_NATIVE_INT64, &v), std::string("writing attribute ") + name);
}

void write_attr_str(hid_t loc, const char* name, const std::string& v) {
  Handle sp(H5Screate(H5S_SCALAR), H5Sclose);
  Handle t(H5Tcopy(H5T_C_S1), H5Tclose);
  H5Tset_size(t, v.empty() ? 1 : v.size());
  H5Tset_strpad(t, H5T_STR_NULLPAD);
  Handle a(H5Acreate2(loc, name, t, sp, H5P_DEFAULT, H5P_DEFAULT), H5Aclose);
  require(a.ok(), std::string("HDF5: cannot create attribute ") + name);
  const std::string buf = v.empty() ? std::string(1, '\0') : v;
  check(H5Awrite(a, t, buf.data()), std::string("writing attribute ") + name);
}

bool has_attr(hid_t loc, const char* name) { return H5Aexists(loc, name) > 0; }

std::int64_t read_attr_i64(hid_t loc, const char* name, const std::string& file) {
  require(has_attr(loc, name), "checkpoint '" + file + "' lacks attribute '" + name + "'");
  Handle a(H5Aopen(loc, name, H5P_DEFAULT), H5Aclose);
  std::int64_t v = 0;
  check(H5Aread(a, H5T_NATIVE_INT64, &v), std::string("reading attribute ") + name);
  return v;
}

std::string read_attr_str(hid_t loc, const char* name, const std::string& file) {
  require(has_attr(loc, name), "checkpoint '" + file + "' lacks attribute '" + name + "'");
  Handle a(H5Aopen(loc, name, H5P_DEFAULT), H5Aclose);
  Handle ft(H5Aget_type(a), H5Tclose);
  require(H5Tget_class(ft) == H5T_STRING, std::string("attribute ") + name + " is not a string");
  require(H5Tis_variable_str(ft) <= 0, std::string("attribute ") + name + " is a variable-length string");
  const std::size_t n = H5Tget_size(ft);
  std::string buf(n, '\0');
  Handle mt(H5Tcopy(H5T_C_S1), H5Tclose);
  H5Tset_size(mt, n);
  H5Tset_strpad(mt, H5T_STR_NULLPAD);
  check(H5Aread(a, mt, &buf[0]), std::string("reading attribute ") + name);
  return buf.substr(0, buf.find('\0'));
}

// Creates intermediate groups ("layers/000/norm" under /params).
hid_t link_create_plist() {
  hid_t lcpl = H5Pcreate(H5P_LINK_CREATE);
  H5Pset_create_intermediate_group(lcpl, 1);
  return lcpl;
}

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
    Handle ds(H5Dcreate2(file, path.c_str(), file_type, sp, lcpl, H5P_DEFAULT, H5P_DEFAULT), H5Dclose);
    require(ds.ok(), "HDF5: cannot create dataset " + path);
    check(H5Dwrite(ds, mem_type, H5S_ALL, H5S_ALL, H5P_DEFAULT, host.data() + t.offset), "writing " + path);
  }
}

template <class S>
void read_paramset(hid_t file, const std::string& group, const ParamSet<S>& ps, const std::string& fname) {
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
    require(H5Tget_class(ft) == H5T_FLOAT, "'" + fname + "': dataset " + path + " is not floating point");
    check(H5Dread(ds, mem_type, H5S_ALL, H5S_ALL, H5P_DEFAULT, host.data() + t.offset), "reading " + path);
  }
  Kokkos::deep_copy(ps.data(), host);
}

Handle open_for_read(const std::string& path, const char* what) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  require(f != nullptr, std::string("cannot open ") + what + " '" + path + "'");
  std::fclose(f);
  require(H5Fis_hdf5(path.c_str()) > 0, std::string(what) + " '" + path + "' is not an HDF5 file (corrupt?)");
  Handle file(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), H5Fclose);
  require(file.ok(), std::string("cannot read ") + what + " '" + path + "' (truncated or corrupt HDF5 file)");
  return file;
}

// Writes through a temporary file and renames it into place.
template <class Fn>
void write_atomically(const std::string& path, Fn&& body) {
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  {
    Handle file(H5Fcreate(tmp.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT), H5Fclose);
    require(file.ok(), "cannot create '" + tmp + "' (does the directory exist and is it writable?)");
    try {
      body(hid_t(file));
    } catch (...) {
      std::remove(tmp.c_str());
      throw;
    }
    if (H5Fflush(file, H5F_SCOPE_GLOBAL) < 0) {
      std::remove(tmp.c_str());
      throw Error("cannot flush '" + tmp + "'");
    }
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::remove(tmp.c_str());
    throw Error("cannot rename '" + tmp + "' to '" + path + "'");
  }
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
  info.format_version = int(read_attr_i64(file, "format_version", path));
  require(info.format_version == checkpoint_format_version,
          "'" + path + "' has checkpoint format version " + std::to_string(info.format_version) +
              "; this build reads version " + std::to_string(checkpoint_format_version));
  info.dims.vocab = read_attr_i64(file, "vocab", path);
  info.dims.width = read_attr_i64(file, "width", path);
  info.dims.state = read_attr_i64(file, "state", path);
  info.dims.layers = read_attr_i64(file, "layers", path);
  info.dims.seed = std::uint64_t(read_attr_i64(file, "seed", path));
  info.precision = read_attr_str(file, "precision", path);
  info.step = read_attr_i64(file, "step", path);
  info.data_cursor = read_attr_i64(file, "data_cursor", path);
  try {
    info.config.merge(nlohmann::json::parse(read_attr_str(file, "config", path)), path + " (config attribute)");
  } catch (const nlohmann::json::exception& e) {
    throw Error("'" + path + "': config attribute is not valid JSON: " + e.what());
  }
  const auto cd = info.config.model();
  require(cd == info.dims, "'" + path + "': model sizes in the attributes and in the stored config disagree");
  require(info.dims.vocab >= 2 && info.dims.width >= 1 && info.dims.state >= 1 && info.dims.layers >= 1,
          "'" + path + "': invalid model sizes");
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
  });
}

template <class S>
bool load_optimizer_state(const std::string& path, const ParamSet<S>& m, const ParamSet<S>& v, std::int64_t* step) {
  Handle file = open_for_read(path, "checkpoint");
  read_header(file, path);
  if (H5Lexists(file, "/optimizer", H5P_DEFAULT) <= 0) return false;
  read_paramset(file, "/optimizer/m", m, path);
  read_paramset(file, "/optimizer/v", v, path);
  Handle g(H5Gopen2(file, "/optimizer", H5P_DEFAULT), H5Gclose);
  if (step) *step = read_attr_i64(g, "step", path);
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
      Handle sp(H5Dget_space(ds), H5Sclose);
      const int rank = H5Sget_simple_extent_ndims(sp);
      std::vector<hsize_t> dims(rank > 0 ? rank : 0);
      if (rank > 0) H5Sget_simple_extent_dims(sp, dims.data(), nullptr);
      d.shape.assign(dims.begin(), dims.end());
      Handle ft(H5Dget_type(ds), H5Tclose);
      d.dtype = H5Tget_class(ft) == H5T_FLOAT ? (H5Tget_size(ft) == 8 ? "float64" : "float32") : "non-float";
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
  read_paramset(file, "/params", params, path);
  if (info_out) *info_out = info;
  return params;
}

template <class S>
void save_gradients(const std::string& path, const Config& cfg, double loss, const ParamSet<S>& grad) {
  write_atomically(path, [&](hid_t file) {
    write_header<S>(file, cfg, grad.dims(), 0, 0);
    Handle sp(H5Screate(H5S_SCALAR), H5Sclose);
    Handle ds(H5Dcreate2(file, "/loss", H5T_IEEE_F64LE, sp, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT), H5Dclose);
    require(ds.ok(), "HDF5: cannot create /loss");
    check(H5Dwrite(ds, H5T_NATIVE_DOUBLE, H5S_ALL, H5S_ALL, H5P_DEFAULT, &loss), "writing /loss");
    write_paramset(file, "/grad", grad);
  });
}

ParamSet<double> load_gradients(const std::string& path, const ModelDims& dims, double* loss) {
  Handle file = open_for_read(path, "gradient file");
  ParamSet<double> g(dims);
  read_paramset(file, "/grad", g, path);
  if (loss) {
    Handle ds(H5Dopen2(file, "/loss", H5P_DEFAULT), H5Dclose);
    require(ds.ok(), "'" + path + "' lacks /loss");
    check(H5Dread(ds, H5T_NATIVE_DOUBLE, H5S_ALL, H5S_ALL, H5P_DEFAULT, loss), "reading /loss");
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
template ParamSet<float> load_checkpoint<float>(const std::string&, CheckpointInfo*);
template ParamSet<double> load_checkpoint<double>(const std::string&, CheckpointInfo*);
template ParamSet<float> load_checkpoint<float>(const std::string&, const LayerRange&, CheckpointInfo*);
template ParamSet<double> load_checkpoint<double>(const std::string&, const LayerRange&, CheckpointInfo*);
template void save_gradients<float>(const std::string&, const Config&, double, const ParamSet<float>&);
template void save_gradients<double>(const std::string&, const Config&, double, const ParamSet<double>&);

}  // namespace ash
