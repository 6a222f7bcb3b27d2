#pragma once
// Document boundaries inside a window (data.separator, docs/design.md §1).
// A token whose id carries doc_start_bit starts a document: every layer's
// state restarts from zero there (A^t = 0: no state and no adjoint crosses the
// boundary) and it is nobody's target. The bit travels with the token through
// every copy, token block and rank of a window, so no engine needs a second
// array; token_id() strips it wherever the id itself is read (embedding, head).
#include <string>
#include <vector>

#include "ash/core/types.hpp"

namespace ash {

// Bit 30: ids stay below 2^30 (model.vocab is checked against it).
constexpr token_t doc_start_bit = token_t(1) << 30;
constexpr index_t max_vocab = index_t(doc_start_bit);

KOKKOS_INLINE_FUNCTION token_t token_id(token_t v) { return v & ~doc_start_bit; }
KOKKOS_INLINE_FUNCTION bool starts_document(token_t v) { return (v & doc_start_bit) != 0; }

// The document starts of the rows of one activation block: row (b, t) is token
// (b, t0 + t) of x. Empty x: no starts (every token continues the state).
struct DocStarts {
  TokenView x;
  index_t t0 = 0;
  DocStarts() = default;
  explicit DocStarts(const TokenView& x_, index_t t0_ = 0) : x(x_), t0(t0_) {}
  // x's starts, or none (the empty DocStarts) when no token of x starts a
  // document: then no kernel reads a token per step (one reduction here).
  static DocStarts of(const TokenView& x);
  // The same tokens from token `t` of these rows on (a token block).
  DocStarts from(index_t t) const { return DocStarts(x, t0 + t); }
  KOKKOS_INLINE_FUNCTION bool at(index_t b, index_t t) const {
    return x.extent(0) > 0 && starts_document(x(b, t0 + t));
  }
  // 0 where (b, t) starts a document, else 1: the factor on A^t (exact, so no
  // starts leaves every number as it was).
  template <class S>
  KOKKOS_INLINE_FUNCTION S keep(index_t b, index_t t) const {
    return at(b, t) ? S(0) : S(1);
  }
};

// Sets doc_start_bit on the tokens that start documents, cu_seqlens style:
// `starts` holds flat row offsets m = b·T + t of x ([Bt, T]) in any order
// (a cu_seqlens array [0, l1, l1+l2, ..., Bt·T] over the flattened windows
// works as is: its closing Bt·T marks nothing); every other token's bit is
// cleared. Offsets outside [0, Bt·T] are an error.
// (Token 0 of a window matters only with a carried state: it drops the carry.)
void set_document_starts(const TokenView& x, const Kokkos::View<const index_t*, MemSpace>& starts);
// The flat offsets of x's document starts, ascending (the inverse of the above).
std::vector<index_t> document_starts(const TokenView& x);

// The targets of x ([Bt, T]): tokens x(b, t+1), t < T-1, that do not start a
// document (Bt·(T-1) without starts). The loss is the mean over them.
index_t target_count(const TokenView& x);

// Host side of data.separator: flags[i] = 1 when tokens[i] is the first token
// after a full occurrence of `sep` (the separator ends the document before it),
// so a separator split across two windows still marks the token after it.
void separator_starts(const std::vector<std::uint32_t>& tokens, const std::vector<std::uint32_t>& sep,
                      std::vector<std::uint8_t>& flags);

// data.separator's JSON string as byte tokens: JSON escapes are already undone
// by the parser; every character must be one byte (the token files are bytes
// or wider ids; a separator names byte values 0..255 through \u00XX).
std::vector<std::uint32_t> separator_tokens(const std::string& sep);

// data.separator's rules against windows of T tokens (data.seq_len), stated once
// for the configuration and for TokenDataset::set_documents: at most T bytes
// (one byte token each; a longer one fits in no window), and present when
// data.pack is on. Throws ash::Error naming the keys.
void check_separator(std::size_t separator_bytes, std::int64_t T, bool pack);

}  // namespace ash
