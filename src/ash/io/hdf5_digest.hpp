#pragma once
// The XXH3 digests of format 3 (docs/file_format.md): a streaming Digest, the
// `digest` attribute of the root and of every dataset, and the header digest
// over every object and attribute. Internal (see hdf5_objects.hpp).
#include <hdf5.h>

#include <cstdint>
#include <memory>
#include <string>

#include "ash/io/hdf5_objects.hpp"

namespace ash::io {

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

// Writes `v` as loc's digest attribute (a 64-bit little-endian integer),
// replacing one already there.
void write_digest(hid_t loc, std::uint64_t v);
// The stored digest of an object; false when it has none (or not a 64-bit integer).
bool read_digest(hid_t loc, std::uint64_t* v);

// The header digest: every object's path and kind, and every attribute of
// every object, except the digest attributes of the root and of datasets
// (docs/file_format.md gives the exact byte sequence).
std::uint64_t header_digest(hid_t file, const Objects& objects, const std::string& fname);
// Writes the header digest as the root's `digest` attribute (last step of a write).
void seal_header(hid_t file);
// "checksum mismatch in the header ... of 'FILE'" unless the root's digest
// attribute holds header_digest().
void verify_header(hid_t file, const Objects& objects, const std::string& fname);

}  // namespace ash::io
