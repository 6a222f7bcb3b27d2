#pragma once
// HDF5 plumbing under the checkpoint schema (checkpoint.cpp): RAII handles,
// strict scalar attributes, checksummed dataset layouts, opening a file for
// reading without following anything, the XXH3 digests of format 3 and the
// atomic whole-file write (docs/file_format.md). Internal to the library: not
// installed, user code never includes it (HDF5 and xxHash are private
// dependencies).
#include <hdf5.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
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

// ---- digests (format 3) -----------------------------------------------------

// XXH3-64, streaming (xxHash).
class Digest {
 public:
  Digest();
  ~Digest();
  Digest(const Digest&) = delete;
  Digest& operator=(const Digest&) = delete;
  void add(const void* bytes, std::size_t n);
  void add_str(const std::string& s);  // its bytes and a NUL
  std::uint64_t value() const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

// Name of the digest attributes (on the root and on every dataset).
constexpr const char* digest_attr = "digest";

// The header digest: every object's path and kind, and every attribute of
// every object, except the digest attributes of the root and of datasets
// (docs/file_format.md gives the exact byte sequence).
std::uint64_t header_digest(hid_t file, const Objects& objects, const std::string& fname);
// Writes the header digest as the root's `digest` attribute (last step of a write).
void seal_header(hid_t file);
// "checksum mismatch in the header ... of 'FILE'" unless the root's digest
// attribute holds header_digest().
void verify_header(hid_t file, const Objects& objects, const std::string& fname);

// Creates dataset `path` (dims; none: a scalar) of file_type with dcpl and
// lcpl, writes its elements from `data` (mem_type) and its `digest`
// attribute: XXH3-64 of the path, a NUL and the bytes as stored.
void write_dataset(hid_t file, const std::string& path, hid_t file_type, const std::vector<hsize_t>& dims,
                   hid_t dcpl, hid_t lcpl, hid_t mem_type, const void* data);
// What keeps a dataset of extent `dims`, elements of `elem_size` bytes, from
// being read within its stored bytes ("" when nothing): chunks larger than the
// extent, or fewer bytes stored than the extent declares (only Fletcher-32 is
// allowed, so nothing is compressed; a chunk never written would read as fill
// values that no checksum covers). Costs one pass over the chunk index: call
// it once the extent has been checked against the schema and the file's size
// (checkpoint.cpp), never on an extent the file alone declares.
std::string extent_problem(hid_t ds, const std::vector<hsize_t>& dims, std::size_t elem_size);

// Reads all of dataset `ds` (its path `path`) into `out` as mem_type (out ==
// nullptr: only checks). HDF5 verifies Fletcher-32 where the dataset has it;
// with `verify` the stored bytes must also match the `digest` attribute.
// Errors name the dataset and `fname`. The extent must have been checked
// (extent_problem is checked again here, before any buffer is sized).
void read_dataset(hid_t ds, const std::string& path, hid_t mem_type, void* out, bool verify,
                  const std::string& fname);
// The same read in blocks of rows (a chunk's rows when chunked), each handed
// to `sink` converted to mem_type: its values, the index of its first
// element, and its element count. Memory: one block, never the dataset.
using BlockSink = std::function<void(const void* values, std::size_t first, std::size_t n)>;
void scan_dataset(hid_t ds, const std::string& path, hid_t mem_type, bool verify, const std::string& fname,
                  const BlockSink& sink);
// Recomputes every dataset's digest from its stored bytes: what any editor
// can do, which is why a digest protects against accidents only (tests use it
// to make altered but consistent files).
void seal_datasets(hid_t file);

// The characters of a temporary file's random suffix ("<path>.tmp." and six of
// them): write_atomically draws from them, the trainer's clean-up matches them.
inline constexpr char temporary_suffix_chars[] = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz";

// Builds the file in memory (HDF5's core driver, 1.10 format), `body` filling
// it, then writes its image to a new "<path>.tmp.XXXXXX" (six random
// characters, created with O_EXCL | O_NOFOLLOW), fsyncs and renames it over
// `path` (a symbolic link there is replaced, not followed). On any failure the
// temporary file is removed and `path` is untouched.
void write_atomically(const std::string& path, const std::function<void(hid_t)>& body);

}  // namespace ash::io
