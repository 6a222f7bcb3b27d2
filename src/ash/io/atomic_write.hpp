#pragma once
// The atomic whole-file write of every HDF5 file ash writes (docs/file_format.md)
// and the temporary-name rules it follows. Internal (see hdf5_objects.hpp).
#include <hdf5.h>

#include <cstddef>
#include <functional>
#include <string>
#include <vector>

namespace ash::io {

// The characters of a temporary file's random suffix ("<path>.tmp." and six of
// them): write_atomically draws from them, the trainer's clean-up matches them.
inline constexpr char temporary_suffix_chars[] = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz";

// The rule of every path ash writes (docs/cli.md, "Output files"): absent, or
// a regular file it replaces. Anything else at the path is an ash::Error naming
// the path and what it is: a directory, a FIFO, a socket, a character or block
// device (a rename would replace /dev/null), and a symbolic link, dangling or
// not (ash neither writes through a link nor replaces one). `what` introduces
// the path in the message ("--out", "the run's checkpoint").
void require_output_path(const std::string& path, const std::string& what = "the output");

// A byte stream written atomically: a new "<path>.tmp.XXXXXX" (six random
// characters, created with O_EXCL | O_NOFOLLOW, so nothing planted at a name
// is written through), then commit() fsyncs, closes and renames it over `path`.
// `path` follows require_output_path, checked when constructed and again just
// before the rename. Uncommitted (an error, an exception) the temporary file
// is removed and `path` is untouched. ash::Error names the file and the call.
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
// it, then writes its image through an AtomicFile at `path`. On any failure
// the temporary file is removed and `path` is untouched.
void write_atomically(const std::string& path, const std::function<void(hid_t)>& body);

// A folder whose files are replaced as one step (ash export-hf; docs/cli.md):
// the new files are written into a new sibling "<parent>/.<name>.tmp.XXXXXX",
// the other entries of the existing folder carried over (files and links as
// hard links before the swap, subfolders moved after it), and commit() swaps
// the two folders with renameat2(RENAME_EXCHANGE) (a rename when `dir` is
// absent; where the file system has no exchange, `dir` is renamed aside first),
// then removes the old one. A kill at any point leaves `dir` the complete old
// folder or the complete new one. `dir` must be absent or a directory (not a
// link), and each of `names` in it absent or a regular file. Uncommitted, the
// staging folder is removed and `dir` is untouched.
class AtomicFolder {
 public:
  AtomicFolder(const std::string& dir, const std::vector<std::string>& names);
  AtomicFolder(const AtomicFolder&) = delete;
  AtomicFolder& operator=(const AtomicFolder&) = delete;
  ~AtomicFolder();
  // Where to write `name` (one of `names`): its path in the staging folder.
  std::string path(const std::string& name) const;
  void commit();

 private:
  std::string dir_, stage_;
  std::vector<std::string> names_;
  bool committed_ = false;
};

// A test seam for kill and failure points (unit tests only set it): when the
// environment variable ASH_TEST_FAULT equals `point`, the process kills itself
// with SIGKILL there; when it equals "<point>:error", an ash::Error is thrown.
void fault_point(const char* point);

}  // namespace ash::io
