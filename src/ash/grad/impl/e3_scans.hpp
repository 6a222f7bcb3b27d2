#pragma once
// E3's scan kernels (docs/design.md §2, §6): μ at chunk starts, the wave
// scans (h replayed over a wave's tokens, h^{t-1} and A^t stored, μ's reverse
// scan per chunk) in the chunk-parallel and the sequential h form, the
// windowed μ_T̄ of a wave, and the carry into the block before. Internal to
// grad/adjoint_exact.cpp; the fused form is e3_fused.hpp.
#include <string>

#include "ash/grad/layer_adjoint.hpp"
#include "ash/kernels/chunked_scan.hpp"

namespace ash::impl {

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
        const index_t bc = bcq / P, q = bcq % P, b = bc / nc, c = bc % nc, gc = L.gcol(q);
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
              const S A = kp * exp_fast(dq * av[j]);
              mu[j] = A * (g * L.gamma(m, gc + n0 + j) + mu[j]);
              pr[j] *= A;
            }
          }
          const S g0 = L.gy(b * T + t0, q);  // the chunk's first step keeps μ^{t0} itself
          for (int j = 0; j < NT; ++j) mu[j] = g0 * L.gamma(b * T + t0, gc + n0 + j) + mu[j];
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
                          const View3<S>& G, const ExactCarry<S>& carry, const ExecSpace& exec,
                          const View3<S>& gbuf = View3<S>()) {
  const index_t P = Ms.extent(1), N = Ms.extent(2);
  ASH_WITH_LANE_TILE(N, chunk_local_adjoints<NT>(L, ch, Bt, Ms, G, carry, exec));
  // M_c = L_c + G_c M_{c+1} right to left, from the later block's μ (if any).
  const View2<S> init = carry.valid ? View2<S>(carry.mu.data(), Bt * P, N) : View2<S>();
  carry_chunks("ash::e3::carry_mu", Ms, G, Bt, ch.n, init, true, carry_group(ch.n), exec, gbuf);
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
  const index_t T = L.T, nc = ch.n, gc = L.gcol(q);
  S cy[NT];  // A^{t+1} μ^{t+1}
  const index_t te = ch.end(c);
  for (int j = 0; j < NT; ++j)
    cy[j] = c + 1 < nc ? L.A(b * T + te, q, n0 + j) * Ms(b * nc + c + 1, q, n0 + j)
                       : (carry.valid ? carry.A(b, q, n0 + j) * carry.mu(b, q, n0 + j) : S(0));
  for (index_t t = te - 1; t >= t0; --t) {
    const index_t m = b * T + t, r = b * W + t - w0;
    const S g = L.gy(m, q);
    for (int j = 0; j < NT; ++j) {
      const S mu = g * L.gamma(m, gc + n0 + j) + cy[j];
      mubuf(r, q, n0 + j) = mu;
      cy[j] = Abuf(r, q, n0 + j) * mu;
    }
  }
}

// h over tokens [t0, t1) of sequence b, channel q, states n0..n0+NT from h
// (on return, h after t1 - 1), storing h^{t-1} and A^t at the rows of the
// wave [w0, w0+W) (rows before w0 are replayed, not stored). Shared by both
// wave forms.
template <int NT, class S>
KOKKOS_INLINE_FUNCTION void wave_replay(const ScanView<S>& L, index_t b, index_t q, index_t n0, index_t t0, index_t t1,
                                        index_t w0, index_t W, S (&h)[NT], const S (&av)[NT], const View3<S>& hbuf,
                                        const View3<S>& Abuf) {
  const index_t T = L.T, gc = L.gcol(q);
  for (index_t t = t0; t < t1; ++t) {
    const index_t m = b * T + t, r = b * W + t - w0;
    const S dq = L.delta(m, q), du = dq * L.yhat(m, q), kp = L.keep(b, t);
    S A[NT];
    for (int j = 0; j < NT; ++j) A[j] = kp * exp_fast(dq * av[j]);
    if (t >= w0)
      for (int j = 0; j < NT; ++j) {
        hbuf(r, q, n0 + j) = h[j];
        Abuf(r, q, n0 + j) = A[j];
      }
    for (int j = 0; j < NT; ++j) h[j] = A[j] * h[j] + du * L.beta(m, gc + n0 + j);
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
  const index_t P = Hb.extent(1), N = Hb.extent(2), nc = ch.n;
  const bool has_h0 = h0.extent(0) > 0;
  const index_t c_lo = w0 / ch.len, c_hi = (w0 + W - 1) / ch.len, ncw = c_hi - c_lo + 1;
  Kokkos::parallel_for(
      "ash::e3::wave_scans", Range(exec, 0, Bt * ncw * P * (N / NT)), KOKKOS_LAMBDA(const index_t i) {
        const index_t ntile = N / NT, bcq = i / ntile, n0 = (i % ntile) * NT;
        const index_t bc = bcq / P, q = bcq % P, b = bc / ncw, c = c_lo + bc % ncw;
        const index_t t0 = ch.start(c), t1 = ch.end(c) < w0 + W ? ch.end(c) : w0 + W;
        S h[NT], av[NT];
        for (int j = 0; j < NT; ++j) {
          h[j] = c > 0 ? Hb(b * nc + c - 1, q, n0 + j) : (has_h0 ? h0(b * P + q, n0 + j) : S(0));
          av[j] = L.a(q, n0 + j);
        }
        wave_replay<NT>(L, b, q, n0, t0, t1, w0, W, h, av, hbuf, Abuf);
        if (mu_too) chunk_mu_reverse<NT>(L, ch, Ms, carry, b, c, q, n0, t0, w0, W, Abuf, mubuf);
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
  const index_t P = L.a.extent(0), N = L.a.extent(1);
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
          wave_replay<NT>(L, b, q, n0, t0, t1, w0, W, h, av, hbuf, Abuf);
          if (mu_too) chunk_mu_reverse<NT>(L, ch, Ms, carry, b, c, q, n0, t0, w0, W, Abuf, mubuf);
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

// μ and A at the block's first token, for the block before it (carry.mu
// and carry.A [Bt, P, N] allocated).
template <class S>
void take_carry(const ScanView<S>& L, index_t Bt, index_t nc, const View3<S>& Ms, ExactCarry<S>& carry,
                const ExecSpace& exec) {
  const index_t P = Ms.extent(1), N = Ms.extent(2), T = L.T;
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

}  // namespace ash::impl
