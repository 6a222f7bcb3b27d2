#include "ash/model/ssm_layer.hpp"

#include "ash/core/error.hpp"
#include "ash/model/impl/blas.hpp"
#include "ash/model/impl/rms_norm.hpp"

namespace ash {

template <class S>
LayerActivations<S>::LayerActivations(const SeqShape& s, const ModelDims& d, bool store_state)
    : rstd("ash::act::rstd", s.rows()),
      yhat("ash::act::yhat", s.rows(), d.width),
      z("ash::act::z", s.rows(), d.width),
      delta("ash::act::delta", s.rows(), d.width),
      beta("ash::act::beta", s.rows(), d.state),
      gamma("ash::act::gamma", s.rows(), d.state) {
  if (store_state) {
    A = View3<S>("ash::act::A", s.rows(), d.width, d.state);
    h = View3<S>("ash::act::h", s.rows(), d.width, d.state);
  }
}

namespace {

KOKKOS_INLINE_FUNCTION double softplus(double z) { return z > 20.0 ? z : kmath::log1p(kmath::exp(z)); }
KOKKOS_INLINE_FUNCTION float softplus(float z) { return z > 20.0f ? z : kmath::log1p(kmath::exp(z)); }
template <class S>
KOKKOS_INLINE_FUNCTION S sigmoid(S z) {
  return S(1) / (S(1) + kmath::exp(-z));
}

}  // namespace

template <class S>
void ssm_layer_forward(const LayerParams<S>& p, const SeqShape& s, const View2<S>& y_in, LayerActivations<S>& act,
                       const View2<S>& y_out) {
  const index_t M = s.rows(), T = s.T, P = y_in.extent(1), N = p.W_B.extent(0);
  impl::rms_norm_forward<S>(y_in, p.norm, act.rstd, act.yhat);
  impl::gemm<S>("N", "T", S(1), act.yhat, p.W_delta, S(0), act.z);
  impl::gemm<S>("N", "T", S(1), act.yhat, p.W_B, S(0), act.beta);
  impl::gemm<S>("N", "T", S(1), act.yhat, p.W_C, S(0), act.gamma);
  auto z = act.z;
  auto delta = act.delta;
  auto bd = p.b_delta;
  Kokkos::parallel_for(
      "ash::layer_delta", Range2({0, 0}, {M, P}), KOKKOS_LAMBDA(const index_t m, const index_t q) {
        z(m, q) += bd(q);
        delta(m, q) = softplus(z(m, q));
      });

  // Scan along t, one work item per (sequence b, channel p); the state h_p[N]
  // lives in `state`, A and h are also stored per token when allocated.
  const bool store = act.h.extent(0) > 0;
  View2<S> state("ash::layer_state", s.batch * P, N);
  auto beta = act.beta;
  auto gamma = act.gamma;
  auto yhat = act.yhat;
  auto Ast = act.A;
  auto Hst = act.h;
  auto Alog = p.A_log;
  auto D = p.D;
  Kokkos::parallel_for(
      "ash::layer_scan_forward", Range(0, s.batch * P), KOKKOS_LAMBDA(const index_t bp) {
        const index_t b = bp / P, q = bp % P;
        for (index_t n = 0; n < N; ++n) state(bp, n) = 0;
        for (index_t t = 0; t < T; ++t) {
          const index_t m = b * T + t;
          const S dq = delta(m, q);
          const S u = dq * yhat(m, q);
          S out = D(q) * yhat(m, q);
          for (index_t n = 0; n < N; ++n) {
            const S a = kmath::exp(dq * -kmath::exp(Alog(q, n)));
            const S hn = a * state(bp, n) + u * beta(m, n);
            state(bp, n) = hn;
            out += gamma(m, n) * hn;
            if (store) {
              Ast(m, q, n) = a;
              Hst(m, q, n) = hn;
            }
          }
          y_out(m, q) = y_in(m, q) + out;
        }
      });
}

template <class S>
void ssm_layer_backward(const LayerParams<S>& p, const SeqShape& s, const View2<S>& y_in,
                        const LayerActivations<S>& act, const View2<S>& gy, const LayerParams<S>& grad,
                        const View2<S>& gy_in, bool detach_input) {
  require(act.h.extent(0) == s.rows(), "ssm_layer_backward needs stored A and h");
  const index_t M = s.rows(), T = s.T, P = y_in.extent(1), N = p.W_B.extent(0);
  auto yhat = act.yhat;
  auto delta = act.delta;
  auto z = act.z;
  auto beta = act.beta;
  auto gamma = act.gamma;
  auto Ast = act.A;
  auto Hst = act.h;
  auto Alog = p.A_log;
  auto D = p.D;
  auto gD = grad.D;

  View2<S> gyhat("ash::grad::gyhat", M, P);
  View2<S> gz("ash::grad::gz", M, P);
  View3<S> mu("ash::grad::mu", M, P, N);  // adjoint of h: μ^t = gy^t γ^t + A^{t+1} μ^{t+1}

  // Reverse scan per (b, p): μ, and everything local to (m, p) — gΔ, the ŷ-part
  // through u = Δ ŷ β, and the per-sequence partial sums of gD, gbδ, gAlog
  // (reduced over b below: deterministic, unit stride, no atomics).
  View2<S> part_D("ash::grad::part_D", s.batch, P);
  View2<S> part_bd("ash::grad::part_bdelta", s.batch, P);
  View3<S> part_Alog("ash::grad::part_Alog", s.batch, P, N);
  Kokkos::parallel_for(
      "ash::layer_scan_backward", Range(0, s.batch * P), KOKKOS_LAMBDA(const index_t bp) {
        const index_t b = bp / P, q = bp % P;
        S acc_D = 0, acc_bd = 0;
        for (index_t t = T - 1; t >= 0; --t) {
          const index_t m = b * T + t;
          const S dq = delta(m, q);
          S gdelta = 0, gyh = gy(m, q) * D(q);
          acc_D += gy(m, q) * yhat(m, q);  // ỹ_p = Σ_n γ_n h_pn + D_p ŷ_p
          for (index_t n = 0; n < N; ++n) {
            const S carry = (t + 1 < T) ? Ast(m + 1, q, n) * mu(m + 1, q, n) : S(0);
            const S mun = gy(m, q) * gamma(m, n) + carry;
            mu(m, q, n) = mun;
            const S hprev = t > 0 ? Hst(m - 1, q, n) : S(0);
            const S a = -kmath::exp(Alog(q, n));
            const S gA = mun * hprev * Ast(m, q, n);  // ∂L/∂A · A
            gdelta += gA * a + mun * beta(m, n) * yhat(m, q);
            gyh += mun * dq * beta(m, n);
            part_Alog(b, q, n) += gA * dq * a;  // ∂A/∂Alog = A Δ a
          }
          gyhat(m, q) = gyh;
          const S gzm = gdelta / (S(1) + kmath::exp(-z(m, q)));  // softplus' = sigmoid
          gz(m, q) = gzm;
          acc_bd += gzm;
        }
        part_D(b, q) = acc_D;
        part_bd(b, q) = acc_bd;
      });
  auto gAlog = grad.A_log;
  auto gbd = grad.b_delta;
  const index_t Bt = s.batch;
  Kokkos::parallel_for(
      "ash::layer_bwd_reduce_batch", Range2({0, 0}, {P, N}), KOKKOS_LAMBDA(const index_t q, const index_t n) {
        S acc = 0;
        for (index_t b = 0; b < Bt; ++b) acc += part_Alog(b, q, n);
        gAlog(q, n) += acc;
        if (n == 0) {
          S d = 0, bd = 0;
          for (index_t b = 0; b < Bt; ++b) {
            d += part_D(b, q);
            bd += part_bd(b, q);
          }
          gD(q) += d;
          gbd(q) += bd;
        }
      });

  // Per-token β, γ cotangents (sums over p).
  View2<S> gbeta("ash::grad::gbeta", M, N);
  View2<S> ggamma("ash::grad::ggamma", M, N);
  Kokkos::parallel_for(
      "ash::layer_bwd_beta_gamma", Range2({0, 0}, {M, N}), KOKKOS_LAMBDA(const index_t m, const index_t n) {
        S gb = 0, gg = 0;
        for (index_t q = 0; q < P; ++q) {
          gb += mu(m, q, n) * delta(m, q) * yhat(m, q);
          gg += gy(m, q) * Hst(m, q, n);
        }
        gbeta(m, n) = gb;
        ggamma(m, n) = gg;
      });

  // Dense VJPs: weight gradients are GEMMs over tokens.
  impl::gemm<S>("T", "N", S(1), gz, yhat, S(1), grad.W_delta);
  impl::gemm<S>("T", "N", S(1), gbeta, yhat, S(1), grad.W_B);
  impl::gemm<S>("T", "N", S(1), ggamma, yhat, S(1), grad.W_C);
  impl::gemm<S>("N", "N", S(1), gz, p.W_delta, S(1), gyhat);
  impl::gemm<S>("N", "N", S(1), gbeta, p.W_B, S(1), gyhat);
  impl::gemm<S>("N", "N", S(1), ggamma, p.W_C, S(1), gyhat);
  // Residual: gy_in = gy + RMSNorm VJP; detached, the input gets gy by identity
  // and only the norm weight still uses ∂L/∂ŷ.
  if (gy_in.data() != gy.data()) Kokkos::deep_copy(gy_in, gy);
  if (detach_input) {
    View2<S> discard("ash::grad::gx_detached", M, P);
    impl::rms_norm_backward<S>(y_in, p.norm, act.rstd, gyhat, grad.norm, discard, false);
    return;
  }
  impl::rms_norm_backward<S>(y_in, p.norm, act.rstd, gyhat, grad.norm, gy_in, true);
}

#define ASH_INSTANTIATE(S)                                                                                   \
  template struct LayerActivations<S>;                                                                       \
  template void ssm_layer_forward<S>(const LayerParams<S>&, const SeqShape&, const View2<S>&,                \
                                     LayerActivations<S>&, const View2<S>&);                                 \
  template void ssm_layer_backward<S>(const LayerParams<S>&, const SeqShape&, const View2<S>&,               \
                                      const LayerActivations<S>&, const View2<S>&, const LayerParams<S>&,    \
                                      const View2<S>&, bool);
ASH_INSTANTIATE(float)
ASH_INSTANTIATE(double)

}  // namespace ash
