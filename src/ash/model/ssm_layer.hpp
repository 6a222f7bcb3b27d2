#pragma once
// One SSM-ResNet layer of DESIGN.md §1, forward and reverse mode.
//
// Rows are tokens: m = b·T + t (batch-major), M = Bt·T rows per activation.
//   ŷ = RMSNorm(y_{k-1}; w)          z = Wδ ŷ + bδ,  Δ = softplus(z)
//   A_pn = exp(Δ_p a_pn), a = -exp(Alog)      β = WB ŷ,  γ = WC ŷ
//   h^t = A^t ⊙ h^{t-1} + Δ^t_p β^t_n ŷ^t_p   ỹ_p = Σ_n γ_n h_pn + D_p ŷ_p
//   y_k = y_{k-1} + ỹ
#include "ash/core/types.hpp"
#include "ash/model/params.hpp"

namespace ash {

struct SeqShape {
  index_t batch = 1;  // Bt
  index_t T = 1;      // tokens per window
  index_t rows() const { return batch * T; }
};

// Activations of one layer. The forward fills what is allocated: A and h
// ([M, P, N]) are stored only when allocated (E1 keeps every intermediate;
// a lean forward leaves them empty and keeps only the running state).
template <class S>
struct LayerActivations {
  View1<S> rstd;   // r [M]
  View2<S> yhat;   // ŷ [M, P]
  View2<S> z;      // Wδ ŷ + bδ [M, P]
  View2<S> delta;  // Δ [M, P]
  View2<S> beta;   // β [M, N]
  View2<S> gamma;  // γ [M, N]
  View3<S> A;      // A [M, P, N]   (optional)
  View3<S> h;      // h [M, P, N]   (optional)

  // store_state: allocate A and h as well.
  LayerActivations(const SeqShape& s, const ModelDims& d, bool store_state);
  LayerActivations() = default;
};

// y_out = y_in + ỹ(y_in). y_out may not alias y_in.
template <class S>
void ssm_layer_forward(const LayerParams<S>& p, const SeqShape& s, const View2<S>& y_in,
                       LayerActivations<S>& act, const View2<S>& y_out);

// Reverse mode through one layer (E1). act must hold A and h.
// gy: ∂L/∂y_k on entry. Accumulates θ_k's gradient into grad (+=). Writes
// gy_in = ∂L/∂y_{k-1} = gy + (VJP through ŷ and the RMSNorm), or gy alone when
// detach_input (stop-gradient on the layer input, DESIGN.md §2 on E2).
template <class S>
void ssm_layer_backward(const LayerParams<S>& p, const SeqShape& s, const View2<S>& y_in,
                        const LayerActivations<S>& act, const View2<S>& gy, const LayerParams<S>& grad,
                        const View2<S>& gy_in, bool detach_input);

}  // namespace ash
