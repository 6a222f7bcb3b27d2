#include "ash/io/checkpoint.hpp"

#include <cmath>
#include <map>
#include <type_traits>

#include "ash/core/error.hpp"
#include "ash/core/sizes.hpp"
#include "ash/io/atomic_write.hpp"
#include "ash/io/hdf5_digest.hpp"
#include "ash/io/hdf5_objects.hpp"
#include "ash/io/hdf5_rows.hpp"

namespace ash {

using namespace io;  // the HDF5 plumbing (io/hdf5_*.hpp, io/atomic_write.hpp); this file is the schema

namespace {

template <class S>
hid_t mem_type_of() {
  return std::is_same<S, double>::value ? H5T_NATIVE_DOUBLE : H5T_NATIVE_FLOAT;
}
template <class S>
hid_t file_type_of() {
  return std::is_same<S, double>::value ? H5T_IEEE_F64LE : H5T_IEEE_F32LE;
}

// The writer's half of "finite values" (docs/file_format.md): what a reader
// refuses is never written. `file` names the file in the message; the
// write is abandoned before its temporary file exists.
template <class S>
void require_finite(const S* v, std::size_t n, const std::string& what, const std::string& file) {
  for (std::size_t i = 0; i < n; ++i)
    if (!std::isfinite(v[i]))
      throw Error("cannot write '" + file + "': " + what + " holds a non-finite value (" +
                  std::to_string(double(v[i])) + " at index " + std::to_string(i) +
                  "), which no reader accepts; nothing was written (the previous "
                  "file, if any, is unchanged)");
}

template <class S>
void write_paramset(hid_t file, const std::string& group, const ParamSet<S>& ps, const std::string& fname) {
  auto host = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), ps.data());
  for (const auto& t : ps.tensors())
    require_finite(host.data() + t.offset, std::size_t(t.size()), group + "/" + t.name, fname);
  Handle lcpl(link_create_plist(), H5Pclose);
  for (const auto& t : ps.tensors()) {
    std::vector<hsize_t> dims(t.shape.begin(), t.shape.end());
    Handle dcpl = checksummed_dcpl(dims, sizeof(S));
    write_dataset(file, group + "/" + t.name, file_type_of<S>(), dims, dcpl, lcpl, mem_type_of<S>(),
                  host.data() + t.offset);
  }
}

// An open file whose structure has been checked: every object is a group or
// a dataset under a single hard link, and (after read_header) every path is
// one of the format's for the stored sizes.
struct Reader {
  Handle file;
  std::string path;
  Objects objects;
  CheckpointInfo info;
  bool verify = true;  // format 3: digests checked on reading

  bool has(const std::string& p, ObjectKind k) const {
    const auto it = objects.find(p);
    return it != objects.end() && it->second == k;
  }
};

std::string shape_str(const std::vector<std::int64_t>& s) {
  std::string o = "[";
  for (std::size_t i = 0; i < s.size(); ++i) o += (i ? "," : "") + std::to_string(s[i]);
  return o + "]";
}

// Opens a dataset of the schema and checks what holds for every one of them:
// exact shape, float32 / float64, Fletcher-32 in formats 2 and 3.
Handle open_dataset(const Reader& r, const std::string& path, const std::vector<std::int64_t>& shape) {
  require(r.has(path, ObjectKind::dataset), "'" + r.path + "' lacks dataset " + path);
  Handle ds(H5Dopen2(r.file, path.c_str(), H5P_DEFAULT), H5Dclose);
  require(ds.ok(), "'" + r.path + "': cannot open dataset " + path);
  Handle sp(H5Dget_space(ds), H5Sclose);
  const int rank = H5Sget_simple_extent_ndims(sp);
  std::vector<hsize_t> dims(rank > 0 ? rank : 0);
  if (rank > 0) H5Sget_simple_extent_dims(sp, dims.data(), nullptr);
  const std::vector<std::int64_t> got(dims.begin(), dims.end());
  require(rank >= 0 && got == shape, "'" + r.path + "': dataset " + path + " has shape " + shape_str(got) +
                                         ", expected " + shape_str(shape) + " from the model sizes");
  Handle ft(H5Dget_type(ds), H5Tclose);
  require(ft.ok() && is_f32_or_f64(ft), "'" + r.path + "': dataset " + path + " is " +
                                            (ft.ok() ? dtype_name(ft) : std::string("unreadable")) +
                                            "; checkpoints hold float32 or float64");
  // Formats 2 and 3 always checksum; a dataset without the filter was altered.
  require(r.info.format_version < 2 || has_fletcher32(ds), "'" + r.path + "': dataset " + path +
                                                               " has no Fletcher-32 checksum (format " +
                                                               std::to_string(r.info.format_version) + " has one)");
  return ds;
}

template <class S>
void read_values(const Reader& r, hid_t ds, const std::string& path, S* out, std::size_t n) {
  read_dataset(ds, path, mem_type_of<S>(), out, r.verify && r.info.format_version >= 3, r.path);
  for (std::size_t i = 0; i < n; ++i)
    require(std::isfinite(out[i]), "dataset " + path + " of '" + r.path + "' holds a non-finite value (" +
                                       std::to_string(double(out[i])) + " at index " + std::to_string(i) + ")");
}

template <class S>
void read_paramset(const Reader& r, const std::string& group, const ParamSet<S>& ps) {
  auto host = Kokkos::create_mirror_view(ps.data());
  for (const auto& t : ps.tensors()) {
    const std::string path = group + "/" + t.name;
    Handle ds = open_dataset(r, path, t.shape);
    read_values(r, ds, path, host.data() + t.offset, std::size_t(t.size()));
  }
  Kokkos::deep_copy(ps.data(), host);
}

template <class S>
void write_carried_state(hid_t file, const std::vector<View2<S>>& state, const std::string& fname) {
  const hsize_t K = state.size(), R = state[0].extent(0), N = state[0].extent(1);
  std::vector<S> host(std::size_t(K * R * N));
  for (hsize_t k = 0; k < K; ++k) {
    Kokkos::View<S**, Kokkos::LayoutRight, Kokkos::HostSpace, Kokkos::MemoryTraits<Kokkos::Unmanaged>> h(
        host.data() + k * R * N, R, N);
    Kokkos::deep_copy(h, state[k]);
  }
  require_finite(host.data(), host.size(), std::string("/train/carry_state"), fname);
  std::vector<hsize_t> dims{K, R, N};
  Handle lcpl(link_create_plist(), H5Pclose);
  Handle dcpl = checksummed_dcpl(dims, sizeof(S));
  write_dataset(file, "/train/carry_state", file_type_of<S>(), dims, dcpl, lcpl, mem_type_of<S>(), host.data());
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
  write_attr_str(file, "rng_state",
                 "splitmix64(seed=" + std::to_string(d.seed) + ", step=" + std::to_string(step) + ")");
  write_attr_str(file, "engine", method_name(cfg.settings().grad.method));
  write_attr_str(file, "config", cfg.stored_json().dump());
}

// The closed schema: every path a file of these sizes may hold, and its kind
// (docs/file_format.md). A checkpoint and a gradient file share it.
Objects schema(const ModelDims& d) {
  Objects s;
  for (const std::string root : {"/params", "/optimizer/m", "/optimizer/v", "/grad"}) {
    s[root] = ObjectKind::group;
    for (const auto& t : param_layout(d)) {
      const std::string p = root + "/" + t.name;
      for (std::size_t i = p.find('/', root.size() + 1); i != std::string::npos; i = p.find('/', i + 1))
        s[p.substr(0, i)] = ObjectKind::group;
      s[p] = ObjectKind::dataset;
    }
  }
  s["/optimizer"] = ObjectKind::group;
  s["/train"] = ObjectKind::group;
  s["/train/carry_state"] = ObjectKind::dataset;
  s["/loss"] = ObjectKind::dataset;
  return s;
}

void check_schema(const Reader& r) {
  const Objects allowed = schema(r.info.dims);
  for (const auto& o : r.objects) {
    const auto it = allowed.find(o.first);
    const char* kind = o.second == ObjectKind::group ? "group" : "dataset";
    require(it != allowed.end(), "not an ash checkpoint: '" + r.path + "' holds " + kind + " " + o.first +
                                     ", which is not part of the format");
    require(it->second == o.second, "not an ash checkpoint: '" + r.path + "': " + o.first + " is a " + kind +
                                        ", the format has a " +
                                        (it->second == ObjectKind::group ? "group" : "dataset") + " there");
  }
}

// The shape of every dataset of the format in a file of these sizes (a scalar:
// {}), but /train/carry_state, whose batch the file does not fix.
std::map<std::string, std::vector<std::int64_t>> schema_shapes(const ModelDims& d) {
  std::map<std::string, std::vector<std::int64_t>> s;
  for (const std::string root : {"/params", "/optimizer/m", "/optimizer/v", "/grad"})
    for (const auto& t : param_layout(d)) s[root + "/" + t.name] = t.shape;
  s["/loss"] = {};
  return s;
}

// Every dataset's declared shape, type and storage against the schema and the
// model sizes, before anything is read or sized from the file: the extent is
// only a number in a dataspace message (an 84 KB file can declare /params/head
// [2^31, 2^31], 16 EiB), so it must equal the one the (checked) model sizes
// give, and all the bytes the datasets declare must fit in the file (nothing
// is compressed). Only then is the chunk index walked (extent_problem), its
// length bounded by the file's size.
void check_datasets(const Reader& r) {
  const auto shapes = schema_shapes(r.info.dims);
  const ModelDims& d = r.info.dims;
  struct Declared {
    std::string path;
    std::vector<hsize_t> dims;
    std::size_t elem;
  };
  std::vector<Declared> declared;
  hsize_t total = 0;
  for (const auto& o : r.objects) {
    if (o.second != ObjectKind::dataset) continue;
    const std::string& p = o.first;
    Handle ds(H5Dopen2(r.file, p.c_str(), H5P_DEFAULT), H5Dclose);
    require(ds.ok(), "'" + r.path + "': cannot open dataset " + p + " (corrupt file)");
    Handle sp(H5Dget_space(ds), H5Sclose);
    const H5S_class_t cls = sp.ok() ? H5Sget_simple_extent_type(sp) : H5S_NO_CLASS;
    const int rank = sp.ok() ? H5Sget_simple_extent_ndims(sp) : -1;
    require((cls == H5S_SCALAR || cls == H5S_SIMPLE) && rank >= 0 && rank <= 32,
            "'" + r.path + "': dataset " + p + " has an unreadable or empty dataspace");
    std::vector<hsize_t> dims(std::size_t(rank), 0);
    if (rank > 0) H5Sget_simple_extent_dims(sp, dims.data(), nullptr);
    const std::vector<std::int64_t> got(dims.begin(), dims.end());
    if (p == "/train/carry_state") {
      // [K, B·P, N] (a Mamba: [K, B·E, Kc−1+N]) for a batch B >= 1 (the run that resumes it checks its own B).
      const std::int64_t rows = d.carry_rows(), cols = d.carry_cols();
      const bool ok = rank == 3 && got[0] == d.layers && got[2] == cols && got[1] >= rows && got[1] % rows == 0;
      require(ok, "'" + r.path + "': dataset " + p + " has shape " + shape_str(got) + ", expected [" +
                      std::to_string(d.layers) + ",B*" + std::to_string(rows) + "," + std::to_string(cols) + "] " +
                      (d.mamba() ? "(layers, batch x inner width, conv_kernel-1 + state)"
                                 : "(layers, batch x width, state)") +
                      " from the model sizes");
    } else {
      const auto want = shapes.find(p);
      require(want != shapes.end(),
              "not an ash checkpoint: '" + r.path + "' holds dataset " + p + ", which is not part of the format");
      require(cls == (want->second.empty() ? H5S_SCALAR : H5S_SIMPLE) && got == want->second,
              "'" + r.path + "': dataset " + p + " has shape " + shape_str(got) + ", expected " +
                  shape_str(want->second) + " from the model sizes");
    }
    Handle ft(H5Dget_type(ds), H5Tclose);
    require(ft.ok() && is_f32_or_f64(ft), "'" + r.path + "': dataset " + p + " is " +
                                              (ft.ok() ? dtype_name(ft) : std::string("unreadable")) +
                                              "; checkpoints hold float32 or float64");
    // Formats 2 and 3 always checksum (but /loss, a scalar in the object header).
    require(r.info.format_version < 2 || p == "/loss" || has_fletcher32(ds),
            "'" + r.path + "': dataset " + p + " has no Fletcher-32 checksum (format " +
                std::to_string(r.info.format_version) + " has one)");
    hsize_t bytes = H5Tget_size(ft);
    for (hsize_t x : dims)
      require(!__builtin_mul_overflow(bytes, x, &bytes),
              "'" + r.path + "': dataset " + p + " has shape " + shape_str(got) + ", more than 2^64 bytes");
    require(!__builtin_add_overflow(total, bytes, &total),
            "'" + r.path + "': its datasets declare more than 2^64 bytes");
    declared.push_back({p, dims, H5Tget_size(ft)});
  }
  hsize_t fsize = 0;
  require(H5Fget_filesize(r.file, &fsize) >= 0, "'" + r.path + "': cannot tell its size");
  require(total <= fsize, "'" + r.path + "' is " + std::to_string(fsize) + " bytes, and its datasets declare " +
                              std::to_string(total) + " bytes of values (model sizes V=" + std::to_string(d.vocab) +
                              " P=" + std::to_string(d.width) + " N=" + std::to_string(d.state) +
                              " K=" + std::to_string(d.layers) + "): the file is truncated or was altered");
  for (const auto& x : declared) {
    Handle ds(H5Dopen2(r.file, x.path.c_str(), H5P_DEFAULT), H5Dclose);
    require(ds.ok(), "'" + r.path + "': cannot open dataset " + x.path + " (corrupt file)");
    const std::string problem = extent_problem(ds, x.dims, x.elem);
    require(problem.empty(), "not an ash checkpoint: '" + r.path + "': dataset " + x.path + " " + problem);
  }
}

void read_header(Reader& r) {
  const hid_t file = r.file;
  const std::string& path = r.path;
  CheckpointInfo& info = r.info;
  require(has_attr(file, "format_version"), "'" + path + "' is not an AdjointSharding checkpoint (no format_version)");
  const auto version = read_attr_i64(file, "format_version", path);
  // Versions 1 (no checksums) and 2 (Fletcher-32 only) still load; see docs/file_format.md.
  require(version >= 1 && version <= checkpoint_format_version,
          "'" + path + "' has checkpoint format version " + std::to_string(version) +
              "; this build reads versions 1 to " + std::to_string(checkpoint_format_version));
  info.format_version = int(version);
  // A file that declares format 1 or 2 is read without digests, so its
  // declaration must agree with its contents: no writer of those formats made
  // a `digest` attribute. One there means format_version was lowered (h5py can
  // do it in one line) to switch the digests off; refused.
  if (version < 3) {
    const auto format3_mark = [&](const std::string& obj) {
      return H5Aexists_by_name(file, obj.c_str(), digest_attr, H5P_DEFAULT) != 0;  // < 0: unreadable, refused too
    };
    std::string marked = format3_mark("/") ? "/" : "";
    for (auto it = r.objects.begin(); marked.empty() && it != r.objects.end(); ++it)
      if (format3_mark(it->first)) marked = it->first;
    require(marked.empty(), "'" + path + "' declares checkpoint format version " + std::to_string(version) +
                                ", which its contents contradict: " + (marked == "/" ? "the root" : marked) +
                                " carries a format-3 digest attribute (format_version was lowered, which would "
                                "switch the digest checks off); refusing the file");
  }
  // The digest first: an altered header is reported as such, not as whatever
  // value it now holds.
  if (version >= 3 && r.verify) verify_header(file, r.objects, path);
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
  if (has_attr(file, "data_tokens")) {
    info.data_tokens = read_attr_i64(file, "data_tokens", path);
    require(info.data_tokens >= 0, "'" + path + "': data_tokens " + std::to_string(info.data_tokens) + " is negative");
    info.data_fingerprint = std::uint64_t(read_attr_i64(file, "data_fingerprint", path));
  }
  info.config.merge(parse_json_strict(read_attr_str(file, "config", path), "'" + path + "': config attribute"),
                    path + " (config attribute)");

  // The architecture and its sizes beyond the attributes' are in the stored
  // configuration only (the attributes are format 3's, unchanged; a file without
  // model.arch is an SSM-ResNet): the dims are the configuration's, whose sizes
  // must be the attributes', and the seed is the attributes'.
  const ModelDims attrs = info.dims;
  info.dims = info.config.model();
  require(info.dims.vocab == attrs.vocab && info.dims.width == attrs.width && info.dims.state == attrs.state &&
              info.dims.layers == attrs.layers,
          "'" + path + "': model sizes in the attributes and in the stored config disagree");
  info.dims.seed = attrs.seed;
  // Sizes from a file are checked before they size an allocation, as a
  // configuration's are. (The rest of the stored configuration is validated by
  // whoever uses it, after --config / --set, so an old file with a
  // since-tightened value still loads.)
  try {
    check_model_dims(info.dims);
  } catch (const Error& e) {
    throw Error("'" + path + "': invalid model sizes: " + e.what());
  }
}

// Opens a checkpoint or gradient file: a regular HDF5 file, its links all
// hard, its header valid (and its digest verified when `verify`), every
// object one of the format's.
Reader open_checkpoint(const std::string& path, const char* what, bool verify = true) {
  Reader r{open_for_read(path, what), path, {}, {}, verify};
  r.objects = list_objects(r.file, path);
  read_header(r);
  check_schema(r);
  check_datasets(r);
  return r;
}

// /loss of a gradient file: a finite float scalar.
double read_loss(const Reader& r) {
  const std::string& path = r.path;
  require(r.has("/loss", ObjectKind::dataset), "'" + path + "' lacks /loss");
  Handle ds(H5Dopen2(r.file, "/loss", H5P_DEFAULT), H5Dclose);
  require(ds.ok(), "'" + path + "': cannot open /loss (corrupt file)");
  Handle sp(H5Dget_space(ds), H5Sclose);
  Handle ft(H5Dget_type(ds), H5Tclose);
  require(sp.ok() && H5Sget_simple_extent_ndims(sp) == 0 && ft.ok() && is_f32_or_f64(ft),
          "'" + path + "': /loss is not a float scalar");
  double loss = 0;
  read_dataset(ds, "/loss", H5T_NATIVE_DOUBLE, &loss, r.info.format_version >= 3, path);
  require(std::isfinite(loss), "'" + path + "': /loss is not finite");
  return loss;
}

}  // namespace

template <class S>
void save_checkpoint(const std::string& path, const Config& cfg, const ParamSet<S>& params, std::int64_t step,
                     std::int64_t data_cursor, const OptimizerState<S>& opt) {
  require(cfg.model() == params.dims(), "save_checkpoint: config sizes differ from the parameters'");
  // What every reader refuses is never written.
  require(step >= 0 && data_cursor >= 0, "'" + path + "': step " + std::to_string(step) + " and data_cursor " +
                                             std::to_string(data_cursor) + " must be >= 0: nothing written");
  write_atomically(path, [&](hid_t file) {
    write_header<S>(file, cfg, params.dims(), step, data_cursor);
    write_paramset(file, "/params", params, path);
    if (opt.m && opt.v) {
      write_paramset(file, "/optimizer/m", *opt.m, path);
      write_paramset(file, "/optimizer/v", *opt.v, path);
      Handle g(H5Gopen2(file, "/optimizer", H5P_DEFAULT), H5Gclose);
      write_attr_i64(g, "step", opt.step);
    }
    if (opt.carry && !opt.carry->empty()) write_carried_state(file, *opt.carry, path);
    if (opt.data_tokens >= 0) {  // what the data cursor indexes
      write_attr_i64(file, "data_tokens", opt.data_tokens);
      write_attr_i64(file, "data_fingerprint", std::int64_t(opt.data_fingerprint));
    }
    seal_header(file);
  });
}

template <class S>
bool load_carried_state(const std::string& path, const std::vector<View2<S>>& state) {
  const Reader r = open_checkpoint(path, "checkpoint");
  const std::string name = "/train/carry_state";
  if (!r.has(name, ObjectKind::dataset)) return false;
  require(!state.empty(), "'" + path + "' holds a carried state but this run carries none");
  const hsize_t K = state.size(), R = state[0].extent(0), N = state[0].extent(1);
  {
    Handle ds(H5Dopen2(r.file, name.c_str(), H5P_DEFAULT), H5Dclose);
    require(ds.ok(), "'" + path + "': cannot open " + name);
    Handle sp(H5Dget_space(ds), H5Sclose);
    hsize_t dims[3] = {0, 0, 0};
    require(H5Sget_simple_extent_ndims(sp) == 3 && H5Sget_simple_extent_dims(sp, dims, nullptr) == 3 && dims[0] == K &&
                dims[1] == R && dims[2] == N,
            "'" + path + "': " + name + " does not match this run's layers, batch and sizes [" + std::to_string(K) +
                "," + std::to_string(R) + "," + std::to_string(N) + "]");
  }
  Handle ds = open_dataset(r, name, {std::int64_t(K), std::int64_t(R), std::int64_t(N)});
  std::vector<S> host(std::size_t(K * R * N));
  read_values(r, ds, name, host.data(), host.size());
  for (hsize_t k = 0; k < K; ++k) {
    Kokkos::View<S**, Kokkos::LayoutRight, Kokkos::HostSpace, Kokkos::MemoryTraits<Kokkos::Unmanaged>> h(
        host.data() + k * R * N, R, N);
    Kokkos::deep_copy(state[k], h);
  }
  return true;
}

template <class S>
bool load_optimizer_state(const std::string& path, const ParamSet<S>& m, const ParamSet<S>& v, std::int64_t* step) {
  const Reader r = open_checkpoint(path, "checkpoint");
  if (!r.has("/optimizer", ObjectKind::group)) return false;
  read_paramset(r, "/optimizer/m", m);
  read_paramset(r, "/optimizer/v", v);
  Handle g(H5Gopen2(r.file, "/optimizer", H5P_DEFAULT), H5Gclose);
  require(g.ok(), "'" + path + "': cannot open /optimizer (corrupt file)");
  const auto s = read_attr_i64(g, "step", path);
  require(s >= 0, "'" + path + "': /optimizer step " + std::to_string(s) + " is negative");
  if (step) *step = s;
  return true;
}

CheckpointInfo inspect_checkpoint(const std::string& path) { return inspect_checkpoint(path, Verify::header); }

CheckpointInfo inspect_checkpoint(const std::string& path, Verify verify) {
  const Reader r = open_checkpoint(path, "checkpoint", verify != Verify::none);
  CheckpointInfo info = r.info;
  for (const auto& t : param_layout(info.dims)) {
    const std::string p = "/params/" + t.name;
    CheckpointInfo::Dataset d{p, {}, "missing"};
    if (r.has(p, ObjectKind::dataset)) {
      Handle ds(H5Dopen2(r.file, p.c_str(), H5P_DEFAULT), H5Dclose);
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
  // Every dataset read through, a block at a time: Fletcher-32 (formats 2,
  // 3), the digests (3), and every value finite, as the loaders require.
  if (verify == Verify::all) {
    info.finite_values = 0;
    for (const auto& o : r.objects) {
      if (o.second != ObjectKind::dataset) continue;
      Handle ds(H5Dopen2(r.file, o.first.c_str(), H5P_DEFAULT), H5Dclose);
      require(ds.ok(), "'" + path + "': cannot open dataset " + o.first + " (corrupt file)");
      scan_dataset(ds, o.first, H5T_NATIVE_DOUBLE, info.format_version >= 3, path,
                   [&](const void* values, std::size_t first, std::size_t n) {
                     const double* v = static_cast<const double*>(values);
                     for (std::size_t i = 0; i < n; ++i)
                       require(std::isfinite(v[i]), "dataset " + o.first + " of '" + path +
                                                        "' holds a non-finite value (" + std::to_string(v[i]) +
                                                        " at index " + std::to_string(first + i) + ")");
                     info.finite_values += std::int64_t(n);
                   });
    }
  }
  return info;
}

template <class S>
ParamSet<S> load_checkpoint(const std::string& path, CheckpointInfo* info_out) {
  return load_checkpoint<S>(path, LayerRange{}, info_out);
}

template <class S>
ParamSet<S> load_checkpoint(const std::string& path, const LayerRange& range, CheckpointInfo* info_out) {
  const Reader r = open_checkpoint(path, "checkpoint");
  const CheckpointInfo& info = r.info;
  // LayerRange{} (k1 = 0, no layers) stands for the whole model.
  const LayerRange lr = range.k1 == 0 ? LayerRange::all(info.dims) : range;
  require(lr.k1 <= info.dims.layers, "'" + path + "' has " + std::to_string(info.dims.layers) +
                                         " layers; this rank owns layers up to " + std::to_string(lr.k1 - 1));
  // Every tensor present before the parameters are allocated (their sizes
  // were checked against the file's by open_checkpoint).
  for (const auto& t : param_layout(info.dims, lr))
    require(r.has("/params/" + t.name, ObjectKind::dataset), "'" + path + "' lacks dataset /params/" + t.name);
  ParamSet<S> params(info.dims, lr);
  read_paramset(r, "/params", params);
  if (info_out) *info_out = info;
  return params;
}

template <class S>
void save_gradients(const std::string& path, const Config& cfg, double loss, const ParamSet<S>& grad) {
  require_finite(&loss, 1, std::string("/loss"), path);
  write_atomically(path, [&](hid_t file) {
    write_header<S>(file, cfg, grad.dims(), 0, 0);
    // A scalar cannot be chunked (no filter); compact layout keeps the value
    // inside the object header, which the 1.10 format checksums.
    Handle dcpl(H5Pcreate(H5P_DATASET_CREATE), H5Pclose);
    check(H5Pset_layout(dcpl, H5D_COMPACT), "compact layout for /loss");
    write_dataset(file, "/loss", H5T_IEEE_F64LE, {}, dcpl, H5P_DEFAULT, H5T_NATIVE_DOUBLE, &loss);
    write_paramset(file, "/grad", grad, path);
    seal_header(file);
  });
}

ParamSet<double> load_gradients(const std::string& path, const ModelDims& dims, double* loss) {
  const Reader r = open_checkpoint(path, "gradient file");
  require(r.info.dims == dims, "'" + path + "' holds gradients of other model sizes");
  ParamSet<double> g(dims);
  read_paramset(r, "/grad", g);
  if (loss) *loss = read_loss(r);
  return g;
}

namespace {

// Every value of `path` read in its stored type S and written by this build's
// writer: the same tensors, header values and stored configuration, with
// format 3's digests. A file holds parameters (with what training added) or
// gradients, as the writers make them.
template <class S>
void upgrade_as(const std::string& path, const std::string& out) {
  CheckpointInfo info;
  bool grads = false, carry = false;
  std::vector<std::int64_t> carry_shape(3, 0);
  {
    const Reader r = open_checkpoint(path, "checkpoint");
    info = r.info;
    grads = r.has("/grad", ObjectKind::group);
    require(!(grads && r.has("/params", ObjectKind::group)),
            "'" + path + "' holds both /params and /grad, which no writer makes; not upgraded");
    if (grads) {
      ParamSet<S> g(info.dims);
      read_paramset(r, "/grad", g);
      const double loss = read_loss(r);
      save_gradients(out, info.config, loss, g);
      return;
    }
    carry = r.has("/train/carry_state", ObjectKind::dataset);
    if (carry) {
      Handle ds(H5Dopen2(r.file, "/train/carry_state", H5P_DEFAULT), H5Dclose);
      Handle sp(H5Dget_space(ds), H5Sclose);
      hsize_t dims[3] = {0, 0, 0};
      require(ds.ok() && sp.ok() && H5Sget_simple_extent_ndims(sp) == 3 &&
                  H5Sget_simple_extent_dims(sp, dims, nullptr) == 3,
              "'" + path + "': /train/carry_state is not three-dimensional");
      for (int i = 0; i < 3; ++i) carry_shape[std::size_t(i)] = std::int64_t(dims[i]);
    }
  }
  const auto params = load_checkpoint<S>(path);
  ParamSet<S> m(info.dims), v(info.dims);
  std::int64_t opt_step = 0;
  const bool opt = load_optimizer_state(path, m, v, &opt_step);
  std::vector<View2<S>> state;
  if (carry) {
    for (std::int64_t k = 0; k < carry_shape[0]; ++k)
      state.emplace_back("ash::upgrade::carry_state", carry_shape[1], carry_shape[2]);
    load_carried_state(path, state);
  }
  save_checkpoint(out, info.config, params, info.step, info.data_cursor,
                  OptimizerState<S>{opt ? &m : nullptr, opt ? &v : nullptr, opt_step, carry ? &state : nullptr,
                                    info.data_tokens, info.data_fingerprint});
}

}  // namespace

CheckpointInfo upgrade_checkpoint(const std::string& path, const std::string& out) {
  // Every check the old format has, before anything is read for writing.
  const CheckpointInfo before = inspect_checkpoint(path, Verify::all);
  require(before.format_version < checkpoint_format_version,
          "'" + path + "' is already checkpoint format " + std::to_string(before.format_version));
  if (before.precision == "float")
    upgrade_as<float>(path, out);
  else
    upgrade_as<double>(path, out);
  // What was written, read back with every check of format 3.
  const CheckpointInfo after = inspect_checkpoint(out, Verify::all);
  require(after.format_version == checkpoint_format_version && after.finite_values == before.finite_values,
          "'" + out + "': the upgraded file does not hold the values of '" + path + "'");
  return before;
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
