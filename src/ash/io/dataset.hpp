#pragma once
// Training data: one token file split into a training part and a held-out
// validation tail, served as batches of windows of T tokens.
//
// Random mode (default): window b of step s starts at
//   splitmix64(seed, s·Bt + b) mod (n_train - T + 1)
// so a batch depends only on (seed, step): resuming at step s replays exactly.
// Sequential mode (data.sequential = true): consecutive windows in document
// order from a cursor that wraps around; the cursor is saved in checkpoints.
// Stream mode (sequential with data.carry_state): the training part is cut
// into Bt streams of L = n_train / Bt tokens; row b of every batch is the next
// T tokens of stream b (offset b·L + cursor), so row b continues row b of the
// previous step and its state can be carried; the cursor (tokens into each
// stream) goes back to 0 when the next window would pass L.
//
// Documents (set_documents, data.separator): a token that follows a full
// separator starts a document; windows carry doc_start_bit there. Packed
// (data.pack): the training and validation parts are each rearranged once into
// windows of whole documents (file order, next fit; a document longer than T
// in T-token pieces, the pieces after the first not marked, so a carried state
// continues them), the rest of a window padding (token 0, every one a document
// start: no target, no state). Windows are then aligned to multiples of T in
// every mode (random offsets T·(hash mod windows), the sequential cursor wraps
// at the packed part's end, streams hold whole windows); offsets and cursors
// index the packed parts.
#include <cstdint>
#include <string>
#include <vector>

#include "ash/io/tokens.hpp"

namespace ash {

class TokenDataset {
 public:
  // Validates sizes: enough tokens for one training window and one validation
  // window (when valid_fraction > 0), every id < vocab.
  TokenDataset(std::vector<std::uint32_t> tokens, index_t vocab, index_t T, double valid_fraction,
               std::uint64_t seed, bool sequential, bool streams = false);
  static TokenDataset from_file(const std::string& path, index_t vocab, index_t T, double valid_fraction,
                                std::uint64_t seed, bool sequential, bool streams = false);
  // Document boundaries after every occurrence of `separator` (empty: none);
  // pack: whole documents per window (see above). Call before the first batch.
  // Throws ash::Error when no training window can hold a target (every token
  // after the first of a window starts a document).
  void set_documents(const std::vector<std::uint32_t>& separator, bool pack);
  index_t documents() const { return documents_; }  // documents in the file (set_documents)
  // Real (non-padding) tokens / tokens of the packed training part; 1 unpacked.
  double pack_fill() const;
  // Document starts of the file (empty without a separator), for ash eval.
  const std::vector<std::uint8_t>& starts() const { return starts_; }

  // Training batch for `step`; in sequential mode reads at and advances *cursor.
  TokenView train_batch(std::int64_t step, index_t batch, std::int64_t* cursor) const;
  // The first `max_windows` consecutive windows of the validation part (fixed).
  TokenView valid_batch(index_t max_windows) const;
  // Start offsets (into the training part) that train_batch uses; for tests.
  std::vector<index_t> train_offsets(std::int64_t step, index_t batch, std::int64_t cursor) const;

  // In sequential and stream modes a cursor from a checkpoint must index this
  // file: throws ash::Error naming the file and the cursor when it is outside
  // the training part (or past the last window of a stream).
  void check_cursor(std::int64_t cursor, index_t batch) const;
  // What a checkpoint stores with its cursor: the token count and an XXH3-64
  // of the count and the first and last 4096 tokens.
  std::uint64_t fingerprint() const;
  const std::string& path() const { return path_; }

  index_t train_tokens() const { return n_train_; }
  index_t valid_tokens() const { return index_t(tokens().size()) - n_train_; }
  index_t valid_windows() const { return valid_tokens() / T_; }
  // The tokens batches are cut from: the file, or its packed parts (training then validation).
  const std::vector<std::uint32_t>& tokens() const { return packed_ ? packed_tokens_ : tokens_; }
  // Entropy (bits/token) of the training part's unigram distribution, for a baseline.
  double unigram_bits() const;
  // Cross-entropy (bits/token) under the training part's unigram model (add-one
  // smoothing) of exactly the targets valid_batch(max_windows) scores: the
  // baseline a model must beat.
  double unigram_valid_bits(index_t max_windows) const;

 private:
  const std::vector<std::uint8_t>* view_starts() const;
  TokenView windows(const std::vector<index_t>& offsets) const;
  index_t span() const;  // sequential cursors run over [0, span)
  index_t stream_length(index_t batch) const;  // tokens per stream in stream mode (L)

  std::vector<std::uint32_t> tokens_;
  std::string path_;  // from_file's, for messages
  index_t vocab_, T_, n_train_;
  index_t n_train_raw_ = 0;  // the file's training tokens (n_train_ counts the packed part when packed)
  std::uint64_t seed_;
  bool sequential_, streams_;
  std::vector<std::uint8_t> starts_;  // per token of the file: starts a document
  index_t documents_ = 0;
  bool packed_ = false;
  std::vector<std::uint32_t> packed_tokens_;  // packed training part, then packed validation part
  std::vector<std::uint8_t> packed_starts_;
  index_t packed_real_ = 0;  // non-padding tokens of the packed training part
};

}  // namespace ash
