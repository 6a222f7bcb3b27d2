#pragma once
// E3's fused per-chunk backward (docs/design.md §6, "E3 fused"): one team per
// (sequence, chunk, block of Pt channels) replays h over its chunk, runs μ's
// reverse scan and forms every per-token VJP of the state, keeping h^{t-1},
// A^t and μ^t of the chunk in team scratch. Global memory gets only what the
// dense VJPs need: per (token, channel) gz and the D and state parts of ∂L/∂ŷ,
// per (token, channel block, state) the block's share of ∂L/∂β and ∂L/∂γ (the
// first level of a fixed-order two-level sum over channels), and per (chunk,
// channel) the partial sums of the A_log, D and bδ gradients. No per-(token,
// channel, state) buffer exists, and no float atomics are used.
#include <algorithm>
#include <string>

#include "ash/grad/layer_adjoint.hpp"
#include "ash/kernels/chunked_scan.hpp"

namespace ash::impl {

// Where the fused kernels write one wave of Bt·W token rows (row r = b·W + t - w0).
template <class S>
struct FusedOut {
  View2<S> gz, gyhat;             // [Bt·W, P]: ∂L/∂z; g D + Δ Σ_n μ β (the dense VJPs add the rest)
  View3<S> beta_part, gamma_part;  // [Bt·W, nPB, N]: sums over each channel block (nPB > 1)
  View2<S> gbeta, ggamma;         // [Bt·W, N]: the sums over all channels
  View3<S> alog_part;             // [Bt·ncw, P, N]: Σ_t μ h^{t-1} A Δ per chunk of the wave
  View2<S> d_part, bd_part;       // [Bt·ncw, P]: Σ_t g ŷ and Σ_t ∂L/∂z per chunk
};

// Channels per team for chunks of C tokens: `requested` if > 0, else as many
// as keep the two [C, Pt·N] scratch arrays within `budget` bytes (a GPU's
// shared memory; a host's L2), at least one. A GPU puts one state per thread
// (Pt·N/NT threads, at most 1024); a host runs teams of one thread with
// NT-wide tiles.
struct FusedShape {
  index_t Pt = 1, nPB = 1;
  int team = 1;
};

inline FusedShape fused_shape(index_t P, index_t N, index_t C, int NT, index_t requested, std::size_t scalar_bytes) {
  constexpr std::size_t budget = host_backend ? (std::size_t(256) << 10) : (std::size_t(32) << 10);
  FusedShape f;
  const std::size_t per_channel = 2 * std::size_t(C) * std::size_t(N) * scalar_bytes;
  f.Pt = std::max<index_t>(1, std::min<index_t>(P, requested > 0 ? requested : index_t(budget / per_channel)));
  if (!host_backend) f.Pt = std::min<index_t>(f.Pt, std::max<index_t>(1, 1024 / (N / NT)));
  f.nPB = (P + f.Pt - 1) / f.Pt;
  f.team = host_backend ? 1 : int(f.Pt * (N / NT));
  return f;
}

using FusedPolicy = Kokkos::TeamPolicy<ExecSpace>;
using FusedMember = FusedPolicy::member_type;

// One wave [w0, w0+W) of whole chunks of every sequence (exact or detached
// mode, no window). Hb: h at chunk ends (h0 before the first chunk; zero when
// empty); Ms: μ at chunk starts; carry: the later block's A μ past the last
// chunk. D: the layer's skip weights.
template <int NT, class S>
void fused_chunk_backward(const ScanView<S>& L, const Chunks ch, index_t Bt, const View3<S>& Hb, const View2<S>& h0,
                          const View3<S>& Ms, const ExactCarry<S>& carry, const Unmanaged1<S>& D, index_t w0,
                          index_t W, const FusedShape fs, const FusedOut<S>& out, const ExecSpace& exec) {
  using Scratch = Kokkos::View<S**, Kokkos::LayoutRight, typename ExecSpace::scratch_memory_space,
                               Kokkos::MemoryTraits<Kokkos::Unmanaged>>;
  const index_t P = L.a.extent(0), N = L.a.extent(1), T = L.T, nc = ch.n, C = ch.len;
  const index_t Pt = fs.Pt, nPB = fs.nPB, ntile = N / NT, PtN = Pt * N;
  const index_t c_lo = w0 / C, ncw = (W + C - 1) / C;
  const bool has_h0 = h0.extent(0) > 0, split = nPB > 1;
  const FusedOut<S> o = out;
  // Past 48 KiB (CUDA's shared memory without an opt-in) the arrays go to
  // level 1, global memory private to the team.
  const std::size_t bytes = 2 * Scratch::shmem_size(C, PtN);
  const int level = !host_backend && bytes > (std::size_t(48) << 10) ? 1 : 0;
  FusedPolicy policy(exec, Bt * ncw * nPB, fs.team);
  policy.set_scratch_size(level, Kokkos::PerTeam(bytes));
  Kokkos::parallel_for(
      "ash::e3::fused_chunk", policy, KOKKOS_LAMBDA(const FusedMember& team) {
        const index_t l = team.league_rank(), pb = l % nPB, bcw = l / nPB, b = bcw / ncw, c = c_lo + bcw % ncw;
        const index_t t0 = ch.start(c), t1 = ch.end(c), len = t1 - t0, p0 = pb * Pt;
        const index_t np = p0 + Pt < P ? Pt : P - p0;  // channels of this block
        // X: A^t, then μ^t. Y: h^{t-1}, then h^{t-1} A^t. Row t - t0, column (q - p0)·N + n.
        Scratch X(team.team_scratch(level), C, PtN), Y(team.team_scratch(level), C, PtN);
        Kokkos::parallel_for(Kokkos::TeamThreadRange(team, np * ntile), [&](const index_t it) {
          const index_t ql = it / ntile, n0 = (it % ntile) * NT, q = p0 + ql, col = ql * N + n0;
          S h[NT], av[NT], cy[NT];
          for (int j = 0; j < NT; ++j) {
            h[j] = c > 0 ? Hb(b * nc + c - 1, q, n0 + j) : (has_h0 ? h0(b * P + q, n0 + j) : S(0));
            av[j] = L.a(q, n0 + j);
          }
          for (index_t t = t0; t < t1; ++t) {
            const index_t m = b * T + t;
            const S dq = L.delta(m, q), du = dq * L.yhat(m, q), kp = L.keep(b, t);
            for (int j = 0; j < NT; ++j) {
              const S A = kp * exp_fast(dq * av[j]);
              X(t - t0, col + j) = A;
              Y(t - t0, col + j) = h[j];
              h[j] = A * h[j] + du * L.beta(m, n0 + j);
            }
          }
          // μ^t = g^t γ^t + A^{t+1} μ^{t+1}, from the carry past the chunk.
          for (int j = 0; j < NT; ++j)
            cy[j] = c + 1 < nc ? L.A(b * T + t1, q, n0 + j) * Ms(b * nc + c + 1, q, n0 + j)
                               : (carry.valid ? carry.A(b, q, n0 + j) * carry.mu(b, q, n0 + j) : S(0));
          for (index_t t = t1 - 1; t >= t0; --t) {
            const index_t m = b * T + t;
            const S g = L.gy(m, q);
            for (int j = 0; j < NT; ++j) {
              const S A = X(t - t0, col + j), mu = g * L.gamma(m, n0 + j) + cy[j];
              X(t - t0, col + j) = mu;
              Y(t - t0, col + j) *= A;
              cy[j] = A * mu;
            }
          }
        });
        team.team_barrier();
        const index_t prow = b * ncw + (c - c_lo);  // this chunk's row of the partial sums
        // Per (token, channel), sums over n: gΔ = Σ μ (hA a + β ŷ) and Σ μ β;
        // per channel, the chunk's D and bδ sums.
        Kokkos::parallel_for(Kokkos::TeamThreadRange(team, np), [&](const index_t ql) {
          const index_t q = p0 + ql;
          S d = 0, bd = 0;
          for (index_t t = t0; t < t1; ++t) {
            const index_t m = b * T + t, r = b * W + t - w0;
            const S dq = L.delta(m, q), yq = L.yhat(m, q), g = L.gy(m, q);
            S gd = 0, gh = 0;
            for (index_t n = 0; n < N; ++n) {
              const S mu = X(t - t0, ql * N + n), bn = L.beta(m, n);
              gd += mu * (Y(t - t0, ql * N + n) * L.a(q, n) + bn * yq);
              gh += mu * bn;
            }
            const S gz = -gd * kmath::expm1(-dq);  // softplus'(z) = 1 - e^{-Δ}
            o.gz(r, q) = gz;
            o.gyhat(r, q) = g * D(q) + gh * dq;
            d += g * yq;
            bd += gz;
          }
          o.d_part(prow, q) = d;
          o.bd_part(prow, q) = bd;
        });
        // Per (channel, state): the chunk's Σ_t μ h^{t-1} A Δ.
        Kokkos::parallel_for(Kokkos::TeamThreadRange(team, np * N), [&](const index_t i) {
          const index_t ql = i / N, n = i % N, q = p0 + ql;
          S acc = 0;
          for (index_t t = t0; t < t1; ++t) acc += X(t - t0, i) * Y(t - t0, i) * L.delta(b * T + t, q);
          o.alog_part(prow, q, n) = acc;
        });
        // Per (token, state), sums over the block's channels in order:
        // ∂L/∂β = Σ_q μ Δ ŷ and ∂L/∂γ = Σ_q g h^t, h^t = h^{t-1} A + Δ ŷ β.
        Kokkos::parallel_for(Kokkos::TeamThreadRange(team, len * N), [&](const index_t i) {
          const index_t t = t0 + i / N, n = i % N, m = b * T + t, r = b * W + t - w0;
          const S bn = L.beta(m, n);
          S gb = 0, gg = 0;
          for (index_t ql = 0; ql < np; ++ql) {
            const index_t q = p0 + ql;
            const S du = L.delta(m, q) * L.yhat(m, q);
            gb += X(t - t0, ql * N + n) * du;
            gg += L.gy(m, q) * (Y(t - t0, ql * N + n) + du * bn);
          }
          if (split) {
            o.beta_part(r, pb, n) = gb;
            o.gamma_part(r, pb, n) = gg;
          } else {
            o.gbeta(r, n) = gb;
            o.ggamma(r, n) = gg;
          }
        });
      });
  if (!split) return;
  // The second level: per (token, state), the channel blocks in order.
  Kokkos::parallel_for(
      "ash::e3::fused_state_sums", Range(exec, 0, Bt * W * N), KOKKOS_LAMBDA(const index_t i) {
        const index_t r = i / N, n = i % N;
        S gb = 0, gg = 0;
        for (index_t k = 0; k < nPB; ++k) {
          gb += o.beta_part(r, k, n);
          gg += o.gamma_part(r, k, n);
        }
        o.gbeta(r, n) = gb;
        o.ggamma(r, n) = gg;
      });
}

}  // namespace ash::impl
