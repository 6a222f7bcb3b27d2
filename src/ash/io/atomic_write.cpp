#include "ash/io/atomic_write.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <vector>

#include "ash/core/error.hpp"
#include "ash/io/hdf5_digest.hpp"
#include "ash/io/hdf5_objects.hpp"

namespace ash::io {

namespace {

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

// What a non-regular file is, for messages.
const char* kind_of(mode_t m) {
  if (S_ISDIR(m)) return "a directory";
  if (S_ISLNK(m)) return "a symbolic link";
  if (S_ISFIFO(m)) return "a FIFO";
  if (S_ISSOCK(m)) return "a socket";
  if (S_ISCHR(m)) return "a character device";
  if (S_ISBLK(m)) return "a block device";
  return "not a regular file";
}

// fsync of a directory: its entries (a rename, a new file) reach the disk.
void sync_dir(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return;  // nothing to sync through (the rename itself succeeded)
  (void)::fsync(fd);
  ::close(fd);
}

std::string parent_of(const std::string& path) {
  const auto p = std::filesystem::path(path).parent_path();
  return p.empty() ? "." : p.string();
}

}  // namespace

void require_output_path(const std::string& path, const std::string& what) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) {
    // Absent (or under a missing folder: creating the file names that).
    require(errno == ENOENT || errno == ENOTDIR, "cannot check " + what + " '" + path + "': " + std::strerror(errno));
    return;
  }
  if (S_ISREG(st.st_mode)) return;
  std::string kind = kind_of(st.st_mode);
  if (S_ISLNK(st.st_mode)) {
    std::error_code ec;
    const auto target = std::filesystem::read_symlink(path, ec);
    if (!ec) kind += " (to '" + target.string() + "')";
  }
  throw Error(what + " '" + path + "' is " + kind +
              ": ash writes only a new file or over a regular file, never a link, directory, FIFO, socket or device " +
              "(remove it, or give another path)");
}

void fault_point(const char* point) {
  const char* want = std::getenv("ASH_TEST_FAULT");
  if (!want) return;
  const std::string w = want, p = point;
  if (w == p) ::raise(SIGKILL);
  if (w == p + ":error") throw Error("injected failure at " + p + " (ASH_TEST_FAULT)");
}

// Writes the whole file in memory (HDF5's core driver, no backing store),
// then its image through a new temporary file, fsync, and a rename into
// place. HDF5 never sees an I/O error, so a full disk or a file-size limit
// cannot leave a library handle half-closed (it crashed HDF5's shutdown); the
// error names the file, the temp file is removed and the previous file stays.
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
  AtomicFile f(path);
  f.write(image.data(), image.size());
  f.commit();
}

// mkstemp's rule (O_CREAT | O_EXCL, a fresh random suffix while the name
// exists) with O_NOFOLLOW besides; mode 0644 less the umask, as a plain create.
AtomicFile::AtomicFile(const std::string& path) : path_(path) {
  require_output_path(path);
  for (int attempt = 0; attempt < 100; ++attempt) {
    tmp_ = path + ".tmp." + random_suffix();
    fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
    if (fd_ >= 0 || errno != EEXIST) break;
  }
  require(fd_ >= 0,
          "cannot create '" + tmp_ + "': " + std::strerror(errno) + " (does the directory exist and is it writable?)");
}

AtomicFile::~AtomicFile() {
  if (fd_ >= 0) ::close(fd_);
  if (!committed_) ::unlink(tmp_.c_str());
}

void AtomicFile::write(const void* data, std::size_t n) {
  const auto* p = static_cast<const unsigned char*>(data);
  while (n > 0) {
    const ssize_t w = ::write(fd_, p, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) fail("write", w == 0 ? EIO : errno);
    p += w;
    n -= std::size_t(w);
  }
}

void AtomicFile::commit() {
  if (::fsync(fd_) != 0) fail("fsync", errno);
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0) fail("close", errno);
  require_output_path(path_);  // again: something may have been planted while the file was written
  if (std::rename(tmp_.c_str(), path_.c_str()) != 0)
    throw Error("cannot rename '" + tmp_ + "' to '" + path_ + "': " + std::strerror(errno));
  committed_ = true;
  sync_dir(parent_of(path_));
}

void AtomicFile::fail(const std::string& what, int err) {
  throw Error("cannot write '" + path_ + "': " + what + ": " + std::strerror(err) +
              (err == ENOSPC || err == EFBIG || err == EDQUOT ? " (disk full or file size limit); " : "; ") +
              "the previous file, if any, is unchanged");
}

namespace {

namespace fs = std::filesystem;

// The entries of folder `dir` but "." and "..".
std::vector<std::string> entries_of(const std::string& dir) {
  std::vector<std::string> names;
  DIR* d = ::opendir(dir.c_str());
  require(d != nullptr, "cannot list folder '" + dir + "': " + std::strerror(errno));
  while (const dirent* e = ::readdir(d)) {
    const std::string n = e->d_name;
    if (n != "." && n != "..") names.push_back(n);
  }
  ::closedir(d);
  return names;
}

// A new name beside `dir` ("<parent>/.<name>.<tag>.XXXXXX") for which make(name)
// succeeds; make returns false when the name exists.
template <class Make>
std::string fresh_sibling(const fs::path& dir, const char* tag, Make make) {
  std::string name;
  for (int attempt = 0; attempt < 100; ++attempt) {
    name = (dir.parent_path() / ("." + dir.filename().string() + "." + tag + "." + random_suffix())).string();
    if (make(name)) return name;
    if (errno != EEXIST) break;
  }
  throw Error("cannot create '" + name + "': " + std::strerror(errno) +
              " (ash export-hf writes the new folder beside '" + dir.string() +
              "' and swaps the two: is its parent folder writable?)");
}

// renameat2 where the C library has it: RENAME_EXCHANGE swaps two names in one
// step, RENAME_NOREPLACE refuses an existing target. EINVAL or ENOSYS: this file
// system or kernel has no such rename.
int rename2(const std::string& from, const std::string& to, unsigned flags) {
#if defined(RENAME_EXCHANGE) && defined(RENAME_NOREPLACE)
  return ::renameat2(AT_FDCWD, from.c_str(), AT_FDCWD, to.c_str(), flags);
#else
  (void)from, (void)to, (void)flags;
  errno = ENOSYS;
  return -1;
#endif
}
#ifndef RENAME_EXCHANGE
constexpr unsigned RENAME_EXCHANGE = 2, RENAME_NOREPLACE = 1;
#endif

[[noreturn]] void fail_swap(const std::string& what, const std::string& a, const std::string& b, int err) {
  throw Error("cannot " + what + " '" + a + "' and '" + b + "': " + std::strerror(err));
}

}  // namespace

AtomicFolder::AtomicFolder(const std::string& dir, const std::vector<std::string>& names) : names_(names) {
  // "d/", "d/." and "d" name one folder; its name and parent make the sibling's.
  fs::path p = fs::path(dir).lexically_normal();
  if (!p.has_filename()) p = p.parent_path();
  require(!p.empty() && p.filename() != "." && p.filename() != "..",
          "--out '" + dir + "': give the folder by its name (export-hf replaces it as a whole)");
  dir_ = p.string();
  struct stat st {};
  const bool exists = ::lstat(dir_.c_str(), &st) == 0;
  require(exists || errno == ENOENT, "cannot check --out '" + dir + "': " + std::strerror(errno));
  if (exists) {
    require(S_ISDIR(st.st_mode), "--out '" + dir + "' is " + kind_of(st.st_mode) +
                                     ": export-hf writes a folder (a link to one is not followed; give the folder)");
    for (const auto& n : names_) require_output_path((p / n).string(), "--out's");
  }
  std::error_code ec;
  const fs::path parent = p.parent_path().empty() ? fs::path(".") : p.parent_path();
  fs::create_directories(parent, ec);
  require(!ec && fs::is_directory(parent), "cannot create folder '" + parent.string() + "': " + ec.message());
  if (p.parent_path().empty()) p = fs::path(".") / p;
  stage_ = fresh_sibling(p, "tmp", [](const std::string& n) { return ::mkdir(n.c_str(), 0777) == 0; });
  if (exists) {
    // The new folder keeps the old one's permissions and, where allowed, owner.
    (void)::chmod(stage_.c_str(), st.st_mode & 07777);
    (void)!::chown(stage_.c_str(), st.st_uid, st.st_gid);
  }
}

AtomicFolder::~AtomicFolder() {
  // Before the swap the staging folder holds only the new files and hard links.
  std::error_code ec;
  if (!committed_) fs::remove_all(stage_, ec);
}

std::string AtomicFolder::path(const std::string& name) const { return (fs::path(stage_) / name).string(); }

void AtomicFolder::commit() {
  fault_point("export:staged");
  struct stat st {};
  const bool exists = ::lstat(dir_.c_str(), &st) == 0;
  std::vector<std::string> carried, folders;
  if (exists) {
    require(S_ISDIR(st.st_mode), "--out '" + dir_ + "' is " + kind_of(st.st_mode) + ": export-hf writes a folder");
    for (const auto& e : entries_of(dir_)) {
      if (std::find(names_.begin(), names_.end(), e) != names_.end()) continue;
      const std::string from = (fs::path(dir_) / e).string(), to = path(e);
      struct stat es {};
      if (::lstat(from.c_str(), &es) == 0 && S_ISDIR(es.st_mode)) {
        folders.push_back(e);  // moved after the swap: a folder cannot be hard-linked
        continue;
      }
      // A hard link, not a copy: the same file (a link stays a link), in both folders until the swap.
      if (::linkat(AT_FDCWD, from.c_str(), AT_FDCWD, to.c_str(), 0) != 0)
        throw Error("cannot carry '" + from + "' into the new folder '" + stage_ + "': " + std::strerror(errno) +
                    " (export-hf replaces '" + dir_ + "' as a whole; every other file in it is kept)");
      carried.push_back(e);
    }
  }
  sync_dir(stage_);
  fault_point("export:carried");
  std::string old = stage_;  // where the previous folder is after the swap
  if (!exists) {
    if (rename2(stage_, dir_, RENAME_NOREPLACE) != 0) {
      if (errno != EINVAL && errno != ENOSYS) fail_swap("rename", stage_, dir_, errno);
      if (::rename(stage_.c_str(), dir_.c_str()) != 0) fail_swap("rename", stage_, dir_, errno);
    }
    committed_ = true;
    sync_dir(parent_of(dir_));
    return;
  }
  if (rename2(stage_, dir_, RENAME_EXCHANGE) != 0) {
    if (errno != EINVAL && errno != ENOSYS) fail_swap("swap", stage_, dir_, errno);
    // No exchange here: the old folder aside, then the new one in. A kill between
    // the two leaves no `dir` and the complete old folder at the aside name.
    old = fresh_sibling(fs::path(dir_), "old", [&](const std::string& n) {
      if (rename2(dir_, n, RENAME_NOREPLACE) == 0) return true;
      if (errno != EINVAL && errno != ENOSYS) return false;
      struct stat ns {};
      if (::lstat(n.c_str(), &ns) == 0) return errno = EEXIST, false;
      return ::rename(dir_.c_str(), n.c_str()) == 0;
    });
    fault_point("export:aside");
    if (::rename(stage_.c_str(), dir_.c_str()) != 0) {
      const int err = errno;
      (void)::rename(old.c_str(), dir_.c_str());  // the old folder back
      fail_swap("rename", stage_, dir_, err);
    }
  }
  committed_ = true;
  sync_dir(parent_of(dir_));
  fault_point("export:swapped");
  for (const auto& f : folders) {
    const std::string from = (fs::path(old) / f).string(), to = (fs::path(dir_) / f).string();
    if (::rename(from.c_str(), to.c_str()) != 0)
      throw Error("the new export is in '" + dir_ + "', but its folder '" + f + "' stayed in the previous one, '" +
                  old + "': " + std::strerror(errno) + " (move it back by hand)");
  }
  // The old folder: the previous files, and the links of the carried ones. Anything
  // else (added during the export) keeps it in place.
  for (const auto& n : names_) (void)::unlink((fs::path(old) / n).c_str());
  for (const auto& n : carried) (void)::unlink((fs::path(old) / n).c_str());
  (void)::rmdir(old.c_str());
  sync_dir(parent_of(dir_));
}

}  // namespace ash::io
