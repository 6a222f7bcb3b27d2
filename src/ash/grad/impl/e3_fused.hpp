#pragma once
// E3's fused per-chunk backward (docs/design.md §6, "E3's fused per-chunk
// backward"): one team per (sequence, chunk, block of Pt channels), or with
// the sequential h form per (sequence, block) walking the chunks in order,
// replays h over a chunk, runs μ's reverse scan and forms every per-token VJP
// of the state, keeping h^{t-1}, A^t and μ^t of the chunk in team scratch.
// Global memory gets only what the dense VJPs need: per (token, channel) gz and the D and state parts of ∂L/∂ŷ,
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
  View2<S> gz, gyhat;              // [Bt·W, P]: ∂L/∂z; g D + Δ Σ_n μ β (the dense VJPs add the rest)
  View3<S> beta_part, gamma_part;  // [Bt·Wl, nPB, N]: sums over each channel block (nPB > 1), per launch
  View2<S> gbeta, ggamma;          // [Bt·W, N]: the sums over all channels
  View3<S> alog_part;              // [Bt·ncw, P, N]: Σ_t μ h^{t-1} A Δ per chunk of the wave
  View2<S> d_part, bd_part;        // [Bt·ncw, P]: Σ_t g ŷ and Σ_t ∂L/∂z per chunk
};

// Channels per team for chunks of C tokens: `requested` if > 0, else as many
// as keep the two [C, Pt·N] scratch arrays within `budget` bytes (a GPU's
// shared memory; a host's L2), at least one. A GPU puts one state per thread
// (Pt·N/NT threads, at most 1024); a host runs teams of one thread with
// NT-wide tiles, and its sequential h form one team per (sequence, block), so
// blocks narrow until the Bt sequences give each of its `concurrency`
// threads 4 teams.
struct FusedShape {
  index_t Pt = 1, nPB = 1;
  int team = 1;
};

inline FusedShape fused_shape(index_t P, index_t N, index_t C, int NT, index_t requested, std::size_t scalar_bytes,
                              index_t Bt, index_t concurrency) {
  constexpr std::size_t budget = host_backend ? (std::size_t(256) << 10) : (std::size_t(32) << 10);
  FusedShape f;
  const std::size_t per_channel = 2 * std::size_t(C) * std::size_t(N) * scalar_bytes;
  f.Pt = std::max<index_t>(1, std::min<index_t>(P, requested > 0 ? requested : index_t(budget / per_channel)));
  if (!host_backend) f.Pt = std::min<index_t>(f.Pt, std::max<index_t>(1, 1024 / (N / NT)));
  if (host_backend && requested <= 0) f.Pt = std::min<index_t>(f.Pt, std::max<index_t>(1, Bt * P / (4 * concurrency)));
  f.nPB = (P + f.Pt - 1) / f.Pt;
  f.team = host_backend ? 1 : int(f.Pt * (N / NT));
  return f;
}

// The per-token sums of the fused kernels and the walk, from a chunk's μ^t
// (X) and h^{t-1} A^t (Y) in team scratch, row i of token m.
// Of channel q (columns col0 + n), over n: ∂L/∂z = Σ μ (hA a + β ŷ)·softplus'(z)
// and the D and state part of ∂L/∂ŷ, g D + Δ Σ μ β; into o's row r.
template <int NT, class S, class X2>
KOKKOS_INLINE_FUNCTION void token_state_sums(const ScanView<S>& L, const X2& X, const X2& Y, index_t i, index_t m,
                                             index_t q, index_t col0, const Unmanaged1<S>& D, const View2<S>& gz,
                                             const View2<S>& gyhat, index_t r) {
  const index_t N = L.a.extent(1);
  const S dq = L.delta(m, q), yq = L.yhat(m, q);
  S gd = 0, gh = 0;
  for (index_t n0 = 0; n0 < N; n0 += NT) {
    S pd[NT], ph[NT];
    for (int j = 0; j < NT; ++j) {
      const index_t col = col0 + n0 + j;
      const S mu = X(i, col), bn = L.beta(m, n0 + j);
      pd[j] = mu * (Y(i, col) * L.a(q, n0 + j) + bn * yq);
      ph[j] = mu * bn;
    }
    for (int j = 0; j < NT; ++j) {
      gd += pd[j];
      gh += ph[j];
    }
  }
  gz(r, q) = -gd * kmath::expm1(-dq);  // softplus'(z) = 1 - e^{-Δ}
  gyhat(r, q) = L.gy(m, q) * D(q) + gh * dq;
}

// Of states n0 .. n0+NT, over the channels p0 .. p0+np (columns ql·N + n), in
// order: ∂L/∂β = Σ_q μ Δ ŷ and ∂L/∂γ = Σ_q g h^t, h^t = h^{t-1} A + Δ ŷ β.
template <int NT, class S, class X2>
KOKKOS_INLINE_FUNCTION void token_channel_sums(const ScanView<S>& L, const X2& X, const X2& Y, index_t i, index_t m,
                                               index_t n0, index_t p0, index_t np, S (&gb)[NT], S (&gg)[NT]) {
  const index_t N = L.a.extent(1);
  S bv[NT];
  for (int j = 0; j < NT; ++j) {
    gb[j] = 0;
    gg[j] = 0;
    bv[j] = L.beta(m, n0 + j);
  }
  for (index_t ql = 0; ql < np; ++ql) {
    const index_t q = p0 + ql, col = ql * N + n0;
    const S du = L.delta(m, q) * L.yhat(m, q), g = L.gy(m, q);
    for (int j = 0; j < NT; ++j) {
      gb[j] += X(i, col + j) * du;
      gg[j] += g * (Y(i, col + j) + du * bv[j]);
    }
  }
}

using FusedPolicy = Kokkos::TeamPolicy<ExecSpace>;
using FusedMember = FusedPolicy::member_type;

// The launch [l0, l0+Wl) of whole chunks of the wave [w0, w0+W) of every
// sequence (exact or detached mode, no window): the wave's rows of `out` get
// the launch's tokens; the block shares are the launch's own (row
// b·Wl + t - l0). h before a chunk comes from one of E3's two h forms:
// chunk-parallel, Hb holds h at chunk ends (a team per chunk); sequential
// (Hb empty), hrun ([Bt·P, N]) carries h from chunk to chunk and wave to wave
// (a team walks its launch's chunks in order; launches come in order). h0: h
// before the first chunk (zero when empty). Ms: μ at chunk starts; carry: the
// later block's A μ past the last chunk. D: the layer's skip weights.
template <int NT, class S>
void fused_chunk_backward(const ScanView<S>& L, const Chunks ch, index_t Bt, const View3<S>& Hb, const View2<S>& hrun,
                          const View2<S>& h0, const View3<S>& Ms, const ExactCarry<S>& carry, const Unmanaged1<S>& D,
                          index_t w0, index_t W, index_t l0, index_t Wl, const FusedShape fs, const FusedOut<S>& out,
                          const ExecSpace& exec) {
  using Scratch = Kokkos::View<S**, Kokkos::LayoutRight, typename ExecSpace::scratch_memory_space,
                               Kokkos::MemoryTraits<Kokkos::Unmanaged>>;
  const index_t P = L.a.extent(0), N = L.a.extent(1), T = L.T, nc = ch.n, C = ch.len;
  const index_t Pt = fs.Pt, nPB = fs.nPB, ntile = N / NT, PtN = Pt * N;
  const index_t c_w = w0 / C, ncw = (W + C - 1) / C, c_lo = l0 / C, ncl = (Wl + C - 1) / C;
  const bool has_h0 = h0.extent(0) > 0, split = nPB > 1, sequential = Hb.extent(0) == 0;
  const index_t per_team = sequential ? ncl : 1;  // chunks a team walks
  const FusedOut<S> o = out;
  // Past 48 KiB (CUDA's shared memory without an opt-in) the arrays go to
  // level 1, global memory private to the team. Kokkos' CUDA teams keep
  // sizeof(double)·(team + 2) bytes of the block's shared memory before the
  // scratch; fs.team bounds the team used below.
  const index_t ld = PtN + 1;  // padded row: a GPU warp reading a column of rows hits 32 banks
  const std::size_t bytes = 2 * Scratch::shmem_size(C, ld);
  const std::size_t reserved = sizeof(double) * std::size_t(fs.team + 2);
  const int level = !host_backend && bytes + reserved > (std::size_t(48) << 10) ? 1 : 0;
  const index_t league = Bt * (ncl / per_team) * nPB;
  const auto body = KOKKOS_LAMBDA(const FusedMember& team) {
    const index_t l = team.league_rank(), pb = l % nPB, bcw = l / nPB;
    const index_t b = bcw / (ncl / per_team), c_first = c_lo + (bcw % (ncl / per_team)) * per_team;
    const index_t p0 = pb * Pt, np = p0 + Pt < P ? Pt : P - p0;  // channels of this block
    // X: A^t, then μ^t. Y: h^{t-1}, then h^{t-1} A^t. Row t - t0, column (q - p0)·N + n.
    Scratch X(team.team_scratch(level), C, ld), Y(team.team_scratch(level), C, ld);
    for (index_t c = c_first; c < c_first + per_team; ++c) {
      const index_t t0 = ch.start(c), t1 = ch.end(c), len = t1 - t0;
      const index_t prow = b * ncw + (c - c_w);  // this chunk's row of the wave's partial sums
      Kokkos::parallel_for(Kokkos::TeamThreadRange(team, np * ntile), [&](const index_t it) {
        const index_t ql = it / ntile, n0 = (it % ntile) * NT, q = p0 + ql, col = ql * N + n0;
        S h[NT], av[NT], cy[NT];
        for (int j = 0; j < NT; ++j) {
          h[j] = c == 0 ? (has_h0 ? h0(b * P + q, n0 + j) : S(0))
                        : (sequential ? hrun(b * P + q, n0 + j) : Hb(b * nc + c - 1, q, n0 + j));
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
        if (sequential)
          for (int j = 0; j < NT; ++j) hrun(b * P + q, n0 + j) = h[j];
        // μ^t = g^t γ^t + A^{t+1} μ^{t+1}, from the carry past the chunk;
        // on the way the chunk's Σ_t μ h^{t-1} A Δ (A_log's partial sum).
        S acc[NT];
        for (int j = 0; j < NT; ++j) {
          cy[j] = c + 1 < nc ? L.A(b * T + t1, q, n0 + j) * Ms(b * nc + c + 1, q, n0 + j)
                             : (carry.valid ? carry.A(b, q, n0 + j) * carry.mu(b, q, n0 + j) : S(0));
          acc[j] = 0;
        }
        for (index_t t = t1 - 1; t >= t0; --t) {
          const index_t m = b * T + t;
          const S g = L.gy(m, q), dq = L.delta(m, q);
          for (int j = 0; j < NT; ++j) {
            const S A = X(t - t0, col + j), mu = g * L.gamma(m, n0 + j) + cy[j], hA = Y(t - t0, col + j) * A;
            X(t - t0, col + j) = mu;
            Y(t - t0, col + j) = hA;
            acc[j] += mu * hA * dq;
            cy[j] = A * mu;
          }
        }
        for (int j = 0; j < NT; ++j) o.alog_part(prow, q, n0 + j) = acc[j];
      });
      team.team_barrier();
      // Per (token, channel), sums over n: gΔ = Σ μ (hA a + β ŷ), then
      // ∂L/∂z = gΔ softplus'(z), and Σ μ β. Channels fastest: a GPU's warp
      // reads its Δ, ŷ and g as rows of np neighbouring channels (the team's
      // whole share of a row) and β as 32/np rows it shares, where tokens
      // fastest read 32 rows P apart (32 sectors a load). Scratch then shares
      // banks between channels N apart, cheaper than the global loads were.
      Kokkos::parallel_for(Kokkos::TeamThreadRange(team, np * len), [&](const index_t i) {
        const index_t ql = i % np, t = t0 + i / np;
        token_state_sums<NT>(L, X, Y, t - t0, b * T + t, p0 + ql, ql * N, D, o.gz, o.gyhat, b * W + t - w0);
      });
      // Per (token, state tile), sums over the block's channels in order:
      // ∂L/∂β = Σ_q μ Δ ŷ and ∂L/∂γ = Σ_q g h^t, h^t = h^{t-1} A + Δ ŷ β.
      Kokkos::parallel_for(Kokkos::TeamThreadRange(team, len * ntile), [&](const index_t i) {
        const index_t t = t0 + i / ntile, n0 = (i % ntile) * NT, m = b * T + t, r = b * W + t - w0;
        const index_t rl = b * Wl + t - l0;  // the launch's row of the block shares
        S gb[NT], gg[NT];
        token_channel_sums<NT>(L, X, Y, t - t0, m, n0, p0, np, gb, gg);
        for (int j = 0; j < NT; ++j) {
          if (split) {
            o.beta_part(rl, pb, n0 + j) = gb[j];
            o.gamma_part(rl, pb, n0 + j) = gg[j];
          } else {
            o.gbeta(r, n0 + j) = gb[j];
            o.ggamma(r, n0 + j) = gg[j];
          }
        }
      });
      team.team_barrier();  // the gz rows above, for the bδ sum
      // Per channel: the chunk's D and bδ sums.
      Kokkos::parallel_for(Kokkos::TeamThreadRange(team, np), [&](const index_t ql) {
        const index_t q = p0 + ql;
        S d = 0, bd = 0;
        for (index_t t = t0; t < t1; ++t) {
          const index_t m = b * T + t;
          d += L.gy(m, q) * L.yhat(m, q);
          bd += o.gz(b * W + t - w0, q);
        }
        o.d_part(prow, q) = d;
        o.bd_part(prow, q) = bd;
      });
      team.team_barrier();  // scratch is read above before the next chunk overwrites it
    }
  };
  // Every loop above is a TeamThreadRange, so any team size gives the same
  // result; a GPU may cap fs.team's one thread per state by its registers.
  FusedPolicy probe(exec, league, fs.team);
  probe.set_scratch_size(level, Kokkos::PerTeam(bytes));
  const int team = std::min(fs.team, probe.team_size_max(body, Kokkos::ParallelForTag()));
  FusedPolicy policy(exec, league, team);
  policy.set_scratch_size(level, Kokkos::PerTeam(bytes));
  Kokkos::parallel_for("ash::e3::fused_chunk", policy, body);
  if (!split) return;
  // The second level: per (token, state), the channel blocks in order.
  Kokkos::parallel_for(
      "ash::e3::fused_state_sums", Range(exec, 0, Bt * Wl * N), KOKKOS_LAMBDA(const index_t i) {
        const index_t rl = i / N, n = i % N, r = (rl / Wl) * W + l0 - w0 + rl % Wl;
        S gb = 0, gg = 0;
        for (index_t k = 0; k < nPB; ++k) {
          gb += o.beta_part(rl, k, n);
          gg += o.gamma_part(rl, k, n);
        }
        o.gbeta(r, n) = gb;
        o.ggamma(r, n) = gg;
      });
}

}  // namespace ash::impl
