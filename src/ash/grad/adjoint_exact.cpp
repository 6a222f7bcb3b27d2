#include "ash/grad/adjoint_exact.hpp"

#include <algorithm>
#include <utility>

#include "ash/core/error.hpp"
#include "ash/model/forward.hpp"
#include "ash/grad/impl/e3_fused.hpp"
#include "ash/kernels/chunked_scan.hpp"

namespace ash {

namespace {

using impl::Chunks;
using impl::ScanView;
using impl::boundary_states;

// μ at every chunk start: chunk-local reverse scans from 0 in parallel
// (L_c = local μ at the chunk start, G_c = Π_{j=start_c+1..start_{c+1}} A^j),
// then M_c = L_c + G_c M_{c+1} right to left. On return Ms holds μ^{start_c}.
// With a carry (a later token block), the last chunk continues into it:
// G = Π A · A^{next start} and M_last = L_last + G μ^{next start}.
template <int NT, class S>
void chunk_local_adjoints(const ScanView<S>& L, const Chunks ch, index_t Bt, const View3<S>& Ms, const View3<S>& G,
                          const ExactCarry<S>& carry, const ExecSpace& exec) {
  const index_t P = Ms.extent(1), N = Ms.extent(2), T = L.T, nc = ch.n;
  const bool next = carry.valid;
  auto An = carry.A;
  Kokkos::parallel_for(
      "ash::e3::chunk_scan_mu", Range(exec, 0, Bt * nc * P * (N / NT)), KOKKOS_LAMBDA(const index_t i) {
        const index_t ntile = N / NT, bcq = i / ntile, n0 = (i % ntile) * NT;
        const index_t bc = bcq / P, q = bcq % P, b = bc / nc, c = bc % nc;
        const index_t t0 = ch.start(c), t1 = ch.end(c);
        {
          S mu[NT], pr[NT], av[NT];
          for (int j = 0; j < NT; ++j) {
            mu[j] = 0;
            pr[j] = 1;
            av[j] = L.a(q, n0 + j);
          }
          // Invariant at the top of step t: mu = A^{t+1} μ^{t+1} (0 past the chunk).
          for (index_t t = t1 - 1; t > t0; --t) {
            const index_t m = b * T + t;
            const S g = L.gy(m, q), dq = L.delta(m, q), kp = L.keep(b, t);
            for (int j = 0; j < NT; ++j) {
              const S A = kp * impl::exp_fast(dq * av[j]);
              mu[j] = A * (g * L.gamma(m, n0 + j) + mu[j]);
              pr[j] *= A;
            }
          }
          const S g0 = L.gy(b * T + t0, q);  // the chunk's first step keeps μ^{t0} itself
          for (int j = 0; j < NT; ++j) mu[j] = g0 * L.gamma(b * T + t0, n0 + j) + mu[j];
          for (int j = 0; j < NT; ++j) {
            Ms(bc, q, n0 + j) = mu[j];
            const S after = t1 < T ? L.A(b * T + t1, q, n0 + j) : (next ? An(b, q, n0 + j) : S(0));
            G(bc, q, n0 + j) = pr[j] * after;
          }
        }
      });
}

template <class S>
void chunk_start_adjoints(const ScanView<S>& L, const Chunks ch, index_t Bt, const View3<S>& Ms,
                          const View3<S>& G, const ExactCarry<S>& carry, const ExecSpace& exec) {
  const index_t P = Ms.extent(1), N = Ms.extent(2);
  ASH_WITH_LANE_TILE(N, chunk_local_adjoints<NT>(L, ch, Bt, Ms, G, carry, exec));
  // M_c = L_c + G_c M_{c+1} right to left, from the later block's μ (if any).
  const View2<S> init = carry.valid ? View2<S>(carry.mu.data(), Bt * P, N) : View2<S>();
  impl::carry_chunks("ash::e3::carry_mu", Ms, G, Bt, ch.n, init, true, impl::carry_group(ch.n), exec);
}

// μ over chunk c's tokens [t0, end(c)) of one (sequence b, channel q, state
// tile n0) in a wave starting at w0: the reverse scan from the carry
// A^{start_{c+1}} μ^{start_{c+1}} (the last chunk's from the later block, if
// any), reading the wave's A back from Abuf. Shared by both wave forms.
template <int NT, class S>
KOKKOS_INLINE_FUNCTION void chunk_mu_reverse(const ScanView<S>& L, const Chunks& ch, const View3<S>& Ms,
                                             const ExactCarry<S>& carry, index_t b, index_t c, index_t q, index_t n0,
                                             index_t t0, index_t w0, index_t W, const View3<S>& Abuf,
                                             const View3<S>& mubuf) {
  const index_t T = L.T, nc = ch.n;
  S cy[NT];  // A^{t+1} μ^{t+1}
  const index_t te = ch.end(c);
  for (int j = 0; j < NT; ++j)
    cy[j] = c + 1 < nc ? L.A(b * T + te, q, n0 + j) * Ms(b * nc + c + 1, q, n0 + j)
                       : (carry.valid ? carry.A(b, q, n0 + j) * carry.mu(b, q, n0 + j) : S(0));
  for (index_t t = te - 1; t >= t0; --t) {
    const index_t m = b * T + t, r = b * W + t - w0;
    const S g = L.gy(m, q);
    for (int j = 0; j < NT; ++j) {
      const S mu = g * L.gamma(m, n0 + j) + cy[j];
      mubuf(r, q, n0 + j) = mu;
      cy[j] = Abuf(r, q, n0 + j) * mu;
    }
  }
}

// One wave of tokens [w0, w0+W) of every sequence, per (sequence, chunk,
// channel, state tile): the forward replay from the boundary state before the chunk
// (h0 before the first; zero when empty) stores h^{t-1} and A^t of the wave's
// rows; in exact mode (`mu_too`, chunk-aligned waves) the same thread then runs
// the reverse scan of μ over its chunk from the carry A^{start_{c+1}}
// μ^{start_{c+1}} (the last chunk's from the later block, if any), reading A
// back from the row buffer: one exp per (token, channel, state) for the wave.
template <int NT, class S>
void wave_scans(const ScanView<S>& L, const Chunks ch, index_t Bt, const View3<S>& Hb, const View2<S>& h0,
                const View3<S>& Ms, const ExactCarry<S>& carry, bool mu_too, index_t w0, index_t W,
                const View3<S>& hbuf, const View3<S>& Abuf, const View3<S>& mubuf, const ExecSpace& exec) {
  const index_t P = Hb.extent(1), N = Hb.extent(2), T = L.T, nc = ch.n;
  const bool has_h0 = h0.extent(0) > 0;
  const index_t c_lo = w0 / ch.len, c_hi = (w0 + W - 1) / ch.len, ncw = c_hi - c_lo + 1;
  Kokkos::parallel_for(
      "ash::e3::wave_scans", Range(exec, 0, Bt * ncw * P * (N / NT)), KOKKOS_LAMBDA(const index_t i) {
        const index_t ntile = N / NT, bcq = i / ntile, n0 = (i % ntile) * NT;
        const index_t bc = bcq / P, q = bcq % P, b = bc / ncw, c = c_lo + bc % ncw;
        const index_t t0 = ch.start(c), t1 = ch.end(c) < w0 + W ? ch.end(c) : w0 + W;
        do {
          S h[NT], av[NT];
          for (int j = 0; j < NT; ++j) {
            h[j] = c > 0 ? Hb(b * nc + c - 1, q, n0 + j) : (has_h0 ? h0(b * P + q, n0 + j) : S(0));
            av[j] = L.a(q, n0 + j);
          }
          for (index_t t = t0; t < t1; ++t) {
            const index_t m = b * T + t, r = b * W + t - w0;
            const S dq = L.delta(m, q), du = dq * L.yhat(m, q), kp = L.keep(b, t);
            S A[NT];
            for (int j = 0; j < NT; ++j) A[j] = kp * impl::exp_fast(dq * av[j]);
            if (t >= w0)
              for (int j = 0; j < NT; ++j) {
                hbuf(r, q, n0 + j) = h[j];
                Abuf(r, q, n0 + j) = A[j];
              }
            for (int j = 0; j < NT; ++j) h[j] = A[j] * h[j] + du * L.beta(m, n0 + j);
          }
          if (!mu_too) break;
          chunk_mu_reverse<NT>(L, ch, Ms, carry, b, c, q, n0, t0, w0, W, Abuf, mubuf);
        } while (false);
      });
}

// The host's form of wave_scans: per (sequence, channel, state tile), h runs
// through the wave's tokens from the running state hrun (h0, or zero, at the
// first wave; waves come in order), so no chunk-boundary states are needed and
// h is the forward's own sequential replay, bit for bit. In exact mode each
// chunk's μ follows as in wave_scans. Bt·P·N/NT threads: enough for a CPU.
template <int NT, class S>
void wave_scans_sequential(const ScanView<S>& L, const Chunks ch, index_t Bt, const View2<S>& hrun,
                           const View2<S>& h0, const View3<S>& Ms, const ExactCarry<S>& carry, bool mu_too, index_t w0,
                           index_t W, const View3<S>& hbuf, const View3<S>& Abuf, const View3<S>& mubuf,
                           const ExecSpace& exec) {
  const index_t P = L.a.extent(0), N = L.a.extent(1), T = L.T;
  const bool has_h0 = h0.extent(0) > 0, first = w0 == 0;
  const index_t c_lo = w0 / ch.len, c_hi = (w0 + W - 1) / ch.len;
  Kokkos::parallel_for(
      "ash::e3::wave_scans_sequential", Range(exec, 0, Bt * P * (N / NT)), KOKKOS_LAMBDA(const index_t i) {
        const index_t ntile = N / NT, bq = i / ntile, n0 = (i % ntile) * NT, b = bq / P, q = bq % P;
        S h[NT], av[NT];
        for (int j = 0; j < NT; ++j) {
          h[j] = first ? (has_h0 ? h0(bq, n0 + j) : S(0)) : hrun(bq, n0 + j);
          av[j] = L.a(q, n0 + j);
        }
        for (index_t c = c_lo; c <= c_hi; ++c) {
          const index_t t0 = ch.start(c) > w0 ? ch.start(c) : w0, t1 = ch.end(c) < w0 + W ? ch.end(c) : w0 + W;
          for (index_t t = t0; t < t1; ++t) {
            const index_t m = b * T + t, r = b * W + t - w0;
            const S dq = L.delta(m, q), du = dq * L.yhat(m, q), kp = L.keep(b, t);
            S A[NT];
            for (int j = 0; j < NT; ++j) A[j] = kp * impl::exp_fast(dq * av[j]);
            for (int j = 0; j < NT; ++j) {
              hbuf(r, q, n0 + j) = h[j];
              Abuf(r, q, n0 + j) = A[j];
            }
            for (int j = 0; j < NT; ++j) h[j] = A[j] * h[j] + du * L.beta(m, n0 + j);
          }
          if (!mu_too) continue;
          chunk_mu_reverse<NT>(L, ch, Ms, carry, b, c, q, n0, t0, w0, W, Abuf, mubuf);
        }
        for (int j = 0; j < NT; ++j) hrun(bq, n0 + j) = h[j];
      });
}

// Windowed μ_T̄ for a wave of whole blocks of T̄ tokens (docs/design.md §2):
//   μ_T̄^i = S^i + R^i F^{min(T, i+T̄-1)}
// Per (sequence, block b, channel): first the prefix scan F over block b+1,
// stored one block back in mubuf (F^s at the row of token s-T̄), then the
// reverse pass over block b forming S and R and overwriting mubuf with μ
// (the F it reads, at token i-1 or earlier, is not yet overwritten).
template <class S>
void wave_mu_window(const ScanView<S>& L, index_t Tbar, index_t Bt, index_t P, index_t N, index_t w0, index_t W,
                    const View3<S>& mubuf, const ExecSpace& exec) {
  const index_t T = L.T, nbw = (W + Tbar - 1) / Tbar, blk0 = w0 / Tbar;
  Kokkos::parallel_for(
      "ash::e3::wave_mu_window", Range(exec, 0, Bt * nbw * P * N), KOKKOS_LAMBDA(const index_t i) {
        const index_t bb = i / (P * N), q = (i / N) % P, n = i % N, b = bb / nbw, blk = blk0 + bb % nbw;
        const index_t s0 = blk * Tbar, s1 = (s0 + Tbar < T) ? s0 + Tbar : T;  // block b = [s0, s1)
        const index_t e1 = (s1 + Tbar < T) ? s1 + Tbar : T;                   // block b+1 = [s1, e1)
        S F = 0, pr = 1;
        for (index_t s = s1; s < e1; ++s) {
          const index_t m = b * T + s;
          pr *= L.A(m, q, n);  // Π_{j=start_{b+1}..s} A^j
          F += L.qv(m, q, n) * pr;
          mubuf(b * W + s - Tbar - w0, q, n) = F;
        }
        S carry = 0, R = 1;
        for (index_t t = s1 - 1; t >= s0; --t) {
          const index_t m = b * T + t;
          const S Sv = L.qv(m, q, n) + carry;
          const index_t s = (t + Tbar - 1 < T - 1) ? t + Tbar - 1 : T - 1;
          const S Fv = s >= s1 ? mubuf(b * W + s - Tbar - w0, q, n) : S(0);
          mubuf(b * W + t - w0, q, n) = Sv + R * Fv;
          const S a = L.A(m, q, n);
          carry = a * Sv;
          R *= a;
        }
      });
}

// μ and A at the block's first token, for the block before it.
template <class S>
void take_carry(const ScanView<S>& L, index_t Bt, index_t nc, const View3<S>& Ms, ExactCarry<S>& carry,
                const ExecSpace& exec) {
  const index_t P = Ms.extent(1), N = Ms.extent(2), T = L.T;
  if (index_t(carry.mu.extent(0)) != Bt) {
    carry.mu = View3<S>("ash::e3::carry_mu", Bt, P, N);
    carry.A = View3<S>("ash::e3::carry_A", Bt, P, N);
  }
  auto Mn = carry.mu;
  auto An = carry.A;
  Kokkos::parallel_for(
      "ash::e3::take_carry", Range(exec, 0, Bt * P * N), KOKKOS_LAMBDA(const index_t i) {
        const index_t b = i / (P * N), q = (i / N) % P, n = i % N;
        Mn(b, q, n) = Ms(b * nc, q, n);
        An(b, q, n) = L.A(b * T, q, n);
      });
  carry.valid = true;
}

}  // namespace

index_t e3_wave_length(const EngineOptions& opts, index_t T, index_t state_per_token) {
  const bool window = opts.truncate > 0 && opts.truncate < T;
  const index_t unit = window ? opts.truncate : (opts.chunk < T ? opts.chunk : T);
  constexpr index_t device_wave_state = index_t(1) << 24;
  const index_t per_token = state_per_token > 0 ? state_per_token : 1;
  const index_t wave = opts.wave > 0 ? opts.wave
                       : host_backend ? 1024
                                      : std::min(T, std::max<index_t>(1024, device_wave_state / per_token));
  return unit * (wave / unit > 0 ? wave / unit : 1);
}

bool e3_fused_form(const EngineOptions& opts, index_t T, bool halo) {
  return opts.e3_fused && !(opts.truncate > 0 && opts.truncate < T) && !halo;
}

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
void AdjointExactLayer<S>::backward(const LayerParams<S>& p, int k, ActivationStore<S>& store, const View2<S>& g,
                                    const LayerParams<S>& grad) {
  const auto& act = store.activations(p, k, this->exec_);
  run(p, store.shape(), store.input(k), act, g, View2<S>(), nullptr, grad);
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
  if (index_t(block_act_.yhat.extent(0)) != sb.rows()) {
    ModelDims d;
    d.width = p.W_delta.extent(0);
    d.state = p.W_B.extent(0);
    block_act_ = LayerActivations<S>(sb, d, LayerActivations<S>::projections_only);
  }
  ssm_layer_project(p, y, block_act_, this->exec_);
  return block_act_;
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
  ExactCarry<S> open;
  open.mu = View3<S>("ash::e3::open_mu", Bt, P, N);
  open.A = View3<S>("ash::e3::open_A", Bt, P, N);
  Kokkos::deep_copy(exec, open.A, S(1));
  open.valid = true;
  View3<S> Ms("ash::e3::mu_chunk_start", Bt * nc, P, N), G("ash::e3::chunk_products", Bt * nc, P, N);
  chunk_start_adjoints(L, chunks, Bt, Ms, G, open, exec);
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
  block_act_ = LayerActivations<S>();
  work_ = Work();
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
  const index_t W = e3_wave_length(opts_, T, Bt * P * N);
  const index_t Wbuf = W < T ? W : T;
  ModelDims d;
  d.width = P;
  d.state = N;
  // Every wave buffer row a wave reads was written by that wave first, so
  // they are neither zeroed nor reallocated between layers of a pass.
  auto& w = work_;
  auto ensure = [](View3<S>& v, const char* label, index_t rows, index_t P_, index_t N_, bool zero) {
    if (index_t(v.extent(0)) == rows && index_t(v.extent(1)) == P_ && index_t(v.extent(2)) == N_) return;
    v = View3<S>();  // free first: the peak holds one copy
    v = zero ? View3<S>(std::string(label), rows, P_, N_)
             : View3<S>(Kokkos::view_alloc(std::string(label), Kokkos::WithoutInitializing), rows, P_, N_);
  };
  const bool fused = e3_fused_form(opts_, T, own < T);  // a halo: the wave form's mask_halo below
  const bool chunked_h = opts_.e3_chunked_h;
  if (chunked_h) {
    ensure(w.Hb, "ash::e3::h_boundary", Bt * chunks.n, P, N, true);
    w.hrun = View2<S>();
  } else {
    w.Hb = View3<S>();
    if (index_t(w.hrun.extent(0)) != Bt * P || index_t(w.hrun.extent(1)) != N)
      w.hrun = View2<S>(Kokkos::view_alloc(std::string("ash::e3::h_running"), Kokkos::WithoutInitializing), Bt * P, N);
  }
  if (chunked_h || !window)  // boundary products (chunked h); μ's chunk products G (exact mode)
    ensure(w.scratch, "ash::e3::chunk_products", Bt * chunks.n, P, N, true);
  else
    w.scratch = View3<S>();
  if (!window)
    ensure(w.Ms, "ash::e3::mu_chunk_start", Bt * chunks.n, P, N, true);
  else
    w.Ms = View3<S>();
  const impl::FusedShape fs = impl::fused_shape(P, N, C, impl::lane_tile(N), opts_.e3_channel_block, sizeof(S), Bt,
                                                   index_t(this->exec_.concurrency()));
  const index_t ncw_max = (Wbuf + C - 1) / C;  // chunks per wave (waves are whole chunks here)
  if (fused) {
    w.hbuf = w.Abuf = w.mubuf = View3<S>();
    ensure(w.alog_part, "ash::e3::fused_alog_part", Bt * ncw_max, P, N, false);
    if (fs.nPB > 1) {
      ensure(w.beta_part, "ash::e3::fused_beta_part", Bt * Wbuf, fs.nPB, N, false);
      ensure(w.gamma_part, "ash::e3::fused_gamma_part", Bt * Wbuf, fs.nPB, N, false);
    } else {
      w.beta_part = w.gamma_part = View3<S>();
    }
    if (index_t(w.d_part.extent(0)) != Bt * ncw_max || index_t(w.d_part.extent(1)) != P) {
      w.d_part = View2<S>(Kokkos::view_alloc(std::string("ash::e3::fused_d_part"), Kokkos::WithoutInitializing),
                          Bt * ncw_max, P);
      w.bd_part = View2<S>(Kokkos::view_alloc(std::string("ash::e3::fused_bd_part"), Kokkos::WithoutInitializing),
                           Bt * ncw_max, P);
    }
  } else {
    w.beta_part = w.gamma_part = w.alog_part = View3<S>();
    w.d_part = w.bd_part = View2<S>();
    ensure(w.hbuf, "ash::e3::wave_hprev", Bt * Wbuf, P, N, false);
    ensure(w.Abuf, "ash::e3::wave_A", Bt * Wbuf, P, N, false);
    ensure(w.mubuf, "ash::e3::wave_mu", Bt * Wbuf, P, N, false);
  }
  if (!w.cot || index_t(w.cot->gyhat.extent(0)) != Bt * Wbuf || index_t(w.cot->gyhat.extent(1)) != P ||
      index_t(w.cot->gbeta.extent(1)) != N || (w.cot->alog_part.extent(0) > 0) == fused) {
    w.cot.reset();
    w.cot = std::make_unique<LayerCotangents<S>>(Bt * Wbuf, d, !fused);  // the fused form keeps its own partials
  }
  const View3<S> Hb = w.Hb, scratch = w.scratch, Ms = w.Ms, hbuf = w.hbuf, Abuf = w.Abuf, mubuf = w.mubuf;
  const View2<S> hrun = w.hrun;
  const LayerCotangents<S>& cot = *w.cot;
  const ExactCarry<S> none;
  const ExactCarry<S>& cin = carry ? *carry : none;

  const ScanView<S> L{act.delta, act.yhat, act.beta, act.gamma, g, act.a, T, s.docs};
  const ExecSpace& exec = this->exec_;
  if (chunked_h) boundary_states(L, chunks, Bt, Hb, scratch, h0, exec);
  if (!window) chunk_start_adjoints(L, chunks, Bt, Ms, scratch, cin, exec);
  for (index_t w0 = 0; w0 < own; w0 += W) {  // in order: the sequential form carries h from wave to wave
    const index_t Ww = (w0 + W < T) ? W : T - w0;
    if (fused) {
      const impl::FusedOut<S> out{cot.gz,       cot.gyhat,  w.beta_part, w.gamma_part, cot.gbeta,
                                  cot.ggamma,   w.alog_part, w.d_part,   w.bd_part};
      ASH_WITH_LANE_TILE(N, impl::fused_chunk_backward<NT>(L, chunks, Bt, Hb, hrun, h0, Ms, cin, layer.D, w0, Ww, fs,
                                                           out, exec));
      const ParamPartials<S> parts{w.alog_part, w.d_part, w.bd_part, Bt * ((Ww + C - 1) / C)};
      ssm_layer_backward_dense(layer, s, y, act, g, BlockRows{Ww, s.T, w0}, cot, parts, grad, g, opts_.detach_inputs,
                               exec);
      continue;
    }
    if (chunked_h) {
      ASH_WITH_LANE_TILE(N, wave_scans<NT>(L, chunks, Bt, Hb, h0, Ms, cin, !window, w0, Ww, hbuf, Abuf, mubuf, exec));
    } else {
      ASH_WITH_LANE_TILE(N, wave_scans_sequential<NT>(L, chunks, Bt, hrun, h0, Ms, cin, !window, w0, Ww, hbuf, Abuf,
                                                      mubuf, exec));
    }
    if (window) wave_mu_window(L, Tbar, Bt, P, N, w0, Ww, mubuf, exec);
    if (w0 + Ww > own) {  // halo rows: μ and g are zero there, so they add nothing (the VJPs are linear in both)
      const index_t h0t = own - w0, nh = w0 + Ww - own;
      const View2<S> gg = g;
      Kokkos::parallel_for(
          "ash::e3::mask_halo", Range(exec, 0, Bt * nh * P), KOKKOS_LAMBDA(const index_t i) {
            const index_t b = i / (nh * P), t = h0t + (i / P) % nh, q = i % P;
            gg(b * T + w0 + t, q) = S(0);
            for (index_t n = 0; n < N; ++n) mubuf(b * Ww + t, q, n) = S(0);
          });
    }
    // g_k of this wave's rows becomes g_{k-1} in place; the scans above read
    // only rows of this wave or later ones, and the carries were taken first.
    ssm_layer_backward_rows(layer, s, y, act, g, BlockRows{Ww, s.T, w0}, mubuf, hbuf, Abuf, cot, grad, g,
                            opts_.detach_inputs, exec);
  }
  if (carry) take_carry(L, Bt, chunks.n, Ms, *carry, exec);
}

template class AdjointExactLayer<float>;
template class AdjointExactLayer<double>;

}  // namespace ash
