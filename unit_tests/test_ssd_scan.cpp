// The SSD scan in chunked matrix form (model/ssd_scan.hpp, Mamba-2's E3 and
// forward): its forward against the per-channel selective scan (an independent
// recurrence, ssm_layer.hpp), with and without a carried state, documents
// starting inside and at the edges of chunks, n_groups 1 and 2, a last chunk
// shorter than the rest; its reverse mode against central differences of its
// own forward for every input (x, Δ per head, B, C, a per head, D per head).
#include <random>

#include "ash/model/ssd_scan.hpp"
#include "ash/plan/memory_plan.hpp"
#include "test_helpers.hpp"

namespace ash::test {

namespace {

struct Problem {
  SsdShape sh;
  SeqShape s;
  LayerActivations<double> act;
  View1<double> D;
  TokenView x;
};

// Random inputs; a_h per head and Δ per head (every channel of a head the same, as a Mamba-2 has them).
Problem make_problem(const SsdShape& sh, const std::vector<index_t>& starts, unsigned seed) {
  const index_t H = sh.heads, P = sh.head_dim, E = H * P, N = sh.state, GN = sh.groups * N, M = sh.batch * sh.T;
  Problem pb{sh, SeqShape{sh.batch, sh.T, DocStarts()}, {}, View1<double>("D", E), TokenView("x", sh.batch, sh.T)};
  Kokkos::View<index_t*, MemSpace> sv("starts", starts.size());
  auto hs = Kokkos::create_mirror_view(sv);
  for (std::size_t i = 0; i < starts.size(); ++i) hs(i) = starts[i];
  Kokkos::deep_copy(sv, hs);
  set_document_starts(pb.x, sv);
  pb.s.docs = DocStarts(pb.x);
  pb.act = LayerActivations<double>(pb.s, E, N, LayerActivations<double>::projections_only, sh.groups);
  std::mt19937 rng(seed);
  std::uniform_real_distribution<double> u(-1, 1), pos(0.05, 0.9), neg(0.3, 1.5);
  auto x = Kokkos::create_mirror_view(pb.act.yhat);
  auto dl = Kokkos::create_mirror_view(pb.act.delta);
  auto b = Kokkos::create_mirror_view(pb.act.beta);
  auto c = Kokkos::create_mirror_view(pb.act.gamma);
  auto a = Kokkos::create_mirror_view(pb.act.a);
  auto D = Kokkos::create_mirror_view(pb.D);
  for (index_t m = 0; m < M; ++m) {
    for (index_t e = 0; e < E; ++e) x(m, e) = u(rng);
    for (index_t h = 0; h < H; ++h) {
      const double v = pos(rng);
      for (index_t p = 0; p < P; ++p) dl(m, h * P + p) = v;
    }
    for (index_t j = 0; j < GN; ++j) {
      b(m, j) = u(rng);
      c(m, j) = u(rng);
    }
  }
  for (index_t h = 0; h < H; ++h) {
    const double ah = -neg(rng), dh = u(rng);
    for (index_t p = 0; p < P; ++p) {
      D(h * P + p) = dh;
      for (index_t n = 0; n < N; ++n) a(h * P + p, n) = ah;
    }
  }
  Kokkos::deep_copy(pb.act.yhat, x);
  Kokkos::deep_copy(pb.act.delta, dl);
  Kokkos::deep_copy(pb.act.beta, b);
  Kokkos::deep_copy(pb.act.gamma, c);
  Kokkos::deep_copy(pb.act.a, a);
  Kokkos::deep_copy(pb.D, D);
  return pb;
}

Unmanaged1<double> unmanaged(const View1<double>& v) { return Unmanaged1<double>(v.data(), v.extent(0)); }

std::vector<double> host(const View2<double>& v) {
  auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), v);
  return std::vector<double>(h.data(), h.data() + h.size());
}

double max_abs_diff(const std::vector<double>& a, const std::vector<double>& b) {
  double m = 0;
  for (std::size_t i = 0; i < a.size(); ++i) m = std::max(m, std::abs(a[i] - b[i]));
  return m;
}

// 2 sequences of 11 tokens, chunks of 4 (the last of 3), 4 heads of 3 channels, 5 states.
SsdShape shape(index_t groups) { return SsdShape{2, 11, 4, 3, groups, 5, 4}; }
// Starts inside a chunk (0:5), at a chunk's first token (1:4, 1:8) and at the window's first token (1:0).
const std::vector<index_t> kStarts = {5, 11 + 0, 11 + 4, 11 + 8};

}  // namespace

class SsdScanGroups : public ::testing::TestWithParam<index_t> {};

TEST_P(SsdScanGroups, ForwardEqualsThePerChannelScan) {
  const SsdShape sh = shape(GetParam());
  const index_t E = sh.heads * sh.head_dim, N = sh.state;
  for (const bool docs : {false, true}) {
    Problem pb = make_problem(sh, docs ? kStarts : std::vector<index_t>{}, 7);
    for (const bool carry : {false, true}) {
      View2<double> s_ref("s_ref", sh.batch * sh.T, E), s("s", sh.batch * sh.T, E);
      View2<double> st_ref, st;
      if (carry) {
        st_ref = View2<double>("st_ref", sh.batch * E, N);
        std::mt19937 rng(3);
        std::uniform_real_distribution<double> u(-1, 1);
        auto h = Kokkos::create_mirror_view(st_ref);
        for (std::size_t i = 0; i < h.size(); ++i) h.data()[i] = u(rng);
        Kokkos::deep_copy(st_ref, h);
        st = View2<double>("st", sh.batch * E, N);
        Kokkos::deep_copy(st, st_ref);
      }
      selective_scan_forward(unmanaged(pb.D), pb.s, View2<double>(), pb.act, s_ref, st_ref);
      SsdScan<double>(sh, false).forward(pb.act, unmanaged(pb.D), pb.s.docs, s, st, ExecSpace());
      EXPECT_LE(max_abs_diff(host(s), host(s_ref)), 1e-13) << "docs " << docs << " carry " << carry;
      if (carry) EXPECT_LE(max_abs_diff(host(st), host(st_ref)), 1e-13) << "end state, docs " << docs;
    }
  }
}

// Without documents every chunk carries state both ways; with them, paths are cut.
class SsdScanReverse : public ::testing::TestWithParam<std::tuple<index_t, bool>> {};

TEST_P(SsdScanReverse, MatchesCentralDifferences) {
  const SsdShape sh = shape(std::get<0>(GetParam()));
  const index_t H = sh.heads, P = sh.head_dim, E = H * P, GN = sh.groups * sh.state, M = sh.batch * sh.T;
  Problem pb = make_problem(sh, std::get<1>(GetParam()) ? kStarts : std::vector<index_t>{}, 11);
  // L = Σ w ⊙ s for fixed random weights w = ∂L/∂s.
  View2<double> w("w", M, E);
  {
    std::mt19937 rng(5);
    std::uniform_real_distribution<double> u(-1, 1);
    auto h = Kokkos::create_mirror_view(w);
    for (std::size_t i = 0; i < h.size(); ++i) h.data()[i] = u(rng);
    Kokkos::deep_copy(w, h);
  }
  const auto wv = host(w);
  const auto loss = [&]() {
    View2<double> s("s", M, E);
    SsdScan<double>(sh, false).forward(pb.act, unmanaged(pb.D), pb.s.docs, s, View2<double>(), ExecSpace());
    const auto sv = host(s);
    double l = 0;
    for (std::size_t i = 0; i < sv.size(); ++i) l += wv[i] * sv[i];
    return l;
  };
  SsdGrads<double> g{View2<double>("gx", M, E), View2<double>("gdelta", M, H), View2<double>("gb", M, GN),
                     View2<double>("gc", M, GN), View1<double>("ga", H), View1<double>("gD", H)};
  SsdScan<double>(sh, true).backward(pb.act, unmanaged(pb.D), pb.s.docs, w, g, ExecSpace());
  const double eps = 1e-6, tol = 2e-8;
  // Central differences of L in the entries (view, indices) perturbed together.
  const auto fd = [&](const auto& view, const std::vector<std::size_t>& flat) {
    auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), view);
    const auto set = [&](double dv) {
      for (std::size_t i : flat) h.data()[i] += dv;
      Kokkos::deep_copy(view, h);
    };
    set(eps);
    const double lp = loss();
    set(-2 * eps);
    const double lm = loss();
    set(eps);
    return (lp - lm) / (2 * eps);
  };
  const auto check = [&](const char* what, const auto& view, const std::vector<double>& got, index_t rows,
                         index_t cols, const auto& entries_of) {
    double worst = 0, scale = 0;
    for (index_t r = 0; r < rows; ++r)
      for (index_t c = 0; c < cols; ++c) {
        const double ref = fd(view, entries_of(r, c));
        worst = std::max(worst, std::abs(got[r * cols + c] - ref));
        scale = std::max(scale, std::abs(ref));
      }
    EXPECT_GT(scale, 1e-3) << what;
    EXPECT_LE(worst, tol * std::max(1.0, scale)) << what;
  };
  const auto one = [](index_t cols) {
    return [cols](index_t r, index_t c) { return std::vector<std::size_t>{std::size_t(r * cols + c)}; };
  };
  check("dL/dx", pb.act.yhat, host(g.gx), M, E, one(E));
  check("dL/dB", pb.act.beta, host(g.gbeta), M, GN, one(GN));
  check("dL/dC", pb.act.gamma, host(g.ggamma), M, GN, one(GN));
  check("dL/dDelta", pb.act.delta, host(g.gdelta), M, H, [&](index_t m, index_t h) {
    std::vector<std::size_t> f;
    for (index_t p = 0; p < P; ++p) f.push_back(std::size_t(m * E + h * P + p));
    return f;
  });
  const auto ga = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), g.ga);
  const auto gD = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), g.gD);
  const std::vector<double> gav(ga.data(), ga.data() + H), gDv(gD.data(), gD.data() + H);
  check("dL/da", pb.act.a, gav, 1, H, [&](index_t, index_t h) {
    std::vector<std::size_t> f;
    for (index_t i = h * P * sh.state; i < (h + 1) * P * sh.state; ++i) f.push_back(std::size_t(i));
    return f;
  });
  check("dL/dD", pb.D, gDv, 1, H, [&](index_t, index_t h) {
    std::vector<std::size_t> f;
    for (index_t p = 0; p < P; ++p) f.push_back(std::size_t(h * P + p));
    return f;
  });
}

INSTANTIATE_TEST_SUITE_P(Groups, SsdScanGroups, ::testing::Values(index_t(1), index_t(2)));
INSTANTIATE_TEST_SUITE_P(GroupsDocs, SsdScanReverse,
                         ::testing::Combine(::testing::Values(index_t(1), index_t(2)), ::testing::Bool()));

// A token block's reverse mode: from a start state h0, with ∂L/∂ the end state
// given (a later block's), L = Σ w ⊙ s + Σ v ⊙ h_end; ∂L/∂h0 (what the block
// before receives), ∂L/∂x, ∂L/∂Δ and ∂L/∂B against central differences.
TEST(SsdScan, ABlockFromAStateWithItsEndStateCotangent) {
  const SsdShape sh = shape(2);
  const index_t H = sh.heads, P = sh.head_dim, E = H * P, N = sh.state, GN = sh.groups * N, M = sh.batch * sh.T;
  // A document starts in sequence 0 only: sequence 1 carries h0 to its end.
  Problem pb = make_problem(sh, {5}, 17);
  std::mt19937 rng(23);
  std::uniform_real_distribution<double> u(-1, 1);
  const auto random = [&](const char* label, index_t r, index_t c) {
    View2<double> v(std::string(label), r, c);
    auto h = Kokkos::create_mirror_view(v);
    for (std::size_t i = 0; i < h.size(); ++i) h.data()[i] = u(rng);
    Kokkos::deep_copy(v, h);
    return v;
  };
  const View2<double> w = random("w", M, E), v = random("v", sh.batch * E, N), h0 = random("h0", sh.batch * E, N);
  const auto wv = host(w), vv = host(v);
  const auto loss = [&]() {
    View2<double> s("s", M, E), st("st", sh.batch * E, N);
    Kokkos::deep_copy(st, h0);
    SsdScan<double>(sh, false).forward(pb.act, unmanaged(pb.D), pb.s.docs, s, st, ExecSpace());
    const auto sv = host(s), hv = host(st);
    double l = 0;
    for (std::size_t i = 0; i < sv.size(); ++i) l += wv[i] * sv[i];
    for (std::size_t i = 0; i < hv.size(); ++i) l += vv[i] * hv[i];
    return l;
  };
  SsdGrads<double> g{View2<double>("gx", M, E), View2<double>("gdelta", M, H), View2<double>("gb", M, GN),
                     View2<double>("gc", M, GN), View1<double>("ga", H), View1<double>("gD", H)};
  View2<double> r("r", sh.batch * E, N);
  Kokkos::deep_copy(r, v);
  SsdScan<double>(sh, true).backward(pb.act, unmanaged(pb.D), pb.s.docs, w, g, ExecSpace(), h0, r);
  const double eps = 1e-6;
  const auto fd = [&](const View2<double>& view, const std::vector<std::size_t>& flat) {
    auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), view);
    const auto bump = [&](double dv) {
      for (std::size_t i : flat) h.data()[i] += dv;
      Kokkos::deep_copy(view, h);
    };
    bump(eps);
    const double lp = loss();
    bump(-2 * eps);
    const double lm = loss();
    bump(eps);
    return (lp - lm) / (2 * eps);
  };
  const auto check = [&](const char* what, const View2<double>& view, const std::vector<double>& got, index_t rows,
                         index_t cols, index_t group) {
    double worst = 0, scale = 0;
    for (index_t i = 0; i < rows; ++i)
      for (index_t j = 0; j < cols; ++j) {
        std::vector<std::size_t> flat;
        for (index_t q = 0; q < group; ++q) flat.push_back(std::size_t(i * cols * group + j * group + q));
        const double ref = fd(view, flat);
        worst = std::max(worst, std::abs(got[std::size_t(i * cols + j)] - ref));
        scale = std::max(scale, std::abs(ref));
      }
    EXPECT_GT(scale, 1e-3) << what;
    EXPECT_LE(worst, 2e-8 * std::max(1.0, scale)) << what;
  };
  check("dL/dh0", h0, host(r), sh.batch * E, N, 1);
  check("dL/dx", pb.act.yhat, host(g.gx), M, E, 1);
  check("dL/dB", pb.act.beta, host(g.gbeta), M, GN, 1);
  check("dL/dDelta", pb.act.delta, host(g.gdelta), M, H, P);
}

// A chunk as long as the window, and chunks of one token: the same numbers.
TEST(SsdScan, ChunkLengthDoesNotChangeTheResult) {
  SsdShape sh = shape(2);
  const index_t E = sh.heads * sh.head_dim, M = sh.batch * sh.T;
  Problem pb = make_problem(sh, kStarts, 13);
  View2<double> w("w", M, E);
  Kokkos::deep_copy(w, 0.25);
  std::vector<std::vector<double>> outs;
  for (const index_t Q : {index_t(1), index_t(4), sh.T}) {
    sh.chunk = Q;
    View2<double> s("s", M, E);
    SsdScan<double>(sh, false).forward(pb.act, unmanaged(pb.D), pb.s.docs, s, View2<double>(), ExecSpace());
    SsdGrads<double> g{View2<double>("gx", M, E), View2<double>("gdelta", M, sh.heads),
                       View2<double>("gb", M, sh.groups * sh.state), View2<double>("gc", M, sh.groups * sh.state),
                       View1<double>("ga", sh.heads), View1<double>("gD", sh.heads)};
    SsdScan<double>(sh, true).backward(pb.act, unmanaged(pb.D), pb.s.docs, w, g, ExecSpace());
    std::vector<double> all = host(s);
    for (const auto& v : {g.gx, g.gdelta, g.gbeta, g.ggamma}) {
      const auto hv = host(v);
      all.insert(all.end(), hv.begin(), hv.end());
    }
    outs.push_back(all);
  }
  EXPECT_LE(max_abs_diff(outs[0], outs[2]), 1e-12);
  EXPECT_LE(max_abs_diff(outs[1], outs[2]), 1e-12);
}

TEST(SsdScan, RefusesHeadsThatAreNoMultipleOfTheGroups) {
  expect_error([] { SsdScan<double>(SsdShape{1, 8, 3, 2, 2, 4, 4}, false); }, "multiple of the groups");
}

namespace {  // kernels outside the TEST body: nvcc refuses extended lambdas in its private member

// Every input a function of the token's place in its document of `len` tokens
// (a document starts every len tokens): every document the same.
void fill_periodic(const LayerActivations<float>& act, const View2<float>& g, index_t len) {
  const index_t E = act.yhat.extent(1), GN = act.beta.extent(1), M = act.yhat.extent(0);
  auto x = act.yhat;
  auto dl = act.delta;
  auto b = act.beta;
  auto c = act.gamma;
  Kokkos::parallel_for(
      "fill_periodic", Range(0, M), KOKKOS_LAMBDA(const index_t m) {
        const double t = double(m % len);
        for (index_t e = 0; e < E; ++e) {
          x(m, e) = float(kmath::sin(0.37 * t + 0.11 * double(e)));
          g(m, e) = float(kmath::cos(0.23 * t - 0.07 * double(e)));
          dl(m, e) = float(0.05 + 0.04 * (1.0 + kmath::sin(0.5 * t)));
        }
        for (index_t n = 0; n < GN; ++n) {
          b(m, n) = float(kmath::cos(0.29 * t + 0.13 * double(n)));
          c(m, n) = float(kmath::sin(0.31 * t - 0.17 * double(n)));
        }
      });
  Kokkos::deep_copy(act.a, -0.7f);
}

// A document starts every len tokens of x's one window.
void set_periodic_starts(const TokenView& x, index_t len) {
  const index_t docs = index_t(x.extent(1)) / len;
  Kokkos::View<index_t*, MemSpace> sv("starts", docs);
  Kokkos::parallel_for(
      "doc_starts", Range(0, docs), KOKKOS_LAMBDA(const index_t k) { sv(k) = k * len; });
  set_document_starts(x, sv);
}

// max over the columns and the `len` rows from `r0` of |v(r0 + i) − v(i)|, and of |v(i)|.
std::pair<double, double> first_vs_rows(const View2<float>& v, index_t r0, index_t len) {
  const index_t C = v.extent(1);
  double diff = 0, scale = 0;
  Kokkos::parallel_reduce(
      "first_vs_rows", Range(0, len * C),
      KOKKOS_LAMBDA(const index_t i, double& d) {
        const double x = kmath::fabs(double(v(r0 + i / C, i % C)) - double(v(i / C, i % C)));
        d = x > d ? x : d;
      },
      Kokkos::Max<double>(diff));
  Kokkos::parallel_reduce(
      "first_rows_max", Range(0, len * C),
      KOKKOS_LAMBDA(const index_t i, double& d) {
        const double x = kmath::fabs(double(v(i / C, i % C)));
        d = x > d ? x : d;
      },
      Kokkos::Max<double>(scale));
  return {diff, scale};
}

}  // namespace

// 64-bit indices (mamba-ssm's int32 offsets overflowed above ~61K tokens): a
// window of T tokens with T·H·P·N > 2^31 (one head of 64 channels, 64 states),
// packed with identical documents of 97 tokens (not a multiple of the chunk):
// the last document's outputs and gradients, past 2^31 state entries of the
// window, equal the first one's. About 1.6 GB; skipped where memory is short.
TEST(SsdScan, PastTwoTo31StateEntriesEveryDocumentIsTheFirst) {
  const index_t len = 97, docs = 5500, T = len * docs;
  const SsdShape sh{1, T, 1, 64, 1, 64, ssd_chunk(T)};
  const index_t E = sh.heads * sh.head_dim, N = sh.state;
  ASSERT_GT(T * E * N, index_t(1) << 31);
  const double need = 4.0 * double(T) * double(10 * E + 5 * N) + 4.0 * double(T) * double(E * N) / double(sh.chunk);
  const auto cap = memory_space_capacity();
  if (double(cap.bytes) < 1.5 * need)
    GTEST_SKIP() << "needs about " << format_bytes(std::uint64_t(1.5 * need)) << " of " << MemSpace::name()
                 << " memory (" << cap.what << ": " << format_bytes(cap.bytes) << ")";
  TokenView x("x", 1, T);
  set_periodic_starts(x, len);
  const SeqShape s{1, T, DocStarts(x)};
  const LayerActivations<float> act(s, E, N, LayerActivations<float>::projections_only, 1);
  View2<float> g("g", T, E), out("s", T, E);
  fill_periodic(act, g, len);
  View1<float> D("D", E);
  Kokkos::deep_copy(D, 0.5f);
  const Unmanaged1<float> Du(D.data(), E);
  SsdScan<float>(sh, false).forward(act, Du, s.docs, out, View2<float>(), ExecSpace());
  SsdGrads<float> gr{View2<float>("gx", T, E), View2<float>("gdelta", T, 1), View2<float>("gb", T, N),
                     View2<float>("gc", T, N), View1<float>("ga", 1), View1<float>("gD", 1)};
  SsdScan<float>(sh, true).backward(act, Du, s.docs, g, gr, ExecSpace());
  const index_t last = T - len;
  ASSERT_GT(last * E * N, index_t(1) << 31);
  const std::pair<const char*, View2<float>> views[] = {
      {"s", out}, {"dL/dx", gr.gx}, {"dL/dDelta", gr.gdelta}, {"dL/dB", gr.gbeta}, {"dL/dC", gr.ggamma}};
  for (const auto& [what, v] : views) {
    const auto [diff, scale] = first_vs_rows(v, last, len);
    EXPECT_GT(scale, 1e-3) << what;
    EXPECT_LE(diff, 1e-4 * scale) << what;
  }
}

}  // namespace ash::test
