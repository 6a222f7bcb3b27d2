#include "ash/io/hdf5_digest.hpp"

#include <xxhash.h>

#include <algorithm>
#include <cstring>
#include <new>
#include <vector>

#include "ash/core/error.hpp"

namespace ash::io {

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
    default: throw Error(bad + " is not an integer, a float or a fixed-length string");
  }
}

}  // namespace

void write_digest(hid_t loc, std::uint64_t v) {
  if (H5Aexists(loc, digest_attr) > 0)
    check(H5Adelete(loc, digest_attr), std::string("replacing attribute ") + digest_attr);
  Handle sp(H5Screate(H5S_SCALAR), H5Sclose);
  Handle a(H5Acreate2(loc, digest_attr, H5T_STD_U64LE, sp, H5P_DEFAULT, H5P_DEFAULT), H5Aclose);
  require(a.ok(), std::string("HDF5: cannot create attribute ") + digest_attr);
  check(H5Awrite(a, H5T_NATIVE_UINT64, &v), std::string("writing attribute ") + digest_attr);
}

bool read_digest(hid_t loc, std::uint64_t* v) {
  if (H5Aexists(loc, digest_attr) <= 0) return false;
  Handle a(H5Aopen(loc, digest_attr, H5P_DEFAULT), H5Aclose);
  Handle t(a.ok() ? H5Aget_type(a) : -1, H5Tclose);
  Handle sp(a.ok() ? H5Aget_space(a) : -1, H5Sclose);
  return t.ok() && sp.ok() && H5Tget_class(t) == H5T_INTEGER && H5Tget_size(t) == 8 &&
         H5Sget_simple_extent_npoints(sp) == 1 && H5Aread(a, H5T_NATIVE_UINT64, v) >= 0;
}

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
  write_digest(file, header_digest(file, objects, "(file being written)"));
}

void verify_header(hid_t file, const Objects& objects, const std::string& fname) {
  std::uint64_t stored = 0;
  require(read_digest(file, &stored), "checksum mismatch in the header of '" + fname +
                                          "': it has no digest (format 3 files have one; the file was altered)");
  require(stored == header_digest(file, objects, fname),
          "checksum mismatch in the header of '" + fname +
              "' (its attributes, configuration or list of objects): the file is corrupt or was altered");
}

}  // namespace ash::io
