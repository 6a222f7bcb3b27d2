// data.carry_state on a Mamba: two windows with the state carried against one long
// window, ash eval's stream, the gradient against finite differences, and the memory
// levers with a carried state.
#include <algorithm>

#include "test_helpers.hpp"

namespace ash::test {

// data.carry_state on a Mamba (docs/design.md §8): one [B·E, Kc−1+N] view per layer,
// row b·E + e the conv's last Kc−1 inputs x, then h.
namespace {

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
  for (const auto& [Kc, arch] :
       {std::pair<std::int64_t, Arch>{2, Arch::mamba}, {4, Arch::mamba}, {4, Arch::falcon_mamba}}) {
    SCOPED_TRACE("Kc " + std::to_string(Kc) + ", " + arch_name(arch));
    const auto d = mamba_tiny_dims(2, false, Kc, 2, arch);
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
  for (const Arch arch : {Arch::mamba, Arch::falcon_mamba}) {
    SCOPED_TRACE(arch_name(arch));
    const auto d = mamba_tiny_dims(2, false, 3, 2, arch);
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
}

// The memory levers with a carried state: token blocks (shorter and longer than
// the conv's reach), layer checkpoints and 16-bit storage give the whole-window
// carried run's loss, gradient and end state (1e-12 in double; bf16 within its
// rounding, test_low_memory.cpp's tolerances).
TEST(MambaCarry, LeversEqualTheWholeWindowCarriedRun) {
  for (const Arch arch : {Arch::mamba, Arch::falcon_mamba}) {
    SCOPED_TRACE(arch_name(arch));
    const auto d = mamba_tiny_dims(3, true, 4, 2, arch);
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
}

}  // namespace ash::test
