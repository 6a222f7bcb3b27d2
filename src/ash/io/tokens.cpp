#include "ash/io/tokens.hpp"

#include <filesystem>
#include <fstream>

#include "ash/core/error.hpp"
#include "ash/core/memory.hpp"
#include "ash/core/sizes.hpp"

namespace ash {

namespace {
bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}
}  // namespace

std::vector<std::uint32_t> load_tokens(const std::string& path) {
  // A directory, /dev/zero or a file larger than memory would read forever or
  // die in the allocator: check what it is and its size first (§7).
  std::error_code ec;
  const auto st = std::filesystem::status(path, ec);
  require(!ec && std::filesystem::exists(st), "cannot open token file '" + path + "'");
  require(std::filesystem::is_regular_file(st),
          "token file '" + path + "' is not a regular file (a directory or a device?)");
  const std::uint64_t size = std::filesystem::file_size(path, ec);
  require(!ec, "cannot read the size of token file '" + path + "': " + ec.message());
  const std::uint64_t mem = physical_memory_bytes();
  // The bytes and the 4-byte ids are both held while decoding.
  require(mem == 0 || size / 4 < mem / 5, "token file '" + path + "' (" + format_bytes(size) +
                                              ") does not fit in memory (" + format_bytes(mem) + ")");
  std::ifstream in(path, std::ios::binary);
  require(in.good(), "cannot open token file '" + path + "'");
  std::vector<unsigned char> bytes;
  try {  // libstdc++ reports a read error (EIO) by throwing from the stream buffer
    bytes.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  } catch (const std::ios_base::failure& e) {
    throw Error("error while reading token file '" + path + "': " + e.code().message());
  }
  require(!in.bad(), "error while reading token file '" + path + "'");
  const std::size_t width = ends_with(path, ".u32") ? 4 : ends_with(path, ".u16") ? 2 : 1;
  require(bytes.size() % width == 0, "token file '" + path + "' has " + std::to_string(bytes.size()) +
                                         " bytes, not a multiple of " + std::to_string(width) +
                                         " (truncated .u" + std::to_string(8 * width) + " file?)");
  std::vector<std::uint32_t> out(bytes.size() / width);
  for (std::size_t i = 0; i < out.size(); ++i) {
    std::uint32_t v = 0;
    for (std::size_t j = 0; j < width; ++j) v |= std::uint32_t(bytes[i * width + j]) << (8 * j);  // little-endian
    out[i] = v;
  }
  return out;
}

TokenView make_windows(const std::vector<std::uint32_t>& tokens, index_t batch, index_t T, index_t vocab,
                       index_t first, const std::vector<std::uint8_t>* starts) {
  require(T >= 2, "sequence length T = " + std::to_string(T) + " is too short: a window needs T >= 2 tokens");
  require(batch >= 1, "batch must be >= 1 (got " + std::to_string(batch) + ")");
  const index_t need = checked_add(first, checked_mul(batch, T, "batch x seq_len"), "tokens needed");
  require(index_t(tokens.size()) >= need, "need " + std::to_string(need) + " tokens for " + std::to_string(batch) +
                                              " window(s) of T = " + std::to_string(T) + ", the file has " +
                                              std::to_string(tokens.size()));
  TokenView x("ash::tokens", batch, T);
  auto h = Kokkos::create_mirror_view(x);
  for (index_t b = 0; b < batch; ++b)
    for (index_t t = 0; t < T; ++t) {
      const std::uint32_t v = tokens[first + b * T + t];
      require(index_t(v) < vocab, "token id " + std::to_string(v) + " at position " +
                                      std::to_string(first + b * T + t) + " is >= vocab " + std::to_string(vocab));
      h(b, t) = token_t(v) | (starts && (*starts)[first + b * T + t] ? doc_start_bit : token_t(0));
    }
  Kokkos::deep_copy(x, h);
  return x;
}

}  // namespace ash
