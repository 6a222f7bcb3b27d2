// E1 against central finite differences of the forward loss, every tensor.
#include "test_helpers.hpp"

namespace ash::test {

class BackpropFD : public ::testing::TestWithParam<int> {};

TEST_P(BackpropFD, EveryTensorMatchesCentralDifferences) {
  const int K = GetParam();
  const auto d = tiny_dims(K);
  auto ps = random_model<double>(d, 100 + K);
  const auto x = random_tokens(2, 13, d.vocab, 200 + K);
  const auto fd = finite_difference(ps, [&](const ParamSet<double>& q) { return forward_loss(q, x); }, 1e-5);
  // the reverse scan as one loop (chunk >= T) and chunked (4: chunks 4,4,4,1; 1)
  for (index_t chunk : {64, 4, 1}) {
    ParamSet<double> grad(d);
    EngineOptions o;
    o.chunk = chunk;
    auto engine = make_engine<double>(o);
    const double loss = engine->compute(ps, x, grad);
    EXPECT_NEAR(loss, forward_loss(ps, x), 1e-13 * loss);
    const auto g = to_host(grad);
    for (const auto& t : grad.tensors()) {
      const double err = rel_l2(g, fd, t.offset, t.size());
      EXPECT_LE(err, 1e-6) << t.name << " (K=" << K << ", chunk " << chunk << ")";
      double norm = 0;
      for (index_t i = 0; i < t.size(); ++i) norm += fd[t.offset + i] * fd[t.offset + i];
      EXPECT_GT(norm, 0.0) << t.name << " has an all-zero gradient: the check would be vacuous";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Layers, BackpropFD, ::testing::Values(1, 2, 3));

template <class S>
class Backprop : public ::testing::Test {};
TYPED_TEST_SUITE(Backprop, Scalars);

// Each scalar type against double E1 (itself checked against finite differences).
TYPED_TEST(Backprop, AgreesWithDouble) { expect_agrees_with_double<TypeParam>(tiny_dims(2)); }

TYPED_TEST(Backprop, DeterministicAndOverwritesGrad) {
  using S = TypeParam;
  const auto d = tiny_dims(2);
  auto ps = random_model<S>(d, 8);
  const auto x = random_tokens(3, 17, d.vocab, 9);
  ParamSet<S> g1(d), g2(d);
  Kokkos::deep_copy(g2.data(), S(123));  // stale contents must not leak in
  auto e = make_engine<S>(EngineOptions{});
  const double l1 = e->compute(ps, x, g1);
  const double l2 = e->compute(ps, x, g2);
  EXPECT_EQ(l1, l2);
  EXPECT_EQ(to_host(g1), to_host(g2));
}

// Stop-gradient on layer inputs (docs/design.md §2): each layer's θ_k gets the VJP
// with cotangent g = ∂L/∂y_K, and the embedding gets Σ g. Checked here for
// K = 1, where θ_1 and the head are then exact and only the embedding differs.
TEST(Backprop, DetachedInputsKeepLayerAndHeadGradientsForOneLayer) {
  const auto d = tiny_dims(1);
  auto ps = random_model<double>(d, 21);
  const auto x = random_tokens(2, 13, d.vocab, 22);
  ParamSet<double> full(d), det(d);
  EngineOptions o;
  make_engine<double>(o)->compute(ps, x, full);
  o.detach_inputs = true;
  make_engine<double>(o)->compute(ps, x, det);
  const auto a = to_host(det), b = to_host(full);
  for (const auto& t : full.tensors()) {
    const double err = rel_l2(a, b, t.offset, t.size());
    if (t.name == "embedding")
      EXPECT_GT(err, 1e-3) << "the embedding should miss layer 1's input VJP";
    else
      EXPECT_LE(err, 1e-13) << t.name;
  }
}

TEST(Backprop, RejectsWindowOption) {
  EngineOptions o;
  o.truncate = 4;
  EXPECT_THROW(make_engine<double>(o), Error);
  EXPECT_THROW(parse_method("nonsense"), Error);
}

}  // namespace ash::test
