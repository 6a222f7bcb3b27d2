#include "ash/io/tokens.hpp"

#include <algorithm>
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
  const std::size_t width = ends_with(path, ".u32") ? 4 : ends_with(path, ".u16") ? 2 : 1;
  require(size % width == 0, "token file '" + path + "' has " + std::to_string(size) + " bytes, not a multiple of " +
                                 std::to_string(width) + " (truncated .u" + std::to_string(8 * width) + " file?)");
  // What the file becomes: a 4-byte id per token (a byte file grows 4x), decoded in
  // pieces so the file's bytes are never held whole beside it.
  const std::uint64_t ids = size / width, need = ids <= ~std::uint64_t(0) / 4 ? ids * 4 : ~std::uint64_t(0);
  const std::uint64_t mem = physical_memory_bytes();
  require(mem == 0 || need <= mem / 5 * 4,
          "token file '" + path + "' (" + format_bytes(size) + ", " + std::to_string(ids) + " tokens) needs " +
              format_bytes(need) + " as 4-byte token ids, more than 80% of memory (" + format_bytes(mem) + ")");
  std::ifstream in(path, std::ios::binary);
  require(in.good(), "cannot open token file '" + path + "'");
  std::vector<std::uint32_t> out(ids);
  std::vector<unsigned char> piece(std::size_t(1) << 20);
  std::size_t done = 0;  // tokens decoded
  try {  // libstdc++ reports a read error (EIO) by throwing from the stream buffer
    while (done < out.size()) {
      const std::size_t n = std::min<std::size_t>(piece.size() / width, out.size() - done);
      in.read(reinterpret_cast<char*>(piece.data()), std::streamsize(n * width));
      require(std::size_t(in.gcount()) == n * width && !in.bad(),
              "error while reading token file '" + path + "' (it changed or could not be read)");
      for (std::size_t i = 0; i < n; ++i) {
        std::uint32_t v = 0;
        for (std::size_t j = 0; j < width; ++j) v |= std::uint32_t(piece[i * width + j]) << (8 * j);  // little-endian
        out[done + i] = v;
      }
      done += n;
    }
    // Nothing past the size it reported (a /proc file reports 0; a file may grow).
    require(in.rdbuf()->sgetc() == std::char_traits<char>::eof(),
            "token file '" + path + "' holds more than the " + format_bytes(size) +
                " its size says (a /proc or growing file?)");
  } catch (const std::ios_base::failure& e) {
    throw Error("error while reading token file '" + path + "': " + e.code().message());
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
