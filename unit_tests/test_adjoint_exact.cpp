// E3 (exact O(T) adjoint) against E1, and in its paper modes against E2.
#include "test_helpers.hpp"

namespace ash::test {

namespace {

// chunked_h: E3's h replay from chunk-boundary states (a GPU's default form)
// or sequential through the waves (a host's); both run on every backend here.
EngineOptions e3(index_t C, index_t wave, bool detach = false, index_t Tbar = 0, bool chunked_h = !host_backend) {
  EngineOptions o;
  o.e3_chunked_h = chunked_h;
  o.method = Method::adjoint_exact;
  o.chunk = C;
  o.wave = wave;
  o.detach_inputs = detach;
  o.truncate = Tbar;
  return o;
}

}  // namespace

// T = 29 is not a multiple of any chunk below; waves smaller than T make the
// recompute run in several pieces. N = 4 is one state tile; N = 12 is three
// tiles of 4 and N = 5 five tiles of 1 on the host (state_tile.hpp), so the
// kernels' loops over tiles run too.
TEST(AdjointExact, EqualsBackpropForAnyDepthChunkAndWave) {
  const index_t T = 29;
  for (auto KN : {std::pair<int, index_t>{1, 4}, {2, 4}, {3, 4}, {2, 12}, {2, 5}}) {
    const int K = KN.first;
    const auto d = tiny_dims(K, 17, 8, KN.second);
    auto ps = random_model<double>(d, 80 + K);
    const auto x = random_tokens(2, T, d.vocab, 90 + K);
    double l1 = 0, l3 = 0;
    const auto e1 = grad_of(engine_options("backprop"), ps, x, &l1);
    for (const bool chunked_h : {false, true})
      for (auto cw : {std::pair<index_t, index_t>{4, 8}, {4, 1024}, {1, 3}, {7, 7}, {29, 29}, {64, 64}}) {
        const auto g3 = grad_of(e3(cw.first, cw.second, false, 0, chunked_h), ps, x, &l3);
        EXPECT_EQ(l1, l3);
        expect_close(g3, e1, d, 1e-10,
                     "K=" + std::to_string(K) + " N=" + std::to_string(d.state) + " C=" + std::to_string(cw.first) + " wave=" +
                         std::to_string(cw.second) + (chunked_h ? " chunked h" : " sequential h"));
      }
  }
}

TEST(AdjointExact, DetachedEqualsFullAdjointSharding) {
  for (int K : {1, 3}) {
    const auto d = tiny_dims(K);
    auto ps = random_model<double>(d, 100 + K);
    const auto x = random_tokens(3, 29, d.vocab, 110 + K);
    for (const bool chunked_h : {false, true})
      expect_close(grad_of(e3(4, 8, true, 0, chunked_h), ps, x), grad_of(engine_options("adjoint"), ps, x), d, 1e-10,
                   "K=" + std::to_string(K));
  }
}

TEST(AdjointExact, WindowEqualsTruncatedAdjointSharding) {
  const index_t T = 29, C = 4;
  const auto d = tiny_dims(2);
  auto ps = random_model<double>(d, 121);
  const auto x = random_tokens(2, T, d.vocab, 122);
  for (index_t Tbar : {index_t(1), index_t(3), C - 1, C, C + 1, index_t(10), T}) {
    const auto e2 = grad_of(engine_options("adjoint", Tbar), ps, x);
    for (const bool chunked_h : {false, true})
      for (index_t wave : {index_t(1), index_t(8), index_t(1024)})
        expect_close(grad_of(e3(C, wave, true, Tbar, chunked_h), ps, x), e2, d, 1e-10,
                     "T-bar=" + std::to_string(Tbar) + " wave=" + std::to_string(wave) +
                         (chunked_h ? " chunked h" : " sequential h"));
  }
}

TEST(AdjointExact, WindowWithoutDetachIsRejected) {
  EXPECT_THROW(make_engine<double>(e3(4, 8, false, 3)), Error);
}

template <class S>
class AdjointExactTyped : public ::testing::Test {};
TYPED_TEST_SUITE(AdjointExactTyped, Scalars);

TYPED_TEST(AdjointExactTyped, AgreesWithDoubleBackprop) {
  using S = TypeParam;
  const auto d = tiny_dims(3);
  auto ref = random_model<double>(d, 131);
  const auto ps = cast_model<S>(ref);
  const auto x = random_tokens(2, 37, d.vocab, 132);
  for (const bool chunked_h : {false, true})
    expect_close(grad_of(e3(5, 10, false, 0, chunked_h), ps, x), grad_of(engine_options("backprop"), ref, x), d,
                 Tol<S>::grad_vs_double, chunked_h ? "exact, chunked h" : "exact, sequential h");
  expect_close(grad_of(e3(5, 10, true, 6), ps, x), grad_of(engine_options("adjoint", 6), ref, x), d, Tol<S>::grad_vs_double,
               "window");
}

TEST(AdjointExact, Deterministic) {
  const auto d = tiny_dims(2);
  auto ps = random_model<double>(d, 141);
  const auto x = random_tokens(2, 40, d.vocab, 142);
  EXPECT_EQ(grad_of(e3(6, 12), ps, x), grad_of(e3(6, 12), ps, x));
}

}  // namespace ash::test
