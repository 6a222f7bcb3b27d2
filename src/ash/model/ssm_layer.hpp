#pragma once
// One SSM-ResNet layer of DESIGN.md §1: forward, and the reverse-mode pieces
// every gradient engine shares.
//
// Rows are tokens: m = b·T + t (batch-major), M = Bt·T rows per activation.
//   ŷ = RMSNorm(y_{k-1}; w)          Δ = softplus(Wδ ŷ + bδ)
//   A_pn = exp(Δ_p a_pn), a = -exp(Alog)      β = WB ŷ,  γ = WC ŷ
//   h^t = A^t ⊙ h^{t-1} + Δ^t_p β^t_n ŷ^t_p   ỹ_p = Σ_n γ_n h_pn + D_p ŷ_p
//   y_k = y_{k-1} + ỹ
//
// Reverse mode is split the way DESIGN.md §2 splits the engines: an engine
// computes the adjoint of h, μ^i (E1: full reverse scan; E2: the paper's
// windowed sum of λ^{t,i}; E3: chunked scan), then
//   ssm_layer_token_vjp   — per-token VJPs of step i (cotangent μ^i) and of
//                           output i (cotangent gy^i), on any set of rows;
//   ssm_layer_finish_vjp  — the dense VJPs (weight gradients as GEMMs over
//                           tokens) and the input VJP through the RMSNorm.
#include "ash/core/types.hpp"
#include "ash/model/params.hpp"

namespace ash {

struct SeqShape {
  index_t batch = 1;  // Bt
  index_t T = 1;      // tokens per window
  index_t rows() const { return batch * T; }
};

// What the forward keeps of one layer. The O(T·P) part is always filled;
// hprev = h^{t-1} and A ([M, P, N]) only when allocated (E1 and E2 keep them;
// E3 recomputes them chunk by chunk).
template <class S>
struct LayerActivations {
  View1<S> rstd;   // r [M]
  View2<S> yhat;   // ŷ [M, P]
  View2<S> delta;  // Δ [M, P]
  View2<S> beta;   // β [M, N]
  View2<S> gamma;  // γ [M, N]
  View3<S> hprev;  // h^{t-1} [M, P, N]  (optional)
  View3<S> A;      // A^t [M, P, N]      (optional)

  enum Store { projections_only = 0, with_hprev = 1, with_hprev_and_A = 2 };
  LayerActivations(const SeqShape& s, const ModelDims& d, Store store);
  LayerActivations() = default;
};

// ŷ, r, Δ, β, γ of every token (no scan).
template <class S>
void ssm_layer_project(const LayerParams<S>& p, const View2<S>& y_in, const LayerActivations<S>& act);

// Projections, then the scan; y_out = y_in + ỹ (y_out must not alias y_in).
template <class S>
void ssm_layer_forward(const LayerParams<S>& p, const SeqShape& s, const View2<S>& y_in,
                       const LayerActivations<S>& act, const View2<S>& y_out);

// Per-token cotangents of one layer, accumulated over the row sets given to
// ssm_layer_token_vjp and consumed by ssm_layer_finish_vjp.
template <class S>
struct LayerCotangents {
  View2<S> gyhat;     // ∂L/∂ŷ   [M, P] (state and output parts; dense parts added later)
  View2<S> gz;        // ∂L/∂(Wδ ŷ + bδ) [M, P]
  View2<S> gbeta;     // ∂L/∂β  [M, N]
  View2<S> ggamma;    // ∂L/∂γ  [M, N]
  View1<S> alog_sum;  // Σ_i μ^i h^{i-1} A^i Δ^i  [P·N]  (times a = ∂Alog later)
  LayerCotangents(const SeqShape& s, const ModelDims& d);
};

// Token rows handled by one ssm_layer_token_vjp call: tokens t in [t0, t0+W)
// of every sequence; buffer row r = b·W + (t - t0).
struct RowBlock {
  index_t t0 = 0;
  index_t W = 0;
};

// VJP of step i (cotangent μ^i) and of output i (cotangent gy^i) for the rows
// of `rows`. mu and hprev are [Bt·W, P, N] in RowBlock order; mu is
// overwritten (used as scratch once consumed).
template <class S>
void ssm_layer_token_vjp(const LayerParams<S>& p, const SeqShape& s, const LayerActivations<S>& act,
                         const View2<S>& gy, const RowBlock& rows, const View3<S>& mu, const View3<S>& hprev,
                         const LayerCotangents<S>& cot);

// Dense VJPs into grad (+=), and gy_in = gy + RMSNorm VJP (= gy alone when
// detach_input: stop-gradient on the layer input). gy_in may alias gy only
// when detach_input.
template <class S>
void ssm_layer_finish_vjp(const LayerParams<S>& p, const View2<S>& y_in, const LayerActivations<S>& act,
                          const View2<S>& gy, const LayerCotangents<S>& cot, const LayerParams<S>& grad,
                          const View2<S>& gy_in, bool detach_input);

}  // namespace ash
