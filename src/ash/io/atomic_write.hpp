#pragma once
// The atomic whole-file write of every HDF5 file ash writes (docs/file_format.md)
// and the temporary-name rules it follows. Internal (see hdf5_objects.hpp).
#include <hdf5.h>

#include <cstddef>
#include <functional>
#include <string>

namespace ash::io {

// The characters of a temporary file's random suffix ("<path>.tmp." and six of
// them): write_atomically draws from them, the trainer's clean-up matches them.
inline constexpr char temporary_suffix_chars[] = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz";

// A byte stream written atomically: a new "<path>.tmp.XXXXXX" (six random
// characters, created with O_EXCL | O_NOFOLLOW, so nothing planted at a name,
// a symbolic link least of all, is written through), then commit() fsyncs,
// closes and renames it over `path` (a link there is replaced, not followed).
// Uncommitted (an error, an exception) the temporary file is removed and
// `path` is untouched. ash::Error names the file and the failing call.
class AtomicFile {
 public:
  explicit AtomicFile(const std::string& path);
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;
  ~AtomicFile();
  void write(const void* data, std::size_t n);
  void commit();

 private:
  [[noreturn]] void fail(const std::string& what, int err);
  std::string path_, tmp_;
  int fd_ = -1;
  bool committed_ = false;
};

// Builds the file in memory (HDF5's core driver, 1.10 format), `body` filling
// it, then writes its image to a new "<path>.tmp.XXXXXX" (six random
// characters, created with O_EXCL | O_NOFOLLOW), fsyncs and renames it over
// `path` (a symbolic link there is replaced, not followed). On any failure the
// temporary file is removed and `path` is untouched.
void write_atomically(const std::string& path, const std::function<void(hid_t)>& body);

}  // namespace ash::io
