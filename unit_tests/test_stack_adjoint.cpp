// StackAdjoint (grad/stack_adjoint.hpp): the K layers alone, forward and
// E3's reverse pass from a given g = ∂L/∂y_K, as the PyTorch module uses them
// (docs/python.md). Of the SSM-ResNet kind: checked against the whole model's
// engines, the layers' gradient and, through the embedding's backward,
// ∂L/∂y_0. Of the Mamba kind (the Mamba blocks alone,
// adjoint_sharding.torch.wrap's): likewise against a Mamba's E1, its detached
// mode against one-block stacks fed g_K.
#include "test_helpers.hpp"

namespace ash::test {

namespace {

using SsmStack = StackAdjoint<double, SsmResNetKind>;
using MambaStack = StackAdjoint<double, MambaKind>;

// The layers of a whole model as a stack's ParamSet (range [0, K), no embedding or head).
ParamSet<double> stack_of(const ParamSet<double>& full) {
  const auto& d = full.dims();
  ParamSet<double> st(d, SsmStack::range(d));
  const auto v = to_host(full);
  std::vector<double> w(std::size_t(st.size()));
  for (const auto& t : st.tensors()) {
    const auto& src = full.tensor(t.name);
    std::copy(v.begin() + src.offset, v.begin() + src.offset + src.size(), w.begin() + t.offset);
  }
  from_host(st, w);
  return st;
}

std::vector<double> host_rows(const View2<double>& a) {
  auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), a);
  return std::vector<double>(h.data(), h.data() + h.size());
}

struct Case {
  EngineOptions opts;
  std::string what;
};

// The whole model's gradient (layers and embedding) against the stack's
// layers and the embedding backward of the stack's ∂L/∂y_0.
// docs: document starts in the windows (the stack gets them as
// SeqShape::of(x), the cu_seqlens of the Python module).
void expect_stack_matches_model(const ModelDims& d, index_t B, index_t T, const EngineOptions& stack_opts,
                                const EngineOptions& model_opts, double tol, const std::string& what,
                                bool docs = false) {
  const auto params = random_model<double>(d, 11);
  const auto x = random_tokens(B, T, d.vocab, 5);
  if (docs) {  // starts at 0, 1, 9, T-1 of window 0 and 17 of the others (cu_seqlens style, closing offset B·T)
    std::vector<index_t> at = {0, 1, 9, T - 1};
    for (index_t b = 1; b < B; ++b) at.push_back(b * T + 17);
    at.push_back(B * T);
    Kokkos::View<index_t*, MemSpace> sv("cu_seqlens", at.size());
    auto h = Kokkos::create_mirror_view(sv);
    for (std::size_t i = 0; i < at.size(); ++i) h(i) = at[i];
    Kokkos::deep_copy(sv, h);
    set_document_starts(x, sv);
  }
  const SeqShape shape = docs ? SeqShape::of(x) : SeqShape{B, T};
  const auto ref = grad_of(model_opts, params, x);
  ParamSet<double> head_grad(d);
  const auto gg = head_grad.global();
  const auto tape = forward_tape<double>(params, x, &gg, LayerActivations<double>::projections_only, false);
  const auto layers = stack_of(params);
  const SsmStack stack(d, stack_opts);
  // forward: bitwise the model's layers
  View2<double> yK("yK", B * T, d.width);
  stack.forward(layers, shape, tape.ys[0], yK);
  EXPECT_EQ(host_rows(yK), host_rows(tape.ys[std::size_t(d.layers)])) << what;
  // backward from the head's g
  View2<double> g("g", B * T, d.width);
  Kokkos::deep_copy(g, tape.g);
  ParamSet<double> grad(d, SsmStack::range(d));
  stack.backward(layers, shape, tape.ys[0], g, grad);
  const auto got = to_host(grad);
  for (const auto& t : grad.tensors()) {
    const auto& r = param_layout(d);
    const auto it = std::find_if(r.begin(), r.end(), [&](const TensorInfo& u) { return u.name == t.name; });
    EXPECT_LE(rel_l2(std::vector<double>(got.begin() + t.offset, got.begin() + t.offset + t.size()),
                     std::vector<double>(ref.begin() + it->offset, ref.begin() + it->offset + it->size())),
              tol)
        << t.name << " " << what;
  }
  ParamSet<double> emb(d);
  embedding_backward(x, g, emb.global().embedding);
  const auto e = to_host(emb);
  const auto& et = emb.tensor("embedding");
  EXPECT_LE(rel_l2(e, ref, et.offset, et.size()), tol) << "embedding (∂L/∂y_0) " << what;
}

}  // namespace

TEST(StackAdjoint, EqualsTheWholeModelsGradientInEveryMode) {
  for (int K : {1, 3}) {
    const auto d = tiny_dims(K);
    for (const auto& c :
         {Case{engine_options("adjoint-exact"), "exact"}, Case{engine_options("adjoint-exact", 0, true), "detached"},
          Case{engine_options("adjoint-exact", 5, true), "detached, T-bar 5"}}) {
      EngineOptions o = c.opts;
      o.chunk = 8;
      expect_stack_matches_model(d, 2, 37, o, o, 1e-12, c.what + " K=" + std::to_string(K));
    }
  }
}

TEST(StackAdjoint, LeversAndBlocks) {
  const auto d = tiny_dims(3);
  EngineOptions o = engine_options("adjoint-exact");
  o.chunk = 8;
  EngineOptions blocks = o;
  blocks.token_block = 16;  // 37 tokens: blocks of 16, 16, 5
  expect_stack_matches_model(d, 2, 37, blocks, o, 1e-12, "token blocks");
  EngineOptions ckpt = blocks;
  ckpt.layer_checkpoint = 2;
  expect_stack_matches_model(d, 2, 37, ckpt, o, 1e-12, "layer checkpoint 2");
  EngineOptions bf16 = ckpt;
  bf16.storage = Storage::bf16;
  expect_stack_matches_model(d, 1, 37, bf16, o, 3e-2, "bf16 storage");
}

// Document starts (docs/design.md §1) through the stack: forward and backward
// equal the whole model's on the same windows, exact, detached, in blocks.
TEST(StackAdjoint, DocumentStarts) {
  const auto d = tiny_dims(3);
  EngineOptions o = engine_options("adjoint-exact");
  o.chunk = 8;
  expect_stack_matches_model(d, 2, 37, o, o, 1e-12, "exact, documents", true);
  EngineOptions det = engine_options("adjoint-exact", 0, true);
  det.chunk = 8;
  expect_stack_matches_model(d, 2, 37, det, det, 1e-12, "detached, documents", true);
  EngineOptions blocks = o;
  blocks.token_block = 16;
  blocks.layer_checkpoint = 2;
  expect_stack_matches_model(d, 2, 37, blocks, o, 1e-12, "blocks and layer checkpoint, documents", true);
}

TEST(StackAdjoint, RefusesWrongShapesAndOtherMethods) {
  const auto d = tiny_dims(2);
  expect_error([&] { SsmStack s(d, engine_options("backprop")); }, "adjoint-exact");
  expect_error([&] { SsmStack s(mamba_tiny_dims(2, true, 3, 2), engine_options("adjoint-exact")); },
               "not model.arch=ssm-resnet");
  const SsmStack s(d, engine_options("adjoint-exact"));
  const ParamSet<double> whole(d);
  View2<double> y("y", 10, d.width), z("z", 10, d.width);
  expect_error([&] { s.forward(whole, SeqShape{2, 5}, y, z); }, "layers [0, K)");
  const ParamSet<double> layers(d, SsmStack::range(d));
  expect_error([&] { s.forward(layers, SeqShape{2, 6}, y, z); }, "[batch·T, width]");
  expect_error([&] { s.forward(layers, SeqShape{2, 5}, y, y); }, "must not be y0");
  const ParamSet<double> other(tiny_dims(3), SsmStack::range(tiny_dims(3)));
  expect_error([&] { s.backward(other, SeqShape{2, 5}, y, z, other); }, "the stack's sizes");
}

namespace {

// A View of `rows` × `cols` values in [-1, 1) from seed.
View2<double> random_rows(index_t rows, index_t cols, std::uint64_t seed) {
  const View2<double> v("random_rows", rows, cols);
  auto h = Kokkos::create_mirror_view(v);
  std::mt19937_64 gen(seed);
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  for (index_t i = 0; i < rows; ++i)
    for (index_t j = 0; j < cols; ++j) h(i, j) = u(gen);
  Kokkos::deep_copy(v, h);
  return v;
}

// A stack of kind K run on a ParamSet and on blocks of other tensors (a copy's
// views, the way the PyTorch wrap hands a model's own): forward, ∂L/∂y_0 and
// the gradient bit for bit alike (whole window or block-wise, the blocks then
// copied into a ParamSet and the gradient out of one).
template <class K>
void expect_paramset_equals_blocks(const ModelDims& d, EngineOptions o, const std::string& what) {
  using Stack = StackAdjoint<double, K>;
  o.chunk = 4;
  const auto layers = stack_of(random_model<double>(d, 3));
  const ParamSet<double> copy(d, Stack::range(d)), grad_ps(d, Stack::range(d)), grad_blocks(d, Stack::range(d));
  from_host(copy, to_host(layers));
  from_host(grad_blocks, std::vector<double>(std::size_t(grad_blocks.size()), 7.0));  // overwritten
  const SeqShape s{2, 13};
  const View2<double> y0 = random_rows(s.rows(), d.width, 1), g_ps = random_rows(s.rows(), d.width, 2),
                      g_blocks = random_rows(s.rows(), d.width, 2);
  const View2<double> yK_ps("yK_ps", s.rows(), d.width), yK_blocks("yK_blocks", s.rows(), d.width);
  const Stack stack(d, o);
  stack.forward(layers, s, y0, yK_ps);
  stack.forward(Stack::blocks(copy), s, y0, yK_blocks);
  EXPECT_EQ(host_rows(yK_ps), host_rows(yK_blocks)) << what;
  stack.backward(layers, s, y0, g_ps, grad_ps);
  stack.backward(Stack::blocks(copy), s, y0, g_blocks, Stack::blocks(grad_blocks));
  EXPECT_EQ(host_rows(g_ps), host_rows(g_blocks)) << what;
  const auto got = to_host(grad_ps);
  EXPECT_EQ(got, to_host(grad_blocks)) << what;
  EXPECT_GT(rel_l2(got, std::vector<double>(got.size(), 0.0)), 0.5) << what << ": a zero gradient shows nothing";
}

}  // namespace

TEST(StackAdjoint, ParamSetAndBlocksGiveTheSameBits) {
  EngineOptions levers = engine_options("adjoint-exact");
  levers.token_block = 4;
  levers.layer_checkpoint = 2;
  levers.storage = Storage::bf16;
  for (const auto& o : {engine_options("adjoint-exact"), engine_options("adjoint-exact", 3, true), levers}) {
    const std::string what = o.blockwise_levers() ? "levers" : o.detach_inputs ? "T-bar 3" : "exact";
    expect_paramset_equals_blocks<SsmResNetKind>(tiny_dims(3), o, "ssm-resnet, " + what);
    expect_paramset_equals_blocks<MambaKind>(mamba_tiny_dims(3, true), o, "mamba, " + what);
    expect_paramset_equals_blocks<FalconMambaKind>(mamba_tiny_dims(3, true, 3, 2, Arch::falcon_mamba), o,
                                                   "falcon_mamba, " + what);
  }
}

namespace {

// The blocks of a whole model's ParamSet (views into it: the stack takes blocks from anywhere).
template <class S>
typename StackAdjoint<S, MambaKind>::Blocks blocks_of(const ParamSet<S>& ps, int k0, int k1) {
  typename StackAdjoint<S, MambaKind>::Blocks b;
  for (int k = k0; k < k1; ++k) b.push_back(ps.mamba_layer(k));
  return b;
}

// A model's sizes with K blocks.
ModelDims with_layers(ModelDims d, int K) {
  d.layers = K;
  return d;
}

}  // namespace

struct MambaStackCase {
  int K;
  index_t batch, T;
  std::int64_t Kc, R;
  bool tied, docs;
  index_t chunk, wave;
};

// ctest's test list shows the case (gtest would print the struct's bytes, padding included).
void PrintTo(const MambaStackCase& c, std::ostream* os) {
  *os << "K=" << c.K << " batch=" << c.batch << " T=" << c.T << " Kc=" << c.Kc << " R=" << c.R
      << (c.tied ? " tied" : " untied") << (c.docs ? " docs" : "") << " chunk=" << c.chunk << " wave=" << c.wave;
}

class MambaStackAdjointCases : public ::testing::TestWithParam<MambaStackCase> {};

// Embedding (C++), the stack's forward, the head's loss and g, the stack's
// backward and the embedding's backward of its ∂L/∂y_0 give the whole model's
// E1 loss and gradient (LocalEngine: every activation kept, E1's reverse scan).
// The stack (options `so`) under the embedding and head against the whole
// model's engine (options `ref_opts`), loss to 1e-13 and each gradient tensor
// to `tol` (relative L2); returns the whole gradient's relative L2 distance.
double expect_stack_equals_model(const MambaStackCase& c, EngineOptions so, const EngineOptions& ref_opts,
                                 const char* what, double tol = 1e-12) {
  const auto d = mamba_tiny_dims(c.K, c.tied, c.Kc, c.R);
  const auto params = random_model<double>(d, 40 + std::uint64_t(c.K));
  auto x = random_tokens(c.batch, c.T, d.vocab, 50 + std::uint64_t(c.T));
  if (c.docs) {  // starts at 0, 3, 4 of window 0 and T + 5 (window 1); closing offset B·T
    std::vector<index_t> at = {0, 3, 4};
    if (c.batch > 1) at.push_back(c.T + 5);
    at.push_back(c.batch * c.T);
    with_document_starts(x, at);
  }
  double ref_loss = 0;
  const auto ref = grad_of(ref_opts, params, x, &ref_loss);
  so.chunk = c.chunk;
  so.wave = c.wave;
  const MambaStack stack(d, so);
  const SeqShape s = SeqShape::of(x);
  const View2<double> y0("y0", s.rows(), d.width), yK("yK", s.rows(), d.width), g("g", s.rows(), d.width);
  embedding_forward(params.global().embedding, x, y0);
  const auto blocks = blocks_of(params, 0, c.K);
  stack.forward(blocks, s, y0, yK);
  ParamSet<double> grad(d);
  grad.fill_zero();
  const auto gg = grad.global();
  const double loss = head_loss<double>(params.global(), x, yK, g, &gg, 0);
  EXPECT_NEAR(loss, ref_loss, 1e-13 * ref_loss);
  // The gradient's blocks hold garbage first: backward overwrites them.
  for (int k = 0; k < c.K; ++k) Kokkos::deep_copy(grad.mamba_layer(k).A_log, 7.0);
  const auto y0_before = host_rows(y0);
  stack.backward(blocks, s, y0, g, blocks_of(grad, 0, c.K));
  EXPECT_EQ(host_rows(y0), y0_before) << "y0 is read only";
  embedding_backward(x, g, gg.embedding);
  const auto got = to_host(grad);
  expect_close(got, ref, d, tol, what);
  return rel_l2(got, ref);
}

TEST_P(MambaStackAdjointCases, EqualsTheWholeModelsBackprop) {
  expect_stack_equals_model(GetParam(), engine_options("adjoint-exact"), EngineOptions{}, "Mamba stack");
}

// The memory levers (the block-wise engine's pass over the stack as a layer
// range): token blocks of 4 tokens and layer checkpointing m = 2 equal E1 (full
// storage, 1e-12), and the window T̄ = 4 with m = 2 the whole model's E2
// truncated. 16-bit kept inputs (the stack's y_0 among them, which the whole
// model would recompute from its embedding instead, so no whole-model run is
// the same computation): within each format's rounding of E1 (bf16 3e-2, fp16
// 5e-3 per tensor) and more than 1e-6 from it (the lever is on).
TEST_P(MambaStackAdjointCases, LeversEqualTheWholeModelsRun) {
  const auto c = GetParam();
  const auto levers = [](Storage st, index_t m, index_t block, index_t Tbar = 0) {
    auto o = engine_options("adjoint-exact", Tbar, Tbar > 0);
    o.storage = st;
    o.layer_checkpoint = m;
    o.token_block = block;
    return o;
  };
  expect_stack_equals_model(c, levers(Storage::full, 1, 4), EngineOptions{}, "Mamba stack, token blocks");
  expect_stack_equals_model(c, levers(Storage::full, 2, 4), EngineOptions{}, "Mamba stack, m = 2, token blocks");
  expect_stack_equals_model(c, levers(Storage::full, 2, 0, 4), engine_options("adjoint", 4, true),
                            "Mamba stack, m = 2, T-bar 4");
  for (const Storage st : {Storage::bf16, Storage::fp16})
    EXPECT_GT(expect_stack_equals_model(c, levers(st, 2, 4), EngineOptions{}, "Mamba stack, 16-bit storage",
                                        st == Storage::bf16 ? 3e-2 : 5e-3),
              1e-6)
        << storage_name(st) << " storage must change the gradient";
}

// The paper's window T̄ = 4 (< T in every case): the stack's E3 detached and
// windowed equals the whole model's E2 truncated at the same T̄ (the
// engines' windowed sum, tested against a brute-force window in
// test_mamba_engines.cpp), and that gradient is not the full window's.
TEST_P(MambaStackAdjointCases, WindowedEqualsTheWholeModelsTruncatedE2) {
  const auto c = GetParam();
  const EngineOptions e2 = engine_options("adjoint", 4, true);
  expect_stack_equals_model(c, engine_options("adjoint-exact", 4, true), e2, "Mamba stack, T-bar 4");
  const auto d = mamba_tiny_dims(c.K, c.tied, c.Kc, c.R);
  const auto params = random_model<double>(d, 40 + std::uint64_t(c.K));
  const auto x = random_tokens(c.batch, c.T, d.vocab, 50 + std::uint64_t(c.T));
  EXPECT_GT(rel_l2(grad_of(e2, params, x), grad_of(engine_options("adjoint", 0, true), params, x)), 1e-6)
      << "the window must change the gradient, or this test shows nothing";
}

INSTANTIATE_TEST_SUITE_P(Cases, MambaStackAdjointCases,
                         ::testing::Values(MambaStackCase{1, 1, 9, 4, 1, true, false, 64, 0},
                                           MambaStackCase{2, 2, 11, 2, 2, false, true, 3, 3},
                                           MambaStackCase{3, 2, 7, 3, 3, true, false, 2, 4},
                                           MambaStackCase{3, 1, 13, 4, 2, false, true, 4, 0}),
                         [](const ::testing::TestParamInfo<MambaStackCase>& i) {
                           const auto& c = i.param;
                           return "K" + std::to_string(c.K) + "_B" + std::to_string(c.batch) + "_T" +
                                  std::to_string(c.T) + "_Kc" + std::to_string(c.Kc) + "_R" + std::to_string(c.R) +
                                  (c.tied ? "_tied" : "_untied") + (c.docs ? "_docs" : "") + "_C" +
                                  std::to_string(c.chunk) + "_W" + std::to_string(c.wave);
                         });

// Detached (the paper's gradient): block k's gradient is a one-block exact
// stack's at its input y_{k-1} with the cotangent g_K, and ∂L/∂y_0 = g_K.
TEST(MambaStackAdjoint, DetachedIsEachBlockAloneFedGK) {
  const int K = 3;
  const auto d = mamba_tiny_dims(K, true, 3, 2);
  const auto params = random_model<double>(d, 77);
  const SeqShape s{2, 9};
  EngineOptions exact = engine_options("adjoint-exact");
  exact.chunk = 4;
  EngineOptions det = exact;
  det.detach_inputs = true;
  const View2<double> y0("y0", s.rows(), d.width), gK("gK", s.rows(), d.width), g("g", s.rows(), d.width);
  {
    auto h0 = Kokkos::create_mirror_view(y0);
    auto hg = Kokkos::create_mirror_view(gK);
    std::mt19937_64 gen(5);
    std::uniform_real_distribution<double> u(-1.0, 1.0);
    for (index_t i = 0; i < s.rows(); ++i)
      for (index_t j = 0; j < index_t(d.width); ++j) {
        h0(i, j) = 1.5 * u(gen);
        hg(i, j) = u(gen);
      }
    Kokkos::deep_copy(y0, h0);
    Kokkos::deep_copy(gK, hg);
  }
  Kokkos::deep_copy(g, gK);
  ParamSet<double> grad(d);
  MambaStack(d, det).backward(blocks_of(params, 0, K), s, y0, g, blocks_of(grad, 0, K));
  EXPECT_EQ(host_rows(g), host_rows(gK)) << "∂L/∂y_0 = g_K through the residuals";
  const auto got = to_host(grad);
  for (int k = 0; k < K; ++k) {
    // y_{k-1} by a k-block stack, then block k alone (exact) from g_K.
    const View2<double> yk("yk", s.rows(), d.width), gk("gk", s.rows(), d.width);
    if (k == 0) {
      Kokkos::deep_copy(yk, y0);
    } else {
      MambaStack(with_layers(d, k), exact).forward(blocks_of(params, 0, k), s, y0, yk);
    }
    Kokkos::deep_copy(gk, gK);
    ParamSet<double> one(d);
    MambaStack(with_layers(d, 1), exact).backward(blocks_of(params, k, k + 1), s, yk, gk, blocks_of(one, k, k + 1));
    const auto ref = to_host(one);
    for (const auto& t : param_layout(d))
      if (t.name.rfind(layer_prefix(k), 0) == 0) EXPECT_LE(rel_l2(got, ref, t.offset, t.size()), 1e-13) << t.name;
  }
}

TEST(MambaStackAdjoint, RefusesTheCarriedStateOtherMethodsAndWrongShapes) {
  const auto d = mamba_tiny_dims(2, true, 3, 2);
  const auto ok = engine_options("adjoint-exact");
  expect_error([&] { MambaStack s(d, engine_options("backprop")); }, "adjoint-exact");
  EngineOptions o = ok;
  o.carry_state = true;
  expect_error([&] { MambaStack s(d, o); }, "data.carry_state=true");
  o = ok;
  o.layer_checkpoint = 0;
  expect_error([&] { MambaStack s(d, o); }, "grad.layer_checkpoint");
  expect_error([&] { MambaStack s(tiny_dims(2), ok); }, "not model.arch=mamba");
  const MambaStack stack(d, ok);
  const ParamSet<double> ps(d);
  const View2<double> y("y", 10, d.width), z("z", 10, d.width);
  expect_error([&] { stack.forward(blocks_of(ps, 0, 1), SeqShape{2, 5}, y, z); }, "expected K = 2");
  auto bad = blocks_of(ps, 0, 2);
  bad[1].conv_weight = Unmanaged2<double>(bad[1].conv_weight.data(), d.inner(), d.conv_kernel - 1);
  expect_error([&] { stack.forward(bad, SeqShape{2, 5}, y, z); }, "conv_weight");
  expect_error([&] { stack.forward(blocks_of(ps, 0, 2), SeqShape{2, 6}, y, z); }, "[batch·T, width]");
  expect_error([&] { stack.forward(blocks_of(ps, 0, 2), SeqShape{2, 5}, y, y); }, "must not be y0");
  const ParamSet<double> layers(d, MambaStack::range(d));
  EXPECT_EQ(MambaStack::blocks(layers).size(), 2u);
  expect_error([&] { MambaStack::blocks(ps); }, "layers [0, K)");
}

}  // namespace ash::test
