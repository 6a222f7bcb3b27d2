// E3 (exact O(T) adjoint) against E1, and in its paper modes against E2.
#include "test_helpers.hpp"

namespace ash::test {

namespace {

// form: E3's four forms (test_helpers.hpp); all run on every backend here.
EngineOptions e3(index_t C, index_t wave, bool detach = false, index_t Tbar = 0, E3Form form = default_e3_form()) {
  EngineOptions o = with_e3_form(EngineOptions(), form);
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
    for (const E3Form form : e3_forms())
      for (auto cw : {std::pair<index_t, index_t>{4, 8}, {4, 1024}, {1, 3}, {7, 7}, {29, 29}, {64, 64}}) {
        const auto g3 = grad_of(e3(cw.first, cw.second, false, 0, form), ps, x, &l3);
        EXPECT_EQ(l1, l3);
        expect_close(g3, e1, d, 1e-10,
                     "K=" + std::to_string(K) + " N=" + std::to_string(d.state) + " C=" + std::to_string(cw.first) + " wave=" +
                         std::to_string(cw.second) + " " + e3_form_name(form));
      }
  }
}

TEST(AdjointExact, DetachedEqualsFullAdjointSharding) {
  for (int K : {1, 3}) {
    const auto d = tiny_dims(K);
    auto ps = random_model<double>(d, 100 + K);
    const auto x = random_tokens(3, 29, d.vocab, 110 + K);
    for (const E3Form form : e3_forms())
      expect_close(grad_of(e3(4, 8, true, 0, form), ps, x), grad_of(engine_options("adjoint"), ps, x), d, 1e-10,
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
    for (const E3Form form : e3_forms())
      for (index_t wave : {index_t(1), index_t(8), index_t(1024)})
        expect_close(grad_of(e3(C, wave, true, Tbar, form), ps, x), e2, d, 1e-10,
                     "T-bar=" + std::to_string(Tbar) + " wave=" + std::to_string(wave) +
                         " " + e3_form_name(form));
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
  for (const E3Form form : e3_forms())
    expect_close(grad_of(e3(5, 10, false, 0, form), ps, x), grad_of(engine_options("backprop"), ref, x), d,
                 Tol<S>::grad_vs_double, "exact, " + e3_form_name(form));
  expect_close(grad_of(e3(5, 10, true, 6), ps, x), grad_of(engine_options("adjoint", 6), ref, x), d, Tol<S>::grad_vs_double,
               "window");
}

TEST(AdjointExact, Deterministic) {
  const auto d = tiny_dims(2);
  auto ps = random_model<double>(d, 141);
  const auto x = random_tokens(2, 40, d.vocab, 142);
  for (const E3Form form : e3_forms()) {
    EngineOptions o = e3(6, 12, false, 0, form);
    o.e3_channel_block = 3;  // the fused form's two-level sums over channel blocks
    EXPECT_EQ(grad_of(o, ps, x), grad_of(o, ps, x)) << e3_form_name(form);
  }
}

// The fused form's channel blocks (one team per block; ∂L/∂β, ∂L/∂γ summed
// over blocks in a second pass): any block size gives E1's gradient, including
// a last block narrower than the others (P = 8 in blocks of 3) and a block of
// one channel; N = 5 runs five state tiles of one on the host.
TEST(AdjointExact, FusedChannelBlocksEqualBackprop) {
  for (const index_t N : {index_t(4), index_t(5)}) {
    const auto d = tiny_dims(2, 17, 8, N);
    auto ps = random_model<double>(d, 151);
    const auto x = random_tokens(2, 29, d.vocab, 152);
    const auto e1 = grad_of(engine_options("backprop"), ps, x);
    for (const E3Form form : {E3Form::fused_sequential, E3Form::fused_chunked})
      for (const index_t Pt : {index_t(1), index_t(3), index_t(8), index_t(100)})
        for (const bool detach : {false, true}) {
          EngineOptions o = e3(4, 8, detach, 0, form);
          o.e3_channel_block = Pt;
          const auto ref = detach ? grad_of(engine_options("adjoint"), ps, x) : e1;
          expect_close(grad_of(o, ps, x), ref, d, 1e-10,
                       "N=" + std::to_string(N) + " Pt=" + std::to_string(Pt) + (detach ? " detached " : " ") +
                           e3_form_name(form));
        }
  }
}

// The fused kernel launched over parts of a wave (grad.e3_fused_launch): the
// block shares hold one launch's tokens, the partial sums and cotangent rows
// the whole wave's. Launches of one and two chunks in waves of three and of
// all T = 29 tokens, so a wave ends in a shorter launch and the last launch
// in a partial chunk; with channel blocks (Pt = 3: the two-level sums) and
// without (Pt = 100). Equal to the wave form's (no fused kernel) to 1e-12
// and to E1's (or E2's, detached) to 1e-10.
TEST(AdjointExact, FusedLaunchesWithinAWaveEqualTheWaveForm) {
  const auto d = tiny_dims(2, 17, 8, 4);
  auto ps = random_model<double>(d, 161);
  const auto x = random_tokens(2, 29, d.vocab, 162);
  for (const bool detach : {false, true}) {
    const auto ref = grad_of(engine_options(detach ? "adjoint" : "backprop"), ps, x);
    for (const index_t wave : {index_t(12), index_t(1024)}) {
      const auto unfused = grad_of(e3(4, wave, detach, 0, E3Form::chunked), ps, x);
      for (const E3Form form :
           {E3Form::fused_sequential, E3Form::fused_chunked, E3Form::walk_sequential, E3Form::walk_chunked})
        for (const index_t launch : {index_t(4), index_t(8)})
          for (const index_t Pt : {index_t(3), index_t(100)}) {
            EngineOptions o = e3(4, wave, detach, 0, form);
            o.e3_fused_launch = launch;
            o.e3_channel_block = Pt;
            const auto g = grad_of(o, ps, x);
            const std::string what = "wave=" + std::to_string(wave) + " launch=" + std::to_string(launch) +
                                     " Pt=" + std::to_string(Pt) + (detach ? " detached " : " ") + e3_form_name(form);
            expect_close(g, unfused, d, 1e-12, what);
            expect_close(g, ref, d, 1e-10, what);
          }
    }
  }
}

// The reverse walk (impl/e3_walk.hpp) against the fused form to 1e-12 in
// double: chunks (segments) of one sub-range (C = 5), of whole sub-ranges
// (16), with a shorter last sub-range (20, 29) and of the whole window (64 >
// T); T = 37 ends in a short chunk; documents start inside and at the first
// token of chunks and sub-ranges; three sequences; exact and detached; both h
// forms; one, three (the last step narrower) and all eight channels a step.
// Bitwise repeatable.
TEST(AdjointExact, WalkEqualsTheFusedForm) {
  const auto d = tiny_dims(2, 17, 8, 4);
  auto ps = random_model<double>(d, 171);
  auto x = random_tokens(3, 37, d.vocab, 172);
  {
    auto h = Kokkos::create_mirror_view(x);
    Kokkos::deep_copy(h, x);
    for (const index_t t : {index_t(3), index_t(8), index_t(16), index_t(21)}) h(1, t) |= doc_start_bit;
    h(2, 20) |= doc_start_bit;
    Kokkos::deep_copy(x, h);
  }
  for (const bool detach : {false, true}) {
    const auto ref = grad_of(engine_options(detach ? "adjoint" : "backprop"), ps, x);
    for (const index_t C : {index_t(5), index_t(16), index_t(20), index_t(29), index_t(64)})
      for (const bool chunked : {false, true}) {
        const auto fused = grad_of(e3(C, 1024, detach, 0, chunked ? E3Form::fused_chunked : E3Form::fused_sequential),
                                   ps, x);
        for (const index_t Qc : {index_t(0), index_t(1), index_t(3), index_t(8)}) {  // channels a step
          EngineOptions o = e3(C, 1024, detach, 0, chunked ? E3Form::walk_chunked : E3Form::walk_sequential);
          o.e3_channel_block = Qc;
          const auto walk = grad_of(o, ps, x);
          const std::string what = "C=" + std::to_string(C) + " Qc=" + std::to_string(Qc) +
                                   (chunked ? " chunked" : " sequential") + (detach ? " detached" : "");
          expect_close(walk, fused, d, 1e-12, what);
          expect_close(walk, ref, d, 1e-10, what);
          EXPECT_EQ(walk, grad_of(o, ps, x)) << what;
        }
      }
  }
}

// EngineOptions::keep_buffers: an engine that keeps its layer inputs, g and
// workspace between calls gives each call bitwise the gradient a fresh engine
// gives, for windows of one shape with and without documents (and again after
// a call on another shape), and a warm call allocates fewer Views than a cold one.
TEST(AdjointExact, KeptBuffersGiveEachCallsGradient) {
  ASSERT_TRUE(MemoryTracker::installed());
  const std::string space = MemSpace::name();
  const auto d = tiny_dims(2, 17, 8, 4);
  auto ps = random_model<double>(d, 181);
  const auto x1 = random_tokens(2, 29, d.vocab, 182);
  auto x2 = random_tokens(2, 29, d.vocab, 183);
  {
    auto h = Kokkos::create_mirror_view(x2);
    Kokkos::deep_copy(h, x2);
    h(0, 7) |= doc_start_bit;
    h(1, 20) |= doc_start_bit;
    Kokkos::deep_copy(x2, h);
  }
  const auto x3 = random_tokens(3, 17, d.vocab, 184);
  for (const char* engine : {"backprop", "adjoint", "adjoint-exact"}) {
    EngineOptions o = engine_options(engine);
    o.chunk = 8;
    o.keep_buffers = true;
    const auto warm = make_engine<double>(o);
    // Calls: cold, warm (x2 has x1's shape), cold (another shape), cold, warm.
    const std::vector<std::pair<const TokenView*, bool>> calls{{&x1, false}, {&x2, true}, {&x3, false}, {&x1, false},
                                                               {&x1, true}};
    for (const auto& [x, is_warm] : calls) {
      ParamSet<double> g(d);
      const auto a0 = MemoryTracker::allocations(space);
      const double l = warm->compute(ps, *x, g);
      const auto allocated = MemoryTracker::allocations(space) - a0;
      double lf = 0;
      EngineOptions fresh = o;
      fresh.keep_buffers = false;
      const auto a1 = MemoryTracker::allocations(space);
      const auto gf = grad_of(fresh, ps, *x, &lf);
      const auto allocated_fresh = MemoryTracker::allocations(space) - a1;
      EXPECT_EQ(l, lf) << engine;
      EXPECT_EQ(to_host(g), gf) << engine;
      if (is_warm)
        EXPECT_LT(allocated, allocated_fresh / 2) << engine << ": a warm call allocated " << allocated << " Views";
      else
        EXPECT_GT(allocated, allocated_fresh / 2) << engine << ": a cold call allocated " << allocated << " Views";
    }
  }
}

// e3_fused_waves: whole chunks, the launch within the wave, both at most T;
// grad.wave and grad.e3_fused_launch as asked (rounded down to whole chunks).
TEST(AdjointExact, FusedWavesAreWholeChunks) {
  EngineOptions o;
  o.method = Method::adjoint_exact;
  o.chunk = 64;
  const LayerShape bench{1, index_t(1) << 20, 256, 16, sizeof(float)};
  const E3FusedWaves a = e3_fused_waves(o, bench);
  EXPECT_EQ(a.wave % 64, 0);
  EXPECT_EQ(a.launch % 64, 0);
  EXPECT_LE(a.launch, a.wave);
  if (host_backend) {
    EXPECT_EQ(a.wave, 1024);
    EXPECT_EQ(a.launch, 1024);
  } else {
    EXPECT_LE((bench.T + a.wave - 1) / a.wave, 8);  // the bench model: at most 8 waves a layer
  }
  o.wave = 1000;
  o.e3_fused_launch = 200;
  const E3FusedWaves b = e3_fused_waves(o, bench);
  EXPECT_EQ(b.wave, 960);
  EXPECT_EQ(b.launch, 192);
  o.e3_fused_launch = 5000;
  EXPECT_EQ(e3_fused_waves(o, bench).launch, 960);
  const E3FusedWaves c = e3_fused_waves(o, LayerShape{2, 100, 8, 4, sizeof(double)});
  EXPECT_EQ(c.wave, 100);
  EXPECT_EQ(c.launch, 100);
}

}  // namespace ash::test
