// model.arch = "mamba" (docs/design.md §1): E1 against central finite differences of
// the forward loss (documents included), float against double, E3 against E1, the
// detached modes against each other and E2's window against a brute-force window sum,
// the checkpoint round trip, the configuration rules, the planner, the refusals, and
// recurrent generation against the full forward. transformers' own model is
// the oracle of python/tests/test_mamba.py; this checks the same code without Python.
#include <algorithm>
#include <sstream>

#include "ash/kernels/row_sums.hpp"
#include "test_helpers.hpp"

namespace ash::test {

namespace {

// random_model, with Δ moved from transformers' 1e-3..0.1 to O(1): the
// gradients through Δ and A are then large enough for central differences to
// resolve (at Δ ~ 0.01 some are ~1e-8, below the differences' noise).
ParamSet<double> fd_model(const ModelDims& d, std::uint64_t seed) {
  auto ps = random_model<double>(d, seed);
  auto v = to_host(ps);
  for (const auto& t : ps.tensors())
    if (t.name.size() > 7 && t.name.substr(t.name.size() - 7) == "dt_bias")
      for (index_t i = 0; i < t.size(); ++i) v[t.offset + i] += 4.5;
  from_host(ps, v);
  return ps;
}

}  // namespace

struct FDCase {
  int K;
  bool tied, docs;
  std::int64_t Kc;
};

class MambaFD : public ::testing::TestWithParam<FDCase> {};

TEST_P(MambaFD, EveryTensorMatchesCentralDifferences) {
  const auto c = GetParam();
  const auto d = mamba_tiny_dims(c.K, c.tied, c.Kc);
  auto ps = fd_model(d, 40 + c.K);
  auto x = random_tokens(2, 9, d.vocab, 50 + c.K);
  // starts at token 3 of window 0 (a document shorter than the conv after it: 3..4) and 5, and 6 of window 1
  if (c.docs) x = with_document_starts(x, {3, 5, 9 + 6});
  // Richardson's extrapolation of central differences at h = 1e-3 and 5e-4 (error
  // O(h⁴)): the gradients through Δ are ~1e-5 of the loss, which a plain central
  // difference resolves to only ~1e-5 (noise at small h, h² at large).
  const auto loss_of = [&](const ParamSet<double>& q) { return forward_loss(q, x); };
  const auto f1 = finite_difference(ps, loss_of, 1e-3), f2 = finite_difference(ps, loss_of, 5e-4);
  std::vector<double> fd(f1.size());
  for (std::size_t i = 0; i < fd.size(); ++i) fd[i] = (4 * f2[i] - f1[i]) / 3;
  for (index_t chunk : {64, 2}) {
    ParamSet<double> grad(d);
    EngineOptions o;
    o.chunk = chunk;
    const double loss = make_engine<double>(o)->compute(ps, x, grad);
    EXPECT_NEAR(loss, forward_loss(ps, x), 1e-13 * loss);
    const auto g = to_host(grad);
    for (const auto& t : grad.tensors()) {
      // 1e-5: dt_proj's gradient is ~1e-6 of the loss, at the differences' resolution
      // (transformers' autograd checks it to 1e-10 in python/tests/test_mamba.py)
      EXPECT_LE(rel_l2(g, fd, t.offset, t.size()), 1e-5) << t.name << " (chunk " << chunk << ")";
      double norm = 0;
      for (index_t i = 0; i < t.size(); ++i) norm += fd[t.offset + i] * fd[t.offset + i];
      EXPECT_GT(norm, 0.0) << t.name << " has an all-zero gradient: the check would be vacuous";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, MambaFD,
                         ::testing::Values(FDCase{1, true, false, 4}, FDCase{2, false, false, 3},
                                           FDCase{2, true, true, 4}, FDCase{3, false, true, 2}));

// The conv's weight and bias gradients are sums over row blocks of impl::reduce_rows
// tokens (two-level, mamba_mixer_backward_dense): a window of several blocks, with
// documents that start just before, at and after block boundaries and a conv reach
// that crosses them, against central differences, for E1 and E3.
TEST(Mamba, ConvGradientOverSeveralRowBlocks) {
  const auto d = mamba_tiny_dims(1, true, 4);
  auto ps = fd_model(d, 77);
  const index_t T = impl::reduce_rows + 22, B = 2;  // rows 0..2·T-1: three blocks
  const index_t rb = impl::reduce_rows;
  auto x = with_document_starts(random_tokens(B, T, d.vocab, 78), {rb - 2, rb + 1, T + 10, 2 * rb, 2 * rb + 2});
  const auto loss_of = [&](const ParamSet<double>& q) { return forward_loss(q, x); };
  const auto f1 = finite_difference(ps, loss_of, 1e-3), f2 = finite_difference(ps, loss_of, 5e-4);
  std::vector<double> fd(f1.size());
  for (std::size_t i = 0; i < fd.size(); ++i) fd[i] = (4 * f2[i] - f1[i]) / 3;
  for (const auto method : {Method::backprop, Method::adjoint_exact}) {
    ParamSet<double> grad(d);
    EngineOptions o;
    o.method = method;
    make_engine<double>(o)->compute(ps, x, grad);
    const auto g = to_host(grad);
    int checked = 0;
    for (const auto& t : grad.tensors())
      if (t.name.find("conv_") != std::string::npos) {
        EXPECT_LE(rel_l2(g, fd, t.offset, t.size()), 1e-6) << t.name << " (" << method_name(method) << ")";
        ++checked;
      }
    EXPECT_EQ(checked, 2);
  }
}

// A document's numbers are those of the document alone: the conv and the scan see
// nothing before a start (the loss of a window of two documents is the
// target-weighted mean of each one's).
TEST(Mamba, DocumentsAreIndependent) {
  const auto d = mamba_tiny_dims(2, true, 4);
  auto ps = random_model<double>(d, 3);
  const auto ids = random_token_ids(12, d.vocab, 4);
  auto x = with_document_starts(make_windows(ids, 1, 12, d.vocab), {7});
  const std::vector<std::uint32_t> a(ids.begin(), ids.begin() + 7), b(ids.begin() + 7, ids.end());
  const double la = forward_loss(ps, make_windows(a, 1, 7, d.vocab));
  const double lb = forward_loss(ps, make_windows(b, 1, 5, d.vocab));
  EXPECT_NEAR(forward_loss(ps, x), (6 * la + 4 * lb) / 10, 1e-13);
}

template <class S>
class MambaTyped : public ::testing::Test {};
TYPED_TEST_SUITE(MambaTyped, Scalars);

TYPED_TEST(MambaTyped, AgreesWithDouble) { expect_agrees_with_double<TypeParam>(mamba_tiny_dims(2, false)); }

TEST(Mamba, LayoutAndTiedHead) {
  for (bool tied : {true, false}) {
    const auto d = mamba_tiny_dims(2, tied, 4, 0);
    ParamSet<float> ps(d);
    EXPECT_EQ(ps.size(), checked_parameter_count(d));
    EXPECT_EQ(d.rank(), 1);  // ceil(4 / 16)
    EXPECT_EQ(ps.tensor("layers/001/in_proj").shape, (std::vector<std::int64_t>{16, 4}));
    EXPECT_EQ(ps.tensor("layers/001/x_proj").shape, (std::vector<std::int64_t>{1 + 6, 8}));
    EXPECT_EQ(ps.tensor("layers/001/conv_weight").shape, (std::vector<std::int64_t>{8, 4}));
    EXPECT_EQ(ps.tensor("layers/000/out_proj").shape, (std::vector<std::int64_t>{4, 8}));
    const auto g = ps.global();
    EXPECT_EQ(g.head.data() == g.embedding.data(), tied);
    EXPECT_EQ(g.norm_eps, d.norm_eps);
    const auto l = ps.mamba_layer(1);  // in_proj's z rows follow its x rows; x_proj's B after Δ, C after B
    EXPECT_EQ(l.in_z.data(), l.in_x.data() + 8 * 4);
    EXPECT_EQ(l.x_B.data(), l.x_dt.data() + 1 * 8);
    EXPECT_EQ(l.x_C.data(), l.x_B.data() + 3 * 8);
    expect_error([&] { (void)ps.layer(0); }, "model.arch=mamba");
  }
}

TEST(Mamba, CheckpointRoundTrip) {
  for (bool tied : {true, false}) {
    const auto d = mamba_tiny_dims(2, tied);
    auto ps = random_model<double>(d, 9);
    const auto path = tmp_path(tied ? "tied.h5" : "untied.h5");
    save_checkpoint(path, config_for(d), ps);
    CheckpointInfo info;
    const auto back = load_checkpoint<double>(path, &info);
    EXPECT_TRUE(info.dims == d);
    EXPECT_EQ(to_host(back), to_host(ps));
    const auto in = inspect_checkpoint(path, Verify::all);
    EXPECT_TRUE(in.dims.mamba());
    bool has_head = false;
    for (const auto& ds : in.datasets) has_head = has_head || ds.path == "/params/head";
    EXPECT_EQ(has_head, !tied);
  }
}

// E3 (grad.engine=adjoint-exact) equals E1 on a Mamba: the same gradient from each
// block's input alone, μ, h^{t-1} and A^t formed wave by wave by E3's scans, in both
// h forms, chunks that split documents and the conv's reach, waves of one chunk to
// the whole window.
struct E3Case {
  int K;
  index_t batch, T;
  std::int64_t Kc;
  bool docs;
};

void PrintTo(const E3Case& c, std::ostream* os) {
  *os << "K=" << c.K << " batch=" << c.batch << " T=" << c.T << " Kc=" << c.Kc << (c.docs ? " docs" : "");
}

class MambaE3 : public ::testing::TestWithParam<E3Case> {};

TEST_P(MambaE3, EqualsBackprop) {
  const auto c = GetParam();
  const auto d = mamba_tiny_dims(c.K, c.K % 2 == 1, c.Kc);
  auto ps = fd_model(d, 60 + c.K);
  auto x = random_tokens(c.batch, c.T, d.vocab, 70 + c.K);
  if (c.docs) x = with_document_starts(x, c.batch == 2 ? std::vector<index_t>{2, 6, c.T + 4} : std::vector<index_t>{3, 4, 8});
  double l1 = 0;
  const auto e1 = grad_of(EngineOptions{}, ps, x, &l1);
  for (const bool chunked_h : {false, true})
    for (const auto& [chunk, wave] : std::vector<std::pair<index_t, index_t>>{{64, 0}, {3, 3}, {2, 4}, {4, 0}}) {
      EngineOptions o = engine_options("adjoint-exact");
      o.chunk = chunk;
      o.wave = wave;
      o.e3_chunked_h = chunked_h;
      double l3 = 0;
      const auto e3 = grad_of(o, ps, x, &l3);
      const std::string what =
          "(chunk " + std::to_string(chunk) + ", wave " + std::to_string(wave) + (chunked_h ? ", chunked h)" : ")");
      EXPECT_NEAR(l3, l1, 1e-14 * l1) << what;
      expect_close(e3, e1, d, 1e-12, what);
    }
}

INSTANTIATE_TEST_SUITE_P(Cases, MambaE3,
                         ::testing::Values(E3Case{1, 1, 9, 4, false}, E3Case{2, 2, 11, 3, true},
                                           E3Case{3, 2, 7, 2, false}, E3Case{2, 1, 13, 4, true},
                                           E3Case{3, 1, 9, 3, true}),
                         [](const ::testing::TestParamInfo<E3Case>& i) {  // a stable name (not the struct's bytes)
                           const E3Case& c = i.param;
                           return "K" + std::to_string(c.K) + "_B" + std::to_string(c.batch) + "_T" +
                                  std::to_string(c.T) + "_Kc" + std::to_string(c.Kc) + (c.docs ? "_docs" : "");
                         });

// The block-wise engine on a Mamba (grad.token_block, docs/design.md §8): token
// blocks of 1 token up to more than Kc−1, blocks shorter than the conv's reach
// (the conv's carry then passes through several blocks), document starts inside
// a block, on a block's first token and within a block's first Kc−1 tokens,
// batch 2, T odd; exact and detached; layer checkpoints m = 1..K+1 and 16-bit
// storage of the kept inputs. The gradient equals the whole window's (E3 in
// one block) to 1e-12 in double, and is the same for every m bit for bit.
struct BlockCase {
  int K;
  index_t batch, T;
  std::int64_t Kc;
  bool docs;
};

void PrintTo(const BlockCase& c, std::ostream* os) {
  *os << "K=" << c.K << " batch=" << c.batch << " T=" << c.T << " Kc=" << c.Kc << (c.docs ? " docs" : "");
}

class MambaBlockwise : public ::testing::TestWithParam<BlockCase> {};

TEST_P(MambaBlockwise, EqualsWholeWindow) {
  const auto c = GetParam();
  const auto d = mamba_tiny_dims(c.K, c.K % 2 == 0, c.Kc);
  auto ps = fd_model(d, 80 + c.K);
  auto x = random_tokens(c.batch, c.T, d.vocab, 90 + c.K);
  // Starts on block boundaries and inside a block's first Kc−1 tokens for the block lengths below.
  if (c.docs)
    x = with_document_starts(x, c.batch == 2 ? std::vector<index_t>{3, 6, c.T + 1, c.T + 5, std::min<index_t>(c.T + 8, 2 * c.T - 1)}
                                    : std::vector<index_t>{2, 5, 9});
  for (const bool detach : {false, true})
    for (const index_t chunk : {1, 2}) {
      EngineOptions whole = engine_options("adjoint-exact", 0, detach);
      whole.chunk = chunk;
      double lw = 0;
      const auto gw = grad_of(whole, ps, x, &lw);
      for (const index_t tb : {1, 2, 3, 5}) {
        std::vector<double> g_m1;
        for (int m = 1; m <= c.K + 1; ++m) {
          EngineOptions o = whole;
          o.token_block = tb;
          o.layer_checkpoint = m;
          double lb = 0;
          const auto gb = grad_of(o, ps, x, &lb);
          const std::string what = std::string(detach ? "detached" : "exact") + ", chunk " + std::to_string(chunk) +
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

INSTANTIATE_TEST_SUITE_P(Cases, MambaBlockwise,
                         ::testing::Values(BlockCase{2, 2, 13, 4, true}, BlockCase{1, 1, 11, 3, false},
                                           BlockCase{2, 1, 9, 2, true}, BlockCase{3, 2, 7, 3, true},
                                           BlockCase{1, 2, 11, 4, false}),
                         [](const ::testing::TestParamInfo<BlockCase>& i) {
                           const BlockCase& c = i.param;
                           return "K" + std::to_string(c.K) + "_B" + std::to_string(c.batch) + "_T" +
                                  std::to_string(c.T) + "_Kc" + std::to_string(c.Kc) + (c.docs ? "_docs" : "");
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
  const auto d = mamba_tiny_dims(c.K, c.K % 2 == 0, c.Kc);
  auto ps = fd_model(d, 80 + c.K);  // Δ ~ O(1): the state reaches across T̄ tokens
  auto x = random_tokens(c.batch, c.T, d.vocab, 90 + c.K);
  // documents of 1..7 tokens, one with targets past every T̄ below (else the window is
  // the whole document: a window's last token has no target, so its ∂L/∂s is 0)
  if (c.docs) x = with_document_starts(x, c.batch == 2 ? std::vector<index_t>{1, c.T + 4} : std::vector<index_t>{3, 4});
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
        check(o, e2, "E3 detached (chunk " + std::to_string(chunk) + ", wave " + std::to_string(wave) +
                         (chunked_h ? ", chunked h)" : ")"));
      }
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, MambaWindow,
                         ::testing::Values(WindowCase{1, 2, 9, 4, false}, WindowCase{2, 1, 11, 3, true},
                                           WindowCase{3, 2, 7, 2, true}),
                         [](const ::testing::TestParamInfo<WindowCase>& i) {
                           const WindowCase& c = i.param;
                           return "K" + std::to_string(c.K) + "_B" + std::to_string(c.batch) + "_T" +
                                  std::to_string(c.T) + "_Kc" + std::to_string(c.Kc) + (c.docs ? "_docs" : "");
                         });

// float against double in the new modes (E2 truncated, E3 detached and windowed).
TYPED_TEST(MambaTyped, DetachedModesAgreeWithDouble) {
  using S = TypeParam;
  const auto d = mamba_tiny_dims(2, true);
  auto ref = random_model<double>(d, 15);
  const auto x = random_tokens(2, 17, d.vocab, 16);
  for (const auto& o : {engine_options("adjoint"), engine_options("adjoint", 5), engine_options("adjoint-exact", 0, true),
                        engine_options("adjoint-exact", 5, true)}) {
    double lref = 0, l = 0;
    const auto b = grad_of(o, ref, x, &lref);
    const auto a = grad_of(o, cast_model<S>(ref), x, &l);
    EXPECT_NEAR(l, lref, Tol<S>::forward * lref);
    expect_close(a, b, d, Tol<S>::grad_vs_double, method_name(o.method));
  }
}

TEST(Mamba, Configuration) {
  Config ssm;
  EXPECT_FALSE(ssm.stored_json()["model"].contains("arch"));  // an SSM-ResNet's files are as before
  EXPECT_FALSE(ssm.stored_json()["model"].contains("expand"));
  EXPECT_TRUE(ssm.json()["model"].contains("arch"));
  Config m;
  m.set("model.arch=mamba");
  EXPECT_EQ(m.stored_json()["model"]["arch"], "mamba");
  EXPECT_TRUE(m.stored_json()["model"].contains("norm_eps"));
  EXPECT_TRUE(m.settings().model.mamba());
  for (const char* k : {"model.expand=3", "model.conv_kernel=2", "model.dt_rank=1", "model.tie_embeddings=false",
                        "model.norm_eps=1e-6"}) {
    Config c;
    c.set(k);
    expect_error([&] { c.validate(); }, "apply to model.arch=mamba only");
  }
  Config bad;
  bad.set("model.arch=transformer");
  expect_error([&] { bad.validate(); }, "model.arch must be ssm-resnet or mamba");
  for (const char* k : {"model.expand=0", "model.conv_kernel=0", "model.dt_rank=-1", "model.norm_eps=0"}) {
    Config c = m;
    c.set(k);
    expect_error([&] { c.validate(); }, std::string(k).substr(0, std::string(k).find('=')));
  }
  // E2 and E3's detached and windowed modes run, on data and layer ranks too, E3's
  // levers and the carried state in one process and on every layout, a window
  // on sequence ranks too: every setting builds (nothing is refused for a Mamba).
  for (const std::string set : {"grad.engine=adjoint", "grad.detach_inputs=true", "grad.truncate=4", "run.storage=bf16",
                                "run.storage=fp16", "grad.layer_checkpoint=2", "grad.token_block=8",
                                "dist.layer_ranks=2", "dist.data_ranks=2", "data.carry_state=true", "dist.seq_ranks=2",
                                "dist.seq_ranks=2 grad.detach_inputs=true run.storage=bf16 grad.token_block=8",
                                "dist.seq_ranks=2 dist.layer_ranks=2 grad.layer_checkpoint=2",
                                "dist.layer_ranks=2 data.sequential=true data.carry_state=true",
                                "dist.data_ranks=2 data.sequential=true data.carry_state=true run.storage=bf16",
                                "dist.seq_ranks=2 data.sequential=true data.carry_state=true grad.token_block=8",
                                "dist.seq_ranks=2 grad.detach_inputs=true grad.truncate=4",
                                "dist.seq_ranks=2 grad.detach_inputs=true grad.truncate=4 run.storage=bf16",
                                "dist.seq_ranks=2 grad.detach_inputs=true grad.truncate=4 data.sequential=true "
                                "data.carry_state=true"}) {
    Config c = m;
    std::istringstream words(set);
    for (std::string w; words >> w;) c.set(w);
    if (set == "grad.truncate=4") c.set("grad.engine=adjoint");
    if (set.find("dist.") != std::string::npos) c.set("model.layers=2");
    if (set == "data.carry_state=true") c.set("data.sequential=true");
    EXPECT_NO_THROW(c.settings()) << set;
    if (std::string(set).rfind("dist", 0) == 0 || std::string(set).rfind("data", 0) == 0) continue;
    for (const char* ranks : {"dist.layer_ranks=2", "dist.data_ranks=2"}) {  // the same on several ranks
      Config r = c;
      r.set("model.layers=2");
      r.set(ranks);
      EXPECT_NO_THROW(r.settings()) << set << " " << ranks;
    }
  }
}

// The planner's Mamba E1 and E3 (ash plan, check_memory) against the measured Kokkos peak, within 10 %.
TEST(Mamba, PlanMatchesMeasuredPeak) {
  for (const std::string engine : {"grad.engine=backprop", "grad.engine=adjoint-exact", "grad.engine=adjoint",
                                   "grad.engine=adjoint grad.truncate=16", "grad.engine=backprop grad.detach_inputs=true",
                                   "grad.engine=adjoint-exact grad.detach_inputs=true",
                                   "grad.engine=adjoint-exact grad.detach_inputs=true grad.truncate=16",
                                   "grad.engine=adjoint-exact grad.token_block=128",
                                   "grad.engine=adjoint-exact grad.token_block=96 grad.layer_checkpoint=2 run.storage=bf16",
                                   "grad.engine=adjoint-exact grad.detach_inputs=true grad.token_block=64 "
                                   "grad.layer_checkpoint=3",
                                   "grad.engine=adjoint-exact data.sequential=true data.carry_state=true",
                                   "grad.engine=adjoint-exact grad.token_block=96 run.storage=bf16 "
                                   "data.sequential=true data.carry_state=true"})
  for (const char* T : {"data.seq_len=512", "data.seq_len=200"}) {
    Config c = config_for(mamba_tiny_dims(2, false, 4, 0));
    for (const std::string s : std::vector<std::string>{"model.vocab=64", "model.width=16", "model.state=8",
                                                        "data.batch=2", "grad.chunk=32", "grad.wave=64", T})
      c.set(s);
    for (std::size_t a = 0, b; a < engine.size(); a = b + 1) {  // the engine's keys, space-separated
      b = engine.find(' ', a);
      if (b == std::string::npos) b = engine.size();
      c.set(engine.substr(a, b - a));
    }
    const Settings st = c.settings();
    const std::string sp = MemSpace::name();
    const auto base = MemoryTracker::current(sp);
    MemoryTracker::reset_peak();
    {
      ParamSet<double> ps(st.model);
      initialize(ps, 1);
      ParamSet<double> g(st.model);
      const auto x = random_tokens(st.data.batch, st.data.seq_len, st.model.vocab, 5);
      auto engine = make_engine<double>(st.grad);
      std::vector<View2<double>> carried;  // data.carry_state: as ash train holds it
      for (index_t k = 0; st.grad.carry_state && k < st.model.layers; ++k)
        carried.emplace_back("carried", st.data.batch * st.model.carry_rows(), st.model.carry_cols());
      if (st.grad.carry_state) engine->set_carried_state(&carried);
      engine->compute(ps, x, g);
      Kokkos::fence();
    }
    const double measured = double(MemoryTracker::peak(sp) - base);
    const double planned = plan_memory(st, Workload::grad, 8).total();
    std::printf("  plan/measured %.3f (%s, %s)\n", planned / measured, engine.c_str(), T);
    EXPECT_LE(std::fabs(planned - measured), 0.10 * measured)
        << engine << ", " << T << ": planned " << planned << ", measured " << measured;
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

namespace {

// Logits [T, V] of every position of one window by the full forward (no state).
std::vector<std::vector<double>> full_logits(const ParamSet<double>& ps, const TokenView& x) {
  const auto& d = ps.dims();
  const SeqShape s = SeqShape::of(x);
  View2<double> y("y", s.rows(), d.width), y_next("y_next", s.rows(), d.width);
  embedding_forward(ps.global().embedding, x, y);
  const MambaActivations<double> act(s, d, LayerActivations<double>::projections_only);
  for (int k = 0; k < d.layers; ++k) {
    mamba_layer_forward(ps.mamba_layer(k), d, s, y, act, y_next);
    std::swap(y, y_next);
  }
  View2<double> logits("logits", s.rows(), d.vocab);
  head_logits(ps.global(), y, logits);
  const auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), logits);
  std::vector<std::vector<double>> out(s.rows());
  for (index_t m = 0; m < s.rows(); ++m)
    for (index_t v = 0; v < d.vocab; ++v) out[m].push_back(h(m, v));
  return out;
}

}  // namespace

// Recurrent generation (docs/design.md §1, "The recurrent step"): the Generator's
// logits after each token equal the full forward's at that position, fed one token
// at a time and in pieces of 2, 5 and 3 tokens (pieces shorter than Kc - 1 read the
// conv state's older columns), with documents starting at a piece's first token,
// inside one, and one token before a piece ends (the conv state keeps only the new
// document's tokens).
TEST(Mamba, GeneratorStepMatchesFullForward) {
  struct Case {
    std::int64_t Kc;
    bool tied, docs;
  };
  for (const auto c : {Case{4, true, false}, Case{4, false, true}, Case{3, true, true}, Case{1, false, true}}) {
    const auto d = mamba_tiny_dims(2, c.tied, c.Kc);
    auto ps = random_model<double>(d, 11 + c.Kc);
    const index_t T = 23;
    const auto ids = random_token_ids(T, d.vocab, 12);
    std::vector<std::uint8_t> flags(T, 0);
    std::vector<index_t> starts;
    if (c.docs)
      for (index_t t : {index_t(7), index_t(11), index_t(15), index_t(16)}) {
        flags[std::size_t(t)] = 1;
        starts.push_back(t);
      }
    const auto ref = full_logits(ps, with_document_starts(make_windows(ids, 1, T, d.vocab), starts));
    for (const auto& pieces : {std::vector<index_t>(T, 1), std::vector<index_t>{2, 5, 3, 1, 2, 4, 1, 5}}) {
      Generator<double> gen(ps);
      index_t t0 = 0;
      double worst = 0, scale = 0;
      for (const index_t n : pieces) {
        const std::vector<std::uint32_t> tok(ids.begin() + t0, ids.begin() + t0 + n);
        const std::vector<std::uint8_t> fl(flags.begin() + t0, flags.begin() + t0 + n);
        gen.feed(tok, &fl);
        t0 += n;
        for (index_t v = 0; v < d.vocab; ++v) {  // the logits after the piece's last token
          worst = std::max(worst, std::fabs(gen.logits()[v] - ref[t0 - 1][v]));
          scale = std::max(scale, std::fabs(ref[t0 - 1][v]));
        }
      }
      ASSERT_EQ(t0, T);
      EXPECT_GT(scale, 0.1);
      EXPECT_LE(worst, 1e-12 * scale) << "Kc " << c.Kc << (c.docs ? " with documents" : "") << ", "
                                      << pieces.size() << " pieces";
    }
  }
  // Greedy sampling feeds the argmax back: the same as the full forward over the
  // sequence so far.
  const auto d = mamba_tiny_dims(2, true, 4);
  auto ps = random_model<double>(d, 21);
  std::vector<std::uint32_t> seq{3, 1, 4, 1, 5};
  Generator<double> gen(ps);
  gen.feed(seq);
  std::mt19937_64 rng(1);
  for (int i = 0; i < 6; ++i) {
    const auto ref = full_logits(ps, make_windows(seq, 1, index_t(seq.size()), d.vocab)).back();
    const auto best = std::uint32_t(std::max_element(ref.begin(), ref.end()) - ref.begin());
    EXPECT_EQ(gen.sample(0.0, rng), best);
    seq.push_back(best);
  }
}


// data.carry_state on a Mamba (docs/design.md §8): one [B·E, Kc−1+N] view per layer,
// row b·E + e the conv's last Kc−1 inputs x, then h.
namespace {

std::vector<View2<double>> carried_state(const ModelDims& d, index_t B) {
  std::vector<View2<double>> st;
  for (int k = 0; k < d.layers; ++k) st.emplace_back("carried", B * d.carry_rows(), d.carry_cols());
  return st;
}

std::vector<View2<double>> copy_of(const std::vector<View2<double>>& src) {
  std::vector<View2<double>> c;
  for (const auto& v : src) {
    c.emplace_back("carried_copy", v.extent(0), v.extent(1));
    Kokkos::deep_copy(c.back(), v);
  }
  return c;
}

// max |a - b| over every layer's state, and max |b|.
std::pair<double, double> state_diff(const std::vector<View2<double>>& a, const std::vector<View2<double>>& b) {
  double diff = 0, ref = 0;
  for (std::size_t k = 0; k < a.size(); ++k) {
    auto ha = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), a[k]);
    auto hb = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), b[k]);
    for (std::size_t i = 0; i < ha.extent(0); ++i)
      for (std::size_t j = 0; j < ha.extent(1); ++j) {
        diff = std::max(diff, std::fabs(ha(i, j) - hb(i, j)));
        ref = std::max(ref, std::fabs(hb(i, j)));
      }
  }
  return {diff, ref};
}

// The conv part (columns 0..Kc−2) of every layer's carried state set to zero.
void zero_conv_part(const std::vector<View2<double>>& st, const ModelDims& d) {
  for (const auto& v : st)
    Kokkos::deep_copy(Kokkos::subview(v, Kokkos::ALL(), Kokkos::make_pair(index_t(0), index_t(d.conv_kernel - 1))),
                      0.0);
}

EngineOptions carry_options(index_t token_block = 0, index_t m = 1, Storage storage = Storage::full) {
  EngineOptions o = engine_options("adjoint-exact");
  o.chunk = 2;
  o.carry_state = true;
  o.token_block = token_block;
  o.layer_checkpoint = m;
  o.storage = storage;
  return o;
}

}  // namespace

// A window of 2T tokens in one pass equals two windows of T with the state
// carried: every layer's output rows, the losses (the eval stream's rule: the
// first window's head also scores token T), the state after each window, and
// the engine's losses and end states; a document start on the second window's
// first token (row 1: its state is dropped) and on its third (row 0: the first
// two tokens read the carried state, within the conv's reach for Kc = 4).
TEST(MambaCarry, TwoWindowsEqualOneLongWindow) {
  for (const std::int64_t Kc : {2, 4}) {
    SCOPED_TRACE("Kc " + std::to_string(Kc));
    const auto d = mamba_tiny_dims(2, false, Kc);
    const auto ps = fd_model(d, 101 + Kc);
    const index_t B = 2, T = 11;
    const auto x = with_document_starts(random_tokens(B, 2 * T, d.vocab, 102), {T + 2, 2 * T + T});
    const TokenView x1 = token_block(x, 0, T), x2 = token_block(x, T, T), xh1 = token_block(x, 0, T + 1);
    // Every layer's output rows: whole window against the two halves carried.
    {
      View2<double> yw("yw", B * 2 * T, d.width), ywn("ywn", B * 2 * T, d.width);
      View2<double> y1("y1", B * T, d.width), y1n("y1n", B * T, d.width), y2("y2", B * T, d.width),
          y2n("y2n", B * T, d.width);
      embedding_forward(ps.global().embedding, x, yw);
      embedding_forward(ps.global().embedding, x1, y1);
      embedding_forward(ps.global().embedding, x2, y2);
      const MambaActivations<double> aw(SeqShape::of(x), d, LayerActivations<double>::projections_only),
          ah(SeqShape::of(x1), d, LayerActivations<double>::projections_only);
      for (int k = 0; k < d.layers; ++k) {
        mamba_layer_forward(ps.mamba_layer(k), d, SeqShape::of(x), yw, aw, ywn);
        const MambaState<double> st(B, d);
        mamba_layer_forward(ps.mamba_layer(k), d, SeqShape::of(x1), y1, ah, y1n, st);
        mamba_layer_forward(ps.mamba_layer(k), d, SeqShape::of(x2), y2, ah, y2n, st);
        std::swap(yw, ywn);
        std::swap(y1, y1n);
        std::swap(y2, y2n);
        auto hw = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), yw);
        auto h1 = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), y1);
        auto h2 = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), y2);
        double diff = 0, ref = 0;
        for (index_t b = 0; b < B; ++b)
          for (index_t t = 0; t < 2 * T; ++t)
            for (index_t p = 0; p < d.width; ++p) {
              const double w = hw(b * 2 * T + t, p), h = t < T ? h1(b * T + t, p) : h2(b * T + t - T, p);
              diff = std::max(diff, std::fabs(w - h));
              ref = std::max(ref, std::fabs(w));
            }
        EXPECT_LE(diff, 1e-12 * ref) << "layer " << k << " output";
      }
    }
    // Losses and states through forward_loss's carried form.
    auto whole = carried_state(d, B);
    const double lw = forward_loss(ps, x, 1024, whole, x, 0);
    EXPECT_NEAR(lw, forward_loss(ps, x), 1e-14 * lw);
    auto st = carried_state(d, B);
    const index_t n1 = target_count(xh1), n2 = target_count(x2), nw = target_count(x);
    ASSERT_EQ(n1 + n2, nw);
    const double l1 = forward_loss(ps, x1, 1024, st, xh1, n1);
    const auto after1 = copy_of(st);
    const double l2 = forward_loss(ps, x2, 1024, st, x2, n2);
    EXPECT_NEAR((l1 * double(n1) + l2 * double(n2)) / double(nw), lw, 1e-12 * lw);
    const auto [ds, rs] = state_diff(st, whole);
    EXPECT_GT(rs, 0.0);
    EXPECT_LE(ds, 1e-12 * rs) << "the state after the two windows";
    // The block-wise engine: the same losses (each window's own targets) and states.
    auto es = carried_state(d, B);
    auto eng = make_engine<double>(carry_options());
    eng->set_carried_state(&es);
    ParamSet<double> g(d);
    const double e1 = eng->compute(ps, x1, g);
    auto zero = carried_state(d, B);
    EXPECT_NEAR(e1, forward_loss(ps, x1, 1024, zero, x1, 0), 1e-12 * e1);
    EXPECT_LE(state_diff(es, after1).first, 1e-12 * state_diff(es, after1).second);
    const double e2 = eng->compute(ps, x2, g);
    EXPECT_NEAR(e2, l2, 1e-12 * l2);
    EXPECT_LE(state_diff(es, whole).first, 1e-12 * rs) << "the engine's state after the two windows";
    // The conv state matters: without it the second window's loss differs.
    auto noconv = copy_of(after1);
    zero_conv_part(noconv, d);
    EXPECT_GT(std::fabs(forward_loss(ps, x2, 1024, noconv, x2, n2) - l2), 1e-6 * l2);
  }
}

// ash eval's stream (evaluate_stream with the state carried) over a Mamba equals
// the forward of the whole sequence in one window, documents included.
TEST(MambaCarry, EvalStreamEqualsOneLongWindow) {
  const auto d = mamba_tiny_dims(3, true, 4);
  const auto ps = fd_model(d, 111);
  const index_t n = 61;
  const auto ids = random_token_ids(n, d.vocab, 112);
  std::vector<std::uint8_t> starts(std::size_t(n), 0);
  starts[20] = starts[33] = 1;  // on a window's first token (T = 10 below: 20), and inside one
  const auto x = make_windows(ids, 1, n, d.vocab, 0, &starts);
  const double whole = forward_loss(ps, x, 1024);
  const auto tot = evaluate_stream(ps, ids, 10, 1024, true, &starts);
  EXPECT_EQ(tot.targets, target_count(x));
  EXPECT_NEAR(tot.nats / double(tot.targets), whole, 1e-12 * whole);
  const auto cut = evaluate_stream(ps, ids, 10, 1024, false, &starts);  // without the state: another number
  EXPECT_GT(std::fabs(cut.nats / double(cut.targets) - whole), 1e-6 * whole);
}

// The gradient with a carried state (of the conv and h) is that of L(θ) with the
// state a constant: central differences (Richardson) of the carried forward loss.
// With the conv part of the state zeroed the gradient is another one.
TEST(MambaCarry, GradientMatchesFiniteDifferences) {
  const auto d = mamba_tiny_dims(2, false, 3);
  const auto ps = fd_model(d, 121);
  const index_t B = 2, T = 9;
  const auto x = with_document_starts(random_tokens(B, 2 * T, d.vocab, 122), {2 * T + T + 1});
  const TokenView x1 = token_block(x, 0, T), x2 = token_block(x, T, T);
  auto h0 = carried_state(d, B);
  forward_loss(ps, x1, 1024, h0, x1, 0);  // the state after the first window
  const auto loss_of = [&](const ParamSet<double>& q) {
    auto st = copy_of(h0);
    return forward_loss(q, x2, 1024, st, x2, 0);
  };
  const auto f1 = finite_difference(ps, loss_of, 1e-3), f2 = finite_difference(ps, loss_of, 5e-4);
  std::vector<double> fd(f1.size());
  for (std::size_t i = 0; i < fd.size(); ++i) fd[i] = (4 * f2[i] - f1[i]) / 3;
  auto st = copy_of(h0);
  auto eng = make_engine<double>(carry_options());
  eng->set_carried_state(&st);
  ParamSet<double> grad(d);
  const double loss = eng->compute(ps, x2, grad);
  EXPECT_NEAR(loss, loss_of(ps), 1e-13 * loss);
  const auto g = to_host(grad);
  for (const auto& t : grad.tensors()) EXPECT_LE(rel_l2(g, fd, t.offset, t.size()), 1e-5) << t.name;
  auto noconv = copy_of(h0);
  zero_conv_part(noconv, d);
  auto eng0 = make_engine<double>(carry_options());
  eng0->set_carried_state(&noconv);
  ParamSet<double> g0(d);
  eng0->compute(ps, x2, g0);
  EXPECT_GT(rel_l2(to_host(g0), g), 1e-4) << "the conv state changes nothing: the check would be vacuous";
}

// The memory levers with a carried state: token blocks (shorter and longer than
// the conv's reach), layer checkpoints and 16-bit storage give the whole-window
// carried run's loss, gradient and end state (1e-12 in double; bf16 within its
// rounding, test_low_memory.cpp's tolerances).
TEST(MambaCarry, LeversEqualTheWholeWindowCarriedRun) {
  const auto d = mamba_tiny_dims(3, true, 4);
  const auto ps = fd_model(d, 131);
  const index_t B = 2, T = 13;
  const auto x = with_document_starts(random_tokens(B, 2 * T, d.vocab, 132), {T + 2, 2 * T + 5});
  const TokenView x1 = token_block(x, 0, T), x2 = token_block(x, T, T);
  auto h0 = carried_state(d, B);
  forward_loss(ps, x1, 1024, h0, x1, 0);
  const auto run = [&](const EngineOptions& o, double* loss, std::vector<View2<double>>* end) {
    auto st = copy_of(h0);
    auto eng = make_engine<double>(o);
    eng->set_carried_state(&st);
    ParamSet<double> g(d);
    *loss = eng->compute(ps, x2, g);
    *end = st;
    return to_host(g);
  };
  double lw = 0;
  std::vector<View2<double>> sw;
  const auto gw = run(carry_options(), &lw, &sw);
  for (const index_t tb : {1, 2, 3, 5})
    for (int m = 1; m <= 4; m += 3) {
      const std::string what = "token_block " + std::to_string(tb) + ", m " + std::to_string(m);
      double l = 0;
      std::vector<View2<double>> s;
      const auto g = run(carry_options(tb, m), &l, &s);
      EXPECT_NEAR(l, lw, 1e-13 * lw) << what;
      expect_close(g, gw, d, 1e-12, what);
      EXPECT_LE(state_diff(s, sw).first, 1e-12 * state_diff(s, sw).second) << what;
    }
  double lb = 0;
  std::vector<View2<double>> sb;
  const auto gb = run(carry_options(4, 2, Storage::bf16), &lb, &sb);
  EXPECT_NE(gb, gw);  // the storage is really rounded
  for (const auto& t : param_layout(d)) {
    EXPECT_GE(cosine(gb, gw, t.offset, t.size()), 0.999) << t.name;
    EXPECT_LE(rel_l2(gb, gw, t.offset, t.size()), 2e-2) << t.name;
  }
  EXPECT_NEAR(lb, lw, 1e-2 * lw);
  EXPECT_LE(state_diff(sb, sw).first, 1e-12 * state_diff(sb, sw).second) << "the forward runs in double";
}

}  // namespace ash::test
