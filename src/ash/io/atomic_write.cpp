#include "ash/io/atomic_write.hpp"

#include <fcntl.h>
#include <sys/random.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <ctime>
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
  AtomicFile f(path);
  f.write(image.data(), image.size());
  f.commit();
}

// mkstemp's rule (O_CREAT | O_EXCL, a fresh random suffix while the name
// exists) with O_NOFOLLOW besides; mode 0644 less the umask, as a plain create.
AtomicFile::AtomicFile(const std::string& path) : path_(path) {
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
  if (std::rename(tmp_.c_str(), path_.c_str()) != 0)
    throw Error("cannot rename '" + tmp_ + "' to '" + path_ + "': " + std::strerror(errno));
  committed_ = true;
}

void AtomicFile::fail(const std::string& what, int err) {
  throw Error("cannot write '" + path_ + "': " + what + ": " + std::strerror(err) +
              (err == ENOSPC || err == EFBIG || err == EDQUOT ? " (disk full or file size limit); " : "; ") +
              "the previous file, if any, is unchanged");
}

}  // namespace ash::io
