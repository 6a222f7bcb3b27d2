// run.matmul (ash/kernels/matmul.hpp): the input rounding of tf32 and bf16, the
// products under each mode against a brute-force loop on rounded inputs, the
// scope, the configuration, and the gradient error of each mode against double.
#include <cstring>
#include <limits>

#include "ash/kernels/blas.hpp"
#include "test_helpers.hpp"

namespace ash::test {

namespace {

// [rows, cols] random floats in [-1, 1), on the device and on the host.
std::pair<View2<float>, std::vector<float>> random_matrix(index_t rows, index_t cols, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> h(std::size_t(rows * cols));
  for (auto& v : h) v = u(rng);
  View2<float> d("m", rows, cols);
  auto m = Kokkos::create_mirror_view(d);
  for (index_t i = 0; i < rows; ++i)
    for (index_t j = 0; j < cols; ++j) m(i, j) = h[std::size_t(i * cols + j)];
  Kokkos::deep_copy(d, m);
  return {d, h};
}

std::vector<float> host_of(const View2<float>& d) {
  auto m = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), d);
  return std::vector<float>(m.data(), m.data() + m.size());
}

}  // namespace

TEST(Matmul, Tf32RoundsToNearestEvenAtTenMantissaBits) {
  const float ulp = std::ldexp(1.0f, -10);  // TF32's spacing in [1, 2)
  EXPECT_EQ(half::round_tf32(1.0f), 1.0f);
  EXPECT_EQ(half::round_tf32(1.0f + ulp), 1.0f + ulp);                            // representable
  EXPECT_EQ(half::round_tf32(1.0f + ulp / 2), 1.0f);                              // tie: to even
  EXPECT_EQ(half::round_tf32(1.0f + 3 * ulp / 2), 1.0f + 2 * ulp);                // tie: to even
  EXPECT_EQ(half::round_tf32(1.0f + ulp / 2 + std::ldexp(1.0f, -23)), 1.0f + ulp);  // above the tie
  EXPECT_EQ(half::round_tf32(-(1.0f + ulp / 2 + std::ldexp(1.0f, -23))), -(1.0f + ulp));
  EXPECT_EQ(half::round_tf32(std::numeric_limits<float>::max()), std::numeric_limits<float>::infinity());
  EXPECT_EQ(half::round_tf32(std::numeric_limits<float>::infinity()), std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isnan(half::round_tf32(std::numeric_limits<float>::quiet_NaN())));
  EXPECT_TRUE(std::isnan(half::round_tf32(bits_to_float(0x7f800001u))));  // a NaN whose payload would round away
  EXPECT_EQ(half::round_bf16(1.0f + std::ldexp(1.0f, -8)), 1.0f);     // bf16: tie at 7 bits, to even
  EXPECT_EQ(half::round_bf16(1.0f + 3 * std::ldexp(1.0f, -8)), 1.0f + std::ldexp(1.0f, -6));
}

TEST(Matmul, ScopeSetsAndRestoresTheMode) {
  EXPECT_EQ(matmul_mode(), Matmul::fp32);
  {
    const MatmulScope a(Matmul::tf32, sizeof(float));
    EXPECT_EQ(matmul_mode(), Matmul::tf32);
    {
      const MatmulScope b(Matmul::bf16, sizeof(float));
      EXPECT_EQ(matmul_mode(), Matmul::bf16);
    }
    EXPECT_EQ(matmul_mode(), Matmul::tf32);
  }
  EXPECT_EQ(matmul_mode(), Matmul::fp32);
  expect_error([] { const MatmulScope s(Matmul::bf16, sizeof(double)); }, "needs float");
  EXPECT_NO_THROW(MatmulScope(Matmul::fp32, sizeof(double)));
}

// C = op(A) op(B) under each mode equals a double-accumulated loop over the
// inputs rounded as the mode says (to float summation error), and tf32 / bf16
// differ from fp32 by far more than that: the rounding is in effect.
TEST(Matmul, ProductsRoundTheirInputsInTheMode) {
  const index_t M = 37, N = 23, K = 300;
  for (const char* ta : {"N", "T"})
    for (const char* tb : {"N", "T"}) {
      const bool tra = ta[0] == 'T', trb = tb[0] == 'T';
      const auto [a, ah] = random_matrix(tra ? K : M, tra ? M : K, 11);
      const auto [b, bh] = random_matrix(trb ? N : K, trb ? K : N, 12);
      const auto [c0, c0h] = random_matrix(M, N, 13);
      auto at = [&, &ah = ah](index_t i, index_t k) { return tra ? ah[std::size_t(k * M + i)] : ah[std::size_t(i * K + k)]; };
      auto bt = [&, &bh = bh](index_t k, index_t j) { return trb ? bh[std::size_t(j * K + k)] : bh[std::size_t(k * N + j)]; };
      std::vector<float> fp32;
      for (const Matmul mode : {Matmul::fp32, Matmul::tf32, Matmul::bf16}) {
        auto round = [mode](float x) {
          return mode == Matmul::tf32 ? half::round_tf32(x) : mode == Matmul::bf16 ? half::round_bf16(x) : x;
        };
        View2<float> c("c", M, N);
        Kokkos::deep_copy(c, c0);
        {
          const MatmulScope scope(mode, sizeof(float));
          impl::gemm<float>(ExecSpace(), ta, tb, 0.5f, a, b, 0.25f, c);
        }
        const auto got = host_of(c);
        double worst = 0;
        for (index_t i = 0; i < M; ++i)
          for (index_t j = 0; j < N; ++j) {
            double ref = 0, mag = 0;
            for (index_t k = 0; k < K; ++k) {
              const double p = double(round(at(i, k))) * double(round(bt(k, j)));
              ref += p;
              mag += std::fabs(p);
            }
            ref = 0.5 * ref + 0.25 * double(c0h[std::size_t(i * N + j)]);
            worst = std::max(worst, std::fabs(double(got[std::size_t(i * N + j)]) - ref) / (0.5 * mag + 0.25));
          }
        EXPECT_LT(worst, 1e-6) << ta << tb << " " << matmul_name(mode);
        if (mode == Matmul::fp32) {
          fp32 = got;
        } else {
          double diff = 0;
          for (std::size_t i = 0; i < got.size(); ++i) diff = std::max(diff, double(std::fabs(got[i] - fp32[i])));
          EXPECT_GT(diff, 1e-4) << ta << tb << " " << matmul_name(mode) << ": the mode changed nothing";
        }
      }
    }
}

TEST(Matmul, ConfigurationKey) {
  Config c;
  EXPECT_EQ(c.settings().grad.matmul, Matmul::fp32);
  c.set("run.matmul=tf32");
  EXPECT_EQ(c.settings().grad.matmul, Matmul::tf32);
  c.set("run.matmul=bf16");
  EXPECT_EQ(c.settings().grad.matmul, Matmul::bf16);
  c.set("run.precision=double");  // the compute type is checked where it is known (ash grad: --precision)
  expect_error([&] { train(c, "", nullptr); }, "run.matmul = bf16 rounds float products: it needs float");
  Config bad;
  bad.set("run.matmul=fp16");
  expect_error([&] { (void)bad.settings(); }, "run.matmul must be fp32, tf32 or bf16");
}

// Every engine runs its products in the mode (the gradient moves off the fp32
// one), and each mode's error against double is of its rounding's size:
// fp32 < tf32 < bf16, tf32 below 3e-3 and bf16 below 2e-2 relative L2 here
// (measured: about 4e-7, 5e-4 and 4e-3).
TEST(Matmul, GradientErrorOfEachModeAgainstDouble) {
  const auto d = tiny_dims(3, 29, 32, 8);
  const auto ref_model = random_model<double>(d, 4242);
  const auto x = random_tokens(2, 96, d.vocab, 4243);
  const auto model = cast_model<float>(ref_model);
  for (const std::string engine : {"backprop", "adjoint", "adjoint-exact"}) {
    auto o = engine_options(engine);
    const auto ref = grad_of(o, ref_model, x);
    double err[3];
    for (const Matmul mode : {Matmul::fp32, Matmul::tf32, Matmul::bf16}) {
      o.matmul = mode;
      err[int(mode)] = rel_l2(grad_of(o, model, x), ref);
    }
    // the block-wise engine (a lever) and the distributed ones share these products
    o.matmul = Matmul::bf16;
    o.storage = Storage::full;
    o.layer_checkpoint = 2;
    const double blockwise_bf16 = engine == "adjoint-exact" ? rel_l2(grad_of(o, model, x), ref) : err[2];
    std::printf("  %s: rel. L2 gradient error against double: fp32 %.2e, tf32 %.2e, bf16 %.2e\n", engine.c_str(),
                err[0], err[1], err[2]);
    EXPECT_LT(err[0], 1e-5) << engine;
    EXPECT_GT(err[1], 10 * err[0]) << engine;
    EXPECT_GT(err[2], 2 * err[1]) << engine;
    EXPECT_LT(err[1], 3e-3) << engine;
    EXPECT_LT(err[2], 2e-2) << engine;
    EXPECT_GT(blockwise_bf16, 10 * err[0]) << engine;
    EXPECT_LT(blockwise_bf16, 2e-2) << engine;
  }
  EXPECT_EQ(matmul_mode(), Matmul::fp32);  // each engine restored it
  auto o = engine_options("adjoint-exact");
  o.matmul = Matmul::tf32;
  ParamSet<double> g(d);
  expect_error([&] { make_engine<double>(o)->compute(ref_model, x, g); }, "needs float");
}

}  // namespace ash::test
