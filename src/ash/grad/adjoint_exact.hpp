#pragma once
// E3: the exact O(T) adjoint (ours, DESIGN.md §2).
//
// Layers in reverse with g_K = g, g_k = ∂L/∂y_k:
//   μ^i_pn = g_k^i_p γ^i_n + A^{i+1}_pn μ^{i+1}_pn   (= Σ_{t>=i} v_k^{t,i})
// as a chunked parallel scan (chunk-local scans in parallel, a short carry
// pass over chunks), then per-token VJPs of step i (cotangent μ^i) and output
// i (cotangent g_k^i) w.r.t. θ_k and the layer input, g_{k-1} = g_k + input VJP.
//
// Memory: every layer's input y_{k-1} (T×P) and the O(T·P) projections of the
// layer being differentiated; A and h are recomputed chunk by chunk from h at
// chunk boundaries, in waves of `wave` tokens: O(K·T·P + T/C·P·N + wave·P·N).
//
// Modes: exact (default); detach_inputs (g_k = g for every k, no input VJP:
// E2's full gradient in O(T)); detach_inputs with a window T̄: the truncated
// sum of E2 in O(T) by the block method (suffix scan S, products R and prefix
// scan F of DESIGN.md §2 — only products and sums, nothing subtracted).
#include "ash/grad/engine.hpp"

namespace ash {

template <class S>
class AdjointExactEngine final : public GradientEngine<S> {
 public:
  // Throws ash::Error for a window without detach_inputs.
  explicit AdjointExactEngine(const EngineOptions& opts);
  std::string name() const override;
  double compute(const ParamSet<S>& params, const TokenView& x, const ParamSet<S>& grad) override;

 private:
  EngineOptions opts_;
};

}  // namespace ash
