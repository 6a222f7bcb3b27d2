// What docs/design.md §3 and §6 promise about determinism: every engine's loss
// and gradient are bitwise repeatable for a fixed build and thread count (no
// atomics; sums over rows and over channel blocks in a fixed order). ctest runs
// this file on each backend variant of the build (openmp.t1 and openmp.t2 in
// a Serial+OpenMP build: unit_tests/CMakeLists.txt), so the promise is checked
// at each thread count. Equality across thread counts is not promised (the
// forward's chunks, E3's channel blocks and the embedding's segments follow the
// thread count) and not tested.
#include "test_helpers.hpp"

namespace ash::test {

namespace {

struct Case {
  std::string what;
  EngineOptions opts;
};

EngineOptions e3(E3Form form, bool detach, index_t Tbar = 0) {
  EngineOptions o = with_e3_form(engine_options("adjoint-exact", Tbar, detach), form);
  o.chunk = 8;
  o.wave = 32;
  return o;
}

// Every engine and form the library has, and the levers that change its sums
// (run.matmul's rounded products are float only).
std::vector<Case> every_engine(bool is_float) {
  std::vector<Case> c{{"backprop", engine_options("backprop")},
                      {"backprop detached", engine_options("backprop", 0, true)},
                      {"adjoint", engine_options("adjoint")},
                      {"adjoint T-bar=7", engine_options("adjoint", 7)}};
  for (const E3Form f : e3_forms())
    for (const bool detach : {false, true})
      c.push_back({"adjoint-exact " + e3_form_name(f) + (detach ? " detached" : ""), e3(f, detach)});
  c.push_back({"adjoint-exact window T-bar=7", e3(E3Form::sequential, true, 7)});
  EngineOptions blocks = e3(default_e3_form(), false);
  blocks.layer_checkpoint = 2;
  blocks.token_block = 32;
  c.push_back({"block-wise, layer checkpoint 2, token block 32", blocks});
  EngineOptions bf16 = blocks;
  bf16.storage = Storage::bf16;
  c.push_back({"block-wise, bf16 storage", bf16});
  if (is_float)
    for (const Matmul m : {Matmul::tf32, Matmul::bf16}) {
      EngineOptions o = e3(default_e3_form(), false);
      o.matmul = m;
      c.push_back({"adjoint-exact, run.matmul=" + matmul_name(m), o});
    }
  return c;
}

}  // namespace

template <class S>
class Determinism : public ::testing::Test {};
TYPED_TEST_SUITE(Determinism, Scalars);

// 3 sequences of 100 tokens: 300 rows, so the sums over rows have several
// blocks of 128 and the threads of a parallel host backend share every kernel.
TYPED_TEST(Determinism, EveryEngineIsBitwiseRepeatable) {
  using S = TypeParam;
  const auto d = tiny_dims(3, 29, 16, 4);
  const auto ps = cast_model<S>(random_model<double>(d, 601));
  const auto x = random_tokens(3, 100, d.vocab, 602);
  for (const Case& c : every_engine(sizeof(S) == 4)) {
    double l1 = 0, l2 = 0;
    const auto g1 = grad_of(c.opts, ps, x, &l1);  // a fresh engine each time
    const auto g2 = grad_of(c.opts, ps, x, &l2);
    double norm = 0;
    for (double v : g1) norm += v * v;
    ASSERT_GT(norm, 0.0) << c.what;
    EXPECT_EQ(l1, l2) << c.what;
    EXPECT_EQ(g1, g2) << c.what;
    // The same engine twice: its kept scratch and a stale gradient change nothing.
    auto engine = make_engine<S>(c.opts);
    ParamSet<S> g(d);
    engine->compute(ps, x, g);
    Kokkos::deep_copy(g.data(), S(7));
    EXPECT_EQ(engine->compute(ps, x, g), l1) << c.what;
    EXPECT_EQ(to_host(g), g1) << c.what;
  }
}

}  // namespace ash::test
