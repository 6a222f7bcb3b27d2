#include "ash/io/dataset.hpp"

#include <cmath>

#include "ash/core/documents.hpp"
#include "ash/core/error.hpp"
#include "ash/io/hdf5_digest.hpp"

namespace ash {

namespace {
// Packs tokens [a, b) (document starts in `starts`) into windows of T: file
// order, next fit; longer documents in T-token pieces. Appends to out/out_starts;
// returns the real tokens placed.
index_t pack_part(const std::vector<std::uint32_t>& tokens, const std::vector<std::uint8_t>& starts, index_t a,
                  index_t b, index_t T, std::vector<std::uint32_t>& out, std::vector<std::uint8_t>& out_starts) {
  index_t cur = 0;  // tokens in the open window
  auto pad = [&]() {
    for (; cur > 0 && cur < T; ++cur) {
      out.push_back(0);
      out_starts.push_back(1);
    }
    cur = 0;
  };
  auto place = [&](index_t s, index_t len, bool start) {
    for (index_t i = 0; i < len; ++i) {
      out.push_back(tokens[std::size_t(s + i)]);
      out_starts.push_back(i == 0 && start ? 1 : 0);
    }
    cur += len;
    if (cur == T) cur = 0;
  };
  for (index_t s = a; s < b;) {
    index_t e = s + 1;
    while (e < b && !starts[std::size_t(e)]) ++e;  // the document is [s, e)
    const index_t len = e - s;
    if (len > T) {
      pad();
      place(s, T, true);
      index_t p = s + T;
      for (; p + T <= e; p += T) place(p, T, false);
      if (p < e) place(p, e - p, false);
    } else {
      if (cur + len > T) pad();
      place(s, len, true);
    }
    s = e;
  }
  pad();
  return b - a;
}

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
  n_train_ = n_train_raw_ = n - n_valid;
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

void TokenDataset::set_documents(const std::vector<std::uint32_t>& separator, bool pack) {
  check_separator(separator.size(), T_, pack);
  starts_.clear();
  n_train_ = n_train_raw_;
  packed_ = false;
  packed_tokens_.clear();
  packed_starts_.clear();
  documents_ = 0;
  if (separator.empty()) return;
  separator_starts(tokens_, separator, starts_);
  documents_ = 1;
  for (const auto f : starts_) documents_ += f;
  if (pack) {
    const index_t n = index_t(tokens_.size());
    packed_real_ = pack_part(tokens_, starts_, 0, n_train_raw_, T_, packed_tokens_, packed_starts_);
    const index_t n_train_packed = index_t(packed_tokens_.size());
    if (n_train_raw_ < n) {
      std::vector<std::uint8_t> st = starts_;
      st[std::size_t(n_train_raw_)] = 1;  // the validation part starts a document
      pack_part(tokens_, st, n_train_raw_, n, T_, packed_tokens_, packed_starts_);
    }
    n_train_ = n_train_packed;
    packed_ = true;
  }
  // A target is a token after the first of its window that starts no
  // document; a training part without one would train on a loss of 0 over
  // nothing. Windows start anywhere (packed: at multiples of T), so a token
  // other than the first of the part (packed: of its window) can be a target.
  const auto* st = view_starts();
  bool any_target = st == nullptr;
  for (index_t i = 1; i < n_train_ && !any_target; ++i)
    any_target = (!packed_ || i % T_ != 0) && !(*st)[std::size_t(i)];
  const std::string file = path_.empty() ? std::string("the token data") : "token file '" + path_ + "'";
  require(any_target, file + " has no target in its " + std::to_string(n_train_) +
                          " training tokens: every token after the first of a window starts a document "
                          "(data.separator), so there is nothing to predict");
}

double TokenDataset::pack_fill() const {
  return packed_ && n_train_ > 0 ? double(packed_real_) / double(n_train_) : 1.0;
}

const std::vector<std::uint8_t>* TokenDataset::view_starts() const {
  if (packed_) return &packed_starts_;
  return starts_.empty() ? nullptr : &starts_;
}

index_t TokenDataset::stream_length(index_t batch) const {
  return packed_ ? (n_train_ / T_ / batch) * T_ : n_train_ / batch;  // packed: whole windows
}

index_t TokenDataset::span() const { return packed_ ? n_train_ : n_train_ - T_ + 1; }

TokenView TokenDataset::windows(const std::vector<index_t>& off) const {
  const index_t batch = index_t(off.size());
  const auto& tok = tokens();
  const auto* st = view_starts();
  std::vector<std::uint32_t> ids(std::size_t(batch * T_));
  std::vector<std::uint8_t> flags(st ? std::size_t(batch * T_) : 0);
  for (index_t b = 0; b < batch; ++b)
    for (index_t t = 0; t < T_; ++t) {
      ids[b * T_ + t] = tok[off[b] + t];
      if (st) flags[b * T_ + t] = (*st)[off[b] + t];
    }
  return make_windows(ids, batch, T_, vocab_, 0, st ? &flags : nullptr);
}

void TokenDataset::check_cursor(std::int64_t cursor, index_t batch) const {
  if (!sequential_) return;  // random windows: the cursor is not read
  const std::string file = path_.empty() ? std::string("the token data") : "token file '" + path_ + "'";
  require(cursor >= 0, "data cursor " + std::to_string(cursor) + " is negative");
  if (streams_) {
    const index_t L = stream_length(batch);
    require(cursor <= L - T_, "data cursor " + std::to_string(cursor) + " is past the last window of " + file + ": " +
                                  std::to_string(batch) + " streams of " + std::to_string(L) +
                                  " training tokens take cursors 0.." + std::to_string(L - T_));
  } else {
    require(cursor < span() && (!packed_ || cursor % T_ == 0),
            "data cursor " + std::to_string(cursor) + " is outside " + file + ": " + std::to_string(n_train_) +
                (packed_ ? " packed training tokens take cursors 0, T, ..., " : " training tokens take cursors 0..") +
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
    const index_t L = stream_length(batch);
    require(L >= T_, "data.carry_state: " + std::to_string(n_train_) + " training tokens make " +
                         std::to_string(batch) + " streams of " + std::to_string(L) + " tokens, shorter than T = " +
                         std::to_string(T_));
    check_cursor(cursor, batch);  // never a read past the buffer
    for (index_t b = 0; b < batch; ++b) off[b] = b * L + cursor;
    return off;
  }
  const index_t span = this->span();
  const index_t align = packed_ ? T_ : 1, starts = packed_ ? n_train_ / T_ : span;  // packed: whole windows only
  check_cursor(cursor, batch);  // never a read past the buffer
  for (index_t b = 0; b < batch; ++b) {
    if (sequential_) {
      off[b] = (cursor + b * T_) % span;
    } else {
      off[b] = align * index_t(splitmix64(seed_ ^ splitmix64(std::uint64_t(step) * std::uint64_t(batch) + b)) %
                               std::uint64_t(starts));
    }
  }
  return off;
}

TokenView TokenDataset::train_batch(std::int64_t step, index_t batch, std::int64_t* cursor) const {
  const auto off = train_offsets(step, batch, cursor ? *cursor : 0);
  const TokenView x = windows(off);
  const index_t L = stream_length(batch);
  if (streams_ && cursor)
    *cursor = *cursor + 2 * T_ <= L ? *cursor + T_ : 0;  // the next window fits, or the streams restart
  else if (sequential_ && cursor)
    *cursor = (*cursor + batch * T_) % span();
  return x;
}

TokenView TokenDataset::valid_batch(index_t max_windows) const {
  const index_t nw = std::min(max_windows, valid_windows());
  require(nw >= 1, "no validation windows (data.valid_fraction is 0 or the file is too short)");
  std::vector<index_t> off(static_cast<std::size_t>(nw));
  for (index_t w = 0; w < nw; ++w) off[std::size_t(w)] = n_train_ + w * T_;
  return windows(off);
}

double TokenDataset::unigram_bits() const {
  std::vector<double> c(vocab_, 0.0);
  for (index_t i = 0; i < n_train_raw_; ++i) c[tokens_[i]] += 1;
  double h = 0;
  for (double x : c)
    if (x > 0) h -= x / double(n_train_raw_) * std::log2(x / double(n_train_raw_));
  return h;
}

double TokenDataset::unigram_valid_bits(index_t max_windows) const {
  std::vector<double> c(vocab_, 1.0);  // add-one
  for (index_t i = 0; i < n_train_raw_; ++i) c[tokens_[i]] += 1;
  const double total = double(n_train_raw_ + vocab_);
  const index_t nw = std::min(max_windows, valid_windows());
  const auto& tok = tokens();
  const auto* st = view_starts();
  double bits = 0;
  index_t targets = 0;
  for (index_t w = 0; w < nw; ++w)
    for (index_t t = 1; t < T_; ++t) {
      const index_t i = n_train_ + w * T_ + t;
      if (st && (*st)[std::size_t(i)]) continue;  // a document start is no target
      bits -= std::log2(c[tok[i]] / total);
      ++targets;
    }
  return targets > 0 ? bits / double(targets) : 0.0;
}

}  // namespace ash
