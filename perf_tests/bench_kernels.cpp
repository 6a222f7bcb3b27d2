// Kernel micro-benchmarks on Google Benchmark (docs/design.md §6), with the
// machine's own peaks beside them for a roofline in numbers:
//   gemm      KokkosBlas::gemm 512³ (the compute peak the dense products see)
//   triad     a = b + s·c over 64 MiB per array (the memory peak)
//   h_scan    impl::boundary_states (chunk-local h scans + carry), T tokens
//   fwd_scan  ssm_layer_scan: the forward replay forming ỹ (one chunk per sequence on a CPU)
//   e3_layer  one layer of E3's backward (h, μ scans, VJP rows, dense VJPs), T tokens,
//             the wave buffers (0) or the fused per-chunk kernels (1)
//   vjp_rows  ssm_layer_backward_rows on one wave of 1024 tokens (μ, h, A given)
//   head      head_loss with its gradient (logits, log-sum-exp, two GEMMs, RMSNorm VJP)
//   e2_window E2's windowed adjoint of one layer, T̄ = 64
// Counters: tokens/s, and FLOP/s and bytes/s from the counts in each
// benchmark's comment (an exp counts as 20 FLOPs: what impl::exp_fast executes).
//   ash_bench_kernels [--benchmark_format=json --benchmark_out=FILE] [--benchmark_filter=REGEX]
#include <benchmark/benchmark.h>

#include "ash/ash.hpp"
#include "ash/grad/adjoint.hpp"
#include "ash/grad/adjoint_exact.hpp"
#include "ash/kernels/blas.hpp"
#include "ash/kernels/chunked_scan.hpp"

namespace {

using S = float;
constexpr double exp_flops = 20;

ash::ModelDims dims() {
  ash::ModelDims d;
  d.vocab = 256;
  d.width = 64;
  d.state = 16;
  d.layers = 1;
  return d;
}

// A model, one window of T tokens, its layer input and projections.
struct Setup {
  ash::ModelDims d = dims();
  ash::SeqShape s;
  ash::ParamSet<S> params{d};
  ash::ParamSet<S> grad{d};
  ash::TokenView x;
  ash::View2<S> y, y_out, g;
  ash::LayerActivations<S> act;
  explicit Setup(ash::index_t T, ash::LayerActivations<S>::Store store = ash::LayerActivations<S>::projections_only)
      : s{1, T}, act(s, d, store) {
    ash::initialize(params, 7);
    std::vector<std::uint32_t> ids(static_cast<std::size_t>(T));
    for (std::size_t i = 0; i < ids.size(); ++i) ids[i] = std::uint32_t((i * 2654435761u) % 256);
    x = ash::make_windows(ids, 1, T, d.vocab);
    y = ash::View2<S>("bench::y", T, d.width);
    y_out = ash::View2<S>("bench::y_out", T, d.width);
    g = ash::View2<S>("bench::g", T, d.width);
    ash::embedding_forward(params.global().embedding, x, y);
    ash::ssm_layer_forward(params.layer(0), s, y, act, y_out);
    Kokkos::deep_copy(g, S(1e-3));
  }
};

void set_counters(benchmark::State& st, double tokens, double flops, double bytes) {
  const auto rate = benchmark::Counter::kIsIterationInvariantRate;
  st.counters["tokens/s"] = benchmark::Counter(tokens, rate);
  st.counters["FLOP/s"] = benchmark::Counter(flops, rate, benchmark::Counter::kIs1000);
  st.counters["bytes/s"] = benchmark::Counter(bytes, rate, benchmark::Counter::kIs1024);
}

// 2·n³ FLOPs; 3 n² numbers moved (at least).
void BM_gemm(benchmark::State& st) {
  const ash::index_t n = st.range(0);
  ash::View2<S> a("a", n, n), b("b", n, n), c("c", n, n);
  Kokkos::deep_copy(a, S(1));
  Kokkos::deep_copy(b, S(0.5));
  for (auto _ : st) {
    ash::impl::gemm<S>(ash::ExecSpace(), "N", "N", S(1), a, b, S(0), c);
    Kokkos::fence();
  }
  set_counters(st, 0, 2.0 * n * n * n, 3.0 * n * n * sizeof(S));
}

// 2 FLOPs and 3 numbers per element.
void BM_triad(benchmark::State& st) {
  const ash::index_t n = st.range(0);
  ash::View1<S> a("a", n), b("b", n), c("c", n);
  Kokkos::deep_copy(b, S(1));
  Kokkos::deep_copy(c, S(2));
  for (auto _ : st) {
    Kokkos::parallel_for(
        "bench::triad", ash::Range(0, n), KOKKOS_LAMBDA(const ash::index_t i) { a(i) = b(i) + S(3) * c(i); });
    Kokkos::fence();
  }
  set_counters(st, 0, 2.0 * n, 3.0 * n * sizeof(S));
}

// Per (token, channel, state): one exp and 4 FLOPs; per token reads Δ, ŷ (P) and β (N).
void BM_h_scan(benchmark::State& st) {
  const ash::index_t T = st.range(0);
  Setup su(T);
  const ash::index_t P = su.d.width, N = su.d.state, C = 64;
  const ash::impl::Chunks ch(C, T);
  const ash::impl::ScanView<S> L{su.act.delta, su.act.yhat, su.act.beta, su.act.gamma, ash::View2<S>(), su.act.a, T};
  ash::View3<S> Hb("Hb", ch.n, P, N), PA("PA", ch.n, P, N);
  for (auto _ : st) {
    ash::impl::boundary_states(L, ch, 1, Hb, PA);
    Kokkos::fence();
  }
  set_counters(st, double(T), double(T) * P * N * (exp_flops + 4), double(T) * (2 * P + N) * sizeof(S));
}

// Per (token, channel, state): one exp and 5 FLOPs; per token reads y, Δ, ŷ (P), β, γ (N), writes y (P).
void BM_fwd_scan(benchmark::State& st) {
  const ash::index_t T = st.range(0);
  Setup su(T);
  const auto P = su.d.width, N = su.d.state;
  for (auto _ : st) {
    ash::ssm_layer_scan(su.params.layer(0), su.s, su.y, su.act, su.y_out);
    Kokkos::fence();
  }
  set_counters(st, double(T), double(T) * P * N * (exp_flops + 5), double(T) * (4 * P + 2 * N) * sizeof(S));
}

// Times one layer's reverse mode (layer 0 of su, g reset outside the timing
// before every iteration): the loop of the per-layer engine benchmarks.
void time_layer_backward(benchmark::State& st, ash::LayerAdjoint<S>& layer, ash::ActivationStore<S>& store,
                         const Setup& su) {
  ash::View2<S> g("g", su.g.extent(0), su.g.extent(1));
  for (auto _ : st) {
    st.PauseTiming();
    Kokkos::deep_copy(g, su.g);
    st.ResumeTiming();
    layer.backward(su.params.layer(0), su.d, 0, store, g, su.grad.layer(0));
    Kokkos::fence();
  }
}

// Per (token, channel, state), E3 evaluates 3 exps (h boundary, μ chunk, the
// chunk replay) and about 30 FLOPs of scans and VJPs; plus 12 P² + 12 P N
// FLOPs of dense VJPs per token. Bytes: the wave form (second argument 0)
// moves h, A, μ of the wave (5 passes of 4 bytes per state); the fused form (1,
// the default) only per-token rows, ~8 P + 6 N numbers (projections, g, the
// cotangents), and the per-chunk boundary states and sums (~4 P·N per chunk).
void BM_e3_layer(benchmark::State& st) {
  const ash::index_t T = st.range(0);
  const bool fused = st.range(1) != 0;
  Setup su(T);
  const auto P = su.d.width, N = su.d.state;
  ash::EngineOptions o;
  o.method = ash::Method::adjoint_exact;
  o.e3_fused = fused;
  ash::AdjointExactLayer<S> layer(o);
  ash::ActivationStore<S> store(su.s, su.d, 0, 1, layer.store(), false);
  Kokkos::deep_copy(store.input(0), su.y);
  time_layer_backward(st, layer, store, su);
  const double per_state = fused ? 4.0 / double(o.chunk) : 5.0;
  set_counters(st, double(T), double(T) * (P * N * (3 * exp_flops + 30) + 12.0 * P * P + 12.0 * P * N),
               double(T) * (per_state * P * N + (fused ? 8.0 * P + 6.0 * N : 0.0)) * sizeof(S));
}

// Per (token, channel, state) ~14 FLOPs reading μ, h, A and writing μ' (4
// numbers), plus the dense VJPs (12 P² + 12 P N per token).
void BM_vjp_rows(benchmark::State& st) {
  const ash::index_t W = st.range(0);
  Setup su(W, ash::LayerActivations<S>::with_hprev_and_A);
  const auto P = su.d.width, N = su.d.state;
  ash::View3<S> mu("mu", W, P, N), mu0("mu0", W, P, N);
  Kokkos::deep_copy(mu0, S(1e-3));
  const ash::LayerCotangents<S> cot(W, su.d);
  ash::View2<S> g("g", W, P);
  for (auto _ : st) {
    st.PauseTiming();
    Kokkos::deep_copy(mu, mu0);
    Kokkos::deep_copy(g, su.g);
    st.ResumeTiming();
    ash::ssm_layer_backward_rows(su.params.layer(0), su.s, su.y, su.act, g, ash::BlockRows{W, su.s.T, 0}, mu,
                                 su.act.hprev, su.act.A, cot, su.grad.layer(0), g, false);
    Kokkos::fence();
  }
  set_counters(st, double(W), double(W) * (14.0 * P * N + 12.0 * P * P + 12.0 * P * N),
               double(W) * P * N * 4 * sizeof(S));
}

// Per token 6 V P FLOPs of GEMMs and V exps twice; the logits (V) written and read 3 times.
void BM_head(benchmark::State& st) {
  const ash::index_t T = st.range(0);
  Setup su(T);
  const auto P = su.d.width, V = su.d.vocab;
  const auto gg = su.grad.global();
  for (auto _ : st) {
    ash::head_loss<S>(su.params.global(), su.x, su.y, su.g, &gg, 1024, 0, ash::ExecSpace());
    Kokkos::fence();
  }
  set_counters(st, double(T), double(T) * (6.0 * V * P + 2 * V * exp_flops), double(T) * V * 4 * sizeof(S));
}

// E2 with T̄ = 64: per (token, channel, state) T̄ products and sums (2 FLOPs
// each) over stored A; μ written once.
void BM_e2_window(benchmark::State& st) {
  const ash::index_t T = st.range(0), Tbar = 64;
  Setup su(T, ash::LayerActivations<S>::with_hprev_and_A);
  const auto P = su.d.width, N = su.d.state;
  ash::EngineOptions o;
  o.method = ash::Method::adjoint;
  o.truncate = Tbar;
  ash::AdjointLayer<S> layer(o);
  ash::ActivationStore<S> store(su.s, su.d, 0, 1, layer.store(), true);
  Kokkos::deep_copy(store.input(0), su.y);
  ash::forward_layers(su.params, store);
  time_layer_backward(st, layer, store, su);
  set_counters(st, double(T), double(T) * P * N * (4.0 * Tbar + 14) + double(T) * 12.0 * P * P,
               double(T) * P * N * (Tbar + 4) * sizeof(S));
}

BENCHMARK(BM_gemm)->Arg(512)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_triad)->Arg(1 << 24)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_h_scan)->RangeMultiplier(4)->Range(1 << 10, 1 << 16)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_fwd_scan)->RangeMultiplier(4)->Range(1 << 10, 1 << 16)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_e3_layer)
    ->ArgsProduct({benchmark::CreateRange(1 << 10, 1 << 16, 4), {0, 1}})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_vjp_rows)->Arg(1024)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_head)->RangeMultiplier(4)->Range(1 << 10, 1 << 14)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_e2_window)->RangeMultiplier(4)->Range(1 << 10, 1 << 14)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace

int main(int argc, char** argv) {
  Kokkos::ScopeGuard kokkos(argc, argv);
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
