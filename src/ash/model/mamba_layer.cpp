#include "ash/model/mamba_layer.hpp"

#include "ash/core/error.hpp"
#include "ash/kernels/blas.hpp"
#include "ash/kernels/chunked_scan.hpp"
#include "ash/kernels/rms_norm.hpp"
#include "ash/kernels/row_sums.hpp"
#include "ash/model/impl/causal_conv.hpp"

namespace ash {

namespace {

using impl::silu;
using impl::silu_grad;

// Column j of a FalconMamba's mixer_rstd (δ, β, γ).
template <class S>
auto column(const View2<S>& v, int j) {
  return Kokkos::subview(v, Kokkos::ALL(), j);
}

}  // namespace

template <class S>
MambaActivations<S>::MambaActivations(const SeqShape& sh, const ModelDims& d,
                                      typename LayerActivations<S>::Store store)
    : rstd("ash::mamba::rstd", sh.rows()),
      yhat("ash::mamba::yhat", sh.rows(), d.width),
      x("ash::mamba::x", sh.rows(), d.conv_dim()),
      z("ash::mamba::z", sh.rows(), d.inner()),
      c("ash::mamba::conv", sh.rows(), d.conv_dim()),
      dlow("ash::mamba::dlow", sh.rows(), d.mamba2() ? d.head_count() : d.rank()),
      s("ash::mamba::scan_out", sh.rows(), d.inner()),
      o("ash::mamba::gated", sh.rows(), d.inner()),
      mixer_rstd(d.mixer_norms() ? View2<S>("ash::mamba::mixer_rstd", sh.rows(), 3)
                 : d.mamba2()    ? View2<S>("ash::mamba::mixer_rstd", sh.rows(), d.n_groups)
                                 : View2<S>()),
      d_channels(d.mamba2() ? View1<S>("ash::mamba::d_channels", d.inner()) : View1<S>()),
      scan(sh, d.inner(), d.state, store, d.mamba2() ? d.n_groups : 1) {}

template <class S>
MambaCotangents<S>::MambaCotangents(index_t rows, const ModelDims& d, bool scan_partials)
    : gs("ash::mamba::cot::gs", rows, d.inner()),
      gz("ash::mamba::cot::gz", rows, d.inner()),
      gx("ash::mamba::cot::gx", rows, d.conv_dim()),
      gdlow("ash::mamba::cot::gdlow", rows, d.mamba2() ? d.head_count() : d.rank()),
      gyhat("ash::mamba::cot::gyhat", rows, d.width),
      norm_part(Kokkos::view_alloc(std::string("ash::mamba::cot::norm_part"), Kokkos::WithoutInitializing),
                impl::row_blocks(rows), d.width),
      conv_part(Kokkos::view_alloc(std::string("ash::mamba::cot::conv_part"), Kokkos::WithoutInitializing),
                impl::row_blocks(rows), d.conv_dim() * (d.conv_kernel + 1)),
      scan(rows, d.inner(), d.state, scan_partials, d.mamba2() ? d.n_groups : 1, false) {
  if (!d.mamba2()) return;
  go = View2<S>("ash::mamba::cot::go", rows, d.inner());
  gc = View2<S>("ash::mamba::cot::gc", rows, d.conv_dim());
  gate_part = View2<S>(Kokkos::view_alloc(std::string("ash::mamba::cot::gate_part"), Kokkos::WithoutInitializing),
                       impl::row_blocks(rows), d.inner());
  ga_channels = View2<S>("ash::mamba::cot::ga_channels", d.inner(), d.state);
  gd_channels = View1<S>("ash::mamba::cot::gd_channels", d.inner());
  gb_channels = View1<S>("ash::mamba::cot::gb_channels", d.inner());
}

template <class S>
MambaState<S>::MambaState(index_t batch, const ModelDims& d)
    : conv("ash::mamba::conv_state", batch * d.conv_dim(), d.conv_kernel - 1),
      ssm("ash::mamba::ssm_state", batch * d.inner(), d.state),
      batch(batch) {}

namespace {

// The conv's output c and the scan's input u = SiLU(c), as one kernel writes them.
template <class S>
struct ConvOut {
  View2<S> c, u;
  KOKKOS_INLINE_FUNCTION void operator()(const index_t m, const index_t e, const S acc) const {
    c(m, e) = acc;
    u(m, e) = silu(acc);
  }
};

// mamba_layer_forward, with a carried state or (null) without; without y_out
// (extent 0) it stops after the gate, or before the scan: mamba_layer_activations.
template <class S>
void forward_impl(const MambaLayerParams<S>& p, const ModelDims& d, const SeqShape& s, const View2<S>& y_in,
                  const MambaActivations<S>& act, const View2<S>& y_out, const MambaState<S>* state,
                  const ExecSpace& exec, MambaUpTo upto = MambaUpTo::gate) {
  const index_t M = y_in.extent(0), E = d.inner(), Kc = d.conv_kernel;
  require(M == s.rows() && index_t(act.x.extent(0)) == M, "mamba_layer_forward: activations of another size");
  const bool carry = state != nullptr;
  require(!carry || (index_t(state->conv.extent(0)) == s.batch * d.conv_dim() && index_t(state->conv.extent(1)) == Kc - 1 &&
                     index_t(state->ssm.extent(0)) == s.batch * E && index_t(state->ssm.extent(1)) == d.state),
          "mamba_layer_forward: a carried state of another size");
  impl::rms_norm_forward<S>(y_in, p.norm, act.rstd, act.yhat, exec, d.norm_eps);
  impl::gemm<S>(exec, "N", "T", S(1), act.yhat, p.in_x, S(0), act.x);
  impl::gemm<S>(exec, "N", "T", S(1), act.yhat, p.in_z, S(0), act.z);
  // The causal depthwise conv, then SiLU: u is the scan's input.
  impl::causal_conv_forward(s, act.x, p.conv_weight, p.conv_bias, carry ? state->conv : View2<S>(),
                            ConvOut<S>{act.c, act.scan.yhat}, exec);
  if (carry) impl::causal_conv_state(s, act.x, state->conv, exec);
  const auto& sc = act.scan;
  const bool norms = d.mixer_norms();
  require(!norms || index_t(act.mixer_rstd.extent(0)) == M, "mamba_layer_forward: activations of another architecture");
  impl::gemm<S>(exec, "N", "T", S(1), sc.yhat, p.x_dt, S(0), act.dlow);
  if (norms) impl::rms_norm_weightless(act.dlow, column(act.mixer_rstd, 0), d.mixer_rms_eps, exec);
  impl::gemm<S>(exec, "N", "T", S(1), act.dlow, p.dt_proj, S(0), sc.delta);
  selective_scan_inputs(p.x_B, p.x_C, p.A_log, p.dt_bias, sc, exec);
  if (norms) {
    impl::rms_norm_weightless(sc.beta, column(act.mixer_rstd, 1), d.mixer_rms_eps, exec);
    impl::rms_norm_weightless(sc.gamma, column(act.mixer_rstd, 2), d.mixer_rms_eps, exec);
  }
  if (upto == MambaUpTo::scan_inputs) return;
  selective_scan_forward(p.D, s, View2<S>(), sc, act.s, carry ? state->ssm : View2<S>(), exec);
  {
    auto so = act.s;
    auto z = act.z;
    auto o = act.o;
    Kokkos::parallel_for(
        "ash::mamba::gate", Range2(exec, {0, 0}, {M, E}),
        KOKKOS_LAMBDA(const index_t m, const index_t e) { o(m, e) = so(m, e) * silu(z(m, e)); });
  }
  if (y_out.extent(0) == 0) return;
  Kokkos::deep_copy(exec, y_out, y_in);
  impl::gemm<S>(exec, "N", "T", S(1), act.o, p.out_proj, S(1), y_out);
}

}  // namespace

template <class S>
void mamba_layer_forward(const MambaLayerParams<S>& p, const ModelDims& d, const SeqShape& s, const View2<S>& y_in,
                         const MambaActivations<S>& act, const View2<S>& y_out, const ExecSpace& exec) {
  forward_impl(p, d, s, y_in, act, y_out, static_cast<const MambaState<S>*>(nullptr), exec);
}

template <class S>
void mamba_layer_forward(const MambaLayerParams<S>& p, const ModelDims& d, const SeqShape& s, const View2<S>& y_in,
                         const MambaActivations<S>& act, const View2<S>& y_out, const MambaState<S>& state,
                         const ExecSpace& exec) {
  forward_impl(p, d, s, y_in, act, y_out, &state, exec);
}

template <class S>
void mamba_layer_activations(const MambaLayerParams<S>& p, const ModelDims& d, const SeqShape& s,
                             const View2<S>& y_in, const MambaActivations<S>& act, MambaUpTo upto,
                             const ExecSpace& exec) {
  forward_impl(p, d, s, y_in, act, View2<S>(), static_cast<const MambaState<S>*>(nullptr), exec, upto);
}

template <class S>
void mamba_gate_backward_first(const MambaLayerParams<S>& p, const MambaActivations<S>& act, const View2<S>& g,
                               const MambaCotangents<S>& cot, const ExecSpace& exec) {
  const index_t M = act.z.extent(0), E = act.z.extent(1);
  impl::gemm<S>(exec, "N", "N", S(1), g, p.out_proj, S(0), cot.gz);  // ∂L/∂o, until the second half
  auto go = cot.gz;
  auto gs = cot.gs;
  auto z = act.z;
  Kokkos::parallel_for(
      "ash::mamba::gate_backward_s", Range2(exec, {0, 0}, {M, E}),
      KOKKOS_LAMBDA(const index_t m, const index_t e) { gs(m, e) = go(m, e) * silu(z(m, e)); });
}

template <class S>
void mamba_gate_backward_second(const MambaActivations<S>& act, const View2<S>& g, const MambaCotangents<S>& cot,
                                const MambaLayerParams<S>& grad, const ExecSpace& exec) {
  const index_t M = act.z.extent(0), E = act.z.extent(1);
  auto gz = cot.gz;
  auto so = act.s;
  auto z = act.z;
  auto o = act.o;
  Kokkos::parallel_for(
      "ash::mamba::gate_backward_z", Range2(exec, {0, 0}, {M, E}), KOKKOS_LAMBDA(const index_t m, const index_t e) {
        const S zv = z(m, e), sv = so(m, e);
        o(m, e) = sv * silu(zv);
        gz(m, e) = gz(m, e) * sv * silu_grad(zv);
      });
  impl::gemm<S>(exec, "T", "N", S(1), g, act.o, S(1), grad.out_proj);
}

template <class S>
void mamba_scan_output_rows(const Unmanaged1<S>& D, const SeqShape& s, const MambaActivations<S>& act,
                            const BlockRows& rows, const View3<S>& hprev, const View3<S>& A, const ExecSpace& exec) {
  const auto& sc = act.scan;
  const index_t E = sc.delta.extent(1), N = sc.a.extent(1), GN = sc.beta.extent(1), R = s.batch * rows.W;
  require(rows.T == s.T && index_t(hprev.extent(0)) >= R && index_t(A.extent(0)) >= R &&
              index_t(hprev.extent(1)) == E && index_t(hprev.extent(2)) == N && index_t(A.extent(1)) == E &&
              index_t(A.extent(2)) == N,
          "mamba_scan_output_rows: wave buffers of another size");
  auto so = act.s;
  auto u = sc.yhat;
  auto delta = sc.delta;
  auto beta = sc.beta;
  auto gamma = sc.gamma;
  const BlockRows map = rows;
  Kokkos::parallel_for(
      "ash::mamba::scan_output_rows", Range(exec, 0, R * E), KOKKOS_LAMBDA(const index_t i) {
        const index_t r = i / E, e = i % E, m = map(r), gc = group_col(e, E, N, GN);
        const S du = delta(m, e) * u(m, e);
        S out = 0;
        for (index_t n = 0; n < N; ++n) out += gamma(m, gc + n) * (A(r, e, n) * hprev(r, e, n) + du * beta(m, gc + n));
        so(m, e) = D(e) * u(m, e) + out;
      });
}

template <class S>
void mamba_gate_backward(const MambaLayerParams<S>& p, const MambaActivations<S>& act, const View2<S>& g,
                         const MambaCotangents<S>& cot, const MambaLayerParams<S>& grad, const ExecSpace& exec) {
  // The two halves E3 splits around its waves, back to back (o is formed again from s and z).
  mamba_gate_backward_first(p, act, g, cot, exec);
  mamba_gate_backward_second(act, g, cot, grad, exec);
}

template <class S>
void mamba_mixer_backward(const MambaLayerParams<S>& p, const ModelDims& d, const SeqShape& s, const View2<S>& y_in,
                          const MambaActivations<S>& act, const View3<S>& mu, const MambaCotangents<S>& cot,
                          const MambaLayerParams<S>& grad, const View2<S>& g, const ExecSpace& exec) {
  // The scan core: ∂L/∂(δ W_dt^T + b_dt), ∂L/∂u through the scan, ∂L/∂β, ∂L/∂γ; A_log, D, b_dt.
  selective_scan_backward_rows(p.D, s, act.scan, cot.gs, BlockRows{s.T, s.T, 0}, mu, act.scan.hprev, act.scan.A, cot.scan,
                               ScanParamGrads<S>{grad.A_log, grad.D, grad.dt_bias}, exec);
  mamba_mixer_backward_dense(p, d, s, y_in, act, cot, grad, g, exec);
}

namespace {

// mamba_mixer_backward_dense, on a token block when cb (the conv state before
// it) and gcs (∂L/∂ the conv state after it, in; before it, out) are given.
// own: the block's own tokens per sequence, the first `own` of s.T (the rest a
// window's halo with zero cotangents): gcs is the state after token own − 1.
template <class S>
void mixer_dense_impl(const MambaLayerParams<S>& p, const ModelDims& d, const SeqShape& s, const View2<S>& y_in,
                      const MambaActivations<S>& act, const MambaCotangents<S>& cot, const MambaLayerParams<S>& grad,
                      const View2<S>& g, const View2<S>& cb, const View2<S>& gcs, index_t own,
                      const ExecSpace& exec) {
  const bool block = gcs.extent(0) > 0;
  require(!block || (index_t(cb.extent(0)) == s.batch * d.conv_dim() && index_t(cb.extent(1)) == d.conv_kernel - 1 &&
                     cb.extent(0) == gcs.extent(0) && cb.extent(1) == gcs.extent(1)),
          "mamba_mixer_backward_block: conv states of another size");
  const index_t M = s.rows(), E = d.inner();
  const auto& sc = act.scan;
  const auto& sg = cot.scan;
  impl::gemm<S>(exec, "T", "N", S(1), sg.gz, act.dlow, S(1), grad.dt_proj);
  impl::gemm<S>(exec, "N", "N", S(1), sg.gz, p.dt_proj, S(0), cot.gdlow);
  if (d.mixer_norms()) {  // FalconMamba: through the norms to x_proj's outputs
    impl::rms_norm_weightless_backward(act.dlow, column(act.mixer_rstd, 0), cot.gdlow, exec);
    impl::rms_norm_weightless_backward(sc.beta, column(act.mixer_rstd, 1), sg.gbeta, exec);
    impl::rms_norm_weightless_backward(sc.gamma, column(act.mixer_rstd, 2), sg.ggamma, exec);
  }
  impl::gemm<S>(exec, "T", "N", S(1), cot.gdlow, sc.yhat, S(1), grad.x_dt);
  impl::gemm<S>(exec, "T", "N", S(1), sg.gbeta, sc.yhat, S(1), grad.x_B);
  impl::gemm<S>(exec, "T", "N", S(1), sg.ggamma, sc.yhat, S(1), grad.x_C);
  auto gu = sg.gyhat;  // ∂L/∂u: the scan's part, then x_proj's three
  impl::gemm<S>(exec, "N", "N", S(1), cot.gdlow, p.x_dt, S(1), gu);
  impl::gemm<S>(exec, "N", "N", S(1), sg.gbeta, p.x_B, S(1), gu);
  impl::gemm<S>(exec, "N", "N", S(1), sg.ggamma, p.x_C, S(1), gu);
  auto gc = cot.gs;  // ∂L/∂c (∂L/∂s is spent)
  auto c = act.c;
  Kokkos::parallel_for(
      "ash::mamba::silu_backward", Range2(exec, {0, 0}, {M, E}),
      KOKKOS_LAMBDA(const index_t m, const index_t e) { gc(m, e) = gu(m, e) * silu_grad(c(m, e)); });
  // The conv's VJPs into x, across a token block's ends, and into w_conv and b_conv.
  impl::causal_conv_backward(s, p.conv_weight, act.x, gc, cot.gx, cb, gcs, own, cot.conv_part, grad.conv_weight,
                             grad.conv_bias, exec);
  impl::gemm<S>(exec, "T", "N", S(1), cot.gx, act.yhat, S(1), grad.in_x);
  impl::gemm<S>(exec, "T", "N", S(1), cot.gz, act.yhat, S(1), grad.in_z);
  impl::gemm<S>(exec, "N", "N", S(1), cot.gx, p.in_x, S(0), cot.gyhat);
  impl::gemm<S>(exec, "N", "N", S(1), cot.gz, p.in_z, S(1), cot.gyhat);
  impl::rms_norm_backward<S>(y_in, p.norm, act.rstd, cot.gyhat, grad.norm, g, true, cot.norm_part, exec);
}

}  // namespace

template <class S>
void mamba_mixer_backward_dense(const MambaLayerParams<S>& p, const ModelDims& d, const SeqShape& s,
                                const View2<S>& y_in, const MambaActivations<S>& act, const MambaCotangents<S>& cot,
                                const MambaLayerParams<S>& grad, const View2<S>& g, const ExecSpace& exec) {
  mixer_dense_impl(p, d, s, y_in, act, cot, grad, g, View2<S>(), View2<S>(), s.T, exec);
}

template <class S>
void mamba_mixer_backward_block(const MambaLayerParams<S>& p, const ModelDims& d, const SeqShape& s,
                                const View2<S>& y_in, const MambaActivations<S>& act, const MambaCotangents<S>& cot,
                                const MambaLayerParams<S>& grad, const View2<S>& g, const View2<S>& conv_before,
                                const View2<S>& gconv, index_t own_T, const ExecSpace& exec) {
  require(gconv.extent(0) > 0 || d.conv_kernel == 1, "mamba_mixer_backward_block: needs the conv state's cotangent");
  require(own_T >= 0 && own_T <= s.T, "mamba_mixer_backward_block: the own tokens must lie in the block");
  mixer_dense_impl(p, d, s, y_in, act, cot, grad, g, conv_before, gconv, own_T > 0 ? own_T : s.T, exec);
}

#define ASH_INSTANTIATE(S)                                                                                        \
  template struct MambaActivations<S>;                                                                            \
  template struct MambaCotangents<S>;                                                                             \
  template struct MambaState<S>;                                                                                  \
  template void mamba_layer_forward<S>(const MambaLayerParams<S>&, const ModelDims&, const SeqShape&,             \
                                       const View2<S>&, const MambaActivations<S>&, const View2<S>&,              \
                                       const ExecSpace&);                                                         \
  template void mamba_layer_forward<S>(const MambaLayerParams<S>&, const ModelDims&, const SeqShape&,             \
                                       const View2<S>&, const MambaActivations<S>&, const View2<S>&,              \
                                       const MambaState<S>&, const ExecSpace&);                                   \
  template void mamba_layer_activations<S>(const MambaLayerParams<S>&, const ModelDims&, const SeqShape&,         \
                                           const View2<S>&, const MambaActivations<S>&, MambaUpTo,                \
                                           const ExecSpace&);                                                     \
  template void mamba_gate_backward_first<S>(const MambaLayerParams<S>&, const MambaActivations<S>&,              \
                                             const View2<S>&, const MambaCotangents<S>&, const ExecSpace&);       \
  template void mamba_gate_backward_second<S>(const MambaActivations<S>&, const View2<S>&,                        \
                                              const MambaCotangents<S>&, const MambaLayerParams<S>&,              \
                                              const ExecSpace&);                                                  \
  template void mamba_scan_output_rows<S>(const Unmanaged1<S>&, const SeqShape&, const MambaActivations<S>&,     \
                                          const BlockRows&, const View3<S>&, const View3<S>&, const ExecSpace&);  \
  template void mamba_gate_backward<S>(const MambaLayerParams<S>&, const MambaActivations<S>&, const View2<S>&,   \
                                       const MambaCotangents<S>&, const MambaLayerParams<S>&, const ExecSpace&);  \
  template void mamba_mixer_backward<S>(const MambaLayerParams<S>&, const ModelDims&, const SeqShape&,            \
                                        const View2<S>&, const MambaActivations<S>&, const View3<S>&,             \
                                        const MambaCotangents<S>&, const MambaLayerParams<S>&, const View2<S>&,   \
                                        const ExecSpace&);                                                        \
  template void mamba_mixer_backward_dense<S>(const MambaLayerParams<S>&, const ModelDims&, const SeqShape&,      \
                                              const View2<S>&, const MambaActivations<S>&, const MambaCotangents<S>&, \
                                              const MambaLayerParams<S>&, const View2<S>&, const ExecSpace&); \
  template void mamba_mixer_backward_block<S>(const MambaLayerParams<S>&, const ModelDims&, const SeqShape&,      \
                                              const View2<S>&, const MambaActivations<S>&, const MambaCotangents<S>&, \
                                              const MambaLayerParams<S>&, const View2<S>&, const View2<S>&,          \
                                              const View2<S>&, index_t, const ExecSpace&);
ASH_INSTANTIATE(float)
ASH_INSTANTIATE(double)

}  // namespace ash
