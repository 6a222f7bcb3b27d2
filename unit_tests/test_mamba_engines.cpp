// The engines on a Mamba and a FalconMamba (the same kind's members with the mixer's norms): E3 against E1, the
// block-wise engine (token blocks, layer checkpoints, 16-bit storage) against the whole window, the detached modes
// against each other and E2's window against a brute-force window sum, float against double in those modes, and the
// refusals.
#include <algorithm>

#include "test_helpers.hpp"

namespace ash::test {

// E3 (grad.engine=adjoint-exact) equals E1 on a Mamba: the same gradient from each
// block's input alone, μ, h^{t-1} and A^t formed wave by wave by E3's scans, in both
// h forms, chunks that split documents and the conv's reach, waves of one chunk to
// the whole window.
struct E3Case {
  int K;
  index_t batch, T;
  std::int64_t Kc;
  bool docs;
  Arch arch = Arch::mamba;
};

void PrintTo(const E3Case& c, std::ostream* os) {
  *os << arch_name(c.arch) << " K=" << c.K << " batch=" << c.batch << " T=" << c.T << " Kc=" << c.Kc
      << (c.docs ? " docs" : "");
}

class MambaE3 : public ::testing::TestWithParam<E3Case> {};

TEST_P(MambaE3, EqualsBackprop) {
  const auto c = GetParam();
  const auto d = mamba_tiny_dims(c.K, c.K % 2 == 1, c.Kc, 2, c.arch);
  auto ps = fd_model(d, 60 + c.K);
  auto x = random_tokens(c.batch, c.T, d.vocab, 70 + c.K);
  if (c.docs)
    x = with_document_starts(x, c.batch == 2 ? std::vector<index_t>{2, 6, c.T + 4} : std::vector<index_t>{3, 4, 8});
  double l1 = 0;
  const auto e1 = grad_of(EngineOptions{}, ps, x, &l1);
  // The scan core in E3's every form: the wave buffers, the fused kernels
  // (the default) and the reverse walk, each with both h forms.
  for (const E3Form form : e3_forms())
    for (const auto& [chunk, wave] : std::vector<std::pair<index_t, index_t>>{{64, 0}, {3, 3}, {2, 4}, {4, 0}, {9, 0}, {20, 0}}) {
      EngineOptions o = with_e3_form(engine_options("adjoint-exact"), form);
      o.chunk = chunk;
      o.wave = wave;
      double l3 = 0;
      const auto e3 = grad_of(o, ps, x, &l3);
      const std::string what =
          "(chunk " + std::to_string(chunk) + ", wave " + std::to_string(wave) + ", " + e3_form_name(form) + ")";
      EXPECT_NEAR(l3, l1, 1e-14 * l1) << what;
      expect_close(e3, e1, d, 1e-12, what);
    }
}

INSTANTIATE_TEST_SUITE_P(Cases, MambaE3,
                         ::testing::Values(E3Case{1, 1, 9, 4, false}, E3Case{2, 2, 11, 3, true},
                                           E3Case{3, 2, 7, 2, false}, E3Case{2, 1, 13, 4, true},
                                           E3Case{3, 1, 9, 3, true}, E3Case{2, 2, 11, 3, true, Arch::falcon_mamba}),
                         [](const ::testing::TestParamInfo<E3Case>& i) {  // a stable name (not the struct's bytes)
                           const E3Case& c = i.param;
                           return (c.arch == Arch::mamba ? "" : arch_name(c.arch) + "_") + "K" + std::to_string(c.K) +
                                  "_B" + std::to_string(c.batch) + "_T" + std::to_string(c.T) + "_Kc" +
                                  std::to_string(c.Kc) + (c.docs ? "_docs" : "");
                         });

// The block-wise engine on a Mamba (grad.token_block, docs/design.md §8): token
// blocks of 1 token up to more than Kc−1, blocks shorter than the conv's reach
// (the conv's carry then passes through several blocks), document starts inside
// a block, on a block's first token and within a block's first Kc−1 tokens,
// batch 2, T odd; exact and detached; layer checkpoints m = 1..K+1 and 16-bit
// storage of the kept inputs; the scan core in each of E3's three forms. The
// gradient equals the whole window's (E3 in one block) to 1e-12 in double, and
// is the same for every m bit for bit.
struct BlockCase {
  int K;
  index_t batch, T;
  std::int64_t Kc;
  bool docs;
  Arch arch = Arch::mamba;
};

void PrintTo(const BlockCase& c, std::ostream* os) {
  *os << arch_name(c.arch) << " K=" << c.K << " batch=" << c.batch << " T=" << c.T << " Kc=" << c.Kc
      << (c.docs ? " docs" : "");
}

class MambaBlockwise : public ::testing::TestWithParam<BlockCase> {};

TEST_P(MambaBlockwise, EqualsWholeWindow) {
  const auto c = GetParam();
  const auto d = mamba_tiny_dims(c.K, c.K % 2 == 0, c.Kc, 2, c.arch);
  auto ps = fd_model(d, 80 + c.K);
  auto x = random_tokens(c.batch, c.T, d.vocab, 90 + c.K);
  // Starts on block boundaries and inside a block's first Kc−1 tokens for the block lengths below.
  if (c.docs)
    x = with_document_starts(
        x, c.batch == 2 ? std::vector<index_t>{3, 6, c.T + 1, c.T + 5, std::min<index_t>(c.T + 8, 2 * c.T - 1)}
                        : std::vector<index_t>{2, 5, 9});
  // The scan core's three forms: waves, fused (a GPU's default) and the walk;
  // each form's whole window is the waves' to 1e-12.
  for (const int form : {0, 1, 2}) {
    for (const bool detach : {false, true})
      for (const index_t chunk : {1, 2}) {
        EngineOptions whole = engine_options("adjoint-exact", 0, detach);
        whole.chunk = chunk;
        whole.e3_scan_fused = form > 0;
        whole.e3_walk = form == 2;
        double lw = 0;
        const auto gw = grad_of(whole, ps, x, &lw);
        if (form > 0) {
          EngineOptions waves = whole;
          waves.e3_scan_fused = waves.e3_walk = false;
          expect_close(gw, grad_of(waves, ps, x), d, 1e-12, form == 1 ? "fused vs waves" : "walk vs waves");
        }
        for (const index_t tb : {1, 2, 3, 5}) {
          std::vector<double> g_m1;
          for (int m = 1; m <= c.K + 1; ++m) {
            EngineOptions o = whole;
            o.token_block = tb;
            o.layer_checkpoint = m;
            double lb = 0;
            const auto gb = grad_of(o, ps, x, &lb);
            const std::string what = std::string(form == 0 ? "waves, " : form == 1 ? "fused, " : "walk, ") +
                                     (detach ? "detached" : "exact") + ", chunk " + std::to_string(chunk) +
                                     ", token_block " + std::to_string(tb) + ", m " + std::to_string(m);
            EXPECT_NEAR(lb, lw, 1e-13 * lw) << what;
            expect_close(gb, gw, d, 1e-12, what);
            if (m == 1)
              g_m1 = gb;
            else
              EXPECT_EQ(gb, g_m1) << what << ": not bitwise the m = 1 gradient";
          }
        }
      }
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, MambaBlockwise,
                         ::testing::Values(BlockCase{2, 2, 13, 4, true}, BlockCase{1, 1, 11, 3, false},
                                           BlockCase{2, 1, 9, 2, true}, BlockCase{3, 2, 7, 3, true},
                                           BlockCase{1, 2, 11, 4, false},
                                           BlockCase{2, 2, 13, 4, true, Arch::falcon_mamba}),
                         [](const ::testing::TestParamInfo<BlockCase>& i) {
                           const BlockCase& c = i.param;
                           return (c.arch == Arch::mamba ? "" : arch_name(c.arch) + "_") + "K" + std::to_string(c.K) +
                                  "_B" + std::to_string(c.batch) + "_T" + std::to_string(c.T) + "_Kc" +
                                  std::to_string(c.Kc) + (c.docs ? "_docs" : "");
                         });

// 16-bit storage of a Mamba's kept layer inputs (run.storage, with token blocks and
// m = 2): float storage's gradient to within the SSM-ResNet's tolerances
// (test_low_memory.cpp). Float storage over token blocks is the whole window's to
// float rounding (the blocks' weight-gradient sums add in another order: not bitwise).
TEST(Mamba, BlockwiseSixteenBitStorage) {
  ModelDims d = mamba_tiny_dims(4, false, 4);
  d.width = 16;
  d.state = 4;
  const auto ps = cast_model<float>(random_model<double>(d, 51));
  const auto x = with_document_starts(random_tokens(2, 64, d.vocab, 52), {20, 64 + 33});
  const auto opts = [](Storage st, index_t tb) {
    EngineOptions o = engine_options("adjoint-exact");
    o.chunk = 8;
    o.storage = st;
    o.layer_checkpoint = tb > 0 ? 2 : 1;
    o.token_block = tb;
    return o;
  };
  double lw = 0, lf = 0, lb = 0, lh = 0;
  const auto gw = grad_of(opts(Storage::full, 0), ps, x, &lw);
  const auto gf = grad_of(opts(Storage::full, 24), ps, x, &lf);
  const auto gb = grad_of(opts(Storage::bf16, 24), ps, x, &lb);
  const auto gh = grad_of(opts(Storage::fp16, 24), ps, x, &lh);
  expect_close(gf, gw, d, 1e-5, "float storage, token blocks");
  EXPECT_NE(gb, gf);  // the storage is really rounded
  for (const auto& t : param_layout(d)) {
    EXPECT_GE(cosine(gb, gf, t.offset, t.size()), 0.999) << t.name;
    EXPECT_LE(rel_l2(gb, gf, t.offset, t.size()), 2e-2) << t.name;
    EXPECT_GE(cosine(gh, gf, t.offset, t.size()), 0.99999) << t.name;
    EXPECT_LE(rel_l2(gh, gf, t.offset, t.size()), 3e-3) << t.name;
  }
  EXPECT_NEAR(lf, lw, 1e-6 * lw);
  EXPECT_NEAR(lb, lf, 1e-2 * lf);
  EXPECT_NEAR(lh, lf, 2e-3 * lf);
}

namespace {

// E2's truncated gradient of a Mamba by explicit products on the host (docs/design.md §2):
//   μ^i = Σ_{t=i}^{min(T,i+T̄-1)} ∂L/∂s^t_e γ^t_n Π_{j=i+1..t} A^j_en
// over the scan's E channels, from the blocks' kept activations and ∂L/∂s of the
// gate's VJP, fed to the mixer's VJPs with the block input detached (g unchanged):
// test_adjoint.cpp's SSM-ResNet oracle with a Mamba block around the scan.
std::vector<double> mamba_brute_force_window(const ParamSet<double>& ps, const TokenView& x, index_t Tbar) {
  const auto& d = ps.dims();
  const SeqShape s = SeqShape::of(x);
  const index_t T = s.T, E = d.inner(), N = d.state;
  const int K = int(d.layers);
  ParamSet<double> grad(d);
  const auto gg = grad.global();
  std::vector<View2<double>> ys;
  std::vector<MambaActivations<double>> acts;
  for (int k = 0; k <= K; ++k) ys.emplace_back("y", s.rows(), d.width);
  embedding_forward(ps.global().embedding, x, ys[0]);
  for (int k = 0; k < K; ++k) {
    acts.emplace_back(s, d, LayerActivations<double>::with_hprev_and_A);
    mamba_layer_forward(ps.mamba_layer(k), d, s, ys[k], acts[k], ys[k + 1]);
  }
  View2<double> g("g", s.rows(), d.width);
  head_loss<double>(ps.global(), x, ys[K], g, &gg, 1024);
  for (int k = K - 1; k >= 0; --k) {
    const auto& act = acts[k];
    const MambaCotangents<double> cot(s.rows(), d);
    mamba_gate_backward(ps.mamba_layer(k), act, g, cot, grad.mamba_layer(k));
    auto A = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), act.scan.A);
    auto gamma = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), act.scan.gamma);
    auto gs = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), cot.gs);
    View3<double> mu("mu_bf", s.rows(), E, N);
    auto muh = Kokkos::create_mirror_view(mu);
    for (index_t b = 0; b < s.batch; ++b)
      for (index_t i = 0; i < T; ++i)
        for (index_t e = 0; e < E; ++e)
          for (index_t n = 0; n < N; ++n) {
            double acc = 0;
            for (index_t t = i; t < T && t <= i + Tbar - 1; ++t) {
              double prod = 1;
              for (index_t j = i + 1; j <= t; ++j) prod *= A(b * T + j, e, n);
              acc += gs(b * T + t, e) * gamma(b * T + t, n) * prod;
            }
            muh(b * T + i, e, n) = acc;
          }
    Kokkos::deep_copy(mu, muh);
    mamba_mixer_backward(ps.mamba_layer(k), d, s, ys[k], act, mu, cot, grad.mamba_layer(k), View2<double>());
  }
  embedding_backward(x, g, gg.embedding);
  return to_host(grad);
}

}  // namespace

// The detached modes (the stop-gradient-on-the-mixer-input model: g_{k-1} = g_k):
// E2 over the full window (T̄ = 0 and T̄ > T), E3 detached in both h forms and
// several chunks and waves, and E1 detached are one gradient; the window T̄: E2
// truncated equals the brute-force window sum and E3 windowed, and differs from the
// full window (T̄ is not ignored).
using WindowCase = E3Case;  // the same cases' fields (and PrintTo)

class MambaWindow : public ::testing::TestWithParam<WindowCase> {};

TEST_P(MambaWindow, DetachedAndWindowedModesAgree) {
  const auto c = GetParam();
  const auto d = mamba_tiny_dims(c.K, c.K % 2 == 0, c.Kc, 2, c.arch);
  auto ps = fd_model(d, 80 + c.K);  // Δ ~ O(1): the state reaches across T̄ tokens
  auto x = random_tokens(c.batch, c.T, d.vocab, 90 + c.K);
  // documents of 1..7 tokens, one with targets past every T̄ below (else the window is
  // the whole document: a window's last token has no target, so its ∂L/∂s is 0)
  if (c.docs)
    x = with_document_starts(x, c.batch == 2 ? std::vector<index_t>{1, c.T + 4} : std::vector<index_t>{3, 4});
  double l0 = 0;
  const auto e2 = grad_of(engine_options("adjoint"), ps, x, &l0);
  const auto check = [&](const EngineOptions& o, const std::vector<double>& ref, const std::string& what) {
    double l = 0;
    const auto got = grad_of(o, ps, x, &l);
    EXPECT_NEAR(l, l0, 1e-14 * l0) << what;
    expect_close(got, ref, d, 1e-12, what);
  };
  check(engine_options("adjoint", c.T + 3), e2, "E2, T-bar > T");
  EngineOptions e1d = engine_options("backprop");
  e1d.detach_inputs = true;
  check(e1d, e2, "E1 detached");
  const auto exact = grad_of(EngineOptions{}, ps, x);
  EXPECT_GT(rel_l2(exact, e2, 0, index_t(e2.size())), 1e-6) << "detached equals exact: the test would be vacuous";
  for (const index_t Tbar : {index_t(1), index_t(3), index_t(4)}) {
    const std::string tb = "T-bar " + std::to_string(Tbar);
    const auto bf = mamba_brute_force_window(ps, x, Tbar);
    check(engine_options("adjoint", Tbar), bf, "E2 truncated vs brute force, " + tb);
    EXPECT_GT(rel_l2(bf, e2, 0, index_t(e2.size())), 1e-6) << tb << " gives the full window's gradient";
    for (const bool chunked_h : {false, true})
      for (const auto& [chunk, wave] : std::vector<std::pair<index_t, index_t>>{{64, 0}, {2, 4}, {3, 9}}) {
        EngineOptions o = engine_options("adjoint-exact", Tbar, true);
        o.chunk = chunk;
        o.wave = wave;
        o.e3_chunked_h = chunked_h;
        const std::string what = "E3 windowed, " + tb + " (chunk " + std::to_string(chunk) + ", wave " +
                                 std::to_string(wave) + (chunked_h ? ", chunked h)" : ")");
        check(o, bf, what);
        o.truncate = 0;  // detached, exact μ
        check(o, e2,
              "E3 detached (chunk " + std::to_string(chunk) + ", wave " + std::to_string(wave) +
                  (chunked_h ? ", chunked h)" : ")"));
      }
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, MambaWindow,
                         ::testing::Values(WindowCase{1, 2, 9, 4, false}, WindowCase{2, 1, 11, 3, true},
                                           WindowCase{3, 2, 7, 2, true},
                                           WindowCase{2, 1, 11, 3, true, Arch::falcon_mamba}),
                         [](const ::testing::TestParamInfo<WindowCase>& i) {
                           const WindowCase& c = i.param;
                           return (c.arch == Arch::mamba ? "" : arch_name(c.arch) + "_") + "K" + std::to_string(c.K) +
                                  "_B" + std::to_string(c.batch) + "_T" + std::to_string(c.T) + "_Kc" +
                                  std::to_string(c.Kc) + (c.docs ? "_docs" : "");
                         });

template <class S>
class MambaTyped : public ::testing::Test {};
TYPED_TEST_SUITE(MambaTyped, Scalars);

// float against double in the new modes (E2 truncated, E3 detached and windowed).
TYPED_TEST(MambaTyped, DetachedModesAgreeWithDouble) {
  using S = TypeParam;
  for (const Arch arch : {Arch::mamba, Arch::falcon_mamba}) {
    const auto d = mamba_tiny_dims(2, true, 3, 2, arch);
    auto ref = random_model<double>(d, 15);
    const auto x = random_tokens(2, 17, d.vocab, 16);
    for (const auto& o : {engine_options("adjoint"), engine_options("adjoint", 5),
                          engine_options("adjoint-exact", 0, true), engine_options("adjoint-exact", 5, true)}) {
      double lref = 0, l = 0;
      const auto b = grad_of(o, ref, x, &lref);
      const auto a = grad_of(o, cast_model<S>(ref), x, &l);
      EXPECT_NEAR(l, lref, Tol<S>::forward * lref);
      expect_close(a, b, d, Tol<S>::grad_vs_double, arch_name(arch) + ", " + method_name(o.method));
    }
  }
}

TEST(Mamba, EnginesRefuse) {
  const auto d = mamba_tiny_dims(1, true);
  auto ps = random_model<double>(d, 1);
  const auto x = random_tokens(1, 8, d.vocab, 2);
  ParamSet<double> grad(d);
  // The levers and the carried state need E3 (the block-wise engine), as an SSM-ResNet's do.
  EngineOptions o = engine_options("adjoint");
  o.token_block = 4;
  expect_error([&] { make_engine<double>(o); }, "need grad.engine = adjoint-exact");
  o = engine_options("backprop");
  o.carry_state = true;
  expect_error([&] { make_engine<double>(o); }, "need grad.engine = adjoint-exact");
  // A window on the exact gradient stays undefined, as for an SSM-ResNet.
  expect_error([&] { make_engine<double>(engine_options("adjoint-exact", 4, false)); }, "needs grad.detach_inputs");
  // A carried state of the SSM-ResNet's shape ([B·D, N]) is not a Mamba's [B·E, Kc−1+N].
  std::vector<View2<double>> state(1, View2<double>("s", d.width, d.state));
  expect_error([&] { forward_loss(ps, x, 0, state, x, 0); }, "expected [batch·E, Kc-1+N]");
  o = engine_options("adjoint-exact");
  o.carry_state = true;
  auto eng = make_engine<double>(o);
  eng->set_carried_state(&state);
  expect_error([&] { eng->compute(ps, x, grad); }, "expected [batch·E, Kc-1+N]");
}

}  // namespace ash::test
