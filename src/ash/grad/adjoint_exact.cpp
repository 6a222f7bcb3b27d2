#include "ash/grad/adjoint_exact.hpp"

#include <algorithm>
#include <cmath>
#include <utility>

#include "ash/core/error.hpp"
#include "ash/model/forward.hpp"
#include "ash/grad/impl/e3_fused.hpp"
#include "ash/grad/impl/e3_scans.hpp"
#include "ash/grad/impl/e3_walk.hpp"
#include "ash/kernels/chunked_scan.hpp"
#include "ash/kernels/row_sums.hpp"

namespace ash {

namespace {

using impl::Chunks;
using impl::ScanView;

// The labels of E3's buffers: the workspace spec names them, run() asks for them.
namespace buf {
constexpr const char* h_boundary = "ash::e3::h_boundary";
constexpr const char* h_running = "ash::e3::h_running";
constexpr const char* chunk_products = "ash::e3::chunk_products";
constexpr const char* mu_chunk_start = "ash::e3::mu_chunk_start";
constexpr const char* carry_groups = "ash::e3::carry_groups";
constexpr const char* fused_alog_part = "ash::e3::fused_alog_part";
constexpr const char* fused_beta_part = "ash::e3::fused_beta_part";
constexpr const char* fused_gamma_part = "ash::e3::fused_gamma_part";
constexpr const char* fused_d_part = "ash::e3::fused_d_part";
constexpr const char* fused_bd_part = "ash::e3::fused_bd_part";
constexpr const char* fused_team = "ash::e3::fused_team_scratch";
constexpr const char* wave_hprev = "ash::e3::wave_hprev";
constexpr const char* wave_A = "ash::e3::wave_A";
constexpr const char* wave_mu = "ash::e3::wave_mu";
constexpr const char* open_mu = "ash::e3::open_mu";
constexpr const char* open_A = "ash::e3::open_A";
constexpr const char* carry_mu = "ash::e3::carry_mu";
constexpr const char* carry_A = "ash::e3::carry_A";
}  // namespace buf

// The fused form's team shape for this layer shape (its chunks: grad.chunk, at most T).
impl::FusedShape fused_shape(const EngineOptions& opts, const LayerShape& sh) {
  const index_t C = opts.chunk < sh.T ? opts.chunk : sh.T;
  if (opts.e3_walk)
    return impl::walk_shape(sh.P, sh.N, C, impl::lane_tile(sh.N), opts.e3_channel_block, sh.scalar_bytes);
  return impl::fused_shape(sh.P, sh.N, C, impl::lane_tile(sh.N), opts.e3_channel_block, sh.scalar_bytes, sh.batch,
                           index_t(ExecSpace().concurrency()));
}

}  // namespace


namespace {
// Whole units (chunks, windows) of about `tokens` tokens, at least one.
index_t whole_units(index_t unit, index_t tokens) { return unit * (tokens / unit > 0 ? tokens / unit : 1); }
}  // namespace

index_t e3_wave_length(const EngineOptions& opts, index_t T, index_t state_per_token) {
  const bool window = opts.truncate > 0 && opts.truncate < T;
  const index_t unit = window ? opts.truncate : (opts.chunk < T ? opts.chunk : T);
  constexpr index_t device_wave_state = index_t(1) << 24;
  const index_t per_token = state_per_token > 0 ? state_per_token : 1;
  const index_t wave = opts.wave > 0 ? opts.wave
                       : host_backend ? 1024
                                      : std::min(T, std::max<index_t>(1024, device_wave_state / per_token));
  return whole_units(unit, wave);
}

E3FusedWaves e3_fused_waves(const EngineOptions& opts, const LayerShape& sh) {
  const index_t T = sh.T, Bt = sh.batch, P = sh.P, N = sh.N, C = opts.chunk < T ? opts.chunk : T;
  const double e = double(sh.scalar_bytes);
  // Per token of one wave: the cotangent rows (∂L/∂ŷ, ∂L/∂z, gathered ŷ;
  // ∂L/∂β, ∂L/∂γ; the norm's row-block sums) and its chunk's share of the
  // [P, N] and two [P] partial sums. Per launched token: the block shares.
  constexpr double device_wave_bytes = double(std::size_t(512) << 20);
  constexpr double device_share_bytes = double(std::size_t(128) << 20);
  const double row = double(Bt) * e *
                     ((3.0 * double(P) + 2.0 * double(N)) + double(P) / double(impl::reduce_rows) +
                      (double(P) * double(N) + 2.0 * double(P)) / double(C));
  const index_t nPB = fused_shape(opts, sh).nPB;
  const double share = nPB > 1 ? double(Bt) * e * 2.0 * double(nPB) * double(N) : 0.0;
  const auto tokens = [T](double budget, double per_token) {
    return per_token > 0 ? index_t(std::min(double(T), std::floor(budget / per_token))) : T;
  };
  E3FusedWaves f;
  const index_t wave = opts.wave > 0 ? opts.wave : host_backend ? 1024 : tokens(device_wave_bytes, row);
  f.wave = std::min(T, whole_units(C, wave));
  const index_t launch = opts.e3_fused_launch > 0 ? opts.e3_fused_launch
                         : host_backend           ? f.wave
                                                  : tokens(device_share_bytes, share);
  f.launch = std::min(f.wave, whole_units(C, launch));
  return f;
}

bool e3_fused_form(const EngineOptions& opts, index_t T, bool halo) {
  return opts.e3_fused && !(opts.truncate > 0 && opts.truncate < T) && !halo;
}

WorkspaceSpec adjoint_exact_workspace(const EngineOptions& opts, const LayerShape& sh, bool halo) {
  const index_t T = sh.T, Bt = sh.batch, P = sh.P, N = sh.N;
  const std::size_t e = sh.scalar_bytes;
  const bool window = opts.truncate > 0 && opts.truncate < T;
  const index_t C = opts.chunk < T ? opts.chunk : T, nc = Chunks(C, T).n;
  const bool fused = e3_fused_form(opts, T, halo), chunked_h = opts.e3_chunked_h;
  const E3FusedWaves fw = fused ? e3_fused_waves(opts, sh) : E3FusedWaves{};
  const index_t W = fused ? fw.wave : e3_wave_length(opts, T, Bt * P * N), Wbuf = W < T ? W : T;
  WorkspaceSpec w;
  // h at chunk ends (chunk-parallel h form) or the running h (sequential form)
  if (chunked_h)
    w.add(buf::h_boundary, e, {Bt * nc, P, N}, true);
  else
    w.add(buf::h_running, e, {Bt * P, N}, false);
  if (chunked_h || !window)  // boundary products (chunked h); μ's chunk products G (exact mode)
    w.add(buf::chunk_products, e, {Bt * nc, P, N}, true);
  if (!window) w.add(buf::mu_chunk_start, e, {Bt * nc, P, N}, true);
  // carry_chunks' groups (a GPU's long windows), shared by the h and μ passes
  if (const index_t rows = impl::carry_group_rows(Bt, nc); rows > 0 && (chunked_h || !window))
    w.add(buf::carry_groups, e, {rows, P, N}, false);
  if (fused) {
    // Per-chunk partial sums, channel-block shares of ∂L/∂β and ∂L/∂γ
    // (impl/e3_fused.hpp), and the team scratch Kokkos keeps once grown: on
    // a host each thread's; on a GPU none while it fits shared memory, else
    // level 1 for as many teams as can be resident (CUDA's concurrency / team
    // size) or the whole league.
    const impl::FusedShape fs = fused_shape(opts, sh);
    const index_t ncw = (Wbuf + C - 1) / C;  // chunks per wave (waves are whole chunks here)
    const index_t ncl = (fw.launch + C - 1) / C;  // chunks per launch
    w.add(buf::fused_alog_part, e, {Bt * ncw, P, N}, false);
    if (fs.nPB > 1) {
      w.add(buf::fused_beta_part, e, {Bt * fw.launch, fs.nPB, N}, false);
      w.add(buf::fused_gamma_part, e, {Bt * fw.launch, fs.nPB, N}, false);
    }
    w.add(buf::fused_d_part, e, {Bt * ncw, P}, false);
    w.add(buf::fused_bd_part, e, {Bt * ncw, P}, false);
    const double per_team = opts.e3_walk ? double(impl::walk_scratch_scalars(C, N, fs.Pt)) * double(e)
                                         : 2 * double(C) * (double(fs.Pt) * double(N) + 1) * double(e);  // two [C, Pt·N + 1]
    const double conc = double(ExecSpace().concurrency());
    const bool level1 = !host_backend && per_team + 8.0 * (fs.team + 2) > 48.0 * 1024;
    const double league = double(Bt) * (chunked_h ? double(ncl) : 1.0) * double(fs.nPB);
    w.team_scratch(buf::fused_team, host_backend ? per_team * conc
                                    : level1     ? per_team * std::min(std::floor(conc / double(fs.team)), league)
                                                 : 0.0);
  } else {  // one wave of h^{t-1}, A and μ
    w.add(buf::wave_hprev, e, {Bt * Wbuf, P, N}, false);
    w.add(buf::wave_A, e, {Bt * Wbuf, P, N}, false);
    w.add(buf::wave_mu, e, {Bt * Wbuf, P, N}, false);
  }
  require(!fused || sh.groups == 1, "adjoint-exact: the fused form reads one group of B and C");
  w.cotangents(Bt * Wbuf, P, N, !fused, e, sh.groups);  // the fused form keeps its own partials
  return w;
}

WorkspaceSpec adjoint_exact_carry_map_workspace(const EngineOptions& opts, const LayerShape& sh) {
  const index_t T = sh.T, Bt = sh.batch, P = sh.P, N = sh.N, C = opts.chunk < T ? opts.chunk : T;
  const index_t nc = Chunks(C, T).n;
  const std::size_t e = sh.scalar_bytes;
  WorkspaceSpec w;
  w.add(buf::open_mu, e, {Bt, P, N}, true);
  w.add(buf::open_A, e, {Bt, P, N}, true);
  w.add(buf::mu_chunk_start, e, {Bt * nc, P, N}, true);
  w.add(buf::chunk_products, e, {Bt * nc, P, N}, true);
  return w;
}

WorkspaceSpec adjoint_exact_block_workspace(const LayerShape& sh) {
  return WorkspaceSpec().projections(sh.rows(), sh.P, sh.N, sh.scalar_bytes);
}

WorkspaceSpec adjoint_exact_carry_workspace(const LayerShape& sh) {
  WorkspaceSpec w;
  w.add(buf::carry_mu, sh.scalar_bytes, {sh.batch, sh.P, sh.N}, true);
  w.add(buf::carry_A, sh.scalar_bytes, {sh.batch, sh.P, sh.N}, true);
  return w;
}

namespace {
// The workspace's carry_chunks group rows; empty where no carry pass runs in
// groups (then nothing reads it). passes: whether h or μ runs a carry pass.
template <class S>
View3<S> carry_groups(const Workspace<S>& w, index_t Bt, index_t nc, bool passes) {
  return passes && impl::carry_group_rows(Bt, nc) > 0 ? w.view3(buf::carry_groups) : View3<S>();
}
}  // namespace

namespace impl {

// E3's wave form over the tokens [0, own) of every sequence, once h (Hb or
// hrun) and μ at chunk starts (Ms, exact mode) are known: per wave of W
// tokens h^{t-1}, A^t and μ (μ_T̄ with a window Tbar > 0) in the workspace's
// wave buffers, then on_wave for its rows. Shared by AdjointExactLayer::run
// and adjoint_exact_scan_waves (a kind's scan core).
template <class S>
void e3_waves(const ScanView<S>& L, const Chunks chunks, index_t Bt, const View3<S>& Hb, const View2<S>& hrun,
              const View2<S>& h0, const View3<S>& Ms, const ExactCarry<S>& cin, index_t Tbar, index_t own, index_t W,
              const Workspace<S>& w, const ScanWaveFn<S>& on_wave, const ExecSpace& exec) {
  const index_t T = L.T, P = L.a.extent(0), N = L.a.extent(1);
  const bool window = Tbar > 0, chunked_h = Hb.extent(0) > 0;
  const View3<S> hbuf = w.view3(buf::wave_hprev), Abuf = w.view3(buf::wave_A), mubuf = w.view3(buf::wave_mu);
  for (index_t w0 = 0; w0 < own; w0 += W) {  // in order: the sequential form carries h from wave to wave
    const index_t Ww = (w0 + W < T) ? W : T - w0;
    if (chunked_h) {
      ASH_WITH_LANE_TILE(
          N, impl::wave_scans<NT>(L, chunks, Bt, Hb, h0, Ms, cin, !window, w0, Ww, hbuf, Abuf, mubuf, exec));
    } else {
      ASH_WITH_LANE_TILE(N, impl::wave_scans_sequential<NT>(L, chunks, Bt, hrun, h0, Ms, cin, !window, w0, Ww, hbuf,
                                                            Abuf, mubuf, exec));
    }
    if (window) impl::wave_mu_window(L, Tbar, Bt, P, N, w0, Ww, mubuf, exec);
    if (w0 + Ww > own) {  // halo rows: μ and g are zero there, so they add nothing (the VJPs are linear in both)
      const index_t h0t = own - w0, nh = w0 + Ww - own;
      const View2<S> gg = L.gy;
      Kokkos::parallel_for(
          "ash::e3::mask_halo", Range(exec, 0, Bt * nh * P), KOKKOS_LAMBDA(const index_t i) {
            const index_t b = i / (nh * P), t = h0t + (i / P) % nh, q = i % P;
            gg(b * T + w0 + t, q) = S(0);
            for (index_t n = 0; n < N; ++n) mubuf(b * Ww + t, q, n) = S(0);
          });
    }
    // The VJPs of this wave's rows (an SSM-ResNet's g_k becomes g_{k-1} in
    // place): the scans above read only rows of this wave or later ones, and
    // the carries were taken first.
    on_wave(BlockRows{Ww, T, w0}, mubuf, hbuf, Abuf, w.cotangents());
  }
}

// E3's fused form (or, with opts.e3_walk, the reverse walk) over the tokens
// [0, own) of every sequence, once h (Hb or hrun) and μ at chunk starts (Ms)
// are known: per wave, the fused kernel (or the walk) in launches of part of
// the wave into the workspace's cotangent rows and partial sums, then
// on_wave for its rows. Shared by AdjointExactLayer::run and
// adjoint_exact_scan_fused (a kind's scan core).
template <class S>
void e3_fused_waves_run(const EngineOptions& opts, const ScanView<S>& L, const Chunks chunks, index_t Bt,
                        const View3<S>& Hb, const View2<S>& hrun, const View2<S>& h0, const View3<S>& Ms,
                        const ExactCarry<S>& cin, const Unmanaged1<S>& D, index_t own, const LayerShape& sh,
                        const Workspace<S>& w, const ScanFusedFn<S>& on_wave, const ExecSpace& exec) {
  const index_t T = L.T, N = L.a.extent(1), C = chunks.len;
  const E3FusedWaves fw = e3_fused_waves(opts, sh);
  const impl::FusedShape fs = ash::fused_shape(opts, sh);
  const bool split = fs.nPB > 1;
  const LayerCotangents<S>& cot = w.cotangents();
  const impl::FusedOut<S> out{cot.gz,
                              cot.gyhat,
                              split ? w.view3(buf::fused_beta_part) : View3<S>(),
                              split ? w.view3(buf::fused_gamma_part) : View3<S>(),
                              cot.gbeta,
                              cot.ggamma,
                              w.view3(buf::fused_alog_part),
                              w.view2(buf::fused_d_part),
                              w.view2(buf::fused_bd_part)};
  const index_t W = fw.wave;
  for (index_t w0 = 0; w0 < own; w0 += W) {  // in order: the sequential form carries h from wave to wave
    const index_t Ww = (w0 + W < T) ? W : T - w0;
    for (index_t l0 = w0; l0 < w0 + Ww; l0 += fw.launch) {  // in order, as the waves
      const index_t Wl = l0 + fw.launch < w0 + Ww ? fw.launch : w0 + Ww - l0;
      if (opts.e3_walk) {
        ASH_WITH_LANE_TILE(N, impl::walk_chunk_backward<NT>(L, chunks, Bt, Hb, hrun, h0, Ms, cin, D, w0, Ww, l0, Wl,
                                                            fs, out, exec));
      } else {
        ASH_WITH_LANE_TILE(N, impl::fused_chunk_backward<NT>(L, chunks, Bt, Hb, hrun, h0, Ms, cin, D, w0, Ww, l0, Wl,
                                                             fs, out, exec));
      }
    }
    on_wave(BlockRows{Ww, T, w0}, cot, ParamPartials<S>{out.alog_part, out.d_part, out.bd_part, Bt * ((Ww + C - 1) / C)});
  }
}

}  // namespace impl

namespace {
// The scan part alone runs the wave form; detachment is its caller's (the dense
// VJPs), the window T̄ its own. A wide scan core (a mixer's, over its inner
// width E): its three [Bt·W, E, N] wave buffers are read by the VJPs right
// after the scans, so on a host "auto" sizes W so that each holds at most
// 2^19 numbers (one 64-token chunk at E·N = 8192; the default 1024 tokens made them 32 MiB each there, and the
// gradient 1.6x slower: perf_tests/RESULTS.md), never more than 1024 tokens.
EngineOptions scan_wave_options(const EngineOptions& opts, index_t state_per_token) {
  EngineOptions o = opts;
  o.e3_fused = false;
  o.detach_inputs = false;
  constexpr index_t host_wave_state = index_t(1) << 19, host_wave = 1024;
  if (host_backend && o.wave == 0)
    o.wave = std::max<index_t>(1, std::min(host_wave, host_wave_state / std::max<index_t>(1, state_per_token)));
  return o;
}
}  // namespace

WorkspaceSpec adjoint_exact_scan_workspace(const EngineOptions& opts, const LayerShape& sh) {
  return adjoint_exact_workspace(scan_wave_options(opts, sh.batch * sh.P * sh.N), sh);
}

template <class S>
void adjoint_exact_scan_waves(const EngineOptions& opts_in, Workspace<S>& work, const SeqShape& s,
                              const LayerActivations<S>& act, const View2<S>& gy, const ScanWaveFn<S>& on_wave,
                              const ExecSpace& exec, const View2<S>& h0, ExactCarry<S>* carry, index_t own_T) {
  const index_t T = s.T, Bt = s.batch, P = act.a.extent(0), N = act.a.extent(1);
  require(own_T >= 0 && own_T <= T, "adjoint-exact: a range's own tokens must lie in its extended block");
  require(opts_in.chunk >= 1 && opts_in.wave >= 0, "adjoint-exact: chunk must be >= 1 and wave >= 0 (0: auto)");
  const EngineOptions opts = scan_wave_options(opts_in, Bt * P * N);
  const index_t C = opts.chunk < T ? opts.chunk : T;
  const Chunks chunks(C, T);
  const index_t W = e3_wave_length(opts, T, Bt * P * N);
  const bool chunked_h = opts.e3_chunked_h, window = opts.truncate > 0 && opts.truncate < T;
  work.plan(adjoint_exact_workspace(opts, LayerShape{Bt, T, P, N, sizeof(S), index_t(act.beta.extent(1)) / N}));
  // The buffers and steps of run()'s wave form: a window reads no μ at chunk starts.
  const View3<S> Hb = chunked_h ? work.view3(buf::h_boundary) : View3<S>();
  const View2<S> hrun = chunked_h ? View2<S>() : work.view2(buf::h_running);
  const View3<S> G = chunked_h || !window ? work.view3(buf::chunk_products) : View3<S>();
  const View3<S> Ms = window ? View3<S>() : work.view3(buf::mu_chunk_start);
  const View3<S> gbuf = carry_groups(work, Bt, chunks.n, chunked_h || !window);
  require(!(window && carry), "adjoint-exact: a window runs on whole windows, not token blocks");
  const ScanView<S> L{act.delta, act.yhat, act.beta, act.gamma, gy, act.a, T, s.docs};
  const ExactCarry<S> none;
  const ExactCarry<S>& cin = carry ? *carry : none;
  if (chunked_h) impl::boundary_states(L, chunks, Bt, Hb, G, h0, exec, gbuf);
  if (!window) impl::chunk_start_adjoints(L, chunks, Bt, Ms, G, cin, exec, gbuf);
  impl::e3_waves(L, chunks, Bt, Hb, hrun, h0, Ms, cin, window ? opts.truncate : 0, own_T > 0 ? own_T : T, W, work,
                 on_wave, exec);
  if (!carry) return;
  if (index_t(carry->mu.extent(0)) != Bt) {  // a layer's first block allocates the carry
    const WorkspaceSpec cs = adjoint_exact_carry_workspace(LayerShape{Bt, T, P, N, sizeof(S)});
    carry->mu = make_view3<S>(*cs.find(buf::carry_mu));
    carry->A = make_view3<S>(*cs.find(buf::carry_A));
  }
  impl::take_carry(L, Bt, chunks.n, Ms, *carry, exec);
}

template void adjoint_exact_scan_waves<float>(const EngineOptions&, Workspace<float>&, const SeqShape&,
                                              const LayerActivations<float>&, const View2<float>&,
                                              const ScanWaveFn<float>&, const ExecSpace&, const View2<float>&,
                                              ExactCarry<float>*, index_t);
template void adjoint_exact_scan_waves<double>(const EngineOptions&, Workspace<double>&, const SeqShape&,
                                               const LayerActivations<double>&, const View2<double>&,
                                               const ScanWaveFn<double>&, const ExecSpace&, const View2<double>&,
                                               ExactCarry<double>*, index_t);

bool e3_scan_fused_form(const EngineOptions& opts, index_t T, index_t groups) {
  return opts.e3_scan_fused && groups == 1 && e3_fused_form(opts, T);
}

namespace {
// The fused scan part's options: exact mode (the caller detaches in its dense VJPs).
EngineOptions scan_fused_options(const EngineOptions& opts) {
  EngineOptions o = opts;
  o.detach_inputs = false;
  return o;
}
}  // namespace

WorkspaceSpec adjoint_exact_scan_fused_workspace(const EngineOptions& opts, const LayerShape& sh) {
  return adjoint_exact_workspace(scan_fused_options(opts), sh);
}

template <class S>
void adjoint_exact_scan_fused(const EngineOptions& opts_in, Workspace<S>& work, const SeqShape& s,
                              const LayerActivations<S>& act, const View2<S>& gy, const Unmanaged1<S>& D,
                              const ScanFusedFn<S>& on_wave, const ExecSpace& exec, const View2<S>& h0,
                              ExactCarry<S>* carry) {
  const index_t T = s.T, Bt = s.batch, P = act.a.extent(0), N = act.a.extent(1);
  const index_t groups = index_t(act.beta.extent(1)) / N;
  require(opts_in.chunk >= 1 && opts_in.wave >= 0, "adjoint-exact: chunk must be >= 1 and wave >= 0 (0: auto)");
  require(e3_scan_fused_form(opts_in, T, groups), "adjoint_exact_scan_fused: not the fused form's case");
  const EngineOptions opts = scan_fused_options(opts_in);
  const index_t C = opts.chunk < T ? opts.chunk : T;
  const Chunks chunks(C, T);
  const bool chunked_h = opts.e3_chunked_h;
  const LayerShape sh{Bt, T, P, N, sizeof(S)};
  work.plan(adjoint_exact_workspace(opts, sh));
  const View3<S> Hb = chunked_h ? work.view3(buf::h_boundary) : View3<S>();
  const View2<S> hrun = chunked_h ? View2<S>() : work.view2(buf::h_running);
  const View3<S> G = work.view3(buf::chunk_products), Ms = work.view3(buf::mu_chunk_start);
  const View3<S> gbuf = carry_groups(work, Bt, chunks.n, true);
  const ScanView<S> L{act.delta, act.yhat, act.beta, act.gamma, gy, act.a, T, s.docs};
  const ExactCarry<S> none;
  const ExactCarry<S>& cin = carry ? *carry : none;
  if (chunked_h) impl::boundary_states(L, chunks, Bt, Hb, G, h0, exec, gbuf);
  impl::chunk_start_adjoints(L, chunks, Bt, Ms, G, cin, exec, gbuf);
  impl::e3_fused_waves_run(opts, L, chunks, Bt, Hb, hrun, h0, Ms, cin, D, T, sh, work, on_wave, exec);
  if (!carry) return;
  if (index_t(carry->mu.extent(0)) != Bt) {  // a layer's first block allocates the carry
    const WorkspaceSpec cs = adjoint_exact_carry_workspace(sh);
    carry->mu = make_view3<S>(*cs.find(buf::carry_mu));
    carry->A = make_view3<S>(*cs.find(buf::carry_A));
  }
  impl::take_carry(L, Bt, chunks.n, Ms, *carry, exec);
}

template void adjoint_exact_scan_fused<float>(const EngineOptions&, Workspace<float>&, const SeqShape&,
                                              const LayerActivations<float>&, const View2<float>&,
                                              const Unmanaged1<float>&, const ScanFusedFn<float>&, const ExecSpace&,
                                              const View2<float>&, ExactCarry<float>*);
template void adjoint_exact_scan_fused<double>(const EngineOptions&, Workspace<double>&, const SeqShape&,
                                               const LayerActivations<double>&, const View2<double>&,
                                               const Unmanaged1<double>&, const ScanFusedFn<double>&,
                                               const ExecSpace&, const View2<double>&, ExactCarry<double>*);

template <class S>
AdjointExactLayer<S>::AdjointExactLayer(const EngineOptions& opts) : opts_(opts) {
  require(opts.truncate == 0 || opts.detach_inputs,
          "adjoint-exact: a window (grad.truncate) needs grad.detach_inputs; a window on the exact gradient is "
          "undefined");
  require(opts.chunk >= 1 && opts.wave >= 0, "adjoint-exact: chunk must be >= 1 and wave >= 0 (0: auto)");
}

template <class S>
std::string AdjointExactLayer<S>::name() const {
  std::string n = "adjoint-exact (C=" + std::to_string(opts_.chunk);
  if (opts_.detach_inputs) n += ", detached";
  if (opts_.truncate > 0) n += ", T-bar=" + std::to_string(opts_.truncate);
  return n + ")";
}

template <class S>
void AdjointExactLayer<S>::backward_block(const LayerParams<S>& p, const SeqShape& sb, const View2<S>& y_blk,
                                          const View2<S>& g_blk, const View2<S>& h0, ExactCarry<S>* carry,
                                          const LayerParams<S>& grad) {
  run(p, sb, y_blk, project_block(p, sb, y_blk), g_blk, h0, carry, grad);
}

template <class S>
const LayerActivations<S>& AdjointExactLayer<S>::project_block(const LayerParams<S>& p, const SeqShape& sb,
                                                               const View2<S>& y) {
  block_work_.plan(adjoint_exact_block_workspace(layer_shape(sb, p)));
  const LayerActivations<S>& act = block_work_.projections();
  ssm_layer_project(p, y, act, this->exec_);
  return act;
}

template <class S>
void AdjointExactLayer<S>::backward_window_range(const LayerParams<S>& p, const SeqShape& s_ext, const View2<S>& y_ext,
                                                 const View2<S>& g_ext, const View2<S>& h0, index_t own_T,
                                                 const LayerParams<S>& grad) {
  require(opts_.detach_inputs, "adjoint-exact: a window (grad.truncate) needs grad.detach_inputs");
  require(own_T >= 1 && own_T <= s_ext.T, "adjoint-exact: a range's own tokens must lie in its extended block");
  run(p, s_ext, y_ext, project_block(p, s_ext, y_ext), g_ext, h0, nullptr, grad, own_T);
}

// μ's carry map over a piece of the window: c_before = M ⊙ c_after + v, from
// μ at chunk starts with a zero carry from later pieces and, through a carry
// of μ = 0, A = 1, the chunks' full products G_c (so c_before = A^0 μ^0 =
// A^0 (Ms_0 + (Π_c G_c) ⊙ c_after)).
template <class S>
void AdjointExactLayer<S>::carry_map(const LayerActivations<S>& act, const SeqShape& s, const View2<S>& g,
                                     const View3<S>& M, const View3<S>& v) {
  const ScanView<S> L{act.delta, act.yhat, act.beta, act.gamma, g, act.a, s.T, s.docs};
  const index_t T = s.T, Bt = s.batch, P = M.extent(1), N = M.extent(2);
  const index_t C = opts_.chunk < T ? opts_.chunk : T;
  const Chunks chunks(C, T);
  const index_t nc = chunks.n;
  const ExecSpace& exec = this->exec_;
  // One call's buffers, freed on return (as before the carry map had a workspace).
  Workspace<S> ws;
  ws.plan(adjoint_exact_carry_map_workspace(opts_, LayerShape{Bt, T, P, N, sizeof(S)}));
  ExactCarry<S> open;
  open.mu = ws.view3(buf::open_mu);
  open.A = ws.view3(buf::open_A);
  Kokkos::deep_copy(exec, open.A, S(1));
  open.valid = true;
  const View3<S> Ms = ws.view3(buf::mu_chunk_start), G = ws.view3(buf::chunk_products);
  impl::chunk_start_adjoints(L, chunks, Bt, Ms, G, open, exec);
  Kokkos::parallel_for(
      "ash::e3::range_map", Range(exec, 0, Bt * P * N), KOKKOS_LAMBDA(const index_t i) {
        const index_t b = i / (P * N), q = (i / N) % P, n = i % N;
        S gt = 1;
        for (index_t c = 0; c < nc; ++c) gt = G(b * nc + c, q, n) * gt;
        const S a0 = L.A(b * T, q, n);
        M(b, q, n) = a0 * gt;
        v(b, q, n) = a0 * Ms(b * nc, q, n);
      });
}

template <class S>
void AdjointExactLayer<S>::block_carry_map(const LayerParams<S>& p, const SeqShape& sb, const View2<S>& y_blk,
                                           const View2<S>& g_blk, const View3<S>& M, const View3<S>& v) {
  require(opts_.truncate == 0, "adjoint-exact: a window (grad.truncate) cannot run on token ranges split over ranks");
  carry_map(project_block(p, sb, y_blk), sb, g_blk, M, v);
}

template <class S>
void AdjointExactLayer<S>::backward_range(const LayerParams<S>& p, int k, ActivationStore<S>& store,
                                          const View2<S>& g, const View2<S>& h0,
                                          const typename BlockAdjoint<S>::Exchange& exchange,
                                          const LayerParams<S>& grad) {
  require(opts_.truncate == 0, "adjoint-exact: a window (grad.truncate) cannot run on token ranges split over ranks");
  const auto& s = store.shape();
  const auto& act = store.activations(p, k, this->exec_);
  const index_t Bt = s.batch, P = p.W_delta.extent(0), N = p.W_B.extent(0);
  View3<S> M("ash::e3::range_map_M", Bt, P, N), v("ash::e3::range_map_v", Bt, P, N);
  carry_map(act, s, g, M, v);
  ExactCarry<S> carry;
  const View3<S> c_after = exchange(M, v);
  if (c_after.extent(0) > 0) {
    carry.mu = c_after;
    carry.A = View3<S>("ash::e3::ones", Bt, P, N);  // ones: the carry is already A μ
    Kokkos::deep_copy(this->exec_, carry.A, S(1));
    carry.valid = true;
  }
  run(p, s, store.input(k), act, g, h0, &carry, grad);
}

template <class S>
void AdjointExactLayer<S>::release() {
  block_work_.release();
  work_.release();
  scratch_.release();
}

template <class S>
void AdjointExactLayer<S>::run(const LayerParams<S>& layer, const SeqShape& s, const View2<S>& y,
                               const LayerActivations<S>& act, const View2<S>& g, const View2<S>& h0,
                               ExactCarry<S>* carry, const LayerParams<S>& grad, index_t own_T) {
  const index_t T = s.T, Bt = s.batch, P = layer.W_delta.extent(0), N = layer.W_B.extent(0);
  const index_t own = own_T > 0 ? own_T : T;
  const bool window = opts_.truncate > 0 && opts_.truncate < T;
  require(!(window && carry), "adjoint-exact: a window runs on whole windows, not token blocks");
  const index_t Tbar = window ? opts_.truncate : T;
  const index_t C = opts_.chunk < T ? opts_.chunk : T;
  const Chunks chunks(C, T);
  const bool fused = e3_fused_form(opts_, T, own < T);  // a halo: the wave form's mask_halo below
  const E3FusedWaves fw = fused ? e3_fused_waves(opts_, layer_shape(s, layer)) : E3FusedWaves{};
  const index_t W = fused ? fw.wave : e3_wave_length(opts_, T, Bt * P * N);
  const bool chunked_h = opts_.e3_chunked_h;
  // Every wave buffer row a wave reads was written by that wave first, so
  // they are neither zeroed nor reallocated between layers of a pass.
  work_.plan(adjoint_exact_workspace(opts_, layer_shape(s, layer), own < T));
  const auto& w = work_;
  const View3<S> Hb = chunked_h ? w.view3(buf::h_boundary) : View3<S>();
  const View2<S> hrun = chunked_h ? View2<S>() : w.view2(buf::h_running);
  const View3<S> scratch = chunked_h || !window ? w.view3(buf::chunk_products) : View3<S>();
  const View3<S> Ms = window ? View3<S>() : w.view3(buf::mu_chunk_start);
  const View3<S> gbuf = carry_groups(w, Bt, chunks.n, chunked_h || !window);
  const LayerCotangents<S>& cot = w.cotangents();
  const ExactCarry<S> none;
  const ExactCarry<S>& cin = carry ? *carry : none;

  const ScanView<S> L{act.delta, act.yhat, act.beta, act.gamma, g, act.a, T, s.docs};
  const ExecSpace& exec = this->exec_;
  if (chunked_h) impl::boundary_states(L, chunks, Bt, Hb, scratch, h0, exec, gbuf);
  if (!window) impl::chunk_start_adjoints(L, chunks, Bt, Ms, scratch, cin, exec, gbuf);
  if (fused) {
    const ScanFusedFn<S> dense = [&](const BlockRows& rb, const LayerCotangents<S>& c, const ParamPartials<S>& parts) {
      ssm_layer_backward_dense(layer, s, y, act, g, rb, c, parts, grad, g, opts_.detach_inputs, exec);
    };
    impl::e3_fused_waves_run(opts_, L, chunks, Bt, Hb, hrun, h0, Ms, cin, layer.D, own, layer_shape(s, layer), w, dense,
                             exec);
  } else {
    const ScanWaveFn<S> rows = [&](const BlockRows& rb, const View3<S>& mu, const View3<S>& hprev, const View3<S>& A,
                                   const LayerCotangents<S>& c) {
      ssm_layer_backward_rows(layer, s, y, act, g, rb, mu, hprev, A, c, grad, g, opts_.detach_inputs, exec);
    };
    impl::e3_waves(L, chunks, Bt, Hb, hrun, h0, Ms, cin, window ? Tbar : 0, own, W, w, rows, exec);
  }
  if (!carry) return;
  if (index_t(carry->mu.extent(0)) != Bt) {  // the first block of a layer
    const WorkspaceSpec cs = adjoint_exact_carry_workspace(layer_shape(s, layer));
    carry->mu = make_view3<S>(*cs.find(buf::carry_mu));
    carry->A = make_view3<S>(*cs.find(buf::carry_A));
  }
  impl::take_carry(L, Bt, chunks.n, Ms, *carry, exec);
}

template class AdjointExactLayer<float>;
template class AdjointExactLayer<double>;

}  // namespace ash
