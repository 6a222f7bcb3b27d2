#pragma once
// One Mamba block (model.arch = "mamba", docs/design.md §1): transformers'
// MambaBlock (pre-norm RMSNorm, residual) around MambaMixer's slow path, on
// the selective-scan core of ssm_layer.hpp over E = expand·D channels.
//
// Rows are tokens m = b·T + t, as in ssm_layer.hpp. Per layer, input y [M, D]:
//   ŷ = RMSNorm(y; w, model.norm_eps)
//   x = ŷ W_inx^T,  z = ŷ W_inz^T                          [M, E] each (in_proj's rows)
//   c^t_e = b_conv,e + Σ_j w_conv[e, j] x^{t-(Kc-1)+j}_e    causal, depthwise; a tap
//           before the sequence or before the document that holds t reads 0
//   u = SiLU(c)                                             the scan input (act.scan.yhat)
//   δ = u W_xΔ^T [M, R],  β = u W_xB^T,  γ = u W_xC^T       x_proj's row blocks
//   FalconMamba (model.arch = "falcon_mamba"): δ, β and γ each replaced by
//   v · r(v), r(v) = 1 / sqrt(mean(v²) + model.mixer_rms_eps), the weightless
//   RMSNorms of transformers' FalconMambaMixer (in S; transformers rounds to float32)
//   Δ = softplus(δ W_dt^T + b_dt)                          [M, E]
//   s = the scan core: h^t = A^t h^{t-1} + Δ u β, s = Σ_n γ h + D ⊙ u
//   o = s ⊙ SiLU(z),  y_out = y + o W_out^T
#include "ash/model/ssm_layer.hpp"

namespace ash {

// What the forward keeps of one Mamba block; the scan's part (Δ, u, β, γ, a,
// and where asked h^{t-1} and A) is a LayerActivations over E channels.
// A Mamba-2 block (mamba2_layer.hpp) keeps the same struct: its conv runs over
// C = E + 2·G·N channels (x, B, C; d.conv_dim()), and the views' comments say
// what each holds for it.
template <class S>
struct MambaActivations {
  View1<S> rstd;  // r [M]
  View2<S> yhat;  // ŷ [M, D]
  View2<S> x;     // in_proj's x [M, E]; a Mamba-2's x|B|C before the conv [M, C]
  View2<S> z;     // the gate before SiLU [M, E]
  View2<S> c;     // the conv's output before SiLU [M, C]
  View2<S> dlow;  // δ, Δ's low-rank input [M, R]; a Mamba-2's Δ before softplus and bias, per head [M, H]
  View2<S> s;     // the scan's output [M, E]
  View2<S> o;     // s ⊙ SiLU(z) [M, E]; a Mamba-2's gated norm of it
  // FalconMamba's r(δ), r(β), r(γ) per token [M, 3] (dlow, scan.beta and
  // scan.gamma hold the normalised values); a Mamba-2's gated norm's r per
  // group [M, G]; empty for a Mamba.
  View2<S> mixer_rstd;
  View1<S> d_channels;  // a Mamba-2's D per scan channel [E] (empty for the others)
  LayerActivations<S> scan;
  MambaActivations(const SeqShape& sh, const ModelDims& d, typename LayerActivations<S>::Store store);
  MambaActivations() = default;
};

// The first `rows` rows of a Mamba block's activations (a token block shorter
// than the buffers it reuses: the block-wise engine, sequence ranks).
template <class S>
MambaActivations<S> first_rows(const MambaActivations<S>& a, index_t rows) {
  MambaActivations<S> o;
  o.rstd = Kokkos::subview(a.rstd, Kokkos::make_pair(index_t(0), rows));
  o.yhat = first_rows(a.yhat, rows);
  o.x = first_rows(a.x, rows);
  o.z = first_rows(a.z, rows);
  o.c = first_rows(a.c, rows);
  o.dlow = first_rows(a.dlow, rows);
  o.s = first_rows(a.s, rows);
  o.o = first_rows(a.o, rows);
  o.mixer_rstd = a.mixer_rstd.extent(0) ? first_rows(a.mixer_rstd, rows) : a.mixer_rstd;
  o.d_channels = a.d_channels;
  o.scan = first_rows(a.scan, rows);
  return o;
}

// The block's forward: y_out = y_in + mixer(RMSNorm(y_in)) (y_out must not alias y_in).
template <class S>
void mamba_layer_forward(const MambaLayerParams<S>& p, const ModelDims& d, const SeqShape& s, const View2<S>& y_in,
                         const MambaActivations<S>& act, const View2<S>& y_out, const ExecSpace& exec = ExecSpace());

// How far mamba_layer_activations goes: through the gate (act.s and act.o), or
// to the scan's inputs only (r, ŷ, x, z, c, u, δ, Δ, β, γ, a; act.s and act.o
// unwritten), for a reverse pass that forms s from the h^{t-1} and A^t it
// replays anyway (mamba_scan_output_rows) instead of running the scan twice.
enum class MambaUpTo { gate, scan_inputs };

// The forward without out_proj and the residual (y_out is not written): what a
// recomputation needs (E3 recomputes each block from its kept input; the block's
// output is not needed again, and out_proj is one of the block's largest products).
template <class S>
void mamba_layer_activations(const MambaLayerParams<S>& p, const ModelDims& d, const SeqShape& s,
                             const View2<S>& y_in, const MambaActivations<S>& act, MambaUpTo upto = MambaUpTo::gate,
                             const ExecSpace& exec = ExecSpace());

// What one block carries from one call to the next (recurrent generation,
// transformers' and mamba-ssm's step): per sequence b and channel e, row b·E + e
// of each view. Zero (the constructor's) is the state before any token.
template <class S>
struct MambaState {
  // x of the Kc−1 tokens before the next one, oldest first (column Kc−2 is the
  // last token); a column whose token is before the last document start is 0,
  // so the conv of the next token sees nothing of an earlier document.
  View2<S> conv;  // [Bt·C, Kc−1] (C = E; a Mamba-2's x|B|C: E + 2·G·N)
  View2<S> ssm;   // h after the last token [Bt·E, N]
  index_t batch = 0;  // Bt
  MambaState(index_t batch, const ModelDims& d);
  MambaState() = default;
};

// The same forward with a carried state: the conv's taps before the window's
// first token read state.conv, the scan starts from state.ssm (both dropped at a
// document start, as the window's own tokens are), and on return state holds what
// follows the window's last token. Token by token this is the recurrent step;
// over a window it gives the same numbers as that window inside a longer one.
template <class S>
void mamba_layer_forward(const MambaLayerParams<S>& p, const ModelDims& d, const SeqShape& s, const View2<S>& y_in,
                         const MambaActivations<S>& act, const View2<S>& y_out, const MambaState<S>& state,
                         const ExecSpace& exec = ExecSpace());

// Scratch of the block's reverse mode (whole window, M rows).
template <class S>
struct MambaCotangents {
  View2<S> gs;     // ∂L/∂s [M, E]; later ∂L/∂c
  View2<S> gz;     // ∂L/∂z [M, E]
  View2<S> gx;     // ∂L/∂x [M, C]
  View2<S> gdlow;  // ∂L/∂δ [M, R]; a Mamba-2's ∂L/∂ its raw Δ per head [M, H]
  View2<S> gyhat;  // ∂L/∂ŷ [M, D]
  View2<S> norm_part;  // RMSNorm's weight-gradient partial sums [row_blocks(M), D]
  View2<S> conv_part;  // the conv's weight and bias partial sums [row_blocks(M), C·(Kc+1)]
  // A Mamba-2's only (empty for the others): ∂L/∂o [M, E] (the gated norm's
  // output), ∂L/∂c [M, C] (∂L/∂s has E columns), the gated norm's weight partial
  // sums [row_blocks(M), E], and the scan core's per-channel A_log [E, N], D and
  // bias [E] gradients, summed per head after the scan.
  View2<S> go, gc, gate_part, ga_channels;
  View1<S> gd_channels, gb_channels;
  LayerCotangents<S> scan;  // the scan core's, over E channels
  // scan_partials = false leaves the scan's row-block partial sums empty (E3
  // runs the scan's VJP per wave, into its own wave cotangents).
  MambaCotangents(index_t rows, const ModelDims& d, bool scan_partials = true);
};

// Reverse mode, first half: from g = ∂L/∂y_out, W_out's gradient and the
// cotangents of the gate's inputs: cot.gs = ∂L/∂s, cot.gz = ∂L/∂z. The caller
// then forms the scan's h-adjoint μ from cot.gs (E1: the reverse scan).
template <class S>
void mamba_gate_backward(const MambaLayerParams<S>& p, const MambaActivations<S>& act, const View2<S>& g,
                         const MambaCotangents<S>& cot, const MambaLayerParams<S>& grad,
                         const ExecSpace& exec = ExecSpace());

// mamba_gate_backward in two halves around the scan's reverse pass, for activations
// of MambaUpTo::scan_inputs (act.s is formed during that pass):
// first ∂L/∂o = g W_out^T into cot.gz (held there until the second half) and
// cot.gs = ∂L/∂s = ∂L/∂o ⊙ SiLU(z), which needs no s;
template <class S>
void mamba_gate_backward_first(const MambaLayerParams<S>& p, const MambaActivations<S>& act, const View2<S>& g,
                               const MambaCotangents<S>& cot, const ExecSpace& exec = ExecSpace());
// then, once act.s is complete, act.o = s ⊙ SiLU(z), W_out's gradient and
// cot.gz = ∂L/∂z: the same numbers as mamba_gate_backward.
template <class S>
void mamba_gate_backward_second(const MambaActivations<S>& act, const View2<S>& g, const MambaCotangents<S>& cot,
                                const MambaLayerParams<S>& grad, const ExecSpace& exec = ExecSpace());
// The same second half with the block's parameters (the Mamba-2 block's form,
// mamba2_layer.hpp, which the layer kinds call).
template <class S>
void mamba_gate_backward_second(const MambaLayerParams<S>&, const MambaActivations<S>& act, const View2<S>& g,
                                const MambaCotangents<S>& cot, const MambaLayerParams<S>& grad,
                                const ExecSpace& exec = ExecSpace()) {
  mamba_gate_backward_second(act, g, cot, grad, exec);
}
// The gate's VJP needs no s: E3 forms s wave by wave (mamba_scan_output_rows).
template <class S>
constexpr bool gate_reads_s(const MambaLayerParams<S>&) {
  return false;
}
// The scan core's D per channel and its parameter gradients: the block's own.
template <class S>
Unmanaged1<S> scan_core_D(const MambaLayerParams<S>& p, const MambaActivations<S>&) {
  return p.D;
}
template <class S>
ScanParamGrads<S> scan_param_grads(const MambaLayerParams<S>& grad, const MambaCotangents<S>&) {
  return {grad.A_log, grad.D, grad.dt_bias};
}
// The scan's output s of the rows of one wave (row r of the wave's buffers is
// window row rows(r)), from its h^{t-1} and A^t ([Bt·W, E, N], as E3 hands them
// to the scan's VJP): s^t = D ⊙ u^t + Σ_n γ^t_n (A^t_n h^{t-1}_n + Δ^t u^t β^t_n),
// the forward scan's step in its order of operations, into act.s.
template <class S>
void mamba_scan_output_rows(const Unmanaged1<S>& D, const SeqShape& s, const MambaActivations<S>& act,
                            const BlockRows& rows, const View3<S>& hprev, const View3<S>& A,
                            const ExecSpace& exec = ExecSpace());

// Reverse mode, second half, given μ ([M, E, N], overwritten) and the stored
// h^{t-1} and A^t of act.scan: every other parameter's gradient added to grad,
// and g += the VJP into y_in (the residual's identity is g itself).
template <class S>
void mamba_mixer_backward(const MambaLayerParams<S>& p, const ModelDims& d, const SeqShape& s, const View2<S>& y_in,
                          const MambaActivations<S>& act, const View3<S>& mu, const MambaCotangents<S>& cot,
                          const MambaLayerParams<S>& grad, const View2<S>& g, const ExecSpace& exec = ExecSpace());

// mamba_mixer_backward after the scan core: given the scan's cotangents of
// every row in cot.scan (gz, gyhat = ∂L/∂u through the scan, gbeta, ggamma;
// E3 forms them wave by wave; a FalconMamba's norms turn gbeta and ggamma
// into the cotangents of x_proj's outputs in place), dt_proj's, x_proj's, the conv's, in_proj's and
// the norm's gradients added to grad, and g += the VJP into y_in.
template <class S>
void mamba_mixer_backward_dense(const MambaLayerParams<S>& p, const ModelDims& d, const SeqShape& s,
                                const View2<S>& y_in, const MambaActivations<S>& act, const MambaCotangents<S>& cot,
                                const MambaLayerParams<S>& grad, const View2<S>& g,
                                const ExecSpace& exec = ExecSpace());

// The same on a token block of a longer window (the block-wise engine,
// blocks last to first): conv_before is the conv state the block's forward
// read (MambaState::conv before its first token); gconv is on entry ∂L/∂(the
// conv state after the block), what the later blocks' taps read of this
// block's x (and, for blocks shorter than Kc−1, of earlier ones), zero after
// the window's last block; on return ∂L/∂(the conv state before the block),
// for the block before. The conv's weight gradient gets the taps into
// conv_before; document starts cut both as the forward does. own_T > 0: the
// block's own tokens are the first own_T of each sequence, the rest a window's
// halo whose cotangents the caller zeroed (a range on sequence ranks): gconv
// is then the state after token own_T − 1.
template <class S>
void mamba_mixer_backward_block(const MambaLayerParams<S>& p, const ModelDims& d, const SeqShape& s,
                                const View2<S>& y_in, const MambaActivations<S>& act, const MambaCotangents<S>& cot,
                                const MambaLayerParams<S>& grad, const View2<S>& g, const View2<S>& conv_before,
                                const View2<S>& gconv, index_t own_T = 0, const ExecSpace& exec = ExecSpace());

}  // namespace ash
