#include "ash/io/dataset.hpp"

#include <cmath>

#include "ash/core/error.hpp"
#include "ash/io/hdf5.hpp"

namespace ash {

namespace {
std::uint64_t splitmix64(std::uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}
}  // namespace

TokenDataset::TokenDataset(std::vector<std::uint32_t> tokens, index_t vocab, index_t T, double valid_fraction,
                           std::uint64_t seed, bool sequential, bool streams)
    : tokens_(std::move(tokens)), vocab_(vocab), T_(T), seed_(seed), sequential_(sequential || streams),
      streams_(streams) {
  require(T >= 2, "data.seq_len = " + std::to_string(T) + " is too short: a window needs T >= 2 tokens");
  require(valid_fraction >= 0 && valid_fraction < 1, "data.valid_fraction must be in [0, 1)");
  const index_t n = index_t(tokens_.size());
  for (index_t i = 0; i < n; ++i)
    require(index_t(tokens_[i]) < vocab, "token id " + std::to_string(tokens_[i]) + " at position " +
                                             std::to_string(i) + " is >= model.vocab " + std::to_string(vocab));
  index_t n_valid = index_t(std::floor(valid_fraction * double(n)));
  if (valid_fraction > 0 && n_valid < T) n_valid = T;  // at least one validation window
  n_train_ = n - n_valid;
  require(n_train_ >= T, "the token file has " + std::to_string(n) + " tokens: too few for a training window of T = " +
                             std::to_string(T) + (n_valid ? " plus a validation window" : ""));
}

TokenDataset TokenDataset::from_file(const std::string& path, index_t vocab, index_t T, double valid_fraction,
                                     std::uint64_t seed, bool sequential, bool streams) {
  require(!path.empty(), "data.train is empty: name a token file (text, .u16 or .u32)");
  TokenDataset d(load_tokens(path), vocab, T, valid_fraction, seed, sequential, streams);
  d.path_ = path;
  return d;
}

void TokenDataset::check_cursor(std::int64_t cursor, index_t batch) const {
  if (!sequential_) return;  // random windows: the cursor is not read
  const std::string file = path_.empty() ? std::string("the token data") : "token file '" + path_ + "'";
  require(cursor >= 0, "data cursor " + std::to_string(cursor) + " is negative");
  if (streams_) {
    const index_t L = n_train_ / batch;
    require(cursor <= L - T_, "data cursor " + std::to_string(cursor) + " is past the last window of " + file + ": " +
                                  std::to_string(batch) + " streams of " + std::to_string(L) +
                                  " training tokens take cursors 0.." + std::to_string(L - T_));
  } else {
    require(cursor < n_train_ - T_ + 1, "data cursor " + std::to_string(cursor) + " is outside " + file + ": " +
                                            std::to_string(n_train_) + " training tokens take cursors 0.." +
                                            std::to_string(n_train_ - T_));
  }
}

std::uint64_t TokenDataset::fingerprint() const {
  io::Digest h;
  const std::int64_t n = std::int64_t(tokens_.size());
  h.add(&n, sizeof n);
  const std::size_t k = tokens_.size() < 4096 ? tokens_.size() : 4096;
  h.add(tokens_.data(), k * sizeof(std::uint32_t));
  h.add(tokens_.data() + (tokens_.size() - k), k * sizeof(std::uint32_t));
  return h.value();
}

std::vector<index_t> TokenDataset::train_offsets(std::int64_t step, index_t batch, std::int64_t cursor) const {
  std::vector<index_t> off(batch);
  if (streams_) {
    const index_t L = n_train_ / batch;
    require(L >= T_, "data.carry_state: " + std::to_string(n_train_) + " training tokens make " +
                         std::to_string(batch) + " streams of " + std::to_string(L) + " tokens, shorter than T = " +
                         std::to_string(T_));
    check_cursor(cursor, batch);  // never a read past the buffer
    for (index_t b = 0; b < batch; ++b) off[b] = b * L + cursor;
    return off;
  }
  const index_t span = n_train_ - T_ + 1;
  check_cursor(cursor, batch);  // never a read past the buffer
  for (index_t b = 0; b < batch; ++b) {
    if (sequential_) {
      off[b] = (cursor + b * T_) % span;
    } else {
      off[b] = index_t(splitmix64(seed_ ^ splitmix64(std::uint64_t(step) * std::uint64_t(batch) + b)) %
                       std::uint64_t(span));
    }
  }
  return off;
}

TokenView TokenDataset::train_batch(std::int64_t step, index_t batch, std::int64_t* cursor) const {
  const auto off = train_offsets(step, batch, cursor ? *cursor : 0);
  std::vector<std::uint32_t> ids(std::size_t(batch * T_));
  for (index_t b = 0; b < batch; ++b)
    for (index_t t = 0; t < T_; ++t) ids[b * T_ + t] = tokens_[off[b] + t];
  if (streams_ && cursor)
    *cursor = *cursor + 2 * T_ <= n_train_ / batch ? *cursor + T_ : 0;  // the next window fits, or the streams restart
  else if (sequential_ && cursor)
    *cursor = (*cursor + batch * T_) % (n_train_ - T_ + 1);
  return make_windows(ids, batch, T_, vocab_);
}

TokenView TokenDataset::valid_batch(index_t max_windows) const {
  const index_t nw = std::min(max_windows, valid_windows());
  require(nw >= 1, "no validation windows (data.valid_fraction is 0 or the file is too short)");
  return make_windows(tokens_, nw, T_, vocab_, n_train_);
}

double TokenDataset::unigram_bits() const {
  std::vector<double> c(vocab_, 0.0);
  for (index_t i = 0; i < n_train_; ++i) c[tokens_[i]] += 1;
  double h = 0;
  for (double x : c)
    if (x > 0) h -= x / double(n_train_) * std::log2(x / double(n_train_));
  return h;
}

double TokenDataset::unigram_valid_bits(index_t max_windows) const {
  std::vector<double> c(vocab_, 1.0);  // add-one
  for (index_t i = 0; i < n_train_; ++i) c[tokens_[i]] += 1;
  const double total = double(n_train_ + vocab_);
  const index_t nw = std::min(max_windows, valid_windows());
  double bits = 0;
  for (index_t w = 0; w < nw; ++w)
    for (index_t t = 1; t < T_; ++t) bits -= std::log2(c[tokens_[n_train_ + w * T_ + t]] / total);
  return nw > 0 ? bits / double(nw * (T_ - 1)) : 0.0;
}

}  // namespace ash
