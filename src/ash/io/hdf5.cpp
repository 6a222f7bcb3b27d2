#include "ash/io/hdf5.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>

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
  std::FILE* f = std::fopen(path.c_str(), "rb");
  require(f != nullptr, std::string("cannot open ") + what + " '" + path + "'");
  std::fclose(f);
  std::error_code ec;
  require(std::filesystem::is_regular_file(path, ec), std::string(what) + " '" + path + "' is not a regular file");
  require(H5Fis_hdf5(path.c_str()) > 0, std::string(what) + " '" + path + "' is not an HDF5 file (corrupt?)");
  Handle file(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), H5Fclose);
  require(file.ok(), std::string("cannot read ") + what + " '" + path + "' (truncated or corrupt HDF5 file)");
  return file;
}

// Writes the whole file in memory (HDF5's core driver, no backing store),
// then its image through a temporary file, fsync, and a rename into place.
// HDF5 never sees an I/O error, so a full disk or a file-size limit cannot
// leave a library handle half-closed (it crashed HDF5's shutdown); the error
// names the file, the temp file is removed and the previous file stays.
void write_atomically(const std::string& path, const std::function<void(hid_t)>& body) {
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  std::vector<unsigned char> image;
  {
    Handle fapl(H5Pcreate(H5P_FILE_ACCESS), H5Pclose);
    require(fapl.ok(), "HDF5: cannot create a file access property list");
    check(H5Pset_fapl_core(fapl, 1 << 20, 0), "selecting the in-memory driver");
    // The 1.10 format checksums all metadata (superblock v3, object headers,
    // chunk indexes: a single chunk's address lives in the object header).
    check(H5Pset_libver_bounds(fapl, H5F_LIBVER_V110, H5F_LIBVER_V110), "setting the format bounds");
    check(H5Pset_fclose_degree(fapl, H5F_CLOSE_STRONG), "setting the close degree");
    Handle file(H5Fcreate(tmp.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, fapl), H5Fclose);
    require(file.ok(), "HDF5: cannot create the in-memory image of '" + path + "'");
    body(hid_t(file));
    check(H5Fflush(file, H5F_SCOPE_GLOBAL), "flushing the image of '" + path + "'");
    const ssize_t n = H5Fget_file_image(file, nullptr, 0);
    require(n > 0, "HDF5: cannot get the image of '" + path + "'");
    image.resize(std::size_t(n));
    require(H5Fget_file_image(file, image.data(), image.size()) == n, "HDF5: cannot copy the image of '" + path + "'");
  }
  fix_superblock_checksum(image);
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
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
