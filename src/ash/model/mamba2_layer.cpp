#include "ash/model/mamba2_layer.hpp"

#include "ash/core/error.hpp"
#include "ash/kernels/blas.hpp"
#include "ash/kernels/rms_norm.hpp"
#include "ash/kernels/row_sums.hpp"
#include "ash/model/impl/causal_conv.hpp"

namespace ash {

namespace {

using impl::silu;
using impl::silu_grad;
using impl::softplus;

// The conv's output c, and SiLU(c) routed to the scan's u, β and γ (channels
// [0, E), [E, E+GN), [E+GN, E+2GN), GN = G·N: B and C of every group), as one
// kernel writes them.
template <class S>
struct ConvOut2 {
  View2<S> c, u, beta, gamma;
  index_t E, GN;
  KOKKOS_INLINE_FUNCTION void operator()(const index_t m, const index_t ch, const S acc) const {
    c(m, ch) = acc;
    const S v = silu(acc);
    if (ch < E)
      u(m, ch) = v;
    else if (ch < E + GN)
      beta(m, ch - E) = v;
    else
      gamma(m, ch - E - GN) = v;
  }
};

// Δ after softplus and the limit (transformers' dt_limit: applied unless (0, ∞)).
template <class S>
KOKKOS_INLINE_FUNCTION S limited(S v, S lo, S hi) {
  if (lo > S(0) && v < lo) return lo;
  if (hi > S(0) && v > hi) return hi;
  return v;
}
template <class S>
KOKKOS_INLINE_FUNCTION bool clamped(S v, S lo, S hi) {
  return (lo > S(0) && v < lo) || (hi > S(0) && v > hi);
}

// mamba_layer_forward with a carried state or (null) without; without y_out it
// stops after the gated norm, or before the scan (mamba_layer_activations).
template <class S>
void forward_impl(const Mamba2LayerParams<S>& p, const ModelDims& d, const SeqShape& s, const View2<S>& y_in,
                  const MambaActivations<S>& act, const View2<S>& y_out, const MambaState<S>* state,
                  const ExecSpace& exec, MambaUpTo upto = MambaUpTo::gate) {
  const index_t M = y_in.extent(0), E = d.inner(), C = d.conv_dim(), N = d.state, P = d.head_dim, G = d.n_groups,
                Kc = d.conv_kernel;
  require(M == s.rows() && index_t(act.x.extent(0)) == M && index_t(act.x.extent(1)) == C &&
              index_t(act.mixer_rstd.extent(1)) == G && index_t(act.d_channels.extent(0)) == E,
          "mamba_layer_forward: Mamba-2 activations of another size");
  const bool carry = state != nullptr;
  require(!carry || (index_t(state->conv.extent(0)) == s.batch * C && index_t(state->conv.extent(1)) == Kc - 1 &&
                     index_t(state->ssm.extent(0)) == s.batch * E && index_t(state->ssm.extent(1)) == N),
          "mamba_layer_forward: a carried Mamba-2 state of another size");
  impl::rms_norm_forward<S>(y_in, p.norm, act.rstd, act.yhat, exec, d.norm_eps);
  impl::gemm<S>(exec, "N", "T", S(1), act.yhat, p.in_z, S(0), act.z);
  impl::gemm<S>(exec, "N", "T", S(1), act.yhat, p.in_xbc, S(0), act.x);
  impl::gemm<S>(exec, "N", "T", S(1), act.yhat, p.in_dt, S(0), act.dlow);
  const auto& sc = act.scan;
  impl::causal_conv_forward(s, act.x, p.conv_weight, p.conv_bias, carry ? state->conv : View2<S>(),
                            ConvOut2<S>{act.c, sc.yhat, sc.beta, sc.gamma, E, G * N}, exec);
  if (carry) impl::causal_conv_state(s, act.x, state->conv, exec);
  // The scan core's per-channel parameters: a = −exp(Alog_h) for every state, D_h.
  {
    auto a = sc.a;
    auto dch = act.d_channels;
    auto alog = p.A_log;
    auto D = p.D;
    Kokkos::parallel_for(
        "ash::mamba2::channel_params", Range2(exec, {0, 0}, {E, N}), KOKKOS_LAMBDA(const index_t e, const index_t n) {
          a(e, n) = -kmath::exp(alog(e / P));
          if (n == 0) dch(e) = D(e / P);
        });
  }
  {
    auto delta = sc.delta;
    auto dt = act.dlow;
    auto b = p.dt_bias;
    const S lo = S(d.time_step_limit_min), hi = S(d.time_step_limit_max);
    const index_t H = d.head_count();
    Kokkos::parallel_for(
        "ash::mamba2::delta", Range2(exec, {0, 0}, {M, H}), KOKKOS_LAMBDA(const index_t m, const index_t h) {
          const S v = limited(softplus(dt(m, h) + b(h)), lo, hi);  // once per head, then its P channels
          for (index_t q = 0; q < P; ++q) delta(m, h * P + q) = v;
        });
  }
  if (upto == MambaUpTo::scan_inputs) return;
  // With no per-token states to keep, the SSD's chunked matrix form, from a
  // zero or a carried state; E1's and E2's h and A, and a carried state over
  // fewer than ssd_min_tokens (generation's one-token steps) take the
  // per-channel scan.
  if (sc.hprev.extent(0) == 0 && (!carry || s.T >= ssd_min_tokens))
    SsdScan<S>(ssd_shape(d, s), false).forward(sc, scan_core_D(p, act), s.docs, act.s, carry ? state->ssm : View2<S>(),
                                               exec);
  else
    selective_scan_forward(scan_core_D(p, act), s, View2<S>(), sc, act.s, carry ? state->ssm : View2<S>(), exec);
  // The gated norm, a team per (token, group): o = w_g ⊙ v r, v = s ⊙ SiLU(z).
  {
    auto so = act.s;
    auto z = act.z;
    auto o = act.o;
    auto r = act.mixer_rstd;
    auto w = p.gated_norm;
    const index_t Eg = E / G;
    const S eps = S(d.norm_eps);
    Kokkos::parallel_for(
        "ash::mamba2::gated_norm", impl::block_sum_policy(exec, M * G),
        KOKKOS_LAMBDA(const impl::BlockSumMember& team) {
          const index_t m = team.league_rank() / G, g0 = (team.league_rank() % G) * Eg;
          // v = s ⊙ SiLU(z) into o on the way (one SiLU per element), then scaled in place.
          const S ss = impl::team_block_sum<S>(team, Eg, [&](const index_t j) {
            const S v = so(m, g0 + j) * silu(z(m, g0 + j));
            o(m, g0 + j) = v;
            return v * v;
          });
          const S rr = S(1) / kmath::sqrt(ss / S(Eg) + eps);
          Kokkos::single(Kokkos::PerTeam(team), [&]() { r(m, g0 / Eg) = rr; });
          team.team_barrier();
          Kokkos::parallel_for(Kokkos::TeamThreadRange(team, Eg), [&](const index_t j) {
            const index_t e = g0 + j;
            o(m, e) = w(e) * (o(m, e) * rr);
          });
        });
  }
  if (y_out.extent(0) == 0) return;
  Kokkos::deep_copy(exec, y_out, y_in);
  impl::gemm<S>(exec, "N", "T", S(1), act.o, p.out_proj, S(1), y_out);
}

}  // namespace

template <class S>
void mamba_layer_forward(const Mamba2LayerParams<S>& p, const ModelDims& d, const SeqShape& s, const View2<S>& y_in,
                         const MambaActivations<S>& act, const View2<S>& y_out, const ExecSpace& exec) {
  forward_impl(p, d, s, y_in, act, y_out, static_cast<const MambaState<S>*>(nullptr), exec);
}

template <class S>
void mamba_layer_forward(const Mamba2LayerParams<S>& p, const ModelDims& d, const SeqShape& s, const View2<S>& y_in,
                         const MambaActivations<S>& act, const View2<S>& y_out, const MambaState<S>& state,
                         const ExecSpace& exec) {
  forward_impl(p, d, s, y_in, act, y_out, &state, exec);
}

template <class S>
void mamba_layer_activations(const Mamba2LayerParams<S>& p, const ModelDims& d, const SeqShape& s,
                             const View2<S>& y_in, const MambaActivations<S>& act, MambaUpTo upto,
                             const ExecSpace& exec) {
  forward_impl(p, d, s, y_in, act, View2<S>(), static_cast<const MambaState<S>*>(nullptr), exec, upto);
}

template <class S>
void mamba_gate_backward_first(const Mamba2LayerParams<S>& p, const MambaActivations<S>& act, const View2<S>& g,
                               const MambaCotangents<S>& cot, const ExecSpace& exec) {
  const index_t M = act.z.extent(0), E = act.z.extent(1), G = act.mixer_rstd.extent(1), Eg = E / G;
  require(cot.go.extent(0) == act.z.extent(0) && cot.ga_channels.extent(0) == act.z.extent(1),
          "mamba_gate_backward_first: cotangents of another architecture");
  Kokkos::deep_copy(exec, cot.ga_channels, S(0));
  Kokkos::deep_copy(exec, cot.gd_channels, S(0));
  Kokkos::deep_copy(exec, cot.gb_channels, S(0));
  impl::gemm<S>(exec, "N", "N", S(1), g, p.out_proj, S(0), cot.go);  // ∂L/∂o
  auto go = cot.go;
  auto gs = cot.gs;
  auto gz = cot.gz;
  auto so = act.s;
  auto z = act.z;
  auto o = act.o;
  auto r = act.mixer_rstd;
  auto w = p.gated_norm;
  // ∂L/∂v = r (ĝ − v̂ mean(ĝ ⊙ v̂)) per group, ĝ = ∂L/∂o ⊙ w_g, v̂ = v r (so ĝ ⊙ v̂
  // = ∂L/∂o ⊙ o); then ∂L/∂s = ∂L/∂v ⊙ SiLU(z), ∂L/∂z = ∂L/∂v ⊙ s ⊙ SiLU'(z), from
  // one σ(z).
  Kokkos::parallel_for(
      "ash::mamba2::gated_norm_backward", impl::block_sum_policy(exec, M * G),
      KOKKOS_LAMBDA(const impl::BlockSumMember& team) {
        const index_t m = team.league_rank() / G, g0 = (team.league_rank() % G) * Eg;
        const S rr = r(m, g0 / Eg);
        const S dot =
            impl::team_block_sum<S>(team, Eg, [&](const index_t j) { return go(m, g0 + j) * o(m, g0 + j); }) / S(Eg);
        Kokkos::parallel_for(Kokkos::TeamThreadRange(team, Eg), [&](const index_t j) {
          const index_t e = g0 + j;
          const S zv = z(m, e), sg = impl::sigmoid(zv), sz = zv * sg, vh = so(m, e) * sz * rr;
          const S gv = rr * (go(m, e) * w(e) - vh * dot);
          gs(m, e) = gv * sz;
          gz(m, e) = gv * so(m, e) * (sg * (S(1) + zv * (S(1) - sg)));  // SiLU'(z)
        });
      });
}

template <class S>
void mamba_gate_backward_second(const Mamba2LayerParams<S>&, const MambaActivations<S>& act, const View2<S>& g,
                                const MambaCotangents<S>& cot, const Mamba2LayerParams<S>& grad,
                                const ExecSpace& exec) {
  const index_t M = act.z.extent(0), E = act.z.extent(1), G = act.mixer_rstd.extent(1), Eg = E / G;
  impl::gemm<S>(exec, "T", "N", S(1), g, act.o, S(1), grad.out_proj);
  // w_g's gradient Σ_m ∂L/∂o ⊙ v̂ in two levels (kernels/row_sums.hpp): bitwise repeatable.
  auto part = cot.gate_part;
  require(index_t(part.extent(0)) >= impl::row_blocks(M) && index_t(part.extent(1)) == E,
          "mamba_gate_backward_second: gated-norm partial sums of another size");
  auto go = cot.go;
  auto so = act.s;
  auto z = act.z;
  auto r = act.mixer_rstd;
  impl::column_sums(
      "ash::mamba2::gated_norm_w", exec, M, E, part,
      KOKKOS_LAMBDA(const index_t m, const index_t e) { return go(m, e) * (so(m, e) * silu(z(m, e)) * r(m, e / Eg)); },
      grad.gated_norm);
}

template <class S>
void mamba_gate_backward(const Mamba2LayerParams<S>& p, const MambaActivations<S>& act, const View2<S>& g,
                         const MambaCotangents<S>& cot, const Mamba2LayerParams<S>& grad, const ExecSpace& exec) {
  mamba_gate_backward_first(p, act, g, cot, exec);
  mamba_gate_backward_second(p, act, g, cot, grad, exec);
}

template <class S>
void mamba_mixer_backward(const Mamba2LayerParams<S>& p, const ModelDims& d, const SeqShape& s, const View2<S>& y_in,
                          const MambaActivations<S>& act, const View3<S>& mu, const MambaCotangents<S>& cot,
                          const Mamba2LayerParams<S>& grad, const View2<S>& g, const ExecSpace& exec) {
  selective_scan_backward_rows(scan_core_D(p, act), s, act.scan, cot.gs, BlockRows{s.T, s.T, 0}, mu, act.scan.hprev,
                               act.scan.A, cot.scan, scan_param_grads(grad, cot), exec);
  mamba_mixer_backward_dense(p, d, s, y_in, act, cot, grad, g, exec);
}

namespace {

// mamba_mixer_backward_dense, on a token block when cb and gcs are given (as the Mamba-1 block's).
template <class S>
void mixer_dense_impl(const Mamba2LayerParams<S>& p, const ModelDims& d, const SeqShape& s, const View2<S>& y_in,
                      const MambaActivations<S>& act, const MambaCotangents<S>& cot, const Mamba2LayerParams<S>& grad,
                      const View2<S>& g, const View2<S>& cb, const View2<S>& gcs, index_t own, const ExecSpace& exec,
                      bool heads_done = false) {
  const bool block = gcs.extent(0) > 0;
  require(!block || (index_t(cb.extent(0)) == s.batch * d.conv_dim() && index_t(cb.extent(1)) == d.conv_kernel - 1 &&
                     cb.extent(0) == gcs.extent(0) && cb.extent(1) == gcs.extent(1)),
          "mamba_mixer_backward_block: conv states of another size");
  const index_t M = s.rows(), E = d.inner(), C = d.conv_dim(), N = d.state, GN = d.n_groups * N, P = d.head_dim,
                H = d.head_count();
  const auto& sg = cot.scan;
  // ∂L/∂δ per head: the scan's ∂L/∂(Δ before softplus) summed over the head's
  // channels, zero where the limit clamps Δ (the chunked form's are per head already).
  if (!heads_done) {
    auto gdt = cot.gdlow;
    auto gz = sg.gz;
    auto dt = act.dlow;
    auto b = p.dt_bias;
    const S lo = S(d.time_step_limit_min), hi = S(d.time_step_limit_max);
    Kokkos::parallel_for(
        "ash::mamba2::delta_backward", Range2(exec, {0, 0}, {M, H}), KOKKOS_LAMBDA(const index_t m, const index_t h) {
          S acc = 0;
          for (index_t q = 0; q < P; ++q) acc += gz(m, h * P + q);
          gdt(m, h) = clamped(softplus(dt(m, h) + b(h)), lo, hi) ? S(0) : acc;
        });
  }
  // dt_bias's gradient Σ_m ∂L/∂δ in two levels, in conv_part's first H columns
  // (free until the conv's VJP: C·(Kc+1) ≥ E ≥ H).
  {
    auto gdt = cot.gdlow;
    impl::column_sums(
        "ash::mamba2::dt_bias_backward", exec, M, H, cot.conv_part,
        KOKKOS_LAMBDA(const index_t m, const index_t h) { return gdt(m, h); }, grad.dt_bias);
  }
  // A_log and D per head: the scan core's per-channel sums, added over the head in order.
  if (!heads_done) {
    auto ga = cot.ga_channels;
    auto gd = cot.gd_channels;
    auto gA = grad.A_log;
    auto gD = grad.D;
    Kokkos::parallel_for(
        "ash::mamba2::head_params_backward", Range(exec, 0, H), KOKKOS_LAMBDA(const index_t h) {
          S acc_a = 0, acc_d = 0;
          for (index_t q = 0; q < P; ++q) {
            for (index_t n = 0; n < N; ++n) acc_a += ga(h * P + q, n);
            acc_d += gd(h * P + q);
          }
          gA(h) += acc_a;
          gD(h) += acc_d;
        });
  }
  // ∂L/∂c through SiLU, from the scan's ∂L/∂u, ∂L/∂β and ∂L/∂γ.
  {
    auto gc = cot.gc;
    auto c = act.c;
    auto gu = sg.gyhat;
    auto gbeta = sg.gbeta;
    auto ggamma = sg.ggamma;
    Kokkos::parallel_for(
        "ash::mamba2::silu_backward", Range2(exec, {0, 0}, {M, C}), KOKKOS_LAMBDA(const index_t m, const index_t ch) {
          const S gin = ch < E ? gu(m, ch) : ch < E + GN ? gbeta(m, ch - E) : ggamma(m, ch - E - GN);
          gc(m, ch) = gin * silu_grad(c(m, ch));
        });
  }
  impl::causal_conv_backward(s, p.conv_weight, act.x, cot.gc, cot.gx, cb, gcs, own, cot.conv_part, grad.conv_weight,
                             grad.conv_bias, exec);
  impl::gemm<S>(exec, "T", "N", S(1), cot.gz, act.yhat, S(1), grad.in_z);
  impl::gemm<S>(exec, "T", "N", S(1), cot.gx, act.yhat, S(1), grad.in_xbc);
  impl::gemm<S>(exec, "T", "N", S(1), cot.gdlow, act.yhat, S(1), grad.in_dt);
  impl::gemm<S>(exec, "N", "N", S(1), cot.gz, p.in_z, S(0), cot.gyhat);
  impl::gemm<S>(exec, "N", "N", S(1), cot.gx, p.in_xbc, S(1), cot.gyhat);
  impl::gemm<S>(exec, "N", "N", S(1), cot.gdlow, p.in_dt, S(1), cot.gyhat);
  impl::rms_norm_backward<S>(y_in, p.norm, act.rstd, cot.gyhat, grad.norm, g, true, cot.norm_part, exec);
}

}  // namespace

template <class S>
void mamba_mixer_backward_dense(const Mamba2LayerParams<S>& p, const ModelDims& d, const SeqShape& s,
                                const View2<S>& y_in, const MambaActivations<S>& act, const MambaCotangents<S>& cot,
                                const Mamba2LayerParams<S>& grad, const View2<S>& g, const ExecSpace& exec) {
  mixer_dense_impl(p, d, s, y_in, act, cot, grad, g, View2<S>(), View2<S>(), s.T, exec);
}

template <class S>
void mamba2_scan_backward_chunked(const Mamba2LayerParams<S>& p, const ModelDims& d, const SeqShape& s,
                                  const MambaActivations<S>& act, const MambaCotangents<S>& cot,
                                  const Mamba2LayerParams<S>& grad, const ExecSpace& exec, const View2<S>& h0,
                                  const View2<S>& r_io) {
  const index_t M = s.rows(), H = d.head_count();
  require(index_t(cot.scan.gyhat.extent(0)) == M && index_t(cot.gdlow.extent(0)) == M,
          "mamba2_scan_backward_chunked: cotangents of another window");
  const View1<S> heads("ash::mamba2::head_grads", 2 * H);  // ∂L/∂a_h, ∂L/∂D_h
  const SsdGrads<S> out{cot.scan.gyhat, cot.gdlow, cot.scan.gbeta, cot.scan.ggamma,
                        Kokkos::subview(heads, Kokkos::make_pair(index_t(0), H)),
                        Kokkos::subview(heads, Kokkos::make_pair(H, 2 * H))};
  SsdScan<S>(ssd_shape(d, s), true).backward(act.scan, scan_core_D(p, act), s.docs, cot.gs, out, exec, h0, r_io);
  // ∂L/∂δ = ∂L/∂Δ softplus'(δ + b) = ∂L/∂Δ (1 − e^{−Δ}), zero where the limit clamps Δ.
  auto gdt = cot.gdlow;
  auto dt = act.dlow;
  auto b = p.dt_bias;
  const S lo = S(d.time_step_limit_min), hi = S(d.time_step_limit_max);
  Kokkos::parallel_for(
      "ash::mamba2::delta_backward_heads", Range2(exec, {0, 0}, {M, H}), KOKKOS_LAMBDA(const index_t m, const index_t h) {
        const S v = softplus(dt(m, h) + b(h));
        gdt(m, h) = clamped(v, lo, hi) ? S(0) : -gdt(m, h) * kmath::expm1(-v);
      });
  // A_log: ∂a/∂A_log = a = −exp(A_log); D per head.
  auto gA = grad.A_log;
  auto gD = grad.D;
  auto alog = p.A_log;
  Kokkos::parallel_for(
      "ash::mamba2::head_params_chunked", Range(exec, 0, H), KOKKOS_LAMBDA(const index_t h) {
        gA(h) += heads(h) * -kmath::exp(alog(h));
        gD(h) += heads(H + h);
      });
}

template <class S>
void mamba2_mixer_backward_dense_chunked(const Mamba2LayerParams<S>& p, const ModelDims& d, const SeqShape& s,
                                         const View2<S>& y_in, const MambaActivations<S>& act,
                                         const MambaCotangents<S>& cot, const Mamba2LayerParams<S>& grad,
                                         const View2<S>& g, const ExecSpace& exec) {
  mixer_dense_impl(p, d, s, y_in, act, cot, grad, g, View2<S>(), View2<S>(), s.T, exec, true);
}

template <class S>
void mamba2_mixer_backward_block_chunked(const Mamba2LayerParams<S>& p, const ModelDims& d, const SeqShape& s,
                                         const View2<S>& y_in, const MambaActivations<S>& act,
                                         const MambaCotangents<S>& cot, const Mamba2LayerParams<S>& grad,
                                         const View2<S>& g, const View2<S>& conv_before, const View2<S>& gconv,
                                         const ExecSpace& exec) {
  require(gconv.extent(0) > 0 || d.conv_kernel == 1, "mamba_mixer_backward_block: needs the conv state's cotangent");
  mixer_dense_impl(p, d, s, y_in, act, cot, grad, g, conv_before, gconv, s.T, exec, true);
}

template <class S>
void mamba_mixer_backward_block(const Mamba2LayerParams<S>& p, const ModelDims& d, const SeqShape& s,
                                const View2<S>& y_in, const MambaActivations<S>& act, const MambaCotangents<S>& cot,
                                const Mamba2LayerParams<S>& grad, const View2<S>& g, const View2<S>& conv_before,
                                const View2<S>& gconv, index_t own_T, const ExecSpace& exec) {
  require(gconv.extent(0) > 0 || d.conv_kernel == 1, "mamba_mixer_backward_block: needs the conv state's cotangent");
  require(own_T >= 0 && own_T <= s.T, "mamba_mixer_backward_block: the own tokens must lie in the block");
  mixer_dense_impl(p, d, s, y_in, act, cot, grad, g, conv_before, gconv, own_T > 0 ? own_T : s.T, exec);
}

#define ASH_INSTANTIATE(S)                                                                                            \
  template void mamba_layer_forward<S>(const Mamba2LayerParams<S>&, const ModelDims&, const SeqShape&,                \
                                       const View2<S>&, const MambaActivations<S>&, const View2<S>&,                  \
                                       const ExecSpace&);                                                             \
  template void mamba_layer_forward<S>(const Mamba2LayerParams<S>&, const ModelDims&, const SeqShape&,                \
                                       const View2<S>&, const MambaActivations<S>&, const View2<S>&,                  \
                                       const MambaState<S>&, const ExecSpace&);                                       \
  template void mamba_layer_activations<S>(const Mamba2LayerParams<S>&, const ModelDims&, const SeqShape&,            \
                                           const View2<S>&, const MambaActivations<S>&, MambaUpTo, const ExecSpace&); \
  template void mamba_gate_backward_first<S>(const Mamba2LayerParams<S>&, const MambaActivations<S>&,                 \
                                             const View2<S>&, const MambaCotangents<S>&, const ExecSpace&);           \
  template void mamba_gate_backward_second<S>(const Mamba2LayerParams<S>&, const MambaActivations<S>&,                \
                                              const View2<S>&, const MambaCotangents<S>&,                             \
                                              const Mamba2LayerParams<S>&, const ExecSpace&);                         \
  template void mamba_gate_backward<S>(const Mamba2LayerParams<S>&, const MambaActivations<S>&, const View2<S>&,      \
                                       const MambaCotangents<S>&, const Mamba2LayerParams<S>&, const ExecSpace&);     \
  template void mamba_mixer_backward<S>(                                                                              \
      const Mamba2LayerParams<S>&, const ModelDims&, const SeqShape&, const View2<S>&, const MambaActivations<S>&,    \
      const View3<S>&, const MambaCotangents<S>&, const Mamba2LayerParams<S>&, const View2<S>&, const ExecSpace&);    \
  template void mamba_mixer_backward_dense<S>(const Mamba2LayerParams<S>&, const ModelDims&, const SeqShape&,         \
                                              const View2<S>&, const MambaActivations<S>&, const MambaCotangents<S>&, \
                                              const Mamba2LayerParams<S>&, const View2<S>&, const ExecSpace&);        \
  template void mamba_mixer_backward_block<S>(const Mamba2LayerParams<S>&, const ModelDims&, const SeqShape&,         \
                                              const View2<S>&, const MambaActivations<S>&, const MambaCotangents<S>&, \
                                              const Mamba2LayerParams<S>&, const View2<S>&, const View2<S>&,          \
                                              const View2<S>&, index_t, const ExecSpace&);                   \
  template void mamba2_scan_backward_chunked<S>(const Mamba2LayerParams<S>&, const ModelDims&, const SeqShape&,       \
                                                const MambaActivations<S>&, const MambaCotangents<S>&,               \
                                                const Mamba2LayerParams<S>&, const ExecSpace&, const View2<S>&,      \
                                                const View2<S>&);                                                    \
  template void mamba2_mixer_backward_block_chunked<S>(                                                               \
      const Mamba2LayerParams<S>&, const ModelDims&, const SeqShape&, const View2<S>&, const MambaActivations<S>&,    \
      const MambaCotangents<S>&, const Mamba2LayerParams<S>&, const View2<S>&, const View2<S>&, const View2<S>&,      \
      const ExecSpace&);                                                                                              \
  template void mamba2_mixer_backward_dense_chunked<S>(                                                               \
      const Mamba2LayerParams<S>&, const ModelDims&, const SeqShape&, const View2<S>&, const MambaActivations<S>&,    \
      const MambaCotangents<S>&, const Mamba2LayerParams<S>&, const View2<S>&, const ExecSpace&);
ASH_INSTANTIATE(float)
ASH_INSTANTIATE(double)
#undef ASH_INSTANTIATE

}  // namespace ash
