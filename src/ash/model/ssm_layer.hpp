#pragma once
// One SSM-ResNet layer of docs/design.md §1: forward, and the reverse-mode pieces
// every gradient engine shares.
//
// Rows are tokens: m = b·T + t (batch-major), M = Bt·T rows per activation.
//   ŷ = RMSNorm(y_{k-1}; w)          Δ = softplus(Wδ ŷ + bδ)
//   A_pn = exp(Δ_p a_pn), a = -exp(Alog)      β = WB ŷ,  γ = WC ŷ
//   h^t = A^t ⊙ h^{t-1} + Δ^t_p β^t_n ŷ^t_p   ỹ_p = Σ_n γ_n h_pn + D_p ŷ_p
//   y_k = y_{k-1} + ỹ
//
// Every kernel runs on the execution-space instance it is given (the default
// one unless an orchestrator passes its own), the dense products too (KokkosBlas::gemm
// on that instance; Kokkos Kernels 3.4 has only the default one, kernels/blas.hpp).
// Loops over the state index run in register tiles (kernels/state_tile.hpp),
// with a = -exp(Alog) computed once per layer and A^t = exp(Δ^t a) once per pass.
//
// Reverse mode is split the way docs/design.md §2 splits the engines: an engine
// computes the adjoint of h, μ^i (E1: full reverse scan; E2: the paper's
// windowed sum of λ^{t,i}; E3: chunked scan), then ssm_layer_backward_rows
// runs the per-token and dense VJPs on any block of token rows.
#include "ash/core/documents.hpp"
#include "ash/core/types.hpp"
#include "ash/kernels/blocks.hpp"
#include "ash/model/params.hpp"

namespace ash {

namespace impl {
KOKKOS_INLINE_FUNCTION double softplus(double z) { return z > 20.0 ? z : kmath::log1p(kmath::exp(z)); }
KOKKOS_INLINE_FUNCTION float softplus(float z) { return z > 20.0f ? z : kmath::log1p(kmath::exp(z)); }
}  // namespace impl

struct SeqShape {
  index_t batch = 1;  // Bt
  index_t T = 1;      // tokens per window
  DocStarts docs;     // where a document starts (A^t = 0 there); empty: nowhere
  index_t rows() const { return batch * T; }
  // The windows of x, their document starts read from x's tokens (none read
  // per step where x marks no start: DocStarts::of).
  static SeqShape of(const TokenView& x) {
    return SeqShape{index_t(x.extent(0)), index_t(x.extent(1)), DocStarts::of(x)};
  }
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
  View2<S> a;      // a = -exp(Alog) [P, N], the layer's decay rates
  View3<S> hprev;  // h^{t-1} [M, P, N]  (optional)
  View3<S> A;      // A^t [M, P, N]      (optional)

  enum Store { projections_only = 0, with_hprev = 1, with_hprev_and_A = 2 };
  LayerActivations(const SeqShape& s, const ModelDims& d, Store store) : LayerActivations(s, d.width, d.state, store) {}
  // Over P scan channels (a Mamba's scan: P = E = expand·D).
  // groups: B and C in groups (a Mamba-2's n_groups), β and γ [M, groups·N] (group_col).
  LayerActivations(const SeqShape& s, index_t P, index_t N, Store store, index_t groups = 1);
  LayerActivations() = default;
};

// The first `rows` rows (token blocks shorter than the buffers they reuse).
template <class S>
View2<S> first_rows(const View2<S>& v, index_t rows) {
  return Kokkos::subview(v, Kokkos::make_pair(index_t(0), rows), Kokkos::ALL());
}
// The same for the projections of LayerActivations (hprev and A are not carried over).
template <class S>
LayerActivations<S> first_rows(const LayerActivations<S>& a, index_t rows) {
  LayerActivations<S> o;
  o.rstd = Kokkos::subview(a.rstd, Kokkos::make_pair(index_t(0), rows));
  o.yhat = first_rows(a.yhat, rows);
  o.delta = first_rows(a.delta, rows);
  o.beta = first_rows(a.beta, rows);
  o.gamma = first_rows(a.gamma, rows);
  o.a = a.a;
  return o;
}

// ŷ, r, Δ, β, γ of every token (no scan).
template <class S>
void ssm_layer_project(const LayerParams<S>& p, const View2<S>& y_in, const LayerActivations<S>& act,
                       const ExecSpace& exec = ExecSpace());

// Projections, then the scan; y_out = y_in + ỹ (y_out must not alias y_in).
// state_io, when given ([Bt·P, N]), is h before the first token on entry and
// h after the last on return (recurrent generation); else h^0 = 0.
template <class S>
void ssm_layer_forward(const LayerParams<S>& p, const SeqShape& s, const View2<S>& y_in,
                       const LayerActivations<S>& act, const View2<S>& y_out, const View2<S>& state_io = View2<S>(),
                       const ExecSpace& exec = ExecSpace());

// Whether the forward scan of Bt sequences of T tokens and P channels on `exec`
// runs token by token in one chunk (a host with Bt·P ≥ 8 threads' worth of
// channels, or T ≤ 64): then cutting the tokens anywhere and carrying the state
// across the cut gives the same bits; chunked, only cuts where a block starts do.
bool forward_scan_is_sequential(index_t T, index_t Bt, index_t P, const ExecSpace& exec = ExecSpace());
// Its chunks per sequence (1 when sequential). In chunks it holds h at chunk
// ends and the chunks' Π A ([Bt·chunks, P, N] each) while it runs.
index_t forward_scan_chunks(index_t T, index_t Bt, index_t P, const ExecSpace& exec = ExecSpace());

// The scan alone, on projections already in act (what ssm_layer_forward runs
// after ssm_layer_project).
template <class S>
void ssm_layer_scan(const LayerParams<S>& p, const SeqShape& s, const View2<S>& y_in, const LayerActivations<S>& act,
                    const View2<S>& y_out, const View2<S>& state_io = View2<S>(), const ExecSpace& exec = ExecSpace());

// The scan core's inputs from ŷ (act.yhat) and Δ before its bias (act.delta),
// how both architectures' projections end: β = ŷ W_Bᵀ, γ = ŷ W_Cᵀ,
// a = −exp(A_log), Δ ← softplus(Δ + bias).
template <class S>
void selective_scan_inputs(const Unmanaged2<S>& W_B, const Unmanaged2<S>& W_C, const Unmanaged2<S>& A_log,
                           const Unmanaged1<S>& bias, const LayerActivations<S>& act,
                           const ExecSpace& exec = ExecSpace());

// The selective-scan core both architectures share (docs/design.md §1): over
// the P channels of act (ŷ is the scan input: an SSM-ResNet's normed input, a
// Mamba's u), y_out = y_in + D ⊙ ŷ + Σ_n γ_n h_·n with h^t = A^t ⊙ h^{t-1} +
// Δ^t ŷ^t β^t (y_in empty: no residual term); h^{t-1} and A^t stored where act
// has them; state_io as ssm_layer_forward's. ssm_layer_scan is this with p.D.
template <class S>
void selective_scan_forward(const Unmanaged1<S>& D, const SeqShape& s, const View2<S>& y_in,
                            const LayerActivations<S>& act, const View2<S>& y_out,
                            const View2<S>& state_io = View2<S>(), const ExecSpace& exec = ExecSpace());

// The layer's state over each whole sequence as an affine map of the state
// before it, h_end = prod ⊙ h_before + h_local (prod = Π_t A^t, h_local the
// end state from zero; [Bt·P, N] each), from the projections in act. Context
// parallelism composes these maps across ranks (docs/design.md §2, E4).
template <class S>
void ssm_layer_state_map(const LayerParams<S>& p, const SeqShape& s, const LayerActivations<S>& act,
                         const View2<S>& prod, const View2<S>& h_local, const ExecSpace& exec = ExecSpace());

// Scratch for the per-token cotangents of one row block (reused across blocks).
// Sums over rows are two-level: partial sums per block of impl::reduce_rows
// rows, then a fixed-order sum over blocks (deterministic on every backend).
template <class S>
struct LayerCotangents {
  View2<S> gyhat;      // ∂L/∂ŷ   [R, P]
  View2<S> gz;         // ∂L/∂(Wδ ŷ + bδ) [R, P]
  View2<S> gbeta;      // ∂L/∂β  [R, N]
  View2<S> ggamma;     // ∂L/∂γ  [R, N]
  View2<S> yhat_rows;  // ŷ of the block's rows [R, P] (batches > 1: one GEMM over all sequences; empty: gather_rows false)
  View3<S> alog_part;  // Σ_i μ^i h^{i-1} A^i Δ^i per row block [R/reduce_rows, P, N]
  View2<S> d_part;     // Σ_i g^i ŷ^i per row block [R/reduce_rows, P]
  View2<S> bd_part;    // Σ_i ∂L/∂z^i per row block [R/reduce_rows, P]
  View2<S> norm_part;  // RMSNorm's weight-gradient sums per row block [R/reduce_rows, P] (always)
  // row_partials = false leaves the three partial-sum views empty (E3's fused
  // kernels keep their own per chunk).
  LayerCotangents(index_t rows, const ModelDims& d, bool row_partials = true)
      : LayerCotangents(rows, d.width, d.state, row_partials) {}
  // gather_rows = false leaves yhat_rows empty: the Mamba kinds' dense VJPs never gather ŷ.
  LayerCotangents(index_t rows, index_t P, index_t N, bool row_partials = true, index_t groups = 1,
                  bool gather_rows = true);
};

// First-level partial sums of the A_log, D and bδ gradients over n blocks of
// token rows: alog [n, P, N] (before the factor a), d and bd [n, P].
template <class S>
struct ParamPartials {
  View3<S> alog;
  View2<S> d, bd;
  index_t n = 0;
};

// Where the scan core's parameter gradients go: A_log, D and the bias inside
// Δ = softplus(· + bias) (an SSM-ResNet's bδ, a Mamba's dt_bias).
template <class S>
struct ScanParamGrads {
  Unmanaged2<S> A_log;
  Unmanaged1<S> D, bias;
};

// The scan core's reverse mode on one row block (`rows`, as below), given μ,
// h^{t-1} and A^t of its rows (ssm_layer_backward_rows' first half, shared by both
// architectures): cot.gz = ∂L/∂(the pre-softplus Δ), cot.gyhat = ∂L/∂ŷ
// through the scan alone (D ŷ and the input term u = Δ ŷ β), cot.gbeta,
// cot.ggamma (=, per row), and the A_log, D and bias gradients added to grad.
// gy is the cotangent of the scan output. mu is overwritten.
template <class S>
void selective_scan_backward_rows(const Unmanaged1<S>& D, const SeqShape& s, const LayerActivations<S>& act,
                                  const View2<S>& gy, const BlockRows& rows, const View3<S>& mu,
                                  const View3<S>& hprev, const View3<S>& A, const LayerCotangents<S>& cot,
                                  const ScanParamGrads<S>& grad, const ExecSpace& exec = ExecSpace());

// The A_log, D and bias gradients from first-level partial sums (fixed order).
template <class S>
void selective_scan_param_sums(const LayerActivations<S>& act, const ParamPartials<S>& parts,
                               const ScanParamGrads<S>& grad, const ExecSpace& exec = ExecSpace());

// Reverse mode of layer k on one row block (`rows`: tokens [t0, t0+W) of every
// sequence, buffer row r = b·W + (t - t0); rows.T is s.T), given the h-adjoint μ, h^{t-1}
// and A^t of its rows (no exp is evaluated here):
// the VJPs of step i (cotangent μ^i) and of output i (cotangent gy^i) w.r.t.
// θ_k (added to grad) and the layer input: gy_in = gy + RMSNorm VJP on these
// rows (gy alone when detach_input: stop-gradient on the layer input). Weight
// gradients are GEMMs over the block's tokens. mu, hprev, A are [Bt·W, P, N]
// in that row order; mu is overwritten (scratch once consumed). gy_in may be gy.
template <class S>
void ssm_layer_backward_rows(const LayerParams<S>& p, const SeqShape& s, const View2<S>& y_in,
                             const LayerActivations<S>& act, const View2<S>& gy, const BlockRows& rows,
                             const View3<S>& mu, const View3<S>& hprev, const View3<S>& A,
                             const LayerCotangents<S>& cot,
                             const LayerParams<S>& grad, const View2<S>& gy_in, bool detach_input,
                             const ExecSpace& exec = ExecSpace());

// The part of ssm_layer_backward_rows after the per-token VJPs, for an engine
// that forms those itself (E3's fused kernels): given cot's gz, gyhat (its D
// and state terms), gbeta and ggamma of the block's rows and the partial sums
// `parts`, adds the A_log, D, bδ sums and the dense and RMSNorm VJPs.
template <class S>
void ssm_layer_backward_dense(const LayerParams<S>& p, const SeqShape& s, const View2<S>& y_in,
                              const LayerActivations<S>& act, const View2<S>& gy, const BlockRows& rows,
                              const LayerCotangents<S>& cot, const ParamPartials<S>& parts,
                              const LayerParams<S>& grad, const View2<S>& gy_in, bool detach_input,
                              const ExecSpace& exec = ExecSpace());

}  // namespace ash
