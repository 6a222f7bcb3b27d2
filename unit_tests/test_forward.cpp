// The Kokkos forward against the independent host loop of docs/design.md §1.
#include <limits>
#include <random>

#include "ash/kernels/chunked_scan.hpp"
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

// The carry pass over chunks (forward's h, E3's μ) against a host loop, in
// both directions, with and without an initial state, plain and in groups of
// every size from 1 to past nc (a GPU takes groups of ⌈√nc⌉ from nc = 512,
// so here every backend runs the grouped form). Decays in (0.5, 1] keep
// values O(1), so the tolerance is rounding only.
TYPED_TEST(Forward, ChunkCarryMatchesSequentialLoop) {
  using S = TypeParam;
  const index_t Bt = 2, P = 3, N = 5, nc = 23;
  std::mt19937_64 gen(17);
  std::uniform_real_distribution<double> ux(-1.0, 1.0), uf(0.5, 1.0);
  View3<S> X0("X0", Bt * nc, P, N), F("F", Bt * nc, P, N);
  View2<S> init("init", Bt * P, N);
  auto hx = Kokkos::create_mirror_view(X0);
  auto hf = Kokkos::create_mirror_view(F);
  auto hi = Kokkos::create_mirror_view(init);
  for (index_t r = 0; r < Bt * nc; ++r)
    for (index_t q = 0; q < P; ++q)
      for (index_t n = 0; n < N; ++n) {
        hx(r, q, n) = S(ux(gen));
        hf(r, q, n) = S(uf(gen));
      }
  for (index_t i = 0; i < Bt * P; ++i)
    for (index_t n = 0; n < N; ++n) hi(i, n) = S(ux(gen));
  Kokkos::deep_copy(X0, hx);
  Kokkos::deep_copy(F, hf);
  Kokkos::deep_copy(init, hi);
  for (const bool reverse : {false, true})
    for (const bool with_init : {false, true}) {
      // the loop: X_c <- X_c + F_c X_prev in scan order, in double
      std::vector<double> want(std::size_t(Bt * nc * P * N));
      for (index_t b = 0; b < Bt; ++b)
        for (index_t q = 0; q < P; ++q)
          for (index_t n = 0; n < N; ++n) {
            double x = with_init ? double(hi(b * P + q, n)) : 0.0;
            for (index_t k = 0; k < nc; ++k) {
              const index_t r = b * nc + (reverse ? nc - 1 - k : k);
              x = double(hx(r, q, n)) + double(hf(r, q, n)) * x;
              want[std::size_t((r * P + q) * N + n)] = x;
            }
          }
      for (const index_t group : {index_t(0), index_t(1), index_t(2), index_t(4), index_t(5), index_t(22),
                                  nc, nc + 3})
        for (const bool caller_buffer : {false, true}) {  // the groups' rows from the caller (NaN until written)
          const index_t G = group > 0 && group < nc ? group : 0;
          View3<S> gbuf;
          if (caller_buffer && G > 0) {
            gbuf = View3<S>("gbuf", Bt * ((nc + G - 1) / G), P, N);
            Kokkos::deep_copy(gbuf, std::numeric_limits<S>::quiet_NaN());
          }
          View3<S> X("X", Bt * nc, P, N);
          Kokkos::deep_copy(X, X0);
          impl::carry_chunks("test::carry", X, F, Bt, nc, with_init ? init : View2<S>(), reverse, group, ExecSpace(),
                             gbuf);
          auto got = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), X);
          auto fl = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), F);
          double worst = 0;
          for (index_t r = 0; r < Bt * nc; ++r)
            for (index_t q = 0; q < P; ++q)
              for (index_t n = 0; n < N; ++n) {
                const double w = want[std::size_t((r * P + q) * N + n)];
                worst = std::max(worst, std::fabs(double(got(r, q, n)) - w) / (1.0 + std::fabs(w)));
                ASSERT_EQ(fl(r, q, n), hf(r, q, n)) << "F must be left as it was";
              }
          EXPECT_LE(worst, sizeof(S) == 8 ? 1e-13 : 2e-6) << "group " << group << (reverse ? " reverse" : " forward")
                                                 << (with_init ? " with init" : "")
                                                 << (caller_buffer ? " caller's buffer" : "");
        }
    }
  // A GPU groups long carries only; a host never does.
  EXPECT_EQ(impl::carry_group(511), 0);
  EXPECT_EQ(impl::carry_group(16384), host_backend ? 0 : 128);
  EXPECT_EQ(impl::carry_group_rows(3, 511), 0);
  EXPECT_EQ(impl::carry_group_rows(3, 16384), host_backend ? 0 : 3 * 128);
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
