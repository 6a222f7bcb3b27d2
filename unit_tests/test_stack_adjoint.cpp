// StackAdjoint (grad/stack_adjoint.hpp): the K layers alone, forward and
// E3's reverse pass from a given g = ∂L/∂y_K, as the PyTorch module uses them
// (docs/python.md). Checked against the whole model's engines: the layers'
// gradient and, through the embedding's backward, ∂L/∂y_0.
#include "test_helpers.hpp"

namespace ash::test {

namespace {

// The layers of a whole model as a stack's ParamSet (range [0, K), no embedding or head).
ParamSet<double> stack_of(const ParamSet<double>& full) {
  const auto& d = full.dims();
  ParamSet<double> st(d, StackAdjoint<double>::range(d));
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
  StackAdjoint<double> stack(stack_opts);
  // forward: bitwise the model's layers
  View2<double> yK("yK", B * T, d.width);
  stack.forward(layers, shape, tape.ys[0], yK);
  EXPECT_EQ(host_rows(yK), host_rows(tape.ys[std::size_t(d.layers)])) << what;
  // backward from the head's g
  View2<double> g("g", B * T, d.width);
  Kokkos::deep_copy(g, tape.g);
  ParamSet<double> grad(d, StackAdjoint<double>::range(d));
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
    for (const auto& c : {Case{engine_options("adjoint-exact"), "exact"},
                          Case{engine_options("adjoint-exact", 0, true), "detached"},
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
  expect_error([&] { StackAdjoint<double> s(engine_options("backprop")); }, "adjoint-exact");
  StackAdjoint<double> s(engine_options("adjoint-exact"));
  const ParamSet<double> whole(d);
  View2<double> y("y", 10, d.width), z("z", 10, d.width);
  expect_error([&] { s.forward(whole, SeqShape{2, 5}, y, z); }, "layers [0, K)");
  const ParamSet<double> layers(d, StackAdjoint<double>::range(d));
  expect_error([&] { s.forward(layers, SeqShape{2, 6}, y, z); }, "[batch·T, P]");
}

}  // namespace ash::test
