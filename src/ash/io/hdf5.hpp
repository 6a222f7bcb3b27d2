#pragma once
// HDF5 plumbing under the checkpoint schema (checkpoint.cpp): RAII handles,
// strict scalar attributes, checksummed dataset layouts, opening a file for
// reading and the atomic whole-file write (docs/file_format.md, "How files
// are written"). Internal to the library: not installed, user code never
// includes it (HDF5 is a private dependency).
#include <hdf5.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

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
bool has_fletcher32(hid_t dataset);
// Chunked with the Fletcher-32 filter: one chunk up to 4 MiB, else blocks of rows.
Handle checksummed_dcpl(const std::vector<hsize_t>& dims, std::size_t elem);

// Opens `path` read-only; `what` ("checkpoint", "gradient file") names it in
// messages: missing, not a regular file, not HDF5, truncated or corrupt.
Handle open_for_read(const std::string& path, const char* what);

// Builds the file in memory (HDF5's core driver, 1.10 format), `body` filling
// it, then writes its image to "<path>.tmp.<pid>", fsyncs and renames it over
// `path`. On any failure the temporary file is removed and `path` is untouched.
void write_atomically(const std::string& path, const std::function<void(hid_t)>& body);

}  // namespace ash::io
