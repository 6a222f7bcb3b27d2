#include "ash/model/mamba_layer.hpp"

#include "ash/core/error.hpp"
#include "ash/kernels/blas.hpp"
#include "ash/kernels/chunked_scan.hpp"
#include "ash/kernels/rms_norm.hpp"
#include "ash/kernels/row_sums.hpp"

namespace ash {

namespace {

// SiLU(v) = v σ(v) and its derivative σ(v) (1 + v (1 - σ(v))).
template <class S>
KOKKOS_INLINE_FUNCTION S sigmoid(S v) {
  return S(1) / (S(1) + kmath::exp(-v));
}
template <class S>
KOKKOS_INLINE_FUNCTION S silu(S v) {
  return v * sigmoid(v);
}
template <class S>
KOKKOS_INLINE_FUNCTION S silu_grad(S v) {
  const S sg = sigmoid(v);
  return sg * (S(1) + v * (S(1) - sg));
}

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
      x("ash::mamba::x", sh.rows(), d.inner()),
      z("ash::mamba::z", sh.rows(), d.inner()),
      c("ash::mamba::conv", sh.rows(), d.inner()),
      dlow("ash::mamba::dlow", sh.rows(), d.rank()),
      s("ash::mamba::scan_out", sh.rows(), d.inner()),
      o("ash::mamba::gated", sh.rows(), d.inner()),
      mixer_rstd(d.mixer_norms() ? View2<S>("ash::mamba::mixer_rstd", sh.rows(), 3) : View2<S>()),
      scan(sh, d.inner(), d.state, store) {}

template <class S>
MambaCotangents<S>::MambaCotangents(index_t rows, const ModelDims& d, bool scan_partials)
    : gs("ash::mamba::cot::gs", rows, d.inner()),
      gz("ash::mamba::cot::gz", rows, d.inner()),
      gx("ash::mamba::cot::gx", rows, d.inner()),
      gdlow("ash::mamba::cot::gdlow", rows, d.rank()),
      gyhat("ash::mamba::cot::gyhat", rows, d.width),
      norm_part(Kokkos::view_alloc(std::string("ash::mamba::cot::norm_part"), Kokkos::WithoutInitializing),
                impl::row_blocks(rows), d.width),
      conv_part(Kokkos::view_alloc(std::string("ash::mamba::cot::conv_part"), Kokkos::WithoutInitializing),
                impl::row_blocks(rows), d.inner() * (d.conv_kernel + 1)),
      scan(rows, d.inner(), d.state, scan_partials) {}

template <class S>
MambaState<S>::MambaState(index_t batch, const ModelDims& d)
    : conv("ash::mamba::conv_state", batch * d.inner(), d.conv_kernel - 1),
      ssm("ash::mamba::ssm_state", batch * d.inner(), d.state) {}

namespace {

// mamba_layer_forward, with a carried state or (null) without; without y_out
// (extent 0) it stops after the gate, or before the scan: mamba_layer_activations.
template <class S>
void forward_impl(const MambaLayerParams<S>& p, const ModelDims& d, const SeqShape& s, const View2<S>& y_in,
                  const MambaActivations<S>& act, const View2<S>& y_out, const MambaState<S>* state,
                  const ExecSpace& exec, MambaUpTo upto = MambaUpTo::gate) {
  const index_t M = y_in.extent(0), E = d.inner(), T = s.T, Kc = d.conv_kernel;
  require(M == s.rows() && index_t(act.x.extent(0)) == M, "mamba_layer_forward: activations of another size");
  const bool carry = state != nullptr;
  require(!carry || (index_t(state->conv.extent(0)) == s.batch * E && index_t(state->conv.extent(1)) == Kc - 1 &&
                     index_t(state->ssm.extent(0)) == s.batch * E && index_t(state->ssm.extent(1)) == d.state),
          "mamba_layer_forward: a carried state of another size");
  impl::rms_norm_forward<S>(y_in, p.norm, act.rstd, act.yhat, exec, d.norm_eps);
  impl::gemm<S>(exec, "N", "T", S(1), act.yhat, p.in_x, S(0), act.x);
  impl::gemm<S>(exec, "N", "T", S(1), act.yhat, p.in_z, S(0), act.z);
  // The causal depthwise conv, then SiLU: u is the scan's input. Taps walk
  // back from the token itself and stop after a document's first token (the
  // conv sees nothing before a start, as mamba-ssm's seq_idx) or the window's;
  // with a carried state, the taps before the window's first token read it.
  {
    auto x = act.x;
    auto c = act.c;
    auto u = act.scan.yhat;
    auto w = p.conv_weight;
    auto bias = p.conv_bias;
    const View2<S> cs = carry ? state->conv : View2<S>();
    const DocStarts docs = s.docs;
    Kokkos::parallel_for(
        "ash::mamba::conv_forward", Range2(exec, {0, 0}, {M, E}), KOKKOS_LAMBDA(const index_t m, const index_t e) {
          const index_t b = m / T, t = m % T;
          S acc = bias(e);
          for (index_t k = 0; k < Kc; ++k) {
            if (k > t) {  // before the window: the state's column of the token k - t before it
              if (!carry) break;
              acc += w(e, Kc - 1 - k) * cs(b * E + e, Kc - 1 - (k - t));
              continue;
            }
            acc += w(e, Kc - 1 - k) * x(m - k, e);
            if (docs.at(b, t - k)) break;
          }
          c(m, e) = acc;
          u(m, e) = silu(acc);
        });
    // The conv state after the window: x of its last Kc-1 tokens (older ones from
    // the state, ascending so a column is read before it is overwritten), 0 for a
    // token before the last document start.
    if (carry && Kc > 1)
      Kokkos::parallel_for(
          "ash::mamba::conv_state", Range(exec, 0, s.batch * E), KOKKOS_LAMBDA(const index_t i) {
            const index_t b = i / E, e = i % E, first = T - (Kc - 1);  // the token of column 0
            index_t start = -Kc;  // the last start after column 0's token (none: before every column)
            for (index_t t = T - 1; t > first && t >= 0; --t)
              if (docs.at(b, t)) {
                start = t;
                break;
              }
            for (index_t j = 0; j < Kc - 1; ++j) {
              const index_t t = first + j;
              cs(i, j) = t < start ? S(0) : t >= 0 ? x(b * T + t, e) : cs(i, j + T);
            }
          });
  }
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
  const index_t E = sc.delta.extent(1), N = sc.beta.extent(1), R = s.batch * rows.W;
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
        const index_t r = i / E, e = i % E, m = map(r);
        const S du = delta(m, e) * u(m, e);
        S out = 0;
        for (index_t n = 0; n < N; ++n) out += gamma(m, n) * (A(r, e, n) * hprev(r, e, n) + du * beta(m, n));
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
  require(!block || (index_t(cb.extent(0)) == s.batch * d.inner() && index_t(cb.extent(1)) == d.conv_kernel - 1 &&
                     cb.extent(0) == gcs.extent(0) && cb.extent(1) == gcs.extent(1)),
          "mamba_mixer_backward_block: conv states of another size");
  const index_t M = s.rows(), E = d.inner(), T = s.T, Bt = s.batch, Kc = d.conv_kernel;
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
  // The conv's VJPs: into x (each token feeds the next Kc - 1 outputs of its
  // document; in a token block, also across the block's ends), and into w_conv
  // and b_conv (below).
  const DocStarts docs = s.docs;
  auto w = p.conv_weight;
  auto x = act.x;
  auto gx = cot.gx;
  Kokkos::parallel_for(
      "ash::mamba::conv_backward_x", Range2(exec, {0, 0}, {M, E}), KOKKOS_LAMBDA(const index_t m, const index_t e) {
        const index_t b = m / T, t = m % T;
        S acc = 0;
        for (index_t k = 0; k < Kc && t + k < T; ++k) {
          if (k > 0 && docs.at(b, t + k)) break;
          acc += w(e, Kc - 1 - k) * gc(m + k, e);
        }
        gx(m, e) = acc;
      });
  // Across the block's start: the later blocks' cotangent of the conv state
  // after this block goes to the x rows it holds (older columns, of a block
  // shorter than Kc−1, pass on to the state before), and the taps of the
  // block's first tokens into the state before it add theirs.
  if (block && Kc > 1)
    Kokkos::parallel_for(
        "ash::mamba::conv_backward_carry", Range(exec, 0, Bt * E), KOKKOS_LAMBDA(const index_t i) {
          const index_t b = i / E, e = i % E, first = own - (Kc - 1);  // the token of the state after's column 0
          index_t start = -Kc;  // the last start after column 0's token, as the forward's conv_state
          for (index_t t = own - 1; t > first && t >= 0; --t)
            if (docs.at(b, t)) {
              start = t;
              break;
            }
          for (index_t j = 0; j < Kc - 1; ++j) {  // first: every column that holds this block's x
            const index_t t = first + j;
            if (t >= 0 && t >= start) gx(b * T + t, e) += gcs(i, j);
          }
          index_t open = own;  // tokens [0, open) of the block read the state before (no start among them)
          for (index_t t = 0; t < own; ++t)
            if (docs.at(b, t)) {
              open = t;
              break;
            }
          for (index_t c = Kc - 2; c >= 0; --c) {  // descending: column c reads column c - own, not yet rewritten
            S acc = 0;
            if (c - own >= 0 && first + (c - own) >= start) acc += gcs(i, c - own);
            for (index_t t = 0; t <= c && t < open; ++t) acc += w(e, c - t) * gc(b * T + t, e);
            gcs(i, c) = acc;
          }
        });
  // Into w_conv and b_conv in two levels (kernels/row_sums.hpp): one thread per
  // (row block, channel) walks its rows in order and adds each tap into its
  // partial sums (consecutive channels read adjacent memory, where one thread per
  // (channel, tap) over the whole window read a new cache line per token), then
  // each (channel, tap) adds its blocks in order: bitwise repeatable.
  const index_t taps = Kc + 1, nblk = impl::row_blocks(M);  // tap Kc is the bias
  auto part = cot.conv_part;
  require(index_t(part.extent(0)) >= nblk && index_t(part.extent(1)) == E * taps,
          "mamba_mixer_backward_dense: conv partial sums of another size");
  Kokkos::parallel_for(
      "ash::mamba::conv_backward_w", Range(exec, 0, nblk * E), KOKKOS_LAMBDA(const index_t i) {
        const index_t blk = i / E, e = i % E, c0 = e * taps;
        const index_t r1 = (blk + 1) * impl::reduce_rows < M ? (blk + 1) * impl::reduce_rows : M;
        for (index_t j = 0; j < taps; ++j) part(blk, c0 + j) = 0;
        for (index_t m = blk * impl::reduce_rows; m < r1; ++m) {
          const index_t b = m / T, t = m % T;
          const S gcm = gc(m, e);
          part(blk, c0 + Kc) += gcm;
          // the forward's taps: back from the token, none before its document; in a
          // token block, the taps before the block's first token read the conv state
          // before it (unless a document starts in between)
          index_t k = 0;
          bool cut = false;
          for (; k < Kc && k <= t; ++k) {
            part(blk, c0 + Kc - 1 - k) += gcm * x(m - k, e);
            if (docs.at(b, t - k)) {
              cut = true;
              break;
            }
          }
          if (block && !cut)
            for (; k < Kc; ++k) part(blk, c0 + Kc - 1 - k) += gcm * cb(b * E + e, Kc - 1 - (k - t));
        }
      });
  auto gw = grad.conv_weight;
  auto gb = grad.conv_bias;
  Kokkos::parallel_for(
      "ash::mamba::conv_backward_w_sum", impl::BlockSumPolicy(exec, E * taps, impl::block_sum_team),
      KOKKOS_LAMBDA(const impl::BlockSumMember& team) {
        const index_t c = team.league_rank(), e = c / taps, j = c % taps;
        const S acc = impl::team_block_sum<S>(team, nblk, [&](const index_t blk) { return part(blk, c); });
        Kokkos::single(Kokkos::PerTeam(team), [&]() {
          if (j == Kc)
            gb(e) += acc;
          else
            gw(e, j) += acc;
        });
      });
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
