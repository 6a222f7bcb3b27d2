// Training data: split, windows, determinism, sequential cursor, errors, baselines.
#include <cmath>

#include "test_helpers.hpp"

namespace ash::test {

namespace {
std::vector<std::uint32_t> ramp(int n, int V) {
  std::vector<std::uint32_t> v(n);
  for (int i = 0; i < n; ++i) v[i] = std::uint32_t(i % V);
  return v;
}
}  // namespace

TEST(Dataset, SplitsTrainAndValidation) {
  TokenDataset ds(ramp(1000, 50), 50, 10, 0.1, 1, false);
  EXPECT_EQ(ds.train_tokens(), 900);
  EXPECT_EQ(ds.valid_tokens(), 100);
  EXPECT_EQ(ds.valid_windows(), 10);
  auto v = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), ds.valid_batch(3));
  ASSERT_EQ(v.extent(0), 3u);
  for (int w = 0; w < 3; ++w)
    for (int t = 0; t < 10; ++t) EXPECT_EQ(v(w, t), (900 + w * 10 + t) % 50);
  // A tiny valid_fraction still leaves one whole validation window.
  TokenDataset small(ramp(1000, 50), 50, 10, 0.001, 1, false);
  EXPECT_EQ(small.valid_tokens(), 10);
}

TEST(Dataset, RandomWindowsAreDeterministicInRangeAndVary) {
  TokenDataset ds(ramp(5000, 64), 64, 32, 0.05, 42, false);
  const auto a = ds.train_offsets(7, 4, 0), b = ds.train_offsets(7, 4, 0), c = ds.train_offsets(8, 4, 0);
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
  for (std::int64_t s = 0; s < 200; ++s)
    for (auto o : ds.train_offsets(s, 4, 0)) {
      EXPECT_GE(o, 0);
      EXPECT_LE(o + 32, ds.train_tokens());
    }
  TokenDataset other_seed(ramp(5000, 64), 64, 32, 0.05, 43, false);
  EXPECT_NE(other_seed.train_offsets(7, 4, 0), a);
  // The batch holds exactly the tokens at those offsets.
  auto x = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), ds.train_batch(7, 4, nullptr));
  for (int b2 = 0; b2 < 4; ++b2)
    for (int t = 0; t < 32; ++t) EXPECT_EQ(std::uint32_t(x(b2, t)), ds.tokens()[a[b2] + t]);
}

TEST(Dataset, SequentialModeAdvancesAndWrapsTheCursor) {
  TokenDataset ds(ramp(100, 100), 100, 10, 0.0, 1, true);
  std::int64_t cursor = 0;
  auto x = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), ds.train_batch(0, 2, &cursor));
  EXPECT_EQ(x(0, 0), 0);
  EXPECT_EQ(x(1, 0), 10);
  EXPECT_EQ(cursor, 20);
  cursor = 85;  // span = 91 start positions: wraps
  const auto off = ds.train_offsets(0, 2, cursor);
  EXPECT_EQ(off[0], 85);
  EXPECT_EQ(off[1], (85 + 10) % 91);
}

TEST(Dataset, BadInputsAreErrors) {
  EXPECT_THROW(TokenDataset(ramp(100, 60), 50, 10, 0.1, 1, false), Error);  // ids >= V
  EXPECT_THROW(TokenDataset(ramp(100, 50), 50, 0, 0.1, 1, false), Error);   // T = 0
  EXPECT_THROW(TokenDataset(ramp(15, 50), 50, 10, 0.1, 1, false), Error);   // no room for train + valid
  EXPECT_THROW(TokenDataset::from_file("", 50, 10, 0.1, 1, false), Error);  // data.train unset
  EXPECT_THROW(TokenDataset::from_file("/nonexistent/x.txt", 50, 10, 0.1, 1, false), Error);
}

TEST(Dataset, UnigramBaselines) {
  // Two equally frequent symbols: 1 bit; the validation part scored the same.
  std::vector<std::uint32_t> v(400);
  for (int i = 0; i < 400; ++i) v[i] = i % 2;
  TokenDataset ds(v, 2, 20, 0.25, 1, false);
  EXPECT_NEAR(ds.unigram_bits(), 1.0, 1e-12);
  EXPECT_NEAR(ds.unigram_valid_bits(100), 1.0, 1e-2);  // add-one smoothing moves it slightly
}

}  // namespace ash::test
