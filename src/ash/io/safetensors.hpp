#pragma once
// The safetensors format (Hugging Face's `safetensors`; docs/file_format.md,
// "safetensors files"): an 8-byte little-endian header length N, N bytes of JSON
// {name: {dtype, shape, data_offsets: [b, e]}, "__metadata__": {str: str}}, then the
// byte buffer the offsets index. Read as strictly as our checkpoints: the header is
// bounded, every rule the format states is checked before a tensor is read, and
// nothing is allocated by a size the file declares before it is checked against the
// file's own size. Namespace ash, not ash::io: a file format a user reads and writes
// (as load_checkpoint), with no HDF5 in its interface; installed with the library.
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace ash {

// The element types read and written; every other safetensors dtype (I64, U8,
// BOOL, F8_*, ...) is refused by name.
enum class TensorDtype { f64, f32, bf16, f16 };
// "F64", "F32", "BF16", "F16" (the format's names).
const char* dtype_name(TensorDtype t);
std::size_t dtype_size(TensorDtype t);
// The dtype a format name gives; ash::Error naming `origin` for any other name.
TensorDtype parse_dtype(const std::string& name, const std::string& origin);

// The largest header the reader accepts: the `safetensors` package's own bound.
constexpr std::uint64_t max_safetensors_header = 100'000'000;

// One tensor of a file: its byte range [begin, end) of the buffer after the header.
struct SafetensorsEntry {
  std::string name;
  TensorDtype dtype = TensorDtype::f32;
  std::vector<std::int64_t> shape;
  std::int64_t elements = 0;  // the product of shape
  std::uint64_t begin = 0, end = 0;
};

// A safetensors file opened for reading. The constructor reads and checks the
// header (ash::Error naming the file, and the tensor where one is at fault):
// the file a regular file of at least 8 bytes; N <= max_safetensors_header and
// N <= size - 8; the header UTF-8 JSON starting with '{', nested at most
// max_json_depth, no key twice (a tensor named twice); each tensor exactly
// {dtype, shape, data_offsets}, dtype in {F64, F32, BF16, F16}, shape
// non-negative integers whose product (checked) times the element size is
// e - b; the tensors, ordered by offset, cover the buffer exactly (no gap, no
// overlap, nothing after the last); "__metadata__" an object of strings.
// Tensors are read later, one at a time, from the open file.
class SafetensorsReader {
 public:
  explicit SafetensorsReader(const std::string& path);
  const std::string& path() const { return path_; }
  // Every tensor, by name (bytewise order).
  const std::vector<SafetensorsEntry>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  bool contains(const std::string& name) const;
  // ash::Error "no tensor 'name' in 'file'" when absent.
  const SafetensorsEntry& at(const std::string& name) const;
  // Its values converted to T (double or float): F16 and BF16 exactly, F32 into
  // double exactly, F64 into float rounded to nearest. Memory: the result and
  // one block of the file.
  template <class T>
  std::vector<T> read(const std::string& name) const;
  // Its elements [first, first + count) converted as above into out[0, count)
  // (ash::Error when the range is not inside the tensor). Memory: one block.
  template <class T>
  void read(const std::string& name, T* out, std::size_t first, std::size_t count) const;
  // Its bytes as stored (little-endian elements).
  std::vector<unsigned char> read_bytes(const std::string& name) const;

 private:
  struct File;
  std::string path_;
  std::shared_ptr<File> file_;  // the open descriptor (copies share it)
  std::uint64_t data_start_ = 0;
  std::vector<SafetensorsEntry> tensors_;
  std::map<std::string, std::string> metadata_;
};

// The tensors of several files as one set: a single model.safetensors, or the
// shards a model.safetensors.index.json names. Every tensor is found exactly once.
class SafetensorsSet {
 public:
  // One file.
  static SafetensorsSet single(const std::string& path);
  // An index {"metadata": {...}, "weight_map": {tensor: file}} in `dir`: each file a
  // plain name (no '/', not "." or ".."; neither it nor a link it is may lead
  // outside `dir`), opened once; every tensor of the map is in the file it names,
  // and every tensor of those files is in the map, pointing at that file.
  static SafetensorsSet index(const std::string& dir, const std::string& index_name = "model.safetensors.index.json");
  // What transformers' from_pretrained loads from a model folder: its
  // model.safetensors, else its model.safetensors.index.json (same file rules);
  // neither: an ash::Error naming the folder.
  static SafetensorsSet folder(const std::string& dir);

  // Every tensor name, bytewise order.
  std::vector<std::string> names() const;
  std::size_t size() const { return where_.size(); }
  bool contains(const std::string& name) const { return where_.count(name) != 0; }
  // The file holding `name` (ash::Error naming it when absent).
  const SafetensorsReader& file_of(const std::string& name) const;
  const SafetensorsEntry& at(const std::string& name) const { return file_of(name).at(name); }
  template <class T>
  std::vector<T> read(const std::string& name) const {
    return file_of(name).template read<T>(name);
  }
  const std::vector<SafetensorsReader>& files() const { return files_; }
  // What the set was opened from (a file, or an index), for messages.
  const std::string& origin() const { return origin_; }

 private:
  std::string origin_;
  std::vector<SafetensorsReader> files_;
  std::map<std::string, std::size_t> where_;  // tensor -> files_ index
};

// `name` inside folder `dir` as a path, for reading: a plain file name (not empty,
// no '/' or NUL, not "." or ".."), a regular file, and, when it is a symbolic link,
// one that resolves inside `dir`. ash::Error naming `what`, the name and the folder.
std::string file_in_folder(const std::string& dir, const std::string& name, const std::string& what);

// A tensor to write: its stored dtype and shape, and the values (product(shape)
// of them, in double or float; converted to dtype on writing, rounded to nearest
// even; into F16/BF16 through float, as torch's .to() does).
struct TensorToWrite {
  std::string name;
  TensorDtype dtype = TensorDtype::f32;
  std::vector<std::int64_t> shape;
  const double* values64 = nullptr;  // exactly one of the two
  const float* values32 = nullptr;
  std::size_t count = 0;

  TensorToWrite() = default;
  TensorToWrite(std::string n, TensorDtype t, std::vector<std::int64_t> s, const double* v, std::size_t c)
      : name(std::move(n)), dtype(t), shape(std::move(s)), values64(v), count(c) {}
  TensorToWrite(std::string n, TensorDtype t, std::vector<std::int64_t> s, const float* v, std::size_t c)
      : name(std::move(n)), dtype(t), shape(std::move(s)), values32(v), count(c) {}
  TensorToWrite(std::string n, TensorDtype t, std::vector<std::int64_t> s, const std::vector<double>& v)
      : TensorToWrite(std::move(n), t, std::move(s), v.data(), v.size()) {}
  TensorToWrite(std::string n, TensorDtype t, std::vector<std::int64_t> s, const std::vector<float>& v)
      : TensorToWrite(std::move(n), t, std::move(s), v.data(), v.size()) {}
  // It only points at the values: a temporary vector would be gone before the write.
  TensorToWrite(std::string, TensorDtype, std::vector<std::int64_t>, std::vector<double>&&) = delete;
  TensorToWrite(std::string, TensorDtype, std::vector<std::int64_t>, std::vector<float>&&) = delete;
};

// The metadata transformers writes (save_pretrained): {"format": "pt"}.
std::vector<std::pair<std::string, std::string>> torch_metadata();

// Writes `tensors` as a safetensors file byte for byte as the `safetensors`
// package (0.8) writes the same tensors: data ordered by dtype (F64, F32, BF16,
// F16) then by name, the header's "__metadata__" first (in the order given;
// omitted when empty) and the tensors in data order, compact JSON padded with
// spaces to a multiple of 8 bytes. Through a new temporary file, fsync and a
// rename over `path` (io::AtomicFile: `path` absent or a regular file; on
// failure `path` is unchanged). ash::Error naming the file and the tensor: an
// empty or repeated name, "__metadata__", a negative dimension, a value count
// other than the shape's, names or metadata that are not UTF-8.
void write_safetensors(const std::string& path, const std::vector<TensorToWrite>& tensors,
                       const std::vector<std::pair<std::string, std::string>>& metadata = torch_metadata());

// Writes `bytes` to `path` the same way (temporary file, fsync, rename).
void write_file_atomically(const std::string& path, const std::string& bytes);

}  // namespace ash
