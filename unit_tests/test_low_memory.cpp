// Training past memory (docs/design.md §8): 16-bit storage types, the
// BlockwiseEngine (token blocks, 16-bit kept inputs, layer checkpointing,
// carried state), resume with a carried state, and `ash eval --carry-state`.
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>

#include "test_helpers.hpp"

namespace ash::test {

namespace {

// Independent reference: the representable neighbours of f among all 2^16
// patterns decoded by from(), chosen by distance, ties to the even pattern.
template <class From>
std::uint16_t nearest_even(float f, From from, std::uint16_t guess) {
  // The nearest value is guess or a neighbour in the ordered patterns of f's sign.
  std::uint16_t best = guess;
  double bd = std::fabs(double(from(guess)) - double(f));
  for (int dlt : {-1, 1}) {
    const int c = int(guess) + dlt;
    if (c < 0 || c > 0xffff || ((c ^ guess) & 0x8000)) continue;
    const float v = from(std::uint16_t(c));
    if (std::isnan(v)) continue;
    const double dist = std::fabs(double(v) - double(f));
    if (dist < bd || (dist == bd && (c & 1) == 0)) {
      best = std::uint16_t(c);
      bd = dist;
    }
  }
  return best;
}

}  // namespace

TEST(Half, Bf16RoundTripsEveryPatternAndRoundsToNearestEven) {
  for (std::uint32_t h = 0; h <= 0xffff; ++h) {
    const float f = half::from_bf16(std::uint16_t(h));
    if (std::isnan(f))
      EXPECT_TRUE(std::isnan(half::from_bf16(half::to_bf16(f))));
    else
      EXPECT_EQ(half::to_bf16(f), h);
  }
  EXPECT_EQ(half::to_bf16(1.0f + std::ldexp(1.0f, -8)), half::to_bf16(1.0f));   // tie: to even (1.0)
  EXPECT_EQ(half::from_bf16(half::to_bf16(1.0f + 3 * std::ldexp(1.0f, -8))), 1.0f + std::ldexp(1.0f, -6));  // tie up
  EXPECT_EQ(half::from_bf16(half::to_bf16(std::numeric_limits<float>::infinity())),
            std::numeric_limits<float>::infinity());
  EXPECT_EQ(half::from_bf16(half::to_bf16(-std::numeric_limits<float>::max())),
            -std::numeric_limits<float>::infinity());  // rounds past the largest bf16
  EXPECT_EQ(half::from_bf16(half::to_bf16(std::numeric_limits<float>::denorm_min())), 0.0f);
  EXPECT_TRUE(std::isnan(half::from_bf16(half::to_bf16(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_TRUE(std::isnan(half::from_bf16(half::to_bf16(bits_to_float(0x7f800001u)))));  // signalling NaN stays NaN
  std::mt19937 gen(5);
  for (int i = 0; i < 200000; ++i) {
    const float f = bits_to_float(gen() & 0xbfffffffu);  // finite, both signs, all exponents below 2^64
    const auto h = half::to_bf16(f);
    EXPECT_EQ(h, nearest_even(f, half::from_bf16, h)) << f;
  }
}

TEST(Half, Fp16RoundTripsEveryPatternWithSubnormalsAndInfinities) {
  for (std::uint32_t h = 0; h <= 0xffff; ++h) {
    const float f = half::from_fp16(std::uint16_t(h));
    if (std::isnan(f))
      EXPECT_TRUE(std::isnan(half::from_fp16(half::to_fp16(f))));
    else
      EXPECT_EQ(half::to_fp16(f), h) << std::hex << h;
  }
  const float sub = std::ldexp(1.0f, -24);  // the smallest subnormal
  EXPECT_EQ(half::from_fp16(half::to_fp16(sub)), sub);
  EXPECT_EQ(half::from_fp16(half::to_fp16(0.5f * sub)), 0.0f);       // tie: to even (0)
  EXPECT_EQ(half::from_fp16(half::to_fp16(0.75f * sub)), sub);       // above the tie
  EXPECT_EQ(half::from_fp16(half::to_fp16(1.5f * sub)), 2 * sub);    // tie: to even (2)
  EXPECT_EQ(half::from_fp16(half::to_fp16(65504.0f)), 65504.0f);     // the largest finite
  EXPECT_EQ(half::from_fp16(half::to_fp16(65519.0f)), 65504.0f);     // below the tie
  EXPECT_EQ(half::from_fp16(half::to_fp16(65520.0f)), std::numeric_limits<float>::infinity());
  EXPECT_EQ(half::from_fp16(half::to_fp16(-1e30f)), -std::numeric_limits<float>::infinity());
  EXPECT_EQ(half::from_fp16(half::to_fp16(1.0f + std::ldexp(1.0f, -11))), 1.0f);  // tie: to even
  EXPECT_TRUE(std::isnan(half::from_fp16(half::to_fp16(std::numeric_limits<float>::quiet_NaN()))));
  std::mt19937 gen(6);
  for (int i = 0; i < 200000; ++i) {
    // exponents around fp16's range: 2^-30 .. 2^17, both signs
    const std::uint32_t e = 97 + gen() % 47, u = ((gen() & 1u) << 31) | (e << 23) | (gen() & 0x7fffffu);
    const float f = bits_to_float(u);
    const auto h = half::to_fp16(f);
    if (std::fabs(f) >= 65520.0f) {
      EXPECT_TRUE(std::isinf(half::from_fp16(h)));
      continue;
    }
    EXPECT_EQ(h, nearest_even(f, half::from_fp16, h)) << f;
  }
}

// A kernel out of the test body (nvcc: no device lambdas in a TEST's private TestBody).
void convert_in_kernel(const Kokkos::View<float*, MemSpace>& in, const Kokkos::View<std::uint16_t*, MemSpace>& b,
                       const Kokkos::View<std::uint16_t*, MemSpace>& h) {
  Kokkos::parallel_for(
      "test::half", Range(0, index_t(in.extent(0))), KOKKOS_LAMBDA(const index_t i) {
        b(i) = half::to_bf16(in(i));
        h(i) = half::to_fp16(in(i));
      });
}

// The conversions give the same bits in a kernel on the default execution space.
TEST(Half, KernelConversionMatchesHost) {
  const index_t n = 4096;
  Kokkos::View<float*, MemSpace> in("in", n);
  Kokkos::View<std::uint16_t*, MemSpace> b("b", n), h("h", n);
  auto hin = Kokkos::create_mirror_view(in);
  std::mt19937 gen(7);
  for (index_t i = 0; i < n; ++i) hin(i) = bits_to_float(0x30000000u + (gen() % 0x18000000u)) * (i % 2 ? -1.f : 1.f);
  Kokkos::deep_copy(in, hin);
  convert_in_kernel(in, b, h);
  auto hb = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), b);
  auto hh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), h);
  for (index_t i = 0; i < n; ++i) {
    EXPECT_EQ(hb(i), half::to_bf16(hin(i)));
    EXPECT_EQ(hh(i), half::to_fp16(hin(i)));
  }
}

namespace {

// form: E3's three forms (test_helpers.hpp); the block-wise engine starts
// each block from a carried state, which all must honour.
EngineOptions lowmem(Storage st, index_t m, index_t block, bool detach = false, index_t Tbar = 0,
                     E3Form form = default_e3_form()) {
  EngineOptions o = with_e3_form(EngineOptions(), form);
  o.method = Method::adjoint_exact;
  o.chunk = 8;
  o.wave = 16;
  o.storage = st;
  o.layer_checkpoint = m;
  o.token_block = block;
  o.detach_inputs = detach;
  o.truncate = Tbar;
  return o;
}

}  // namespace

template <class S>
class LowMemoryTyped : public ::testing::Test {};
TYPED_TEST_SUITE(LowMemoryTyped, Scalars);

// Checkpointed == uncheckpointed, bitwise, for K = 1..5 and several m (float
// storage: the recomputed layer inputs are the forward's own bits); and the
// block-wise engine equals E3 on the whole window to rounding.
TYPED_TEST(LowMemoryTyped, CheckpointingIsBitwiseAndMatchesE3) {
  using S = TypeParam;
  const index_t T = 40;  // blocks of 16: 16 + 16 + 8
  for (int K = 1; K <= 5; ++K) {
    const auto d = tiny_dims(K);
    const auto ps = cast_model<S>(random_model<double>(d, 300 + K));
    const auto x = random_tokens(2, T, d.vocab, 310 + K);
    double l1 = 0, lm = 0, le = 0;
    for (const E3Form f : e3_forms()) {
      const std::string form = " " + e3_form_name(f);
      const auto g1 = grad_of(lowmem(Storage::full, 1, 16, false, 0, f), ps, x, &l1);
      for (index_t m : {2, 3, 5, 6}) {
        const auto gm = grad_of(lowmem(Storage::full, m, 16, false, 0, f), ps, x, &lm);
        EXPECT_EQ(lm, l1) << "K=" << K << " m=" << m << form;
        EXPECT_EQ(gm, g1) << "K=" << K << " m=" << m << form;  // bitwise
      }
      EngineOptions plain = lowmem(Storage::full, 1, 0, false, 0, f);
      plain.token_block = 0;
      const auto gp = grad_of(plain, ps, x, &le);
      EXPECT_NEAR(l1, le, 10 * Tol<S>::forward * std::fabs(le));
      expect_close(g1, gp, d, sizeof(S) == 8 ? 1e-11 : 2e-5, "blocks vs whole window, K=" + std::to_string(K) + form);
    }
  }
}

// The paper's modes run block-wise too (full window) or in one block (T̄).
TEST(LowMemory, DetachedAndWindowMatchE3) {
  const auto d = tiny_dims(3);
  const auto ps = random_model<double>(d, 41);
  const auto x = random_tokens(2, 40, d.vocab, 42);
  for (index_t Tbar : {0, 8}) {
    EngineOptions plain = lowmem(Storage::full, 1, 0, true, Tbar);
    plain.token_block = 0;
    ASSERT_FALSE(plain.blockwise_levers());
    const auto gp = grad_of(plain, ps, x);
    const auto gl = grad_of(lowmem(Storage::full, 2, 16, true, Tbar), ps, x);
    expect_close(gl, gp, d, 1e-11, "T-bar=" + std::to_string(Tbar));
  }
}

// 16-bit storage: the gradient of float storage to within what rounding the
// kept inputs to 8 (bf16) or 11 (fp16) significant bits costs.
TEST(LowMemory, SixteenBitStorageIsCloseToFloatStorage) {
  const auto d = tiny_dims(4, 17, 16, 4);
  const auto ps = cast_model<float>(random_model<double>(d, 51));
  const auto x = random_tokens(2, 64, d.vocab, 52);
  double lf = 0, lb = 0, lh = 0;
  const auto gf = grad_of(lowmem(Storage::full, 2, 32), ps, x, &lf);
  const auto gb = grad_of(lowmem(Storage::bf16, 2, 32), ps, x, &lb);
  const auto gh = grad_of(lowmem(Storage::fp16, 2, 32), ps, x, &lh);
  EXPECT_NE(gb, gf);  // the storage is really rounded
  for (const auto& t : param_layout(d)) {
    EXPECT_GE(cosine(gb, gf, t.offset, t.size()), 0.999) << t.name;
    EXPECT_LE(rel_l2(gb, gf, t.offset, t.size()), 2e-2) << t.name;
    EXPECT_GE(cosine(gh, gf, t.offset, t.size()), 0.99999) << t.name;
    EXPECT_LE(rel_l2(gh, gf, t.offset, t.size()), 3e-3) << t.name;
  }
  EXPECT_NEAR(lb, lf, 1e-2 * lf);
  EXPECT_NEAR(lh, lf, 2e-3 * lf);
}

// With a carried state h0: the gradient is that of L(θ) with h0 a constant
// (central differences of the forward loss with the same h0), and the state
// left behind is the forward's state after the window.
TEST(LowMemory, CarriedStateGradientMatchesFiniteDifferences) {
  const auto d = tiny_dims(2);
  const auto ps = random_model<double>(d, 61);
  const index_t B = 2, T = 24;
  const auto x = random_tokens(B, T, d.vocab, 62);
  std::vector<View2<double>> h0;
  std::mt19937_64 gen(63);
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  for (int k = 0; k < d.layers; ++k) {
    h0.emplace_back("h0", B * d.width, d.state);
    auto h = Kokkos::create_mirror_view(h0.back());
    for (index_t i = 0; i < B * d.width; ++i)
      for (index_t n = 0; n < d.state; ++n) h(i, n) = u(gen);
    Kokkos::deep_copy(h0.back(), h);
  }
  auto copy_state = [&](const std::vector<View2<double>>& src) {
    std::vector<View2<double>> c;
    for (const auto& v : src) {
      c.emplace_back("h", v.extent(0), v.extent(1));
      Kokkos::deep_copy(c.back(), v);
    }
    return c;
  };
  auto loss_at = [&](const ParamSet<double>& p) {
    auto st = copy_state(h0);
    return forward_loss(p, x, 1024, st, x, 0);
  };
  // Every form must start every block from the carried state.
  std::vector<double> gv;
  for (const E3Form f : e3_forms()) {
    SCOPED_TRACE(e3_form_name(f));
    auto state = copy_state(h0);
    auto eng = make_engine<double>(lowmem(Storage::full, 1, 8, false, 0, f));
    eng->set_carried_state(&state);
    ParamSet<double> g(d);
    const double loss = eng->compute(ps, x, g);
    EXPECT_NEAR(loss, loss_at(ps), 1e-12);
    gv = to_host(g);
    auto pv = to_host(ps);
    // every tensor, a few entries each
    ParamSet<double> q(d);
    for (const auto& t : param_layout(d))
      for (index_t j : {index_t(0), t.size() / 2, t.size() - 1}) {
        const std::size_t i = t.offset + j;
        const double e = 1e-5;
        auto v = pv;
        v[i] += e;
        from_host(q, v);
        const double lp = loss_at(q);
        v[i] -= 2 * e;
        from_host(q, v);
        const double lm = loss_at(q);
        const double fd = (lp - lm) / (2 * e);
        EXPECT_NEAR(gv[i], fd, 1e-7 + 1e-6 * std::fabs(fd)) << t.name << "[" << j << "]";
      }
    // The state it leaves is the forward's state after the window.
    auto fwd = copy_state(h0);
    forward_loss(ps, x, 1024, fwd, x, 0);
    for (int k = 0; k < d.layers; ++k) {
      auto a = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), state[k]);
      auto b = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), fwd[k]);
      for (index_t i = 0; i < a.extent(0); ++i)
        for (index_t n = 0; n < a.extent(1); ++n) EXPECT_NEAR(a(i, n), b(i, n), 1e-12);
    }
  }
  // And the state matters: without it the gradient differs.
  ParamSet<double> g0(d);
  make_engine<double>(lowmem(Storage::full, 1, 8))->compute(ps, x, g0);
  EXPECT_GT(rel_l2(to_host(g0), gv), 1e-3);
}

// Engines keep scratch between layers and blocks: a reused engine gives the
// fresh engine's bits on new windows (of another length, too), exact and windowed.
TEST(LowMemory, ReusedEnginesMatchFreshOnes) {
  const auto d = tiny_dims(3);
  const auto ps = random_model<double>(d, 81);
  for (const auto& o : {lowmem(Storage::full, 1, 0), lowmem(Storage::full, 1, 0, true, 5),
                        lowmem(Storage::bf16, 2, 16), lowmem(Storage::full, 1, 16, true, 0)}) {
    auto eng = make_engine<double>(o);
    for (auto bt : {std::pair<index_t, index_t>{2, 40}, {1, 37}, {2, 40}}) {
      const auto x = random_tokens(bt.first, bt.second, d.vocab, 82 + bt.second);
      ParamSet<double> g(d);
      const double l = eng->compute(ps, x, g);
      double lf = 0;
      EXPECT_EQ(to_host(g), grad_of(o, ps, x, &lf));
      EXPECT_EQ(l, lf);
    }
  }
}

TEST(LowMemory, RejectsOtherEnginesAndBadKeys) {
  EngineOptions o = lowmem(Storage::bf16, 1, 0);
  o.method = Method::backprop;
  expect_error([&] { make_engine<float>(o); }, "need grad.engine = adjoint-exact");
  Config c;
  expect_error([&] { c.set("run.storage=half"); c.validate(); }, "run.storage must be float, bf16 or fp16");
  Config c2;
  c2.set("data.carry_state=true");
  expect_error([&] { c2.validate(); }, "data.carry_state needs data.sequential");
  Config c3;
  c3.set("grad.layer_checkpoint=auto");
  c3.set("model.layers=9");
  EXPECT_EQ(EngineOptions::from_config(c3).layer_checkpoint, 3);
}

// Resume with a carried state (and bf16 storage, checkpointing) is bitwise:
// the state is in the checkpoint.
TEST(LowMemory, ResumeWithCarriedStateIsBitwise) {
  const auto corpus = word_corpus(tmp_path("corpus.txt"));
  auto cfg = [&](const std::string& dir) {
    Config c;
    for (const auto& kv : {"model.width=8", "model.state=4", "model.layers=3", "data.seq_len=32", "data.batch=2",
                           "data.sequential=true", "data.carry_state=true", "run.storage=bf16",
                           "grad.layer_checkpoint=2", "grad.token_block=16", "grad.engine=adjoint-exact",
                           "grad.chunk=8", "optim.steps=6", "optim.warmup=2", "run.log_every=1",
                           "run.eval_every=3", "run.ckpt_every=3"})
      c.set(kv);
    c.set("data.train=" + corpus);
    c.set("run.out_dir=" + dir);
    return c;
  };
  const auto a = tmp_path("straight"), b = tmp_path("split");
  std::filesystem::remove_all(a);
  std::filesystem::remove_all(b);
  train(cfg(a), "", nullptr);
  train(cfg(b), "", nullptr, 3);
  // the checkpoint holds a non-zero state
  std::vector<View2<float>> st;
  for (int k = 0; k < 3; ++k) st.emplace_back("s", 2 * 8, 4);
  ASSERT_TRUE(load_carried_state(b + "/checkpoint.h5", st));
  auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), st[1]);
  double norm = 0;
  for (index_t i = 0; i < 16; ++i)
    for (index_t n = 0; n < 4; ++n) norm += std::fabs(h(i, n));
  EXPECT_GT(norm, 0.0);
  train(cfg(b), b + "/checkpoint.h5", nullptr);
  auto losses = [](const std::string& f) {
    std::vector<double> out;
    std::ifstream in(f);
    for (std::string line; std::getline(in, line);) out.push_back(nlohmann::json::parse(line)["loss"].get<double>());
    return out;
  };
  const auto la = losses(a + "/metrics.jsonl"), lb = losses(b + "/metrics.jsonl");
  ASSERT_EQ(la.size(), 6u);
  EXPECT_EQ(la, lb);
  EXPECT_EQ(to_host(load_checkpoint<float>(a + "/checkpoint.h5")), to_host(load_checkpoint<float>(b + "/checkpoint.h5")));
}

// Streaming windows with the carried state is the forward of one long sequence.
TEST(LowMemory, CarriedForwardEqualsOneLongWindow) {
  const auto d = tiny_dims(3);
  const auto ps = random_model<double>(d, 71);
  const auto ids = random_token_ids(100, d.vocab, 72);
  const double whole = forward_loss(ps, make_windows(ids, 1, 100, d.vocab), 1024);
  std::vector<View2<double>> st;
  for (int k = 0; k < 3; ++k) st.emplace_back("s", d.width, d.state);
  double sum = 0;
  for (index_t first = 0; first < 100; first += 30) {
    const index_t len = std::min<index_t>(30, 100 - first), hl = std::min<index_t>(len + 1, 100 - first);
    sum += (hl - 1) * forward_loss(ps, make_windows(ids, 1, len, d.vocab, first), 1024, st,
                                   make_windows(ids, 1, hl, d.vocab, first), hl - 1);
  }
  EXPECT_NEAR(sum / 99, whole, 1e-12);
}

}  // namespace ash::test

namespace ash::test {

// The MPI pipeline's token blocks (pipeline_block_length): grad.token_block
// when set; else dist.pipeline_blocks; else one process's 4096 tokens with a
// memory lever (so a lever never gets longer blocks on ranks than alone) and
// 4 blocks per layer rank without one. Whole chunks of 64.
TEST(LowMemory, PipelineBlockLengthFollowsItsRules) {
  const index_t T = 1 << 20;
  EngineOptions plain;
  plain.method = Method::adjoint_exact;
  EXPECT_EQ(pipeline_block_length(plain, T, 4, 0), T / 16);
  EXPECT_EQ(pipeline_block_length(plain, T, 4, 8), T / 8);
  auto lever = plain;
  lever.storage = Storage::bf16;
  EXPECT_EQ(pipeline_block_length(lever, T, 4, 0), 4096);
  EXPECT_EQ(pipeline_block_length(lever, T, 4, 8), T / 8);
  auto blocks = plain;
  blocks.token_block = 1000;  // rounded up to whole chunks
  EXPECT_EQ(pipeline_block_length(blocks, T, 4, 8), 1024);
  EXPECT_EQ(pipeline_block_length(plain, 100, 4, 0), 64);  // 100 / 16 -> 7 tokens -> one chunk
}

}  // namespace ash::test
