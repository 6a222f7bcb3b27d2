#include "ash/io/hdf5.hpp"

#include <fcntl.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <ctime>
#include <cstdio>
#include <cstring>
#include <new>

#include "ash/core/error.hpp"

namespace ash::io {

namespace {

struct QuietHdf5 {  // our messages replace HDF5's error stack dumps
  QuietHdf5() { H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr); }
};
const QuietHdf5 quiet_hdf5;

// One element: HDF5 would read the first of an array attribute silently.
void require_scalar_attr(hid_t a, const char* name, const std::string& file) {
  Handle sp(H5Aget_space(a), H5Sclose);
  require(sp.ok() && H5Sget_simple_extent_npoints(sp) == 1,
          "'" + file + "': attribute '" + name + "' is not a single value");
}

// Jenkins' lookup3 (hashlittle), the checksum of HDF5's 1.8+ metadata.
std::uint32_t lookup3(const unsigned char* k, std::size_t length) {
  auto rot = [](std::uint32_t x, int r) { return (x << r) | (x >> (32 - r)); };
  std::uint32_t a, b, c;
  a = b = c = 0xdeadbeefu + std::uint32_t(length);
  auto word = [&](int i) {
    return std::uint32_t(k[i]) | std::uint32_t(k[i + 1]) << 8 | std::uint32_t(k[i + 2]) << 16 |
           std::uint32_t(k[i + 3]) << 24;
  };
  while (length > 12) {
    a += word(0), b += word(4), c += word(8);
    a -= c, a ^= rot(c, 4), c += b, b -= a, b ^= rot(a, 6), a += c, c -= b, c ^= rot(b, 8), b += a;
    a -= c, a ^= rot(c, 16), c += b, b -= a, b ^= rot(a, 19), a += c, c -= b, c ^= rot(b, 4), b += a;
    length -= 12, k += 12;
  }
  if (length == 0) return c;
  unsigned char tail[12] = {0};
  std::memcpy(tail, k, length);
  k = tail;
  a += word(0), b += word(4), c += word(8);
  c ^= b, c -= rot(b, 14), a ^= c, a -= rot(c, 11), b ^= a, b -= rot(a, 25), c ^= b, c -= rot(b, 16);
  a ^= c, a -= rot(c, 4), b ^= a, b -= rot(a, 14), c ^= b, c -= rot(b, 24);
  return c;
}

// HDF5 1.10's H5Fget_file_image clears the superblock's status flags without
// recomputing its checksum (the image would not open); recompute it. A
// version-2 superblock with 8-byte offsets is 44 bytes plus the checksum.
void fix_superblock_checksum(std::vector<unsigned char>& img) {
  static const unsigned char sig[8] = {0x89, 'H', 'D', 'F', '\r', '\n', 0x1a, '\n'};
  require(img.size() >= 48 && std::memcmp(img.data(), sig, 8) == 0 && (img[8] == 2 || img[8] == 3) && img[9] == 8,
          "HDF5: unexpected superblock in the file image");
  const std::uint32_t sum = lookup3(img.data(), 44);
  for (int i = 0; i < 4; ++i) img[44 + i] = (unsigned char)(sum >> (8 * i));
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
  require(has_attr(loc, name), "checkpoint '" + file + "' lacks attribute '" + name + "'");
  Handle a(H5Aopen(loc, name, H5P_DEFAULT), H5Aclose);
  require(a.ok(), "'" + file + "': cannot open attribute '" + name + "' (corrupt file)");
  // Strict schema: an integer, not a float HDF5 would convert (1.5 -> 1).
  Handle ft(H5Aget_type(a), H5Tclose);
  require(ft.ok() && H5Tget_class(ft) == H5T_INTEGER, "'" + file + "': attribute '" + name + "' is not an integer");
  require_scalar_attr(a, name, file);
  std::int64_t v = 0;
  require(H5Aread(a, H5T_NATIVE_INT64, &v) >= 0, "'" + file + "': cannot read attribute '" + name + "'");
  return v;
}

std::string read_attr_str(hid_t loc, const char* name, const std::string& file) {
  require(has_attr(loc, name), "checkpoint '" + file + "' lacks attribute '" + name + "'");
  Handle a(H5Aopen(loc, name, H5P_DEFAULT), H5Aclose);
  require(a.ok(), "'" + file + "': cannot open attribute '" + name + "' (corrupt file)");
  Handle ft(H5Aget_type(a), H5Tclose);
  require(ft.ok() && H5Tget_class(ft) == H5T_STRING, "'" + file + "': attribute '" + name + "' is not a string");
  require_scalar_attr(a, name, file);
  require(H5Tis_variable_str(ft) <= 0, std::string("attribute ") + name + " is a variable-length string");
  const std::size_t n = H5Tget_size(ft);
  std::string buf(n, '\0');
  Handle mt(H5Tcopy(H5T_C_S1), H5Tclose);
  H5Tset_size(mt, n);
  H5Tset_strpad(mt, H5T_STR_NULLPAD);
  require(n > 0 && H5Aread(a, mt, &buf[0]) >= 0, "'" + file + "': cannot read attribute '" + name + "'");
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

bool has_fletcher32(hid_t ds) {
  Handle dcpl(H5Dget_create_plist(ds), H5Pclose);
  if (!dcpl.ok()) return false;
  unsigned flags = 0;
  std::size_t nelem = 0;
  unsigned config = 0;
  return H5Pget_filter_by_id2(dcpl, H5Z_FILTER_FLETCHER32, &flags, &nelem, nullptr, 0, nullptr, &config) >= 0;
}

// Format 2: every dataset chunked with HDF5's Fletcher-32 filter, which HDF5
// verifies on every read. One chunk per dataset up to 4 MiB, else blocks of
// rows (a chunk may not exceed 4 GiB).
Handle checksummed_dcpl(const std::vector<hsize_t>& dims, std::size_t elem) {
  Handle dcpl(H5Pcreate(H5P_DATASET_CREATE), H5Pclose);
  require(dcpl.ok(), "HDF5: cannot create a dataset property list");
  constexpr hsize_t target = hsize_t(4) << 20;
  std::vector<hsize_t> chunk(dims);
  hsize_t inner = elem;
  for (std::size_t i = chunk.size(); i-- > 0;) {
    const hsize_t room = std::max<hsize_t>(1, target / inner);
    chunk[i] = std::max<hsize_t>(1, std::min(dims[i], room));
    inner *= chunk[i];
  }
  check(H5Pset_chunk(dcpl, int(chunk.size()), chunk.data()), "setting the chunk size");
  check(H5Pset_fletcher32(dcpl), "enabling the Fletcher-32 checksum");
  return dcpl;
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
herr_t visit_links(hid_t g, H5L_iterate2_t op, void* data) { return H5Lvisit2(g, H5_INDEX_NAME, H5_ITER_INC, op, data); }
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
    if (id != H5Z_FILTER_FLETCHER32) return "uses HDF5 filter " + std::to_string(id) + " (only Fletcher-32 is allowed)";
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

// ---- digests ----------------------------------------------------------------

struct Digest::State {
  XXH3_state_t* s = nullptr;
};

Digest::Digest() : state_(new State) {
  state_->s = XXH3_createState();
  if (!state_->s || XXH3_64bits_reset(state_->s) != XXH_OK) throw std::bad_alloc();
}
Digest::~Digest() { XXH3_freeState(state_->s); }
void Digest::add(const void* bytes, std::size_t n) {
  if (n > 0) XXH3_64bits_update(state_->s, bytes, n);
}
void Digest::add_str(const std::string& s) { add(s.c_str(), s.size() + 1); }
std::uint64_t Digest::value() const { return XXH3_64bits_digest(state_->s); }

namespace {

void add_le64(Digest& d, std::uint64_t v) {
  unsigned char b[8];
  for (int i = 0; i < 8; ++i) b[i] = (unsigned char)(v >> (8 * i));
  d.add(b, 8);
}

herr_t collect_attr_name(hid_t, const char* name, const H5A_info_t*, void* data) {
  static_cast<std::vector<std::string>*>(data)->push_back(name);
  return 0;
}

// One attribute, canonically: 'i' / 'u' and a 64-bit little-endian integer,
// 'f' and a little-endian binary64, or 's', the length (64-bit LE) and the
// bytes of a fixed-length string, padding included.
void add_attr_value(Digest& d, hid_t obj, const std::string& name, const std::string& where) {
  const std::string bad = "not an ash checkpoint: " + where + ": attribute '" + name + "'";
  Handle a(H5Aopen(obj, name.c_str(), H5P_DEFAULT), H5Aclose);
  require(a.ok(), bad + " cannot be opened (corrupt file)");
  Handle t(H5Aget_type(a), H5Tclose);
  Handle sp(H5Aget_space(a), H5Sclose);
  require(t.ok() && sp.ok() && H5Sget_simple_extent_npoints(sp) == 1, bad + " is not a single value");
  switch (H5Tget_class(t)) {
    case H5T_INTEGER: {
      const bool sign = H5Tget_sign(t) != H5T_SGN_NONE;
      std::uint64_t v = 0;
      require(H5Aread(a, sign ? H5T_NATIVE_INT64 : H5T_NATIVE_UINT64, &v) >= 0, bad + " cannot be read");
      d.add(sign ? "i" : "u", 1);
      add_le64(d, v);
      return;
    }
    case H5T_FLOAT: {
      double x = 0;
      require(H5Aread(a, H5T_NATIVE_DOUBLE, &x) >= 0, bad + " cannot be read");
      std::uint64_t v;
      std::memcpy(&v, &x, 8);
      d.add("f", 1);
      add_le64(d, v);
      return;
    }
    case H5T_STRING: {
      require(H5Tis_variable_str(t) == 0, bad + " is a variable-length string");
      std::string v(H5Tget_size(t), '\0');
      require(!v.empty() && H5Aread(a, t, &v[0]) >= 0, bad + " cannot be read");
      d.add("s", 1);
      add_le64(d, v.size());
      d.add(v.data(), v.size());
      return;
    }
    default:
      throw Error(bad + " is not an integer, a float or a fixed-length string");
  }
}

void write_attr_u64(hid_t loc, const char* name, std::uint64_t v) {
  if (H5Aexists(loc, name) > 0) check(H5Adelete(loc, name), std::string("replacing attribute ") + name);
  Handle sp(H5Screate(H5S_SCALAR), H5Sclose);
  Handle a(H5Acreate2(loc, name, H5T_STD_U64LE, sp, H5P_DEFAULT, H5P_DEFAULT), H5Aclose);
  require(a.ok(), std::string("HDF5: cannot create attribute ") + name);
  check(H5Awrite(a, H5T_NATIVE_UINT64, &v), std::string("writing attribute ") + name);
}

// The stored digest of an object; false when it has none (or not a 64-bit integer).
bool read_digest(hid_t loc, std::uint64_t* v) {
  if (H5Aexists(loc, digest_attr) <= 0) return false;
  Handle a(H5Aopen(loc, digest_attr, H5P_DEFAULT), H5Aclose);
  Handle t(a.ok() ? H5Aget_type(a) : -1, H5Tclose);
  Handle sp(a.ok() ? H5Aget_space(a) : -1, H5Sclose);
  return t.ok() && sp.ok() && H5Tget_class(t) == H5T_INTEGER && H5Tget_size(t) == 8 &&
         H5Sget_simple_extent_npoints(sp) == 1 && H5Aread(a, H5T_NATIVE_UINT64, v) >= 0;
}

// Nothing is sized from a dataset's extent before its bytes are known to be stored.
void require_stored_extent(hid_t ds, const std::vector<hsize_t>& dims, std::size_t elem_size, const std::string& path,
                           const std::string& fname) {
  const std::string problem = extent_problem(ds, dims, elem_size);
  require(problem.empty(), "not an ash checkpoint: '" + fname + "': dataset " + path + " " + problem);
}

// Reads a dataset's stored bytes in blocks of rows (a chunk's rows when
// chunked, so each chunk is read and Fletcher-checked once), hands each block
// converted to mem_type to `sink` when there is one, and returns the XXH3-64
// of the path, a NUL and the bytes as stored.
std::uint64_t read_blocks(hid_t ds, const std::string& path, hid_t mem_type, const BlockSink& sink,
                          const std::string& fname) {
  Handle ft(H5Dget_type(ds), H5Tclose);
  const auto cls = ft.ok() ? H5Tget_class(ft) : H5T_NO_CLASS;
  require(cls == H5T_FLOAT || cls == H5T_INTEGER,
          "not an ash checkpoint: '" + fname + "': dataset " + path + " is not numeric");
  Handle fspace(H5Dget_space(ds), H5Sclose);
  const int rank = fspace.ok() ? H5Sget_simple_extent_ndims(fspace) : -1;
  require(rank >= 0 && rank <= 8, "'" + fname + "': dataset " + path + " has an unreadable shape");
  std::vector<hsize_t> dims(std::size_t(rank), 0);
  if (rank > 0) H5Sget_simple_extent_dims(fspace, dims.data(), nullptr);
  const std::size_t fsize = H5Tget_size(ft), msize = sink ? H5Tget_size(mem_type) : 0;
  require_stored_extent(ds, dims, fsize, path, fname);
  hsize_t row = 1;  // elements per index of dimension 0
  for (int i = 1; i < rank; ++i) row *= dims[std::size_t(i)];
  const hsize_t rows = rank > 0 ? dims[0] : 1;
  hsize_t block = std::max<hsize_t>(1, (hsize_t(4) << 20) / std::max<hsize_t>(1, row * std::max(fsize, msize)));
  {
    Handle dcpl(H5Dget_create_plist(ds), H5Pclose);
    hsize_t chunk[32];
    if (rank > 0 && dcpl.ok() && H5Pget_layout(dcpl) == H5D_CHUNKED && H5Pget_chunk(dcpl, rank, chunk) == rank)
      block = chunk[0];
  }
  const bool fletcher = has_fletcher32(ds);
  const std::string failed = fletcher ? "checksum mismatch in dataset " + path + " of '" + fname + "' (the file is corrupt)"
                                      : "cannot read dataset " + path + " of '" + fname + "' (the file is corrupt)";
  Digest d;
  d.add_str(path);
  std::vector<unsigned char> buf;
  for (hsize_t r0 = 0; r0 < rows; r0 += block) {
    const hsize_t nr = std::min(block, rows - r0), n = nr * row;
    buf.resize(std::size_t(n) * std::max(fsize, msize));
    if (rank == 0) {
      require(H5Dread(ds, ft, H5S_ALL, H5S_ALL, H5P_DEFAULT, buf.data()) >= 0, failed);
    } else {
      std::vector<hsize_t> start(std::size_t(rank), 0), count(dims);
      start[0] = r0;
      count[0] = nr;
      check(H5Sselect_hyperslab(fspace, H5S_SELECT_SET, start.data(), nullptr, count.data(), nullptr),
            "selecting rows of " + path);
      Handle mspace(H5Screate_simple(1, &n, nullptr), H5Sclose);
      require(H5Dread(ds, ft, mspace, fspace, H5P_DEFAULT, buf.data()) >= 0, failed);
    }
    d.add(buf.data(), std::size_t(n) * fsize);
    if (sink) {
      check(H5Tconvert(ft, mem_type, std::size_t(n), buf.data(), nullptr, H5P_DEFAULT), "converting " + path);
      sink(buf.data(), std::size_t(r0 * row), std::size_t(n));
    }
  }
  return d.value();
}

}  // namespace

std::uint64_t header_digest(hid_t file, const Objects& objects, const std::string& fname) {
  Digest d;
  auto object = [&](const std::string& path, ObjectKind kind) {
    d.add("O", 1);
    d.add_str(path);
    d.add(kind == ObjectKind::group ? "g" : "d", 1);
    Handle obj(H5Oopen(file, path.c_str(), H5P_DEFAULT), H5Oclose);
    require(obj.ok(), "'" + fname + "': cannot open " + path + " (corrupt file)");
    std::vector<std::string> names;
    require(H5Aiterate2(obj, H5_INDEX_NAME, H5_ITER_INC, nullptr, collect_attr_name, &names) >= 0,
            "'" + fname + "': cannot list the attributes of " + path + " (corrupt file)");
    std::sort(names.begin(), names.end());
    for (const auto& n : names) {
      if (n == digest_attr && (path == "/" || kind == ObjectKind::dataset)) continue;
      d.add("A", 1);
      d.add_str(n);
      add_attr_value(d, obj, n, "'" + fname + "' " + path);
    }
  };
  object("/", ObjectKind::group);
  for (const auto& o : objects) object(o.first, o.second);
  return d.value();
}

void seal_header(hid_t file) {
  const auto objects = list_objects(file, "(file being written)");
  write_attr_u64(file, digest_attr, header_digest(file, objects, "(file being written)"));
}

void verify_header(hid_t file, const Objects& objects, const std::string& fname) {
  std::uint64_t stored = 0;
  require(read_digest(file, &stored), "checksum mismatch in the header of '" + fname +
                                          "': it has no digest (format 3 files have one; the file was altered)");
  require(stored == header_digest(file, objects, fname),
          "checksum mismatch in the header of '" + fname +
              "' (its attributes, configuration or list of objects): the file is corrupt or was altered");
}

void write_dataset(hid_t file, const std::string& path, hid_t file_type, const std::vector<hsize_t>& dims,
                   hid_t dcpl, hid_t lcpl, hid_t mem_type, const void* data) {
  Handle sp(dims.empty() ? H5Screate(H5S_SCALAR) : H5Screate_simple(int(dims.size()), dims.data(), nullptr),
            H5Sclose);
  Handle ds(H5Dcreate2(file, path.c_str(), file_type, sp, lcpl, dcpl, H5P_DEFAULT), H5Dclose);
  require(ds.ok(), "HDF5: cannot create dataset " + path);
  check(H5Dwrite(ds, mem_type, H5S_ALL, H5S_ALL, H5P_DEFAULT, data), "writing " + path);
  // The digest of the bytes as stored: the buffer itself when the memory
  // type is the file's (little-endian hosts), else a converted copy.
  std::size_t n = 1;
  for (hsize_t x : dims) n *= std::size_t(x);
  const std::size_t fsize = H5Tget_size(file_type), msize = H5Tget_size(mem_type);
  Digest d;
  d.add_str(path);
  if (H5Tequal(mem_type, file_type) > 0) {
    d.add(data, n * fsize);
  } else {
    std::vector<unsigned char> buf(n * std::max(fsize, msize));
    std::memcpy(buf.data(), data, n * msize);
    check(H5Tconvert(mem_type, file_type, n, buf.data(), nullptr, H5P_DEFAULT), "converting " + path);
    d.add(buf.data(), n * fsize);
  }
  write_attr_u64(ds, digest_attr, d.value());
}

std::string extent_problem(hid_t ds, const std::vector<hsize_t>& dims, std::size_t elem_size) {
  std::string shape = "[";
  for (std::size_t i = 0; i < dims.size(); ++i) shape += (i ? "," : "") + std::to_string(dims[i]);
  shape += "]";
  hsize_t bytes = elem_size;
  for (hsize_t x : dims)
    if (__builtin_mul_overflow(bytes, x, &bytes)) return "has shape " + shape + ", more bytes than 2^64";
  Handle dcpl(H5Dget_create_plist(ds), H5Pclose);
  if (!dcpl.ok()) return "has an unreadable storage description";
  if (H5Pget_layout(dcpl) == H5D_CHUNKED) {
    std::vector<hsize_t> chunk(std::max<std::size_t>(dims.size(), 1), 0);
    if (dims.empty() || H5Pget_chunk(dcpl, int(dims.size()), chunk.data()) != int(dims.size()))
      return "has an unreadable chunk shape";
    for (std::size_t i = 0; i < dims.size(); ++i)
      if (chunk[i] < 1 || chunk[i] > dims[i])
        return "has chunks of dimension " + std::to_string(chunk[i]) + " in its shape " + shape;
  }
  const hsize_t stored = H5Dget_storage_size(ds);
  if (stored < bytes)
    return "stores " + std::to_string(stored) + " bytes of the " + std::to_string(bytes) + " its shape " + shape +
           " declares (chunks never written: the file is truncated or was altered)";
  return "";
}

void read_dataset(hid_t ds, const std::string& path, hid_t mem_type, void* out, bool verify,
                  const std::string& fname) {
  if (!verify && out) {  // one read of the whole dataset, Fletcher-32 checked by HDF5
    Handle ft(H5Dget_type(ds), H5Tclose), sp(H5Dget_space(ds), H5Sclose);
    const int rank = sp.ok() ? H5Sget_simple_extent_ndims(sp) : -1;
    require(ft.ok() && rank >= 0 && rank <= 8, "'" + fname + "': dataset " + path + " has an unreadable shape");
    std::vector<hsize_t> dims(std::size_t(rank), 0);
    if (rank > 0) H5Sget_simple_extent_dims(sp, dims.data(), nullptr);
    require_stored_extent(ds, dims, H5Tget_size(ft), path, fname);
    require(H5Dread(ds, mem_type, H5S_ALL, H5S_ALL, H5P_DEFAULT, out) >= 0,
            (has_fletcher32(ds) ? "checksum mismatch in dataset " : "cannot read dataset ") + path + " of '" + fname +
                "' (the file is corrupt)");
    return;
  }
  const std::size_t msize = out ? H5Tget_size(mem_type) : 0;
  BlockSink copy;
  if (out)
    copy = [&](const void* values, std::size_t first, std::size_t n) {
      std::memcpy(static_cast<unsigned char*>(out) + first * msize, values, n * msize);
    };
  scan_dataset(ds, path, mem_type, verify, fname, copy);
}

void scan_dataset(hid_t ds, const std::string& path, hid_t mem_type, bool verify, const std::string& fname,
                  const BlockSink& sink) {
  std::uint64_t stored = 0;
  require(!verify || read_digest(ds, &stored),
          "checksum mismatch in dataset " + path + " of '" + fname +
              "': it has no digest (format 3 files have one; the file was altered)");
  const std::uint64_t got = read_blocks(ds, path, mem_type, sink, fname);
  require(!verify || got == stored, "checksum mismatch in dataset " + path + " of '" + fname +
                                        "' (its digest differs: the file is corrupt or was altered)");
}

void seal_datasets(hid_t file) {
  for (const auto& o : list_objects(file, "(file being sealed)")) {
    if (o.second != ObjectKind::dataset) continue;
    Handle ds(H5Dopen2(file, o.first.c_str(), H5P_DEFAULT), H5Dclose);
    require(ds.ok(), "HDF5: cannot open " + o.first);
    write_attr_u64(ds, digest_attr, read_blocks(ds, o.first, -1, BlockSink(), "(file being sealed)"));
  }
}

namespace {

// Six characters from [0-9A-Za-z], unpredictable (the kernel's random bytes;
// the clock, the PID and a counter if none can be had).
std::string random_suffix() {
  static std::atomic<std::uint64_t> counter{0};
  std::uint64_t bits = 0;
  if (::getrandom(&bits, sizeof bits, GRND_NONBLOCK) != ssize_t(sizeof bits)) {
    timespec now{};
    ::clock_gettime(CLOCK_REALTIME, &now);
    Digest d;
    const std::uint64_t mix[4] = {std::uint64_t(now.tv_sec), std::uint64_t(now.tv_nsec), std::uint64_t(::getpid()),
                                  counter.fetch_add(1)};
    d.add(mix, sizeof mix);
    bits = d.value();
  }
  constexpr std::uint64_t n = sizeof(temporary_suffix_chars) - 1;
  std::string s(6, '0');
  for (auto& c : s) {
    c = temporary_suffix_chars[bits % n];
    bits /= n;
  }
  return s;
}

// Creates "<path>.tmp.XXXXXX" (mkstemp's rule: O_CREAT | O_EXCL, a fresh
// random suffix while the name exists; O_NOFOLLOW besides), so nothing planted
// at a predictable name, a symbolic link least of all, is ever written through.
// Mode 0644 less the umask, as a plain create. Sets *tmp to the name.
int create_temporary(const std::string& path, std::string* tmp) {
  for (int attempt = 0; attempt < 100; ++attempt) {
    *tmp = path + ".tmp." + random_suffix();
    const int fd = ::open(tmp->c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
    if (fd >= 0 || errno != EEXIST) return fd;
  }
  errno = EEXIST;
  return -1;
}

}  // namespace

// Writes the whole file in memory (HDF5's core driver, no backing store),
// then its image through a new temporary file, fsync, and a rename into
// place. HDF5 never sees an I/O error, so a full disk or a file-size limit
// cannot leave a library handle half-closed (it crashed HDF5's shutdown); the
// error names the file, the temp file is removed and the previous file stays.
// A symbolic link at `path` is replaced by the rename, never written through.
void write_atomically(const std::string& path, const std::function<void(hid_t)>& body) {
  std::vector<unsigned char> image;
  {
    Handle fapl(H5Pcreate(H5P_FILE_ACCESS), H5Pclose);
    require(fapl.ok(), "HDF5: cannot create a file access property list");
    check(H5Pset_fapl_core(fapl, 1 << 20, 0), "selecting the in-memory driver");
    // The 1.10 format checksums all metadata (superblock v3, object headers,
    // chunk indexes: a single chunk's address lives in the object header).
    check(H5Pset_libver_bounds(fapl, H5F_LIBVER_V110, H5F_LIBVER_V110), "setting the format bounds");
    check(H5Pset_fclose_degree(fapl, H5F_CLOSE_STRONG), "setting the close degree");
    // The name is HDF5's only: without a backing store nothing is opened on disk.
    const std::string image_name = path + ".image." + random_suffix();
    Handle file(H5Fcreate(image_name.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, fapl), H5Fclose);
    require(file.ok(), "HDF5: cannot create the in-memory image of '" + path + "'");
    body(hid_t(file));
    check(H5Fflush(file, H5F_SCOPE_GLOBAL), "flushing the image of '" + path + "'");
    const ssize_t n = H5Fget_file_image(file, nullptr, 0);
    require(n > 0, "HDF5: cannot get the image of '" + path + "'");
    image.resize(std::size_t(n));
    require(H5Fget_file_image(file, image.data(), image.size()) == n, "HDF5: cannot copy the image of '" + path + "'");
  }
  fix_superblock_checksum(image);
  std::string tmp;
  const int fd = create_temporary(path, &tmp);
  require(fd >= 0, "cannot create '" + tmp + "': " + std::strerror(errno) +
                       " (does the directory exist and is it writable?)");
  auto fail = [&](const std::string& what) {
    const int err = errno;
    ::close(fd);
    ::unlink(tmp.c_str());
    throw Error("cannot write '" + path + "': " + what + ": " + std::strerror(err) +
                (err == ENOSPC || err == EFBIG || err == EDQUOT ? " (disk full or file size limit); " : "; ") +
                "the previous file, if any, is unchanged");
  };
  for (std::size_t done = 0; done < image.size();) {
    const ssize_t w = ::write(fd, image.data() + done, image.size() - done);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) {
      if (w == 0) errno = EIO;
      fail("write");
    }
    done += std::size_t(w);
  }
  if (::fsync(fd) != 0) fail("fsync");
  if (::close(fd) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    throw Error("cannot write '" + path + "': close: " + std::strerror(err));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    throw Error("cannot rename '" + tmp + "' to '" + path + "': " + std::strerror(err));
  }
}

}  // namespace ash::io
