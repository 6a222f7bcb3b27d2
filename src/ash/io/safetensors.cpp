#include "ash/io/safetensors.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>

#include "ash/core/config.hpp"
#include "ash/core/error.hpp"
#include "ash/core/sizes.hpp"
#include "ash/io/atomic_write.hpp"  // AtomicFile: the one temporary-file write
#include "ash/kernels/half_storage.hpp"

namespace fs = std::filesystem;

namespace ash {

const char* dtype_name(TensorDtype t) {
  switch (t) {
    case TensorDtype::f64: return "F64";
    case TensorDtype::f32: return "F32";
    case TensorDtype::bf16: return "BF16";
    case TensorDtype::f16: return "F16";
  }
  return "?";
}

std::size_t dtype_size(TensorDtype t) {
  return t == TensorDtype::f64 ? 8 : t == TensorDtype::f32 ? 4 : 2;
}

TensorDtype parse_dtype(const std::string& name, const std::string& origin) {
  for (TensorDtype t : {TensorDtype::f64, TensorDtype::f32, TensorDtype::bf16, TensorDtype::f16})
    if (name == dtype_name(t)) return t;
  throw Error(origin + ": dtype '" + name + "' is not read (only F64, F32, BF16 and F16 are)");
}

namespace {

std::string quoted(const std::string& s) {  // for messages: never throws on bad UTF-8
  return nlohmann::json(s).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

// pread of exactly n bytes at `offset`, or an ash::Error: a short read means the
// file shrank after its header was checked.
void read_exactly(int fd, void* out, std::size_t n, std::uint64_t offset, const std::string& what) {
  auto* p = static_cast<unsigned char*>(out);
  while (n > 0) {
    const ssize_t r = ::pread(fd, p, n, off_t(offset));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) throw Error(what + ": read error: " + std::strerror(errno));
    if (r == 0) throw Error(what + ": the file ended early (truncated, or changed while being read)");
    p += r;
    n -= std::size_t(r);
    offset += std::uint64_t(r);
  }
}

std::uint64_t le64(const unsigned char* b) {
  std::uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | b[i];
  return v;
}

// One element of dtype t at b, as double (exact for every dtype read).
double decode(TensorDtype t, const unsigned char* b) {
  switch (t) {
    case TensorDtype::f64: {
      const std::uint64_t u = le64(b);
      double d;
      std::memcpy(&d, &u, 8);
      return d;
    }
    case TensorDtype::f32: {
      const std::uint32_t u = std::uint32_t(b[0]) | std::uint32_t(b[1]) << 8 | std::uint32_t(b[2]) << 16 |
                              std::uint32_t(b[3]) << 24;
      return double(half::bits_float(u));
    }
    case TensorDtype::bf16: return double(half::from_bf16(std::uint16_t(b[0] | b[1] << 8)));
    case TensorDtype::f16: return double(half::from_fp16(std::uint16_t(b[0] | b[1] << 8)));
  }
  return 0;
}

// v stored as dtype t at b, little-endian.
template <class T>
void encode(TensorDtype t, T v, unsigned char* b) {
  std::uint64_t u = 0;
  int n = 0;
  switch (t) {
    case TensorDtype::f64: {
      const double d = double(v);
      std::memcpy(&u, &d, 8);
      n = 8;
      break;
    }
    case TensorDtype::f32: u = half::float_bits(float(v)), n = 4; break;
    case TensorDtype::bf16: u = half::to_bf16(float(v)), n = 2; break;
    case TensorDtype::f16: u = half::to_fp16(float(v)), n = 2; break;
  }
  for (int i = 0; i < n; ++i, u >>= 8) b[i] = static_cast<unsigned char>(u & 0xffu);
}

// A non-negative JSON integer that fits int64, else an ash::Error.
std::int64_t json_size(const nlohmann::json& v, const std::string& what) {
  require((v.is_number_unsigned() && v.get<std::uint64_t>() <= std::uint64_t(INT64_MAX)) ||
              (v.is_number_integer() && !v.is_number_unsigned() && v.get<std::int64_t>() >= 0),
          what + " is " + v.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) +
              ", not a non-negative integer below 2^63");
  return v.get<std::int64_t>();
}

}  // namespace

// ---- reading ------------------------------------------------------------------

struct SafetensorsReader::File {
  int fd = -1;
  ~File() {
    if (fd >= 0) ::close(fd);
  }
};

SafetensorsReader::SafetensorsReader(const std::string& path) : path_(path), file_(std::make_shared<File>()) {
  const std::string where = "safetensors file '" + path + "'";
  // A FIFO or a device is refused before anything blocks on it.
  struct stat st {};
  require(::stat(path.c_str(), &st) == 0, "cannot open " + where + ": " + std::strerror(errno));
  require(S_ISREG(st.st_mode), where + " is not a regular file");
  file_->fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  require(file_->fd >= 0, "cannot open " + where + ": " + std::strerror(errno));
  require(::fstat(file_->fd, &st) == 0 && S_ISREG(st.st_mode), where + " is not a regular file");
  const std::uint64_t size = std::uint64_t(st.st_size);

  require(size >= 8, where + " is truncated: " + std::to_string(size) +
                         " bytes, less than the 8-byte header length that starts the format");
  unsigned char len[8];
  read_exactly(file_->fd, len, 8, 0, where);
  const std::uint64_t n = le64(len);
  require(n <= max_safetensors_header, where + ": header length " + std::to_string(n) + " is above the limit of " +
                                           std::to_string(max_safetensors_header) + " bytes");
  require(n <= size - 8, where + ": header length " + std::to_string(n) + " runs past the end of the " +
                             std::to_string(size) + "-byte file (truncated?)");
  require(n >= 2, where + ": header length " + std::to_string(n) + " is too short for a JSON object");
  std::string text(std::size_t(n), '\0');  // bounded by the file's own size above
  read_exactly(file_->fd, text.data(), text.size(), 8, where);
  require(text[0] == '{', where + ": the header does not start with '{'");
  const nlohmann::json doc = parse_json_strict(text, "the header of " + where);
  require(doc.is_object(), where + ": the header is not a JSON object");
  // The object ends at the last '}' (only whitespace may follow it); the format
  // pads with spaces (0x20) alone, and the `safetensors` package refuses others.
  const std::size_t pad = text.find_first_not_of(' ', text.rfind('}') + 1);
  if (pad != std::string::npos) {
    char hex[8];
    std::snprintf(hex, sizeof hex, "0x%02x", unsigned(static_cast<unsigned char>(text[pad])));
    throw Error(where + ": the header is padded with byte " + hex + " at offset " + std::to_string(8 + pad) +
                " of the file; the format pads with spaces (0x20) only");
  }
  data_start_ = 8 + n;
  const std::uint64_t buffer = size - data_start_;

  for (auto it = doc.begin(); it != doc.end(); ++it) {
    const std::string& name = it.key();
    const nlohmann::json& v = it.value();
    if (name == "__metadata__") {
      require(v.is_object(), where + ": \"__metadata__\" is not a JSON object");
      for (auto m = v.begin(); m != v.end(); ++m) {
        require(m.value().is_string(), where + ": \"__metadata__\" value of " + quoted(m.key()) + " is not a string");
        metadata_[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    const std::string tw = where + ": tensor " + quoted(name);
    require(!name.empty(), where + ": a tensor has an empty name");
    require(v.is_object(), tw + " is not a JSON object");
    for (auto f = v.begin(); f != v.end(); ++f)
      require(f.key() == "dtype" || f.key() == "shape" || f.key() == "data_offsets",
              tw + " has an unknown field " + quoted(f.key()) + " (a tensor has dtype, shape and data_offsets)");
    require(v.contains("dtype") && v.contains("shape") && v.contains("data_offsets"),
            tw + " lacks dtype, shape or data_offsets");
    require(v["dtype"].is_string(), tw + ": dtype is not a string");
    SafetensorsEntry e;
    e.name = name;
    e.dtype = parse_dtype(v["dtype"].get<std::string>(), tw);
    require(v["shape"].is_array(), tw + ": shape is not an array");
    e.elements = 1;
    for (const auto& d : v["shape"]) {
      e.shape.push_back(json_size(d, tw + ": a dimension"));
      e.elements = checked_mul(e.elements, e.shape.back(), tw + ": its element count");
    }
    const auto& off = v["data_offsets"];
    require(off.is_array() && off.size() == 2, tw + ": data_offsets is not an array [begin, end]");
    e.begin = std::uint64_t(json_size(off[0], tw + ": data_offsets[0]"));
    e.end = std::uint64_t(json_size(off[1], tw + ": data_offsets[1]"));
    require(e.begin <= e.end, tw + ": data_offsets [" + std::to_string(e.begin) + ", " + std::to_string(e.end) +
                                  "] ends before it begins");
    require(e.end <= buffer, tw + ": data_offsets [" + std::to_string(e.begin) + ", " + std::to_string(e.end) +
                                 "] run past the " + std::to_string(buffer) + "-byte data buffer (truncated?)");
    const std::int64_t bytes = checked_mul(e.elements, std::int64_t(dtype_size(e.dtype)), tw + ": its byte count");
    require(std::uint64_t(bytes) == e.end - e.begin,
            tw + ": shape × " + dtype_name(e.dtype) + " is " + std::to_string(bytes) + " bytes but data_offsets span " +
                std::to_string(e.end - e.begin));
    tensors_.push_back(std::move(e));
  }
  // Ordered by offset, the tensors must tile the buffer: each begins where the
  // previous ended and the last ends at the end of the file (the format's rule).
  std::vector<const SafetensorsEntry*> by_offset;
  for (const auto& e : tensors_) by_offset.push_back(&e);
  std::sort(by_offset.begin(), by_offset.end(), [](const SafetensorsEntry* a, const SafetensorsEntry* b) {
    return a->begin != b->begin ? a->begin < b->begin : a->end < b->end;
  });
  std::uint64_t at = 0;
  const SafetensorsEntry* prev = nullptr;
  for (const auto* e : by_offset) {
    const std::string tw = where + ": tensor " + quoted(e->name);
    if (e->begin < at)
      throw Error(tw + " at bytes [" + std::to_string(e->begin) + ", " + std::to_string(e->end) + ") overlaps tensor " +
                  quoted(prev->name) + " at [" + std::to_string(prev->begin) + ", " + std::to_string(prev->end) + ")");
    require(e->begin == at, tw + " begins at byte " + std::to_string(e->begin) + " of the buffer, leaving bytes [" +
                                std::to_string(at) + ", " + std::to_string(e->begin) + ") that no tensor holds");
    at = e->end;
    prev = e;
  }
  require(at == buffer, where + ": the tensors end at byte " + std::to_string(at) + " of the " +
                            std::to_string(buffer) + "-byte data buffer; the bytes after it belong to no tensor");
  std::sort(tensors_.begin(), tensors_.end(),
            [](const SafetensorsEntry& a, const SafetensorsEntry& b) { return a.name < b.name; });
}

bool SafetensorsReader::contains(const std::string& name) const {
  const auto it = std::lower_bound(tensors_.begin(), tensors_.end(), name,
                                   [](const SafetensorsEntry& e, const std::string& n) { return e.name < n; });
  return it != tensors_.end() && it->name == name;
}

const SafetensorsEntry& SafetensorsReader::at(const std::string& name) const {
  const auto it = std::lower_bound(tensors_.begin(), tensors_.end(), name,
                                   [](const SafetensorsEntry& e, const std::string& n) { return e.name < n; });
  require(it != tensors_.end() && it->name == name, "no tensor " + quoted(name) + " in safetensors file '" + path_ + "'");
  return *it;
}

template <class T>
void SafetensorsReader::read(const std::string& name, T* out, std::size_t first, std::size_t count) const {
  const SafetensorsEntry& e = at(name);
  require(first <= std::size_t(e.elements) && count <= std::size_t(e.elements) - first,
          "safetensors file '" + path_ + "': tensor " + quoted(name) + " has " + std::to_string(e.elements) +
              " elements, not [" + std::to_string(first) + ", " + std::to_string(first) + " + " +
              std::to_string(count) + ")");
  const std::size_t esize = dtype_size(e.dtype);
  constexpr std::size_t block = 1 << 16;  // elements per read
  std::vector<unsigned char> buf(std::min(block, count) * esize);
  const std::string what = "safetensors file '" + path_ + "': tensor " + quoted(name);
  for (std::size_t i = 0; i < count; i += block) {
    const std::size_t m = std::min(block, count - i);
    read_exactly(file_->fd, buf.data(), m * esize, data_start_ + e.begin + (first + i) * esize, what);
    for (std::size_t j = 0; j < m; ++j) out[i + j] = T(decode(e.dtype, buf.data() + j * esize));
  }
}
template void SafetensorsReader::read<float>(const std::string&, float*, std::size_t, std::size_t) const;
template void SafetensorsReader::read<double>(const std::string&, double*, std::size_t, std::size_t) const;

template <class T>
std::vector<T> SafetensorsReader::read(const std::string& name) const {
  std::vector<T> out(std::size_t(at(name).elements));  // checked against the file's size when opened
  read(name, out.data(), 0, out.size());
  return out;
}
template std::vector<float> SafetensorsReader::read<float>(const std::string&) const;
template std::vector<double> SafetensorsReader::read<double>(const std::string&) const;

std::vector<unsigned char> SafetensorsReader::read_bytes(const std::string& name) const {
  const SafetensorsEntry& e = at(name);
  std::vector<unsigned char> out(std::size_t(e.end - e.begin));
  read_exactly(file_->fd, out.data(), out.size(), data_start_ + e.begin,
               "safetensors file '" + path_ + "': tensor " + quoted(name));
  return out;
}

// ---- sets of files ---------------------------------------------------------------

std::string file_in_folder(const std::string& dir, const std::string& name, const std::string& what) {
  const std::string w = what + " " + quoted(name) + " of folder '" + dir + "'";
  require(!name.empty() && name != "." && name != ".." && name.find('/') == std::string::npos &&
              name.find('\0') == std::string::npos,
          w + " is not a plain file name inside the folder");
  const fs::path p = fs::path(dir) / name;
  std::error_code ec;
  const auto ls = fs::symlink_status(p, ec);
  require(!ec && fs::exists(ls), w + " does not exist");
  if (fs::is_symlink(ls)) {
    const fs::path target = fs::canonical(p, ec);
    require(!ec, w + " is a symbolic link that does not resolve");
    const fs::path base = fs::canonical(dir, ec);
    require(!ec, "cannot resolve folder '" + dir + "'");
    const fs::path rel = target.lexically_relative(base);
    require(!rel.empty() && *rel.begin() != "..",
            w + " is a symbolic link to '" + target.string() +
                "', outside the folder (a Hugging Face cache snapshot? copy it with cp -rL first)");
  }
  require(fs::is_regular_file(fs::status(p, ec)) && !ec, w + " is not a regular file");
  return p.string();
}

SafetensorsSet SafetensorsSet::single(const std::string& path) {
  SafetensorsSet s;
  s.origin_ = "safetensors file '" + path + "'";
  s.files_.emplace_back(path);
  for (const auto& e : s.files_[0].tensors()) s.where_[e.name] = 0;
  return s;
}

SafetensorsSet SafetensorsSet::index(const std::string& dir, const std::string& index_name) {
  const std::string path = file_in_folder(dir, index_name, "index");
  const std::string where = "safetensors index '" + path + "'";
  SafetensorsSet s;
  s.origin_ = where;
  std::error_code ec;
  const auto size = fs::file_size(path, ec);
  constexpr std::uintmax_t max_index_bytes = std::uintmax_t(64) << 20;  // a large model's index is ~100 KB
  require(!ec && size <= max_index_bytes, where + " is " + std::to_string(size) + " bytes; an index is at most " +
                                              std::to_string(max_index_bytes));
  std::ifstream in(path, std::ios::binary);
  require(in.good(), "cannot open " + where);
  std::string text;
  try {
    text.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  } catch (const std::ios_base::failure& e) {
    throw Error("error while reading " + where + ": " + e.code().message());
  }
  require(text.size() <= max_index_bytes, where + " grew past " + std::to_string(max_index_bytes) + " bytes");
  const nlohmann::json doc = parse_json_strict(text, where);
  require(doc.is_object() && doc.contains("weight_map") && doc["weight_map"].is_object(),
          where + " has no \"weight_map\" object");
  for (auto it = doc.begin(); it != doc.end(); ++it)
    require(it.key() == "weight_map" || it.key() == "metadata",
            where + " has an unknown key " + quoted(it.key()) + " (an index has metadata and weight_map)");
  require(!doc.contains("metadata") || doc["metadata"].is_object(), where + ": \"metadata\" is not an object");

  std::map<std::string, std::size_t> shard_index;  // file name -> files_ index
  const auto& map = doc["weight_map"];
  for (auto it = map.begin(); it != map.end(); ++it) {
    require(it.value().is_string(), where + ": tensor " + quoted(it.key()) + " maps to a non-string");
    const std::string shard = it.value().get<std::string>();
    auto f = shard_index.find(shard);
    if (f == shard_index.end()) {
      s.files_.emplace_back(file_in_folder(dir, shard, "shard"));
      f = shard_index.emplace(shard, s.files_.size() - 1).first;
    }
    require(s.files_[f->second].contains(it.key()),
            where + ": tensor " + quoted(it.key()) + " is not in shard " + quoted(shard) + ", which the index names");
    s.where_[it.key()] = f->second;
  }
  // Every tensor of every shard is the one the map points at (none unlisted, none twice).
  for (const auto& f : shard_index)
    for (const auto& e : s.files_[f.second].tensors()) {
      const auto w = s.where_.find(e.name);
      require(w != s.where_.end(), where + ": shard " + quoted(f.first) + " holds tensor " + quoted(e.name) +
                                       ", which the weight_map does not list");
      require(w->second == f.second, where + ": tensor " + quoted(e.name) + " is in shard " + quoted(f.first) +
                                         " and in the shard the weight_map names");
    }
  return s;
}

SafetensorsSet SafetensorsSet::folder(const std::string& dir) {
  std::error_code ec;
  require(fs::is_directory(dir, ec), "'" + dir + "' is not a folder");
  // transformers' order: the single file first, then the index.
  if (fs::exists(fs::symlink_status(fs::path(dir) / "model.safetensors", ec)))
    return single(file_in_folder(dir, "model.safetensors", "weights file"));
  if (fs::exists(fs::symlink_status(fs::path(dir) / "model.safetensors.index.json", ec)))
    return index(dir, "model.safetensors.index.json");
  throw Error("folder '" + dir + "' has neither model.safetensors nor model.safetensors.index.json" +
              (fs::exists(fs::path(dir) / "pytorch_model.bin", ec)
                   ? std::string(" (pytorch_model.bin is not read: save it with safe_serialization)")
                   : std::string()));
}

std::vector<std::string> SafetensorsSet::names() const {
  std::vector<std::string> n;
  for (const auto& w : where_) n.push_back(w.first);
  return n;
}

const SafetensorsReader& SafetensorsSet::file_of(const std::string& name) const {
  const auto it = where_.find(name);
  require(it != where_.end(), "no tensor " + quoted(name) + " in " + origin_);
  return files_[it->second];
}

// ---- writing ----------------------------------------------------------------------

namespace {

std::string json_string(const std::string& s, const std::string& what) {
  try {
    return nlohmann::json(s).dump();  // escapes as serde_json does: \" \\ \b \f \n \r \t, \u00xx
  } catch (const nlohmann::json::exception&) {
    throw Error(what + " is not valid UTF-8");
  }
}

}  // namespace

std::vector<std::pair<std::string, std::string>> torch_metadata() { return {{"format", "pt"}}; }

void write_file_atomically(const std::string& path, const std::string& bytes) {
  io::AtomicFile f(path);
  f.write(bytes.data(), bytes.size());
  f.commit();
}

void write_safetensors(const std::string& path, const std::vector<TensorToWrite>& tensors,
                       const std::vector<std::pair<std::string, std::string>>& metadata) {
  const std::string where = "safetensors file '" + path + "'";
  std::set<std::string> names;
  for (const auto& t : tensors) {
    const std::string tw = where + ": tensor " + quoted(t.name);
    require(!t.name.empty(), where + ": a tensor has an empty name");
    require(t.name != "__metadata__", tw + " has the name reserved for the metadata");
    require(names.insert(t.name).second, tw + " is given twice");
    std::int64_t n = 1;
    for (const auto d : t.shape) {
      require(d >= 0, tw + ": negative dimension " + std::to_string(d));
      n = checked_mul(n, d, tw + ": its element count");
    }
    require(std::uint64_t(n) == t.count, tw + ": the shape holds " + std::to_string(n) + " values, " +
                                             std::to_string(t.count) + " were given");
    require(t.count == 0 || ((t.values64 != nullptr) != (t.values32 != nullptr)),
            tw + ": give its values in double or in float");
  }
  std::set<std::string> keys;
  for (const auto& m : metadata) require(keys.insert(m.first).second, where + ": metadata key " + quoted(m.first) + " twice");

  // The safetensors package's order: by dtype, widest first (its Dtype enum
  // descending: F64, F32, BF16, F16; TensorDtype is declared so), then by name.
  std::vector<const TensorToWrite*> order;
  for (const auto& t : tensors) order.push_back(&t);
  std::sort(order.begin(), order.end(), [](const TensorToWrite* a, const TensorToWrite* b) {
    return a->dtype != b->dtype ? int(a->dtype) < int(b->dtype) : a->name < b->name;
  });
  std::string header = "{";
  if (!metadata.empty()) {
    header += "\"__metadata__\":{";
    for (std::size_t i = 0; i < metadata.size(); ++i)
      header += (i ? "," : "") + json_string(metadata[i].first, where + ": a metadata key") + ":" +
                json_string(metadata[i].second, where + ": metadata " + quoted(metadata[i].first));
    header += "}";
  }
  std::int64_t offset = 0;
  for (const auto* t : order) {
    const std::string tw = where + ": tensor " + quoted(t->name);
    const std::int64_t bytes = checked_mul(std::int64_t(t->count), std::int64_t(dtype_size(t->dtype)), tw);
    header += (header.size() > 1 ? "," : "") + json_string(t->name, tw + "'s name") + ":{\"dtype\":\"" +
              dtype_name(t->dtype) + "\",\"shape\":[";
    for (std::size_t i = 0; i < t->shape.size(); ++i) header += (i ? "," : "") + std::to_string(t->shape[i]);
    header += "],\"data_offsets\":[" + std::to_string(offset) + ",";
    offset = checked_add(offset, bytes, where + ": the data size");
    header += std::to_string(offset) + "]}";
  }
  header += "}";
  while (header.size() % 8 != 0) header += ' ';  // as the package pads: the buffer starts 8-byte aligned
  require(header.size() <= max_safetensors_header, where + ": the header would be " + std::to_string(header.size()) +
                                                       " bytes, above the format's limit");

  io::AtomicFile f(path);
  unsigned char len[8];
  std::uint64_t n = header.size();
  for (auto& b : len) b = static_cast<unsigned char>(n & 0xffu), n >>= 8;
  f.write(len, 8);
  f.write(header.data(), header.size());
  constexpr std::size_t block = 1 << 16;
  std::vector<unsigned char> buf;
  for (const auto* t : order) {
    const std::size_t esize = dtype_size(t->dtype);
    buf.resize(std::min(block, t->count) * esize);
    for (std::size_t i = 0; i < t->count; i += block) {
      const std::size_t m = std::min(block, t->count - i);
      for (std::size_t j = 0; j < m; ++j) {
        if (t->values64)
          encode(t->dtype, t->values64[i + j], buf.data() + j * esize);
        else
          encode(t->dtype, t->values32[i + j], buf.data() + j * esize);
      }
      f.write(buf.data(), m * esize);
    }
  }
  f.commit();
}

}  // namespace ash
