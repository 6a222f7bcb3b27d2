#pragma once
// RMSNorm of docs/design.md §1: ŷ = w ⊙ x · r,  r = 1 / sqrt(mean_p x_p² + eps), eps = 1e-5.
#include "ash/core/types.hpp"

namespace ash::impl {

constexpr double rms_eps = 1e-5;

// rstd[m] = r(x[m, :]),  yhat[m, p] = w[p] x[m, p] r.
template <class S, class X, class W, class R, class Y>
void rms_norm_forward(const X& x, const W& w, const R& rstd, const Y& yhat, const ExecSpace& exec = ExecSpace()) {
  const index_t M = x.extent(0), P = x.extent(1);
  Kokkos::parallel_for(
      "ash::rms_norm_forward", Range(exec, 0, M), KOKKOS_LAMBDA(const index_t m) {
        S ss = 0;
        for (index_t p = 0; p < P; ++p) ss += x(m, p) * x(m, p);
        const S r = S(1) / kmath::sqrt(ss / S(P) + S(rms_eps));
        rstd(m) = r;
        for (index_t p = 0; p < P; ++p) yhat(m, p) = w(p) * x(m, p) * r;
      });
}

// Given gyhat = ∂L/∂ŷ: gw[p] += Σ_m gyhat x r (deterministic: one thread per p),
// gx[m, :] (=, or += when accumulate) r (gw⊙gyhat - x̂ mean(gyhat⊙w⊙x̂)), x̂ = x r.
// An empty gx skips the input VJP (stop-gradient on x).
template <class S, class X, class W, class R, class G, class GW, class GX>
void rms_norm_backward(const X& x, const W& w, const R& rstd, const G& gyhat, const GW& gw, const GX& gx,
                       bool accumulate_gx, const ExecSpace& exec = ExecSpace()) {
  const index_t M = x.extent(0), P = x.extent(1);
  Kokkos::parallel_for(
      "ash::rms_norm_backward_w", Range(exec, 0, P), KOKKOS_LAMBDA(const index_t p) {
        S acc = 0;
        for (index_t m = 0; m < M; ++m) acc += gyhat(m, p) * x(m, p) * rstd(m);
        gw(p) += acc;
      });
  if (gx.extent(0) == 0) return;
  const S keep = accumulate_gx ? S(1) : S(0);
  Kokkos::parallel_for(
      "ash::rms_norm_backward_x", Range(exec, 0, M), KOKKOS_LAMBDA(const index_t m) {
        const S r = rstd(m);
        S dot = 0;
        for (index_t p = 0; p < P; ++p) dot += gyhat(m, p) * w(p) * x(m, p) * r;
        dot /= S(P);
        for (index_t p = 0; p < P; ++p) {
          const S v = r * (gyhat(m, p) * w(p) - x(m, p) * r * dot);
          gx(m, p) = keep * gx(m, p) + v;
        }
      });
}

}  // namespace ash::impl
