// model.arch = "mamba" and "falcon_mamba" (docs/design.md §1), the forward and E1: every tensor's gradient
// against central finite differences of the forward loss (documents included), the
// conv's gradient over several row blocks, documents independent of each other, and
// float against double. transformers' own model is the oracle of
// python/tests/test_mamba.py; this checks the same code without Python.
#include "ash/kernels/row_sums.hpp"
#include "test_helpers.hpp"

namespace ash::test {

struct FDCase {
  int K;
  bool tied, docs;
  std::int64_t Kc;
  Arch arch = Arch::mamba;
};

class MambaFD : public ::testing::TestWithParam<FDCase> {};

TEST_P(MambaFD, EveryTensorMatchesCentralDifferences) {
  const auto c = GetParam();
  const auto d = mamba_tiny_dims(c.K, c.tied, c.Kc, 2, c.arch);
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
                                           FDCase{2, true, true, 4}, FDCase{3, false, true, 2},
                                           FDCase{1, true, false, 4, Arch::falcon_mamba},
                                           FDCase{2, false, true, 3, Arch::falcon_mamba}),
                         [](const ::testing::TestParamInfo<FDCase>& i) {
                           const FDCase& c = i.param;
                           return arch_name(c.arch) + "_K" + std::to_string(c.K) + (c.tied ? "_tied" : "") +
                                  (c.docs ? "_docs" : "") + "_Kc" + std::to_string(c.Kc);
                         });

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

TYPED_TEST(MambaTyped, AgreesWithDouble) {
  expect_agrees_with_double<TypeParam>(mamba_tiny_dims(2, false));
  expect_agrees_with_double<TypeParam>(mamba_tiny_dims(2, false, 3, 2, Arch::falcon_mamba));
}

}  // namespace ash::test
