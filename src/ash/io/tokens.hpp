#pragma once
// Token files (docs/design.md §4): raw bytes of any text file (ids 0..255), or a
// flat little-endian uint16 / uint32 array named *.u16 / *.u32.
#include <cstdint>
#include <string>
#include <vector>

#include "ash/model/embedding.hpp"

namespace ash {

std::vector<std::uint32_t> load_tokens(const std::string& path);

// Windows b = 0..batch-1 of T tokens, window b = tokens [first + b·T, first + (b+1)·T).
// Errors name the problem: too few tokens, an id >= vocab, T < 2.
// starts (same length as tokens, or null): the tokens that start a document
// (data.separator) get doc_start_bit.
TokenView make_windows(const std::vector<std::uint32_t>& tokens, index_t batch, index_t T, index_t vocab,
                       index_t first = 0, const std::vector<std::uint8_t>* starts = nullptr);

}  // namespace ash
