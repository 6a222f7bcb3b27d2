#pragma once
// RMSNorm of docs/design.md §1: ŷ = w ⊙ x · r,  r = 1 / sqrt(mean_p x_p² + eps), eps = 1e-5
// (a Mamba's: model.norm_eps).
#include "ash/core/error.hpp"
#include "ash/core/types.hpp"
#include "ash/kernels/blocks.hpp"
#include "ash/kernels/row_sums.hpp"

namespace ash::impl {

constexpr double rms_eps = 1e-5;

// One team per row (block_sum_team threads: one on a host, which sums p in
// order as a plain loop would; 64 on a GPU, whose threads read a row's
// consecutive channels together instead of one thread striding through it).

// rstd[m] = r(x[m, :]),  yhat[m, p] = w[p] x[m, p] r.
template <class S, class X, class W, class R, class Y>
void rms_norm_forward(const X& x, const W& w, const R& rstd, const Y& yhat, const ExecSpace& exec = ExecSpace(),
                      double eps = rms_eps) {
  const index_t M = x.extent(0), P = x.extent(1);
  const S e = S(eps);
  Kokkos::parallel_for(
      "ash::rms_norm_forward", block_sum_policy(exec, M), KOKKOS_LAMBDA(const BlockSumMember& team) {
        const index_t m = team.league_rank();
        const S ss = team_block_sum<S>(team, P, [&](const index_t p) { return x(m, p) * x(m, p); });
        const S r = S(1) / kmath::sqrt(ss / S(P) + e);
        Kokkos::single(Kokkos::PerTeam(team), [&]() { rstd(m) = r; });
        Kokkos::parallel_for(Kokkos::TeamThreadRange(team, P),
                             [&](const index_t p) { yhat(m, p) = w(p) * x(m, p) * r; });
      });
}

// Given gyhat = ∂L/∂ŷ for R rows (row r is token map(r) of x, rstd, gx):
// gw[p] += Σ_r gyhat x r (two-level sum over blocks of reduce_rows rows), and
// gx[m, :] (=, or += when accumulate) r (gw⊙gyhat - x̂ mean(gyhat⊙w⊙x̂)), x̂ = x r.
// An empty gx skips the input VJP (stop-gradient on x). part is the caller's
// workspace for the first-level sums, at least [row_blocks(R), P]: no allocation
// here (on a GPU each free synchronises the device, and this runs per wave).
template <class S, class X, class W, class R, class G, class GW, class GX, class Map = ash::IdentityRows>
void rms_norm_backward(const X& x, const W& w, const R& rstd, const G& gyhat, const GW& gw, const GX& gx,
                       bool accumulate_gx, const View2<S>& part, const ExecSpace& exec = ExecSpace(),
                       const Map map = Map()) {
  const index_t Rn = gyhat.extent(0), P = x.extent(1);
  const index_t nblk = row_blocks(Rn);
  ash::require(index_t(part.extent(0)) >= nblk && index_t(part.extent(1)) == P,
               "rms_norm_backward: the workspace is smaller than [row_blocks(R), P]");
  column_sums(
      "ash::rms_norm_backward_w", exec, Rn, P, part,
      KOKKOS_LAMBDA(const index_t r, const index_t p) {
        const index_t m = map(r);
        return gyhat(r, p) * x(m, p) * rstd(m);
      },
      gw);
  if (gx.extent(0) == 0) return;
  const S keep = accumulate_gx ? S(1) : S(0);
  Kokkos::parallel_for(
      "ash::rms_norm_backward_x", block_sum_policy(exec, Rn), KOKKOS_LAMBDA(const BlockSumMember& team) {
        const index_t r = team.league_rank(), m = map(r);
        const S rs = rstd(m);
        const S dot =
            team_block_sum<S>(team, P, [&](const index_t p) { return gyhat(r, p) * w(p) * x(m, p) * rs; }) / S(P);
        Kokkos::parallel_for(Kokkos::TeamThreadRange(team, P), [&](const index_t p) {
          const S v = rs * (gyhat(r, p) * w(p) - x(m, p) * rs * dot);
          gx(m, p) = keep * gx(m, p) + v;
        });
      });
}

// A weightless RMSNorm in place (FalconMamba's on δ, B and C): per row m,
// r = 1 / sqrt(mean_p v[m, p]² + eps) into rstd[m], then v[m, :] *= r.
template <class V, class R>
void rms_norm_weightless(const V& v, const R& rstd, double eps, const ExecSpace& exec = ExecSpace()) {
  using S = typename V::non_const_value_type;
  const index_t M = v.extent(0), P = v.extent(1);
  const S e = S(eps);
  Kokkos::parallel_for(
      "ash::rms_norm_weightless", block_sum_policy(exec, M), KOKKOS_LAMBDA(const BlockSumMember& team) {
        const index_t m = team.league_rank();
        const S ss = team_block_sum<S>(team, P, [&](const index_t p) { return v(m, p) * v(m, p); });
        const S r = S(1) / kmath::sqrt(ss / S(P) + e);
        Kokkos::single(Kokkos::PerTeam(team), [&]() { rstd(m) = r; });
        Kokkos::parallel_for(Kokkos::TeamThreadRange(team, P), [&](const index_t p) { v(m, p) *= r; });
      });
}

// Its VJP in place, from the normalised values vhat = v r and r: on entry g is
// ∂L/∂vhat, on return ∂L/∂v = r (g - vhat mean_p(g ⊙ vhat)).
template <class V, class R, class G>
void rms_norm_weightless_backward(const V& vhat, const R& rstd, const G& g, const ExecSpace& exec = ExecSpace()) {
  using S = typename G::non_const_value_type;
  const index_t M = vhat.extent(0), P = vhat.extent(1);
  Kokkos::parallel_for(
      "ash::rms_norm_weightless_backward", block_sum_policy(exec, M), KOKKOS_LAMBDA(const BlockSumMember& team) {
        const index_t m = team.league_rank();
        const S r = rstd(m);
        const S dot = team_block_sum<S>(team, P, [&](const index_t p) { return g(m, p) * vhat(m, p); }) / S(P);
        Kokkos::parallel_for(Kokkos::TeamThreadRange(team, P),
                             [&](const index_t p) { g(m, p) = r * (g(m, p) - vhat(m, p) * dot); });
      });
}

}  // namespace ash::impl
