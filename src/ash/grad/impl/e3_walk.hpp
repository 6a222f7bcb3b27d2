#pragma once
// E3's reverse walk (docs/design.md §6): one team per (sequence, segment of C
// tokens) takes the segment's channels a few at a time (a step). Per step its
// threads run over (channel, token sub-range, state): each thread computes
// A^t = exp(Δ^t a) of its sub-range once into scratch and composes the
// sub-range's h and A μ maps; a short pass over sub-ranges (the second level)
// seeds each from h before the segment and A μ past it; each thread then
// replays h and μ over its tokens from the A in scratch. One exp per element
// serves both scans. Sums over states (per token and channel) go straight to
// ∂L/∂z and ∂L/∂ŷ; sums over channels (∂L/∂β, ∂L/∂γ per token and state)
// accumulate in scratch, step after step, and are written once per segment:
// no channel-block partials, no atomics, a fixed order of additions. Writes
// the same FusedOut as the fused kernel (e3_fused.hpp), so the dense VJPs
// after it are shared.
#include <algorithm>

#include "ash/grad/impl/e3_fused.hpp"

namespace ash::impl {

// Tokens a thread of the walk composes serially (the first level of its
// two-level scan); a segment of C tokens has walk_sub_ranges(C) of them.
constexpr index_t walk_sub = 8;
KOKKOS_INLINE_FUNCTION index_t walk_sub_ranges(index_t C) { return (C + walk_sub - 1) / walk_sub; }

// The walk's team policy: at most walk_team_max threads and, on a GPU, two
// teams resident per SM, so ptxas keeps a thread within 128 registers. The
// walk's phases keep many views' metadata live: unbounded, its float kernel
// took 167 registers (12 warps an SM); bounded, 128 and no spill (double:
// 40 bytes), 16 warps an SM, nvcc 13.0 for sm_90 (perf_tests/gpu/kernel_resources.py).
constexpr int walk_team_max = 256;
using WalkPolicy = Kokkos::TeamPolicy<ExecSpace, Kokkos::LaunchBounds<walk_team_max, 2>>;
using WalkMember = WalkPolicy::member_type;

// Team scratch of one walk team, in scalars, for Qc channels a step: μ/A and
// h^{t-1}A ([C, Qc·N+1] each), Σ_q for ∂L/∂β and ∂L/∂γ ([C, N+1] each), the
// sub-ranges' products, h and carries ([ns, Qc·N+1] each).
inline std::size_t walk_scratch_scalars(index_t C, index_t N, index_t Qc) {
  const std::size_t ns = std::size_t(walk_sub_ranges(C)), wide = std::size_t(Qc * N + 1);
  return (2 * std::size_t(C) + 3 * ns) * wide + 2 * std::size_t(C) * std::size_t(N + 1);
}

// The walk's shape: Pt is the channels a team takes per step (the rest of
// FusedShape as the fused form's with one channel block: nPB = 1). `requested`
// if > 0, else as many as keep the scratch within a GPU's 40 KiB of shared
// memory (a host's 256 KiB of L2) and a GPU team within walk_team_max threads, one
// per (channel, sub-range, state tile); a host team has one thread.
inline FusedShape walk_shape(index_t P, index_t N, index_t C, int NT, index_t requested, std::size_t scalar_bytes) {
  const std::size_t budget = host_backend ? (std::size_t(256) << 10) : (std::size_t(40) << 10);
  const index_t per_step = walk_sub_ranges(C) * (N / NT);
  index_t Qc = requested > 0 ? requested : 1;
  if (requested <= 0)
    while (Qc < P && walk_scratch_scalars(C, N, Qc + 1) * scalar_bytes <= budget &&
           (host_backend || (Qc + 1) * per_step <= walk_team_max))
      ++Qc;
  FusedShape f;
  f.Pt = std::min(Qc, P);
  f.nPB = 1;
  f.team = host_backend ? 1 : int(std::min<index_t>(walk_team_max, f.Pt * per_step));
  return f;
}

// The launch [l0, l0+Wl) of whole chunks (segments) of the wave [w0, w0+W),
// with fused_chunk_backward's inputs and outputs (out's block shares unused):
// h before a chunk from Hb (chunk-parallel, a team per chunk) or hrun (a team
// per sequence walking the launch's chunks in order); μ past a chunk from Ms
// or the later block's carry. fs: walk_shape's (fs.Pt channels a step).
template <int NT, class S>
void walk_chunk_backward(const ScanView<S>& L, const Chunks ch, index_t Bt, const View3<S>& Hb, const View2<S>& hrun,
                         const View2<S>& h0, const View3<S>& Ms, const ExactCarry<S>& carry, const Unmanaged1<S>& D,
                         index_t w0, index_t W, index_t l0, index_t Wl, const FusedShape fs, const FusedOut<S>& out,
                         const ExecSpace& exec) {
  using Scratch = Kokkos::View<S**, Kokkos::LayoutRight, typename ExecSpace::scratch_memory_space,
                               Kokkos::MemoryTraits<Kokkos::Unmanaged>>;
  const index_t P = L.a.extent(0), N = L.a.extent(1), T = L.T, nc = ch.n, C = ch.len, Qc = fs.Pt;
  const index_t ntile = N / NT, ns = walk_sub_ranges(C);
  const index_t ld = Qc * N + 1, ldn = N + 1;  // padded rows, as the fused kernel's
  const index_t c_w = w0 / C, ncw = (W + C - 1) / C, c_lo = l0 / C, ncl = (Wl + C - 1) / C;
  const bool has_h0 = h0.extent(0) > 0, sequential = Hb.extent(0) == 0;
  const index_t per_team = sequential ? ncl : 1;
  const FusedOut<S> o = out;
  const std::size_t bytes = 2 * Scratch::shmem_size(C, ld) + 3 * Scratch::shmem_size(ns, ld) +
                            2 * Scratch::shmem_size(C, ldn);
  const std::size_t reserved = sizeof(double) * std::size_t(fs.team + 2);
  const int level = !host_backend && bytes + reserved > (std::size_t(48) << 10) ? 1 : 0;
  const index_t league = Bt * (ncl / per_team);
  const auto body = KOKKOS_LAMBDA(const WalkMember& team) {
    const index_t l = team.league_rank(), b = l / (ncl / per_team), c_first = c_lo + (l % (ncl / per_team)) * per_team;
    // Columns ql·N + n of channel p0 + ql of the step. X: A^t, then μ^t. Y:
    // h^{t-1} A^t. SP: a sub-range's Π A, then its Σ μ h^{t-1} A Δ, then its
    // Σ ∂L/∂z; SH: its local h, then h before it; SC: its local A μ, then A μ
    // past it, then its Σ g ŷ. GB, GG ([t, n]): Σ_q μ Δ ŷ and Σ_q g h^t so far.
    Scratch X(team.team_scratch(level), C, ld), Y(team.team_scratch(level), C, ld);
    Scratch SP(team.team_scratch(level), ns, ld), SH(team.team_scratch(level), ns, ld),
        SC(team.team_scratch(level), ns, ld);
    Scratch GB(team.team_scratch(level), C, ldn), GG(team.team_scratch(level), C, ldn);
    for (index_t c = c_first; c < c_first + per_team; ++c) {
      const index_t t0 = ch.start(c), t1 = ch.end(c), len = t1 - t0, nsc = (len + walk_sub - 1) / walk_sub;
      const index_t prow = b * ncw + (c - c_w);
      for (index_t p0 = 0; p0 < P; p0 += Qc) {
        const index_t np = p0 + Qc < P ? Qc : P - p0;
        // The first level, per (channel, sub-range, state tile): A^t into X,
        // the sub-range's Π A, its h from 0, its A μ from 0 past it
        // (c^t = A^t μ^t, μ^t = g^t γ^t + c^{t+1}).
        Kokkos::parallel_for(Kokkos::TeamThreadRange(team, np * nsc * ntile), [&](const index_t it) {
          const index_t n0 = (it % ntile) * NT, k = (it / ntile) % nsc, ql = it / (ntile * nsc), q = p0 + ql;
          const index_t col = ql * N + n0, a0 = t0 + k * walk_sub, a1 = a0 + walk_sub < t1 ? a0 + walk_sub : t1;
          S av[NT], pr[NT], h[NT], cy[NT];
          for (int j = 0; j < NT; ++j) {
            av[j] = L.a(q, n0 + j);
            pr[j] = 1;
            h[j] = 0;
            cy[j] = 0;
          }
          for (index_t t = a0; t < a1; ++t) {
            const index_t m = b * T + t;
            const S dq = L.delta(m, q), du = dq * L.yhat(m, q), kp = L.keep(b, t);
            for (int j = 0; j < NT; ++j) {
              const S A = kp * exp_fast(dq * av[j]);
              X(t - t0, col + j) = A;
              pr[j] *= A;
              h[j] = A * h[j] + du * L.beta(m, n0 + j);
            }
          }
          for (index_t t = a1 - 1; t >= a0; --t) {
            const index_t m = b * T + t;
            const S g = L.gy(m, q);
            for (int j = 0; j < NT; ++j) cy[j] = X(t - t0, col + j) * (g * L.gamma(m, n0 + j) + cy[j]);
          }
          for (int j = 0; j < NT; ++j) {
            SP(k, col + j) = pr[j];
            SH(k, col + j) = h[j];
            SC(k, col + j) = cy[j];
          }
        });
        team.team_barrier();
        // The second level, per (channel, state tile) over the sub-ranges: h
        // before each (from h before the chunk) and A μ past each (from A μ
        // past the chunk).
        Kokkos::parallel_for(Kokkos::TeamThreadRange(team, np * ntile), [&](const index_t it) {
          const index_t n0 = (it % ntile) * NT, ql = it / ntile, q = p0 + ql, col = ql * N + n0;
          S h[NT], cy[NT];
          for (int j = 0; j < NT; ++j) {
            h[j] = c == 0 ? (has_h0 ? h0(b * P + q, n0 + j) : S(0))
                          : (sequential ? hrun(b * P + q, n0 + j) : Hb(b * nc + c - 1, q, n0 + j));
            cy[j] = c + 1 < nc ? L.A(b * T + t1, q, n0 + j) * Ms(b * nc + c + 1, q, n0 + j)
                               : (carry.valid ? carry.A(b, q, n0 + j) * carry.mu(b, q, n0 + j) : S(0));
          }
          for (index_t k = 0; k < nsc; ++k)
            for (int j = 0; j < NT; ++j) {
              const S hk = h[j];
              h[j] = SP(k, col + j) * h[j] + SH(k, col + j);
              SH(k, col + j) = hk;
            }
          if (sequential)
            for (int j = 0; j < NT; ++j) hrun(b * P + q, n0 + j) = h[j];
          for (index_t k = nsc - 1; k >= 0; --k)
            for (int j = 0; j < NT; ++j) {
              const S ck = cy[j];
              cy[j] = SP(k, col + j) * cy[j] + SC(k, col + j);
              SC(k, col + j) = ck;
            }
        });
        team.team_barrier();
        // Each sub-range replays h^{t-1} A^t into Y and μ^t into X (over A^t)
        // from the A^t in X, and sums μ h^{t-1} A Δ (A_log's share) into SP.
        Kokkos::parallel_for(Kokkos::TeamThreadRange(team, np * nsc * ntile), [&](const index_t it) {
          const index_t n0 = (it % ntile) * NT, k = (it / ntile) % nsc, ql = it / (ntile * nsc), q = p0 + ql;
          const index_t col = ql * N + n0, a0 = t0 + k * walk_sub, a1 = a0 + walk_sub < t1 ? a0 + walk_sub : t1;
          S h[NT], cy[NT], acc[NT];
          for (int j = 0; j < NT; ++j) {
            h[j] = SH(k, col + j);
            cy[j] = SC(k, col + j);
            acc[j] = 0;
          }
          for (index_t t = a0; t < a1; ++t) {
            const index_t m = b * T + t;
            const S du = L.delta(m, q) * L.yhat(m, q);
            for (int j = 0; j < NT; ++j) {
              const S A = X(t - t0, col + j);
              Y(t - t0, col + j) = h[j] * A;
              h[j] = A * h[j] + du * L.beta(m, n0 + j);
            }
          }
          for (index_t t = a1 - 1; t >= a0; --t) {
            const index_t m = b * T + t;
            const S g = L.gy(m, q), dq = L.delta(m, q);
            for (int j = 0; j < NT; ++j) {
              const S A = X(t - t0, col + j), mu = g * L.gamma(m, n0 + j) + cy[j];
              X(t - t0, col + j) = mu;
              acc[j] += mu * Y(t - t0, col + j) * dq;
              cy[j] = A * mu;
            }
          }
          for (int j = 0; j < NT; ++j) SP(k, col + j) = acc[j];
        });
        team.team_barrier();
        // Per (token, channel), sums over n: gΔ = Σ μ (hA a + β ŷ) gives
        // ∂L/∂z; Σ μ β. Channels fastest: a warp writes rows of neighbours.
        Kokkos::parallel_for(Kokkos::TeamThreadRange(team, len * np), [&](const index_t it) {
          const index_t ql = it % np, i = it / np;
          token_state_sums<NT>(L, X, Y, i, b * T + t0 + i, p0 + ql, ql * N, D, o.gz, o.gyhat, b * W + t0 + i - w0);
        });
        // Per (token, state tile): the step's terms of ∂L/∂β and ∂L/∂γ, in channel order.
        Kokkos::parallel_for(Kokkos::TeamThreadRange(team, len * ntile), [&](const index_t it) {
          const index_t i = it / ntile, n0 = (it % ntile) * NT;
          S gb[NT], gg[NT];
          token_channel_sums<NT>(L, X, Y, i, b * T + t0 + i, n0, p0, np, gb, gg);
          for (int j = 0; j < NT; ++j) {
            GB(i, n0 + j) = p0 == 0 ? gb[j] : GB(i, n0 + j) + gb[j];
            GG(i, n0 + j) = p0 == 0 ? gg[j] : GG(i, n0 + j) + gg[j];
          }
        });
        // A_log's share of the chunk: the sub-ranges' sums in order.
        Kokkos::parallel_for(Kokkos::TeamThreadRange(team, np * ntile), [&](const index_t it) {
          const index_t n0 = (it % ntile) * NT, ql = it / ntile, col = ql * N + n0;
          for (int j = 0; j < NT; ++j) {
            S sum = 0;
            for (index_t k = 0; k < nsc; ++k) sum += SP(k, col + j);
            o.alog_part(prow, p0 + ql, n0 + j) = sum;
          }
        });
        team.team_barrier();  // ∂L/∂z rows written; SP read
        // The chunk's D and bδ sums, two-level: per (channel, sub-range), then over sub-ranges.
        Kokkos::parallel_for(Kokkos::TeamThreadRange(team, np * nsc), [&](const index_t it) {
          const index_t ql = it / nsc, k = it % nsc, q = p0 + ql;
          const index_t a0 = t0 + k * walk_sub, a1 = a0 + walk_sub < t1 ? a0 + walk_sub : t1;
          S d = 0, bd = 0;
          for (index_t t = a0; t < a1; ++t) {
            const index_t m = b * T + t;
            d += L.gy(m, q) * L.yhat(m, q);
            bd += o.gz(b * W + t - w0, q);
          }
          SC(k, ql) = d;
          SP(k, ql) = bd;
        });
        team.team_barrier();
        Kokkos::parallel_for(Kokkos::TeamThreadRange(team, np), [&](const index_t ql) {
          S d = 0, bd = 0;
          for (index_t k = 0; k < nsc; ++k) {
            d += SC(k, ql);
            bd += SP(k, ql);
          }
          o.d_part(prow, p0 + ql) = d;
          o.bd_part(prow, p0 + ql) = bd;
        });
        team.team_barrier();  // the next step overwrites the scratch read above
      }
      Kokkos::parallel_for(Kokkos::TeamThreadRange(team, len * N), [&](const index_t it) {
        const index_t i = it / N, n = it % N, r = b * W + t0 + i - w0;
        o.gbeta(r, n) = GB(i, n);
        o.ggamma(r, n) = GG(i, n);
      });
      team.team_barrier();
    }
  };
  // Every loop above is a TeamThreadRange, so any team size gives the same
  // result; a GPU may cap fs.team by its registers.
  WalkPolicy probe(exec, league, fs.team);
  probe.set_scratch_size(level, Kokkos::PerTeam(bytes));
  const int team = std::min(fs.team, probe.team_size_max(body, Kokkos::ParallelForTag()));
  WalkPolicy policy(exec, league, team);
  policy.set_scratch_size(level, Kokkos::PerTeam(bytes));
  Kokkos::parallel_for("ash::e3::walk", policy, body);
}

}  // namespace ash::impl
