#pragma once
// Datasets as blocks of rows (docs/file_format.md): the checksummed chunked
// layout (Fletcher-32), writing a dataset with its digest, and reading one
// block of rows at a time, checked against its stored extent, its checksums
// and its digest. Internal (see hdf5_objects.hpp).
#include <hdf5.h>

#include <cstddef>
#include <functional>
#include <string>
#include <vector>

#include "ash/io/hdf5_objects.hpp"

namespace ash::io {

// True when the dataset passes through the Fletcher-32 filter.
bool has_fletcher32(hid_t dataset);
// Chunked with the Fletcher-32 filter: one chunk up to 4 MiB, else blocks of rows.
Handle checksummed_dcpl(const std::vector<hsize_t>& dims, std::size_t elem);

// Creates dataset `path` (dims; none: a scalar) of file_type with dcpl and
// lcpl, writes its elements from `data` (mem_type) and its `digest`
// attribute: XXH3-64 of the path, a NUL and the bytes as stored.
void write_dataset(hid_t file, const std::string& path, hid_t file_type, const std::vector<hsize_t>& dims, hid_t dcpl,
                   hid_t lcpl, hid_t mem_type, const void* data);
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
void read_dataset(hid_t ds, const std::string& path, hid_t mem_type, void* out, bool verify, const std::string& fname);
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

}  // namespace ash::io
