// model.arch = "mamba2" (docs/design.md §1, the SSD block of transformers'
// Mamba2ForCausalLM with n_groups = 1): every tensor's gradient against central
// finite differences of the forward loss (documents, tied and untied, a clamped
// Δ), E3 exact, detached and windowed against E1 and E2, the block-wise engine's
// levers against the whole window, a carried state against one long window, the
// recurrent generator against the full forward, float against double, and the
// configurations it refuses. transformers' own model is the oracle of
// python/tests/test_mamba2.py.
#include <algorithm>

#include "test_helpers.hpp"

namespace ash::test {

namespace {

// Richardson's extrapolation of central differences at h = 1e-3 and 5e-4 (error O(h⁴)).
template <class F>
std::vector<double> richardson(const ParamSet<double>& ps, const F& loss_of) {
  const auto f1 = finite_difference(ps, loss_of, 1e-3), f2 = finite_difference(ps, loss_of, 5e-4);
  std::vector<double> fd(f1.size());
  for (std::size_t i = 0; i < fd.size(); ++i) fd[i] = (4 * f2[i] - f1[i]) / 3;
  return fd;
}

}  // namespace

struct FD2Case {
  int K;
  bool tied, docs;
  std::int64_t Kc;
  double dt_max;  // model.time_step_limit_max (0: none)
  std::int64_t groups = 1;
};

void PrintTo(const FD2Case& c, std::ostream* os) {
  *os << "K=" << c.K << (c.tied ? " tied" : " untied") << (c.docs ? " docs" : "") << " Kc=" << c.Kc
      << " dt_max=" << c.dt_max << " groups=" << c.groups;
}

class Mamba2FD : public ::testing::TestWithParam<FD2Case> {};

// E1 and E3 against central differences, every tensor to 1e-5 relative L2 (the
// gradients through Δ are ~1e-5 of the loss: the differences' resolution).
TEST_P(Mamba2FD, EveryTensorMatchesCentralDifferences) {
  const auto c = GetParam();
  ModelDims d = mamba2_tiny_dims(c.K, c.tied, c.Kc, c.groups);
  d.time_step_limit_max = c.dt_max;
  auto ps = fd_model(d, 40 + c.K);
  auto x = random_tokens(2, 9, d.vocab, 50 + c.K);
  if (c.docs) x = with_document_starts(x, {3, 5, 9 + 6});
  const auto fd = richardson(ps, [&](const ParamSet<double>& q) { return forward_loss(q, x); });
  for (const auto method : {Method::backprop, Method::adjoint_exact}) {
    ParamSet<double> grad(d);
    EngineOptions o;
    o.method = method;
    o.chunk = 2;
    const double loss = make_engine<double>(o)->compute(ps, x, grad);
    EXPECT_NEAR(loss, forward_loss(ps, x), 1e-13 * loss);
    const auto g = to_host(grad);
    for (const auto& t : grad.tensors()) {
      EXPECT_LE(rel_l2(g, fd, t.offset, t.size()), 1e-5) << t.name << " (" << method_name(method) << ")";
      double norm = 0;
      for (index_t i = 0; i < t.size(); ++i) norm += fd[t.offset + i] * fd[t.offset + i];
      EXPECT_GT(norm, 0.0) << t.name << " has an all-zero gradient: the check would be vacuous";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, Mamba2FD,
                         ::testing::Values(FD2Case{1, true, false, 4, 0}, FD2Case{2, false, true, 3, 0},
                                           FD2Case{2, true, true, 2, 0.5}, FD2Case{2, false, true, 3, 0, 2},
                                           FD2Case{1, true, false, 4, 0, 4}),
                         [](const ::testing::TestParamInfo<FD2Case>& i) {
                           const FD2Case& c = i.param;
                           return "K" + std::to_string(c.K) + (c.tied ? "_tied" : "") + (c.docs ? "_docs" : "") +
                                  "_Kc" + std::to_string(c.Kc) + (c.dt_max > 0 ? "_clamped" : "") +
                                  (c.groups > 1 ? "_G" + std::to_string(c.groups) : "");
                         });

// A limit on Δ: where softplus exceeds it, Δ is the limit and its gradient is 0
// (the clamped case above sees some of each: checked here so it is not vacuous).
TEST(Mamba2, TimeStepLimitClampsSomeTokens) {
  ModelDims d = mamba2_tiny_dims(2, true, 2);
  auto ps = fd_model(d, 42);
  const auto x = random_tokens(2, 9, d.vocab, 52);
  const double free_loss = forward_loss(ps, x);
  d.time_step_limit_max = 0.5;
  ParamSet<double> clamped(d);
  from_host(clamped, to_host(ps));
  EXPECT_GT(std::fabs(forward_loss(clamped, x) - free_loss), 1e-9 * free_loss) << "the limit clamps nothing";
  d.time_step_limit_max = 1e6;
  ParamSet<double> loose(d);
  from_host(loose, to_host(ps));
  EXPECT_EQ(forward_loss(loose, x), free_loss) << "a limit above every Δ changes the loss";
}

struct Engine2Case {
  int K;
  index_t batch, T;
  std::int64_t Kc;
  bool docs;
  std::int64_t groups = 1;
};

void PrintTo(const Engine2Case& c, std::ostream* os) {
  *os << "K=" << c.K << " batch=" << c.batch << " T=" << c.T << " Kc=" << c.Kc << (c.docs ? " docs" : "")
      << " groups=" << c.groups;
}

class Mamba2Engines : public ::testing::TestWithParam<Engine2Case> {};

// E3 (exact, both h forms, several chunks and waves) equals E1; the detached
// modes (E1 detached, E2 full, E3 detached) agree, and E3 windowed equals E2
// truncated; the block-wise engine (token blocks shorter and longer than the
// conv's reach, layer checkpoints, exact and detached) equals the whole window.
TEST_P(Mamba2Engines, AgreeWithEachOther) {
  const auto c = GetParam();
  const auto d = mamba2_tiny_dims(c.K, c.K % 2 == 1, c.Kc, c.groups);
  auto ps = fd_model(d, 60 + c.K);
  auto x = random_tokens(c.batch, c.T, d.vocab, 70 + c.K);
  if (c.docs)
    x = with_document_starts(x, c.batch == 2 ? std::vector<index_t>{2, 6, c.T + 4} : std::vector<index_t>{4, 5});
  double l1 = 0;
  const auto e1 = grad_of(EngineOptions{}, ps, x, &l1);
  for (const bool chunked_h : {false, true})
    for (const auto& [chunk, wave] : std::vector<std::pair<index_t, index_t>>{{64, 0}, {3, 3}, {2, 4}}) {
      EngineOptions o = engine_options("adjoint-exact");
      o.chunk = chunk;
      o.wave = wave;
      o.e3_chunked_h = chunked_h;
      double l3 = 0;
      const auto e3 = grad_of(o, ps, x, &l3);
      const std::string what =
          "E3 (chunk " + std::to_string(chunk) + ", wave " + std::to_string(wave) + (chunked_h ? ", chunked h)" : ")");
      EXPECT_NEAR(l3, l1, 1e-14 * l1) << what;
      expect_close(e3, e1, d, 1e-12, what);
    }
  // The detached modes and the window.
  const auto e2 = grad_of(engine_options("adjoint"), ps, x);
  EngineOptions e1d = engine_options("backprop");
  e1d.detach_inputs = true;
  expect_close(grad_of(e1d, ps, x), e2, d, 1e-12, "E1 detached vs E2");
  expect_close(grad_of(engine_options("adjoint-exact", 0, true), ps, x), e2, d, 1e-12, "E3 detached vs E2");
  EXPECT_GT(rel_l2(e1, e2, 0, index_t(e2.size())), 1e-6) << "detached equals exact: the check would be vacuous";
  const auto e2t = grad_of(engine_options("adjoint", 2), ps, x);
  EXPECT_GT(rel_l2(e2t, e2, 0, index_t(e2.size())), 1e-6) << "T-bar 2 gives the full window's gradient";
  expect_close(grad_of(engine_options("adjoint-exact", 2, true), ps, x), e2t, d, 1e-12, "E3 windowed vs E2 T-bar 2");
  // The block-wise engine.
  for (const bool detach : {false, true}) {
    EngineOptions whole = engine_options("adjoint-exact", 0, detach);
    whole.chunk = 2;
    double lw = 0;
    const auto gw = grad_of(whole, ps, x, &lw);
    for (const index_t tb : {1, 2, 5})
      for (int m = 1; m <= c.K + 1; m += c.K) {
        EngineOptions o = whole;
        o.token_block = tb;
        o.layer_checkpoint = m;
        double lb = 0;
        const auto gb = grad_of(o, ps, x, &lb);
        const std::string what = std::string(detach ? "detached" : "exact") + ", token_block " + std::to_string(tb) +
                                 ", m " + std::to_string(m);
        EXPECT_NEAR(lb, lw, 1e-13 * lw) << what;
        expect_close(gb, gw, d, 1e-12, what);
      }
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, Mamba2Engines,
                         ::testing::Values(Engine2Case{1, 1, 9, 4, false}, Engine2Case{2, 2, 11, 3, true},
                                           Engine2Case{3, 1, 7, 2, true}, Engine2Case{2, 2, 11, 3, true, 2}),
                         [](const ::testing::TestParamInfo<Engine2Case>& i) {
                           const Engine2Case& c = i.param;
                           return "K" + std::to_string(c.K) + "_B" + std::to_string(c.batch) + "_T" +
                                  std::to_string(c.T) + "_Kc" + std::to_string(c.Kc) + (c.docs ? "_docs" : "") +
                                  (c.groups > 1 ? "_G" + std::to_string(c.groups) : "");
                         });

// Two windows with the state carried (the conv's x, B and C and each head's h)
// equal one window of both: the losses and the state after, in one process and
// through the block-wise engine; the recurrent generator's logits after every
// piece equal the full forward's.
TEST(Mamba2, CarriedStateAndGeneratorEqualOneLongWindow) {
  const auto d = mamba2_tiny_dims(2, false, 4, 2);  // two groups of B and C
  const auto ps = fd_model(d, 101);
  const index_t B = 2, T = 11;
  const auto x = with_document_starts(random_tokens(B, 2 * T, d.vocab, 102), {T + 2, 2 * T + T});
  const TokenView x1 = token_block(x, 0, T), x2 = token_block(x, T, T), xh1 = token_block(x, 0, T + 1);
  auto whole = carried_state(d, B);
  const double lw = forward_loss(ps, x, 1024, whole, x, 0);
  EXPECT_NEAR(lw, forward_loss(ps, x), 1e-14 * lw);
  auto st = carried_state(d, B);
  const index_t n1 = target_count(xh1), n2 = target_count(x2), nw = target_count(x);
  const double l1 = forward_loss(ps, x1, 1024, st, xh1, n1);
  const double l2 = forward_loss(ps, x2, 1024, st, x2, n2);
  EXPECT_NEAR((l1 * double(n1) + l2 * double(n2)) / double(nw), lw, 1e-12 * lw);
  const auto [ds, rs] = state_diff(st, whole);
  EXPECT_GT(rs, 0.0);
  EXPECT_LE(ds, 1e-12 * rs) << "the state after the two windows";
  // The block-wise engine with the state carried, token blocks and layer checkpoints.
  for (const index_t tb : {0, 3}) {
    auto es = carried_state(d, B);
    EngineOptions o = engine_options("adjoint-exact");
    o.carry_state = true;
    o.token_block = tb;
    o.layer_checkpoint = tb > 0 ? 2 : 1;
    auto eng = make_engine<double>(o);
    eng->set_carried_state(&es);
    ParamSet<double> g(d);
    eng->compute(ps, x1, g);
    const double e2 = eng->compute(ps, x2, g);
    EXPECT_NEAR(e2, l2, 1e-12 * l2) << "token_block " << tb;
    EXPECT_LE(state_diff(es, whole).first, 1e-12 * rs) << "token_block " << tb;
  }
  // The generator, token by token and in pieces, against the full forward's logits.
  const auto ids = random_token_ids(17, d.vocab, 12);
  const auto ref = full_logits(ps, make_windows(ids, 1, 17, d.vocab));
  Generator<double> gen(ps);
  double worst = 0, scale = 0;
  index_t t0 = 0;
  for (const index_t n : {1, 4, 1, 6, 5}) {
    gen.feed(std::vector<std::uint32_t>(ids.begin() + t0, ids.begin() + t0 + n));
    t0 += n;
    for (index_t v = 0; v < d.vocab; ++v) {
      worst = std::max(worst, std::fabs(gen.logits()[v] - ref[t0 - 1][v]));
      scale = std::max(scale, std::fabs(ref[t0 - 1][v]));
    }
  }
  EXPECT_GT(scale, 0.1);
  EXPECT_LE(worst, 1e-12 * scale);
}

// The carried state's gradient (E3 block-wise) against central differences with the state a constant.
TEST(Mamba2, CarriedGradientMatchesFiniteDifferences) {
  const auto d = mamba2_tiny_dims(2, true, 3);
  const auto ps = fd_model(d, 121);
  const index_t B = 2, T = 9;
  const auto x = random_tokens(B, 2 * T, d.vocab, 122);
  const TokenView x1 = token_block(x, 0, T), x2 = token_block(x, T, T);
  auto h0 = carried_state(d, B);
  forward_loss(ps, x1, 1024, h0, x1, 0);
  const auto fd = richardson(ps, [&](const ParamSet<double>& q) {
    auto st = copy_of(h0);
    return forward_loss(q, x2, 1024, st, x2, 0);
  });
  auto st = copy_of(h0);
  EngineOptions o = engine_options("adjoint-exact");
  o.carry_state = true;
  auto eng = make_engine<double>(o);
  eng->set_carried_state(&st);
  ParamSet<double> grad(d);
  eng->compute(ps, x2, grad);
  const auto g = to_host(grad);
  for (const auto& t : grad.tensors()) EXPECT_LE(rel_l2(g, fd, t.offset, t.size()), 1e-5) << t.name;
}

// The layout (in_proj's row blocks, per-head vectors, tied or untied head) and a
// checkpoint's round trip of every Mamba-2 key, a time-step limit included.
TEST(Mamba2, LayoutAndCheckpointRoundTrip) {
  for (const bool tied : {true, false}) {
    ModelDims d = mamba2_tiny_dims(2, tied, 4);
    d.time_step_limit_min = 0.01;
    d.time_step_limit_max = 0.75;
    auto ps = random_model<double>(d, 9);
    EXPECT_EQ(ps.size(), checked_parameter_count(d));
    EXPECT_EQ(ps.tensor("layers/001/in_proj").shape, (std::vector<std::int64_t>{8 + 14 + 4, 4}));
    EXPECT_EQ(ps.tensor("layers/001/conv_weight").shape, (std::vector<std::int64_t>{14, 4}));
    EXPECT_EQ(ps.tensor("layers/000/A_log").shape, (std::vector<std::int64_t>{4}));
    EXPECT_EQ(ps.tensor("layers/000/gated_norm").shape, (std::vector<std::int64_t>{8}));
    const auto l = ps.mamba2_layer(1);  // in_proj's rows: z, then x|B|C, then Δ per head
    EXPECT_EQ(l.in_xbc.data(), l.in_z.data() + 8 * 4);
    EXPECT_EQ(l.in_dt.data(), l.in_xbc.data() + 14 * 4);
    expect_error([&] { (void)ps.mamba_layer(0); }, "not a Mamba-1 block");
    const auto path = tmp_path(tied ? "m2tied.h5" : "m2untied.h5");
    save_checkpoint(path, config_for(d), ps);
    CheckpointInfo info;
    const auto back = load_checkpoint<double>(path, &info);
    EXPECT_TRUE(info.dims == d);
    EXPECT_EQ(to_host(back), to_host(ps));
    bool has_head = false;
    for (const auto& ds : inspect_checkpoint(path, Verify::all).datasets)
      has_head = has_head || ds.path == "/params/head";
    EXPECT_EQ(has_head, !tied);
  }
}

template <class S>
class Mamba2Typed : public ::testing::Test {};
TYPED_TEST_SUITE(Mamba2Typed, Scalars);

TYPED_TEST(Mamba2Typed, AgreesWithDouble) { expect_agrees_with_double<TypeParam>(mamba2_tiny_dims(2, false)); }

// What a Mamba-2 configuration may not say, each refused by name.
TEST(Mamba2, ConfigurationsItDoesNotBuildAreRefused) {
  Config c = config_for(mamba2_tiny_dims(2, true));
  EXPECT_TRUE(c.settings().model.mamba2());
  EXPECT_EQ(c.stored_json()["model"]["arch"], "mamba2");
  EXPECT_EQ(c.stored_json()["model"]["head_dim"], 2);
  const auto refused = [&](const std::string& set, const std::string& what) {
    Config b = c;
    std::istringstream words(set);
    for (std::string w; words >> w;) b.set(w);
    expect_error([&] { b.validate(); }, what);
  };
  refused("model.n_groups=3", "model.n_groups must be >= 1 and divide the heads (4; got 3)");
  refused("model.head_dim=3", "model.heads x model.head_dim must equal model.expand x model.width");
  refused("model.heads=3", "model.heads x model.head_dim must equal");
  refused("model.dt_rank=2", "model.dt_rank applies to model.arch=mamba or falcon_mamba only");
  refused("model.time_step_limit_min=0.2 model.time_step_limit_max=0.1", "model.time_step_limit_min must be");
  Config m;
  m.set("model.arch=mamba");
  m.set("model.head_dim=4");
  expect_error([&] { m.validate(); }, "apply to model.arch=mamba2 only");
  EXPECT_FALSE(Config().stored_json()["model"].contains("head_dim"));  // other files are as before
  Config mm;
  mm.set("model.arch=mamba");
  EXPECT_FALSE(mm.stored_json()["model"].contains("n_groups"));
}

}  // namespace ash::test
