#include "ash/io/hdf5_rows.hpp"

#include <algorithm>
#include <cstring>

#include "ash/core/error.hpp"
#include "ash/io/hdf5_digest.hpp"

namespace ash::io {

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

namespace {

// Nothing is sized from a dataset's extent before its bytes are known to be stored.
void require_stored_extent(hid_t ds, const std::vector<hsize_t>& dims, std::size_t elem_size, const std::string& path,
                           const std::string& fname) {
  const std::string problem = extent_problem(ds, dims, elem_size);
  require(problem.empty(), "not an ash checkpoint: '" + fname + "': dataset " + path + " " + problem);
}

// Reads a dataset's stored bytes in blocks of rows (a chunk's rows when
// chunked, so each chunk is read and Fletcher-checked once), hands each block
// converted to mem_type to `sink` when there is one, and returns the XXH3-64
// of the path, a NUL and the bytes as stored.
std::uint64_t read_blocks(hid_t ds, const std::string& path, hid_t mem_type, const BlockSink& sink,
                          const std::string& fname) {
  Handle ft(H5Dget_type(ds), H5Tclose);
  const auto cls = ft.ok() ? H5Tget_class(ft) : H5T_NO_CLASS;
  require(cls == H5T_FLOAT || cls == H5T_INTEGER,
          "not an ash checkpoint: '" + fname + "': dataset " + path + " is not numeric");
  Handle fspace(H5Dget_space(ds), H5Sclose);
  const int rank = fspace.ok() ? H5Sget_simple_extent_ndims(fspace) : -1;
  require(rank >= 0 && rank <= 8, "'" + fname + "': dataset " + path + " has an unreadable shape");
  std::vector<hsize_t> dims(std::size_t(rank), 0);
  if (rank > 0) H5Sget_simple_extent_dims(fspace, dims.data(), nullptr);
  const std::size_t fsize = H5Tget_size(ft), msize = sink ? H5Tget_size(mem_type) : 0;
  require_stored_extent(ds, dims, fsize, path, fname);
  hsize_t row = 1;  // elements per index of dimension 0
  for (int i = 1; i < rank; ++i) row *= dims[std::size_t(i)];
  const hsize_t rows = rank > 0 ? dims[0] : 1;
  hsize_t block = std::max<hsize_t>(1, (hsize_t(4) << 20) / std::max<hsize_t>(1, row * std::max(fsize, msize)));
  {
    Handle dcpl(H5Dget_create_plist(ds), H5Pclose);
    hsize_t chunk[32];
    if (rank > 0 && dcpl.ok() && H5Pget_layout(dcpl) == H5D_CHUNKED && H5Pget_chunk(dcpl, rank, chunk) == rank)
      block = chunk[0];
  }
  const bool fletcher = has_fletcher32(ds);
  const std::string failed = fletcher
                                 ? "checksum mismatch in dataset " + path + " of '" + fname + "' (the file is corrupt)"
                                 : "cannot read dataset " + path + " of '" + fname + "' (the file is corrupt)";
  Digest d;
  d.add_str(path);
  std::vector<unsigned char> buf;
  for (hsize_t r0 = 0; r0 < rows; r0 += block) {
    const hsize_t nr = std::min(block, rows - r0), n = nr * row;
    buf.resize(std::size_t(n) * std::max(fsize, msize));
    if (rank == 0) {
      require(H5Dread(ds, ft, H5S_ALL, H5S_ALL, H5P_DEFAULT, buf.data()) >= 0, failed);
    } else {
      std::vector<hsize_t> start(std::size_t(rank), 0), count(dims);
      start[0] = r0;
      count[0] = nr;
      check(H5Sselect_hyperslab(fspace, H5S_SELECT_SET, start.data(), nullptr, count.data(), nullptr),
            "selecting rows of " + path);
      Handle mspace(H5Screate_simple(1, &n, nullptr), H5Sclose);
      require(H5Dread(ds, ft, mspace, fspace, H5P_DEFAULT, buf.data()) >= 0, failed);
    }
    d.add(buf.data(), std::size_t(n) * fsize);
    if (sink) {
      check(H5Tconvert(ft, mem_type, std::size_t(n), buf.data(), nullptr, H5P_DEFAULT), "converting " + path);
      sink(buf.data(), std::size_t(r0 * row), std::size_t(n));
    }
  }
  return d.value();
}

}  // namespace

void write_dataset(hid_t file, const std::string& path, hid_t file_type, const std::vector<hsize_t>& dims, hid_t dcpl,
                   hid_t lcpl, hid_t mem_type, const void* data) {
  Handle sp(dims.empty() ? H5Screate(H5S_SCALAR) : H5Screate_simple(int(dims.size()), dims.data(), nullptr), H5Sclose);
  Handle ds(H5Dcreate2(file, path.c_str(), file_type, sp, lcpl, dcpl, H5P_DEFAULT), H5Dclose);
  require(ds.ok(), "HDF5: cannot create dataset " + path);
  check(H5Dwrite(ds, mem_type, H5S_ALL, H5S_ALL, H5P_DEFAULT, data), "writing " + path);
  // The digest of the bytes as stored: the buffer itself when the memory
  // type is the file's (little-endian hosts), else a converted copy.
  std::size_t n = 1;
  for (hsize_t x : dims) n *= std::size_t(x);
  const std::size_t fsize = H5Tget_size(file_type), msize = H5Tget_size(mem_type);
  Digest d;
  d.add_str(path);
  if (H5Tequal(mem_type, file_type) > 0) {
    d.add(data, n * fsize);
  } else {
    std::vector<unsigned char> buf(n * std::max(fsize, msize));
    std::memcpy(buf.data(), data, n * msize);
    check(H5Tconvert(mem_type, file_type, n, buf.data(), nullptr, H5P_DEFAULT), "converting " + path);
    d.add(buf.data(), n * fsize);
  }
  write_digest(ds, d.value());
}

std::string extent_problem(hid_t ds, const std::vector<hsize_t>& dims, std::size_t elem_size) {
  std::string shape = "[";
  for (std::size_t i = 0; i < dims.size(); ++i) shape += (i ? "," : "") + std::to_string(dims[i]);
  shape += "]";
  hsize_t bytes = elem_size;
  for (hsize_t x : dims)
    if (__builtin_mul_overflow(bytes, x, &bytes)) return "has shape " + shape + ", more bytes than 2^64";
  Handle dcpl(H5Dget_create_plist(ds), H5Pclose);
  if (!dcpl.ok()) return "has an unreadable storage description";
  if (H5Pget_layout(dcpl) == H5D_CHUNKED) {
    std::vector<hsize_t> chunk(std::max<std::size_t>(dims.size(), 1), 0);
    if (dims.empty() || H5Pget_chunk(dcpl, int(dims.size()), chunk.data()) != int(dims.size()))
      return "has an unreadable chunk shape";
    for (std::size_t i = 0; i < dims.size(); ++i)
      if (chunk[i] < 1 || chunk[i] > dims[i])
        return "has chunks of dimension " + std::to_string(chunk[i]) + " in its shape " + shape;
  }
  const hsize_t stored = H5Dget_storage_size(ds);
  if (stored < bytes)
    return "stores " + std::to_string(stored) + " bytes of the " + std::to_string(bytes) + " its shape " + shape +
           " declares (chunks never written: the file is truncated or was altered)";
  return "";
}

void read_dataset(hid_t ds, const std::string& path, hid_t mem_type, void* out, bool verify,
                  const std::string& fname) {
  if (!verify && out) {  // one read of the whole dataset, Fletcher-32 checked by HDF5
    Handle ft(H5Dget_type(ds), H5Tclose), sp(H5Dget_space(ds), H5Sclose);
    const int rank = sp.ok() ? H5Sget_simple_extent_ndims(sp) : -1;
    require(ft.ok() && rank >= 0 && rank <= 8, "'" + fname + "': dataset " + path + " has an unreadable shape");
    std::vector<hsize_t> dims(std::size_t(rank), 0);
    if (rank > 0) H5Sget_simple_extent_dims(sp, dims.data(), nullptr);
    require_stored_extent(ds, dims, H5Tget_size(ft), path, fname);
    require(H5Dread(ds, mem_type, H5S_ALL, H5S_ALL, H5P_DEFAULT, out) >= 0,
            (has_fletcher32(ds) ? "checksum mismatch in dataset " : "cannot read dataset ") + path + " of '" + fname +
                "' (the file is corrupt)");
    return;
  }
  const std::size_t msize = out ? H5Tget_size(mem_type) : 0;
  BlockSink copy;
  if (out)
    copy = [&](const void* values, std::size_t first, std::size_t n) {
      std::memcpy(static_cast<unsigned char*>(out) + first * msize, values, n * msize);
    };
  scan_dataset(ds, path, mem_type, verify, fname, copy);
}

void scan_dataset(hid_t ds, const std::string& path, hid_t mem_type, bool verify, const std::string& fname,
                  const BlockSink& sink) {
  std::uint64_t stored = 0;
  require(!verify || read_digest(ds, &stored),
          "checksum mismatch in dataset " + path + " of '" + fname +
              "': it has no digest (format 3 files have one; the file was altered)");
  const std::uint64_t got = read_blocks(ds, path, mem_type, sink, fname);
  require(!verify || got == stored, "checksum mismatch in dataset " + path + " of '" + fname +
                                        "' (its digest differs: the file is corrupt or was altered)");
}

void seal_datasets(hid_t file) {
  for (const auto& o : list_objects(file, "(file being sealed)")) {
    if (o.second != ObjectKind::dataset) continue;
    Handle ds(H5Dopen2(file, o.first.c_str(), H5P_DEFAULT), H5Dclose);
    require(ds.ok(), "HDF5: cannot open " + o.first);
    write_digest(ds, read_blocks(ds, o.first, -1, BlockSink(), "(file being sealed)"));
  }
}

}  // namespace ash::io
