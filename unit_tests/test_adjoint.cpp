// E2 (the paper's adjoint sharding) against E1 and a brute-force window sum.
#include "test_helpers.hpp"

namespace ash::test {

namespace {

// The truncated adjoint of docs/design.md §2 by explicit products on the host:
//   μ^i = Σ_{t=i}^{min(T,i+T̄-1)} g^t_p γ^t_n Π_{j=i+1..t} A^j_pn
// fed to the library's per-token and dense VJPs (checked against E1 elsewhere).
std::vector<double> brute_force_window(const ParamSet<double>& ps, const TokenView& x, index_t Tbar) {
  const auto& d = ps.dims();
  const SeqShape s{index_t(x.extent(0)), index_t(x.extent(1))};
  const index_t T = s.T, P = d.width, N = d.state;
  ParamSet<double> grad(d);
  const auto gg = grad.global();
  auto tape = forward_tape<double>(ps, x, &gg, LayerActivations<double>::with_hprev_and_A, true);
  auto g = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), tape.g);
  for (int k = 0; k < d.layers; ++k) {
    const auto& act = tape.acts[k];
    auto A = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), act.A);
    auto gamma = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), act.gamma);
    View3<double> mu("mu_bf", s.rows(), P, N);
    auto muh = Kokkos::create_mirror_view(mu);
    for (index_t b = 0; b < s.batch; ++b)
      for (index_t i = 0; i < T; ++i)
        for (index_t q = 0; q < P; ++q)
          for (index_t n = 0; n < N; ++n) {
            double acc = 0;
            for (index_t t = i; t < T && t <= i + Tbar - 1; ++t) {
              double prod = 1;
              for (index_t j = i + 1; j <= t; ++j) prod *= A(b * T + j, q, n);
              acc += g(b * T + t, q) * gamma(b * T + t, n) * prod;
            }
            muh(b * T + i, q, n) = acc;
          }
    Kokkos::deep_copy(mu, muh);
    const LayerCotangents<double> cot(s.rows(), d);
    ssm_layer_backward_rows(ps.layer(k), s, tape.ys[k], act, tape.g, BlockRows{T, T, 0}, mu, act.hprev, act.A, cot,
                            grad.layer(k), tape.g, true);
  }
  embedding_backward(x, tape.g, gg.embedding);
  return to_host(grad);
}

}  // namespace

// K = 1: layer 1 and the head are exact; the embedding misses layer 1's input VJP.
TEST(Adjoint, MatchesBackpropForOneLayerExceptEmbedding) {
  const auto d = tiny_dims(1);
  auto ps = random_model<double>(d, 31);
  const auto x = random_tokens(2, 23, d.vocab, 32);
  double l1 = 0, l2 = 0;
  const auto e1 = grad_of(engine_options("backprop"), ps, x, &l1);
  const auto e2 = grad_of(engine_options("adjoint"), ps, x, &l2);
  EXPECT_EQ(l1, l2);
  for (const auto& t : param_layout(d)) {
    const double err = rel_l2(e2, e1, t.offset, t.size());
    if (t.name == "embedding")
      EXPECT_GT(err, 1e-3) << "E2 gives the embedding Σ g, not the exact gradient";
    else
      EXPECT_LE(err, 1e-10) << t.name;
  }
}

// For any K, E2 is E1 on the model with stop-gradient on every layer input.
TEST(Adjoint, EqualsBackpropWithDetachedInputs) {
  for (int K : {1, 2, 3}) {
    const auto d = tiny_dims(K);
    auto ps = random_model<double>(d, 40 + K);
    const auto x = random_tokens(2, 19, d.vocab, 50 + K);
    const auto e1 = grad_of(engine_options("backprop", 0, true), ps, x);
    const auto e2 = grad_of(engine_options("adjoint"), ps, x);
    expect_close(e2, e1, d, 1e-10, "K=" + std::to_string(K));
  }
}

TEST(Adjoint, TruncatedEqualsBruteForceWindowSum) {
  const index_t T = 17;
  const auto d = tiny_dims(2);
  auto ps = random_model<double>(d, 61);
  const auto x = random_tokens(2, T, d.vocab, 62);
  for (index_t Tbar : {index_t(1), index_t(2), T - 1, T}) {
    const auto e2 = grad_of(engine_options("adjoint", Tbar), ps, x);
    const auto bf = brute_force_window(ps, x, Tbar);
    EXPECT_LE(rel_l2(e2, bf), 1e-12) << "T-bar=" << Tbar;
    expect_close(e2, bf, d, 1e-11, "T-bar=" + std::to_string(Tbar));
  }
  // The window matters: T̄ = 1 and T̄ = T differ.
  EXPECT_GT(rel_l2(grad_of(engine_options("adjoint", 1), ps, x), grad_of(engine_options("adjoint", T), ps, x)), 1e-4);
}

template <class S>
class AdjointTyped : public ::testing::Test {};
TYPED_TEST_SUITE(AdjointTyped, Scalars);

TYPED_TEST(AdjointTyped, AgreesWithDoubleDetachedBackprop) {
  using S = TypeParam;
  const auto d = tiny_dims(2);
  auto ref = random_model<double>(d, 71);
  const auto ps = cast_model<S>(ref);
  const auto x = random_tokens(2, 21, d.vocab, 72);
  const auto e1 = grad_of(engine_options("backprop", 0, true), ref, x);
  for (index_t Tbar : {index_t(0), index_t(4)}) {
    const auto e2 = grad_of(engine_options("adjoint", Tbar), ps, x);
    if (Tbar == 0)
      expect_close(e2, e1, d, Tol<S>::grad_vs_double);
    else
      EXPECT_LE(rel_l2(e2, grad_of(engine_options("adjoint", Tbar), ref, x)), Tol<S>::grad_vs_double);
  }
}

}  // namespace ash::test

namespace ash::test {

// E2's two kernel forms (host: t outermost with scratch; device: registers
// per lane) give the same bits on a host backend, so the GPU form is checked
// on every CI run. A GPU compiler contracts a·b + c into FMAs differently in
// the two forms, so there they agree to a few ulps of the largest value.
TYPED_TEST(AdjointTyped, HostAndDeviceWindowFormsAgree) {
  using S = TypeParam;
  const auto d = tiny_dims(2, 17, 8, 5);  // N = 5: lanes over a state count that is not a power of two
  const auto ps = cast_model<S>(random_model<double>(d, 91));
  const auto x = random_tokens(2, 23, d.vocab, 92);
  const auto tape = forward_tape<S>(ps, x, nullptr, LayerActivations<S>::with_hprev_and_A, true);
  const SeqShape s{2, 23};
  for (index_t Tbar : {1, 4, 23}) {
    View3<S> mh("mh", s.rows(), d.width, d.state), md("md", s.rows(), d.width, d.state);
    impl::window_adjoint(impl::WindowForm::host, s, tape.acts[1], tape.g, Tbar, mh);
    impl::window_adjoint(impl::WindowForm::device, s, tape.acts[1], tape.g, Tbar, md);
    auto a = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), mh);
    auto b = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), md);
    double norm = 0, amax = 0;
    for (index_t i = 0; i < a.size(); ++i) {
      norm += std::fabs(double(a.data()[i]));
      amax = std::max(amax, std::fabs(double(a.data()[i])));
    }
    EXPECT_GT(norm, 0.0);
    const double tol = host_backend ? 0.0 : 16 * std::numeric_limits<S>::epsilon() * amax;
    for (index_t i = 0; i < a.size(); ++i)
      ASSERT_LE(std::fabs(double(a.data()[i]) - double(b.data()[i])), tol)
          << "T-bar=" << Tbar << " at " << i << ": " << a.data()[i] << " vs " << b.data()[i];
  }
}

}  // namespace ash::test
