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
  index_t valid_tokens() const { return index_t(tokens_.size()) - n_train_; }
  index_t valid_windows() const { return valid_tokens() / T_; }
  const std::vector<std::uint32_t>& tokens() const { return tokens_; }
  // Entropy (bits/token) of the training part's unigram distribution, for a baseline.
  double unigram_bits() const;
  // Cross-entropy (bits/token) under the training part's unigram model (add-one
  // smoothing) of exactly the targets valid_batch(max_windows) scores: the
  // baseline a model must beat.
  double unigram_valid_bits(index_t max_windows) const;

 private:
  std::vector<std::uint32_t> tokens_;
  std::string path_;  // from_file's, for messages
  index_t vocab_, T_, n_train_;
  std::uint64_t seed_;
  bool sequential_, streams_;
};

}  // namespace ash
