#pragma once
// The HDF5 objects under the checkpoint schema (checkpoint.cpp): RAII handles,
// strict scalar attributes, element types, opening a file for reading without
// following anything, and the closed structure of a file (list_objects;
// docs/file_format.md). Internal to the library, like every io/hdf5_* header
// and io/atomic_write.hpp: not installed, user code never includes them (HDF5
// and xxHash are private dependencies).
#include <hdf5.h>

#include <cstdint>
#include <map>
#include <string>

namespace ash::io {

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

// An ash::Error "HDF5: <what> failed" when rc < 0.
void check(herr_t rc, const std::string& what);

void write_attr_i64(hid_t loc, const char* name, std::int64_t v);
// Fixed-length, null-padded ASCII sized to the text (one NUL when empty).
void write_attr_str(hid_t loc, const char* name, const std::string& v);
bool has_attr(hid_t loc, const char* name);
// Strict readers: the attribute must exist, hold one value and be of the
// class asked for (an integer, not a float converted; a fixed-length string).
// Messages name `file`.
std::int64_t read_attr_i64(hid_t loc, const char* name, const std::string& file);
std::string read_attr_str(hid_t loc, const char* name, const std::string& file);

// A link creation property list that creates intermediate groups.
hid_t link_create_plist();

// float32 / float64 IEEE only (float16, integers, custom floats are refused).
bool is_f32_or_f64(hid_t type);
// "float32", "int16", ... or "non-numeric", for messages and `ash inspect`.
std::string dtype_name(hid_t type);

// Opens `path` read-only; `what` ("checkpoint", "gradient file") names it in
// messages: missing, not a regular file (a FIFO or a device is refused before
// anything blocks on it), not HDF5, truncated or corrupt.
Handle open_for_read(const std::string& path, const char* what);

// ---- the closed structure ---------------------------------------------------

enum class ObjectKind { group, dataset };
// Every object below the root of a file, by absolute path ("/params/head").
using Objects = std::map<std::string, ObjectKind>;

// Visits every link of an open file without following any but hard links to
// groups, and refuses ("not an ash checkpoint: ...", naming `file` and the
// link) soft, external and user-defined links, objects other than groups and
// datasets, an object reachable by two links, and datasets whose bytes live
// outside the file (external or virtual storage) or pass through a filter
// other than Fletcher-32. Call it before opening anything by path: every path
// it returns then resolves through hard links only.
Objects list_objects(hid_t file, const std::string& fname);

}  // namespace ash::io
