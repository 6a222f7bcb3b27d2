// AdamW against a hand-computed step; the learning-rate schedule; clipping.
#include <cmath>
#include <set>

#include "test_helpers.hpp"

namespace ash::test {

TEST(Schedule, WarmupThenCosine) {
  AdamWOptions o;
  o.lr = 1.0;
  o.warmup = 4;
  o.steps = 14;
  o.min_lr_ratio = 0.1;
  EXPECT_DOUBLE_EQ(learning_rate(o, 0), 0.25);
  EXPECT_DOUBLE_EQ(learning_rate(o, 3), 1.0);
  EXPECT_DOUBLE_EQ(learning_rate(o, 4), 1.0);                     // cosine starts at lr
  EXPECT_NEAR(learning_rate(o, 9), 0.1 + 0.9 * 0.5, 1e-15);        // half way
  EXPECT_NEAR(learning_rate(o, 14), 0.1, 1e-15);                   // end
  EXPECT_NEAR(learning_rate(o, 100), 0.1, 1e-15);                  // after the end
  for (std::int64_t s = 4; s < 14; ++s) EXPECT_GT(learning_rate(o, s), learning_rate(o, s + 1));
}

TEST(AdamW, DecayMask) {
  // The layout marks what decays: the embedding, the head and the matrices, per architecture.
  const auto decayed = [](const ModelDims& d) {
    std::set<std::string> out;
    for (const auto& t : param_layout(d))
      if (t.decay) out.insert(t.name.substr(t.name.rfind('/') + 1));
    return out;
  };
  ModelDims d;
  d.vocab = 11, d.width = 4, d.state = 2, d.layers = 2;
  EXPECT_EQ(decayed(d), (std::set<std::string>{"embedding", "head", "W_delta", "W_B", "W_C"}));
  d.arch = Arch::mamba;
  d.tie_embeddings = false;
  EXPECT_EQ(decayed(d), (std::set<std::string>{"embedding", "head", "in_proj", "conv_weight", "x_proj", "dt_proj",
                                               "out_proj"}));
}

template <class S>
class AdamWTyped : public ::testing::Test {};
TYPED_TEST_SUITE(AdamWTyped, Scalars);

// Two steps by hand, in double on the host, for every element.
TYPED_TEST(AdamWTyped, MatchesHandComputedSteps) {
  using S = TypeParam;
  const auto d = tiny_dims(1, 5, 3, 2);
  ParamSet<S> p(d), g(d);
  const auto p0 = to_host(random_model<S>(d, 1));
  from_host(p, p0);
  AdamWOptions o;
  o.lr = 0.01;
  o.weight_decay = 0.1;
  o.beta1 = 0.9;
  o.beta2 = 0.95;
  o.eps = 1e-8;
  o.clip = 0;  // off
  o.warmup = 0;
  o.steps = 1000;
  AdamW<S> opt(d, o);
  std::vector<double> ref = p0, m(p0.size(), 0.0), v(p0.size(), 0.0);
  for (int step = 0; step < 2; ++step) {
    std::vector<double> grad(p0.size());
    for (std::size_t i = 0; i < grad.size(); ++i) grad[i] = std::sin(double(i) + step);
    from_host(g, grad);
    opt.update(p, g);
    const double lr = learning_rate(o, step);
    for (const auto& t : p.tensors())
      for (index_t i = t.offset; i < t.offset + t.size(); ++i) {
        m[i] = 0.9 * m[i] + 0.1 * grad[i];
        v[i] = 0.95 * v[i] + 0.05 * grad[i] * grad[i];
        const double mh = m[i] / (1 - std::pow(0.9, step + 1)), vh = v[i] / (1 - std::pow(0.95, step + 1));
        ref[i] -= lr * mh / (std::sqrt(vh) + 1e-8) + (t.decay ? lr * 0.1 * ref[i] : 0.0);
      }
  }
  const auto got = to_host(p);
  EXPECT_LE(rel_l2(got, ref), sizeof(S) == 8 ? 1e-14 : 1e-6);
  EXPECT_EQ(opt.step(), 2);
}

TEST(AdamW, ClipsTheGlobalNorm) {
  const auto d = tiny_dims(1, 5, 3, 2);
  ParamSet<double> p(d), g(d);
  Kokkos::deep_copy(g.data(), 2.0);
  const double n = std::sqrt(4.0 * double(g.size()));
  EXPECT_NEAR(global_norm(g), n, 1e-12 * n);
  AdamWOptions o;
  o.clip = 1.0;
  AdamW<double> opt(d, o);
  EXPECT_NEAR(opt.update(p, g), n, 1e-12 * n);  // returns the norm before clipping
  EXPECT_NEAR(global_norm(g), 1.0, 1e-12);      // and leaves the clipped gradient
}

}  // namespace ash::test
