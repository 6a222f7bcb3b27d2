#pragma once
// One Mamba-2 block (model.arch = "mamba2", docs/design.md §1): transformers'
// Mamba2Block (pre-norm RMSNorm, residual) around Mamba2Mixer's torch_forward,
// on the selective-scan core of ssm_layer.hpp over E = H·P channels (H heads of
// head_dim P), B and C in G = n_groups groups (channel e reads group e / (E/G)'s).
//
// Rows are tokens m = b·T + t. Per layer, input y [M, D], C = E + 2·G·N:
//   ŷ = RMSNorm(y; w, model.norm_eps)
//   z = ŷ W_z^T [M, E],  ξ = ŷ W_ξ^T [M, C],  δ = ŷ W_Δ^T [M, H]   (in_proj's row blocks)
//   c = the causal depthwise conv of ξ (model/impl/causal_conv.hpp), SiLU:
//   u = SiLU(c)[:, :E],  β = SiLU(c)[:, E:E+GN],  γ = SiLU(c)[:, E+GN:]   [M, G·N] each
//   Δ_h = clamp(softplus(δ_h + b_dt,h), time_step_limit),  a_h = −exp(Alog_h)
//   s = the scan core over E channels, channel e = h·P + p reading Δ_h, a_h, D_h
//       and its group's β, γ (group_col, kernels/blocks.hpp)
//   o = w_g ⊙ RMSNorm(s ⊙ SiLU(z); eps) per group of E/G channels (the gated norm)
//   y_out = y + o W_out^T
// The same MambaActivations, MambaState and MambaCotangents hold it (their
// comments say what each view holds for a Mamba-2), so MambaKind's engine forms
// run it by overload (grad/mamba2_kind.hpp).
#include "ash/model/mamba_layer.hpp"
#include "ash/model/ssd_scan.hpp"

namespace ash {

template <class S>
void mamba_layer_forward(const Mamba2LayerParams<S>& p, const ModelDims& d, const SeqShape& s, const View2<S>& y_in,
                         const MambaActivations<S>& act, const View2<S>& y_out, const ExecSpace& exec = ExecSpace());
template <class S>
void mamba_layer_forward(const Mamba2LayerParams<S>& p, const ModelDims& d, const SeqShape& s, const View2<S>& y_in,
                         const MambaActivations<S>& act, const View2<S>& y_out, const MambaState<S>& state,
                         const ExecSpace& exec = ExecSpace());
template <class S>
void mamba_layer_activations(const Mamba2LayerParams<S>& p, const ModelDims& d, const SeqShape& s,
                             const View2<S>& y_in, const MambaActivations<S>& act, MambaUpTo upto = MambaUpTo::gate,
                             const ExecSpace& exec = ExecSpace());

// The gate's reverse mode in two halves (the Mamba-1 block's, mamba_layer.hpp),
// here around the gated norm, which reads s: first (act.s complete) cot.go = ∂L/∂o
// = g W_out, cot.gs = ∂L/∂s and cot.gz = ∂L/∂z, and the scan's per-channel
// parameter gradients zeroed; second W_out's and w_g's gradients from g and cot.go
// (a window's halo rows of g and cot.go zeroed in between add nothing).
template <class S>
void mamba_gate_backward_first(const Mamba2LayerParams<S>& p, const MambaActivations<S>& act, const View2<S>& g,
                               const MambaCotangents<S>& cot, const ExecSpace& exec = ExecSpace());
template <class S>
void mamba_gate_backward_second(const Mamba2LayerParams<S>& p, const MambaActivations<S>& act, const View2<S>& g,
                                const MambaCotangents<S>& cot, const Mamba2LayerParams<S>& grad,
                                const ExecSpace& exec = ExecSpace());
template <class S>
void mamba_gate_backward(const Mamba2LayerParams<S>& p, const MambaActivations<S>& act, const View2<S>& g,
                         const MambaCotangents<S>& cot, const Mamba2LayerParams<S>& grad,
                         const ExecSpace& exec = ExecSpace());
// The gated norm reads s: E3 forms the block's activations through the gate
// (one forward scan more) rather than s wave by wave (mamba_scan_output_rows).
template <class S>
constexpr bool gate_reads_s(const Mamba2LayerParams<S>&) {
  return true;
}
// The scan core's D per channel, and where its parameter gradients go (per
// channel, summed per head by the dense VJPs).
template <class S>
Unmanaged1<S> scan_core_D(const Mamba2LayerParams<S>&, const MambaActivations<S>& act) {
  return Unmanaged1<S>(act.d_channels.data(), act.d_channels.extent(0));
}
template <class S>
ScanParamGrads<S> scan_param_grads(const Mamba2LayerParams<S>&, const MambaCotangents<S>& cot) {
  return {Unmanaged2<S>(cot.ga_channels.data(), cot.ga_channels.extent(0), cot.ga_channels.extent(1)),
          Unmanaged1<S>(cot.gd_channels.data(), cot.gd_channels.extent(0)),
          Unmanaged1<S>(cot.gb_channels.data(), cot.gb_channels.extent(0))};
}

// Reverse mode after the gate, as the Mamba-1 block's (mamba_layer.hpp): the
// scan core's VJP from μ (E1/E2), then the dense VJPs: Δ's per head (zero where
// time_step_limit clamps), dt_bias, A_log and D per head, SiLU, the conv (with a
// token block's carry), in_proj, the norm; g += the VJP into y_in (empty g: detached).
template <class S>
void mamba_mixer_backward(const Mamba2LayerParams<S>& p, const ModelDims& d, const SeqShape& s, const View2<S>& y_in,
                          const MambaActivations<S>& act, const View3<S>& mu, const MambaCotangents<S>& cot,
                          const Mamba2LayerParams<S>& grad, const View2<S>& g, const ExecSpace& exec = ExecSpace());
template <class S>
void mamba_mixer_backward_dense(const Mamba2LayerParams<S>& p, const ModelDims& d, const SeqShape& s,
                                const View2<S>& y_in, const MambaActivations<S>& act, const MambaCotangents<S>& cot,
                                const Mamba2LayerParams<S>& grad, const View2<S>& g,
                                const ExecSpace& exec = ExecSpace());
template <class S>
void mamba_mixer_backward_block(const Mamba2LayerParams<S>& p, const ModelDims& d, const SeqShape& s,
                                const View2<S>& y_in, const MambaActivations<S>& act, const MambaCotangents<S>& cot,
                                const Mamba2LayerParams<S>& grad, const View2<S>& g, const View2<S>& conv_before,
                                const View2<S>& gconv, index_t own_T = 0, const ExecSpace& exec = ExecSpace());

// E3 on a whole window in the SSD's chunked matrix form (model/ssd_scan.hpp):
// between the gate's halves (act through the gate, from a zero state), the
// scan's VJP from cot.gs into cot.scan's ∂L/∂x, ∂L/∂B, ∂L/∂C and cot.gdlow (∂L/∂δ
// per head), A_log's and D's gradients added; then the dense VJPs with those
// per-head gradients already formed.
// A token block's: from the state h0 before it, r_io as SsdScan::backward's.
template <class S>
void mamba2_scan_backward_chunked(const Mamba2LayerParams<S>& p, const ModelDims& d, const SeqShape& s,
                                  const MambaActivations<S>& act, const MambaCotangents<S>& cot,
                                  const Mamba2LayerParams<S>& grad, const ExecSpace& exec = ExecSpace(),
                                  const View2<S>& h0 = View2<S>(), const View2<S>& r_io = View2<S>());
template <class S>
void mamba2_mixer_backward_dense_chunked(const Mamba2LayerParams<S>& p, const ModelDims& d, const SeqShape& s,
                                         const View2<S>& y_in, const MambaActivations<S>& act,
                                         const MambaCotangents<S>& cot, const Mamba2LayerParams<S>& grad,
                                         const View2<S>& g, const ExecSpace& exec = ExecSpace());
// On a token block, with the conv's carry (mamba_mixer_backward_block's).
template <class S>
void mamba2_mixer_backward_block_chunked(const Mamba2LayerParams<S>& p, const ModelDims& d, const SeqShape& s,
                                         const View2<S>& y_in, const MambaActivations<S>& act,
                                         const MambaCotangents<S>& cot, const Mamba2LayerParams<S>& grad,
                                         const View2<S>& g, const View2<S>& conv_before, const View2<S>& gconv,
                                         const ExecSpace& exec = ExecSpace());
// A carried state runs the SSD form from this many tokens on (mamba_layer_forward):
// generation's one-token steps keep the recurrent step.
constexpr index_t ssd_min_tokens = 2;
// The SSD scan's shape for a Mamba-2 of d on s.
inline SsdShape ssd_shape(const ModelDims& d, const SeqShape& s) {
  return SsdShape{s.batch, s.T, d.head_count(), d.head_dim, d.n_groups, d.state, ssd_chunk(s.T)};
}

// f(layer k's parameters) for a Mamba-1 or Mamba-2 ParamSet: model/'s one
// dispatch between the two blocks (the engines' is the layer kind).
template <class S, class F>
void with_mamba_block(const ParamSet<S>& ps, int k, F&& f) {
  if (ps.dims().mamba2())
    f(ps.mamba2_layer(k));
  else
    f(ps.mamba_layer(k));
}

}  // namespace ash
