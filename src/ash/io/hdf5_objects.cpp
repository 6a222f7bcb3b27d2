#include "ash/io/hdf5_objects.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "ash/core/error.hpp"

namespace ash::io {

namespace {

struct QuietHdf5 {  // our messages replace HDF5's error stack dumps
  QuietHdf5() { H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr); }
};
const QuietHdf5 quiet_hdf5;

struct ScalarAttr {
  Handle attr, type;
};

// The attribute `name` of loc for a strict read: present, of class `cls` (not
// one HDF5 would convert: 1.5 -> 1), and one element (HDF5 would read the
// first of an array attribute silently). `kind` names the class in messages.
ScalarAttr open_scalar_attr(hid_t loc, const char* name, const std::string& file, H5T_class_t cls, const char* kind) {
  require(H5Aexists(loc, name) > 0, "checkpoint '" + file + "' lacks attribute '" + name + "'");
  Handle a(H5Aopen(loc, name, H5P_DEFAULT), H5Aclose);
  require(a.ok(), "'" + file + "': cannot open attribute '" + name + "' (corrupt file)");
  Handle ft(H5Aget_type(a), H5Tclose);
  require(ft.ok() && H5Tget_class(ft) == cls, "'" + file + "': attribute '" + name + "' is not " + kind);
  Handle sp(H5Aget_space(a), H5Sclose);
  require(sp.ok() && H5Sget_simple_extent_npoints(sp) == 1,
          "'" + file + "': attribute '" + name + "' is not a single value");
  return {std::move(a), std::move(ft)};
}

}  // namespace

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
  const ScalarAttr s = open_scalar_attr(loc, name, file, H5T_INTEGER, "an integer");
  std::int64_t v = 0;
  require(H5Aread(s.attr, H5T_NATIVE_INT64, &v) >= 0, "'" + file + "': cannot read attribute '" + name + "'");
  return v;
}

std::string read_attr_str(hid_t loc, const char* name, const std::string& file) {
  const ScalarAttr s = open_scalar_attr(loc, name, file, H5T_STRING, "a string");
  require(H5Tis_variable_str(s.type) <= 0, std::string("attribute ") + name + " is a variable-length string");
  const std::size_t n = H5Tget_size(s.type);
  std::string buf(n, '\0');
  Handle mt(H5Tcopy(H5T_C_S1), H5Tclose);
  H5Tset_size(mt, n);
  H5Tset_strpad(mt, H5T_STR_NULLPAD);
  require(n > 0 && H5Aread(s.attr, mt, &buf[0]) >= 0, "'" + file + "': cannot read attribute '" + name + "'");
  return buf.substr(0, buf.find('\0'));
}

hid_t link_create_plist() {
  hid_t lcpl = H5Pcreate(H5P_LINK_CREATE);
  if (lcpl >= 0) H5Pset_create_intermediate_group(lcpl, 1);
  return lcpl;
}

// float32 / float64 IEEE only (float16, integers, custom floats are refused).
bool is_f32_or_f64(hid_t t) {
  // A named array, not a braced list in the range-for: nvcc 13 mistranslates a
  // braced list of comma expressions (HDF5's H5T_* macros are (H5open(), id)).
  const hid_t accepted[] = {H5T_IEEE_F32LE, H5T_IEEE_F32BE, H5T_IEEE_F64LE, H5T_IEEE_F64BE};
  for (hid_t ok : accepted)
    if (H5Tequal(t, ok) > 0) return true;
  return false;
}

std::string dtype_name(hid_t t) {
  const auto c = H5Tget_class(t);
  const auto n = H5Tget_size(t);
  if (c == H5T_FLOAT) return "float" + std::to_string(8 * n);
  if (c == H5T_INTEGER) return "int" + std::to_string(8 * n);
  return "non-numeric";
}

Handle open_for_read(const std::string& path, const char* what) {
  // Looked at without blocking before HDF5 opens it: open(2) of a FIFO for
  // reading waits for a writer, and a read from a device may never end.
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) throw Error(std::string("cannot open ") + what + " '" + path + "': " + std::strerror(errno));
  struct stat st {};
  const bool regular = ::fstat(fd, &st) == 0 && S_ISREG(st.st_mode);
  ::close(fd);
  require(regular, std::string(what) + " '" + path + "' is not a regular file");
  require(H5Fis_hdf5(path.c_str()) > 0, std::string(what) + " '" + path + "' is not an HDF5 file (corrupt?)");
  Handle file(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), H5Fclose);
  require(file.ok(), std::string("cannot read ") + what + " '" + path + "' (truncated or corrupt HDF5 file)");
  return file;
}

// ---- the closed structure ---------------------------------------------------

namespace {

// HDF5 1.12 renamed the link and object info structs and their functions.
#if H5_VERSION_GE(1, 12, 0)
using LinkInfo = H5L_info2_t;
using ObjectInfo = H5O_info2_t;
herr_t visit_links(hid_t g, H5L_iterate2_t op, void* data) {
  return H5Lvisit2(g, H5_INDEX_NAME, H5_ITER_INC, op, data);
}
herr_t object_info(hid_t loc, const char* name, ObjectInfo* oi) {
  return H5Oget_info_by_name3(loc, name, oi, H5O_INFO_BASIC, H5P_DEFAULT);
}
#else
using LinkInfo = H5L_info_t;
using ObjectInfo = H5O_info_t;
herr_t visit_links(hid_t g, H5L_iterate_t op, void* data) { return H5Lvisit(g, H5_INDEX_NAME, H5_ITER_INC, op, data); }
herr_t object_info(hid_t loc, const char* name, ObjectInfo* oi) {
  return H5Oget_info_by_name2(loc, name, oi, H5O_INFO_BASIC, H5P_DEFAULT);
}
#endif

struct Walk {
  Objects objects;
  std::string problem;
};

// H5Lvisit recurses into hard-linked groups only, so `name` resolves through
// hard links; nothing here may throw through HDF5's C frames.
herr_t visit_link(hid_t g, const char* name, const LinkInfo* li, void* data) {
  auto& w = *static_cast<Walk*>(data);
  const std::string path = std::string("/") + name;
  if (li->type != H5L_TYPE_HARD) {
    w.problem = path + (li->type == H5L_TYPE_SOFT       ? " is a soft link"
                        : li->type == H5L_TYPE_EXTERNAL ? " is an external link (to another file)"
                                                        : " is a user-defined link");
    return 1;
  }
  ObjectInfo oi;
  if (object_info(g, name, &oi) < 0) {
    w.problem = "the object at " + path + " cannot be read (corrupt file)";
    return 1;
  }
  // A second name for an object would let /params/head be /params/embedding.
  if (oi.rc != 1) {
    w.problem = path + " is one object under " + std::to_string(oi.rc) + " names (hard links)";
    return 1;
  }
  if (oi.type == H5O_TYPE_GROUP)
    w.objects[path] = ObjectKind::group;
  else if (oi.type == H5O_TYPE_DATASET)
    w.objects[path] = ObjectKind::dataset;
  else {
    w.problem = path + " is neither a group nor a dataset";
    return 1;
  }
  return 0;
}

// "" when the dataset's bytes are in the file and need no filter but Fletcher-32.
std::string storage_problem(hid_t ds) {
  Handle dcpl(H5Dget_create_plist(ds), H5Pclose);
  if (!dcpl.ok()) return "has an unreadable storage description";
  const H5D_layout_t layout = H5Pget_layout(dcpl);
  if (layout != H5D_COMPACT && layout != H5D_CONTIGUOUS && layout != H5D_CHUNKED)
    return "is a virtual dataset (its data lives in other datasets or files)";
  if (H5Pget_external_count(dcpl) != 0) return "keeps its data in external files";
  const int n = H5Pget_nfilters(dcpl);
  for (int i = 0; i < n; ++i) {
    unsigned flags = 0, config = 0;
    std::size_t nelem = 0;
    const H5Z_filter_t id = H5Pget_filter2(dcpl, unsigned(i), &flags, &nelem, nullptr, 0, nullptr, &config);
    if (id != H5Z_FILTER_FLETCHER32)
      return "uses HDF5 filter " + std::to_string(id) + " (only Fletcher-32 is allowed)";
  }
  return "";
}

}  // namespace

Objects list_objects(hid_t file, const std::string& fname) {
  Walk w;
  const herr_t rc = visit_links(file, visit_link, &w);
  const std::string why = " (ash files hold only groups and datasets under single hard links)";
  require(w.problem.empty(), "not an ash checkpoint: '" + fname + "': " + w.problem + why);
  require(rc >= 0, "'" + fname + "': cannot list the objects (corrupt file)");
  for (const auto& o : w.objects) {
    if (o.second != ObjectKind::dataset) continue;
    Handle ds(H5Dopen2(file, o.first.c_str(), H5P_DEFAULT), H5Dclose);
    require(ds.ok(), "'" + fname + "': cannot open dataset " + o.first + " (corrupt file)");
    const std::string p = storage_problem(ds);
    require(p.empty(), "not an ash checkpoint: '" + fname + "': dataset " + o.first + " " + p);
  }
  return w.objects;
}

}  // namespace ash::io
