// The Kokkos forward against the independent host loop of docs/design.md §1.
#include "reference_model.hpp"
#include "test_helpers.hpp"

namespace ash::test {

template <class S>
class Forward : public ::testing::Test {};
TYPED_TEST_SUITE(Forward, Scalars);

TYPED_TEST(Forward, MatchesHostReference) {
  using S = TypeParam;
  for (int K : {1, 2, 3}) {
    const auto d = tiny_dims(K);
    const auto ps = cast_model<S>(random_model<double>(d, 11 + K));
    const int B = 2, T = 13;
    const auto ids = random_token_ids(B * T, d.vocab, 5 + K);
    const double ref = reference_loss(d, to_host(ps), ids, B, T);
    const double got = forward_loss(ps, make_windows(ids, B, T, d.vocab));
    EXPECT_NEAR(got, ref, Tol<S>::forward * std::fabs(ref)) << "K=" << K;
    EXPECT_GT(ref, 0.0);
  }
}

TYPED_TEST(Forward, HeadChunkingDoesNotChangeTheLoss) {
  using S = TypeParam;
  const auto d = tiny_dims(2);
  auto ps = random_model<S>(d, 3);
  const auto x = random_tokens(3, 29, d.vocab, 4);
  const double whole = forward_loss(ps, x, 1 << 20);
  for (index_t c : {1, 7, 29, 30})
    EXPECT_NEAR(forward_loss(ps, x, c), whole, Tol<S>::forward * whole) << "chunk " << c;
}

TEST(Forward, LongerWindowUsesEveryToken) {
  // Changing the last token only changes the loss through its role as a target.
  const auto d = tiny_dims(1);
  auto ps = random_model<double>(d, 9);
  auto ids = random_token_ids(20, d.vocab, 2);
  const double a = forward_loss(ps, make_windows(ids, 1, 20, d.vocab));
  ids[19] = (ids[19] + 1) % d.vocab;
  const double b = forward_loss(ps, make_windows(ids, 1, 20, d.vocab));
  EXPECT_NE(a, b);
  EXPECT_NEAR(b, reference_loss(d, to_host(ps), ids, 1, 20), 1e-12 * b);
}

}  // namespace ash::test
