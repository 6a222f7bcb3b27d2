#pragma once
// Cutting a token array into what a run reads (the use-case floor,
// docs/architecture.md): document starts from data.separator, the windows of a
// gradient, where the tokens come from. The `ash` tool and the Python module
// both use these.
#include <cstdint>
#include <string>
#include <vector>

#include "ash/core/options.hpp"
#include "ash/core/types.hpp"

namespace ash {

// A document start flag per token from data.separator's bytes (Settings::data.separator);
// empty when there is no separator. documents() is the pointer the readers take.
struct DocumentStarts {
  std::vector<std::uint8_t> flags;
  bool on = false;
  const std::vector<std::uint8_t>* documents() const { return on ? &flags : nullptr; }
};
DocumentStarts document_starts(const std::vector<std::uint32_t>& ids, const std::string& separator);

// The tokens a verb reads: a token file (ash grad / eval: text bytes, .u16, .u32;
// io/tokens), or an array already in memory (Python). name() is how messages
// quote it.
struct TokenSource {
  std::string path;                                 // a token file, or
  const std::vector<std::uint32_t>* ids = nullptr;  // tokens in memory (not copied)
  // *ids, or the file read into `storage`.
  const std::vector<std::uint32_t>& read(std::vector<std::uint32_t>& storage) const;
  std::string name() const;  // "token file 'x'" or "the token array"
};

// The first data.batch windows of data.seq_len tokens of ids, document starts marked
// (ash grad, Python's grad).
TokenView first_windows(const std::vector<std::uint32_t>& ids, const Settings& st);

}  // namespace ash
