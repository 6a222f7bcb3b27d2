#pragma once
// Mamba-2's scan in the state-space dual's chunked matrix form (docs/design.md
// §1, "The SSD scan in chunks"): per head h a scalar decay a_h, so within a
// chunk of Q tokens the scan is a masked product of Q×Q matrices and across
// chunks a short recurrence of [P, N] chunk states. Forward and reverse mode
// are GEMMs per (chunk, head) through impl::gemm (OpenBLAS / cuBLAS) plus
// O(Q²) elementwise work; nothing per (token, state) is stored.
//
// Inputs are the scan core's (LayerActivations over E = H·P channels, as the
// per-channel scan of ssm_layer.hpp reads them): u = x [M, E], Δ [M, E] (the
// head's value in each of its P channels), β = B and γ = C [M, G·N], a [E, N]
// (a_h in every entry of the head's rows), D per channel, document starts.
// Within a chunk, with ℓ_t = Δ_t a, L_i = Σ_{k≤i} ℓ_k and a document start
// cutting every path across it (dec = 0 there):
//   s_i = Σ_{j≤i} (C_i·B_j) e^{L_i−L_j} Δ_j x_j + e^{L_i} H₀ C_i + D x_i
//   H_end = e^{L_end} H₀ + Σ_j e^{L_end−L_j} Δ_j x_j B_jᵀ
// A SsdScan is a plan (kokkos-fft's Plan): built from the shapes, it owns its
// buffers, and ssd_buffers lists them for the memory planner.
#include <string>
#include <vector>

#include "ash/model/ssm_layer.hpp"

namespace ash {

// The shapes: batch sequences of T tokens, H heads of head_dim P, G groups of N states, chunks of Q tokens.
struct SsdShape {
  index_t batch = 1, T = 1, heads = 1, head_dim = 1, groups = 1, state = 1, chunk = 64;
  index_t chunks() const { return (T + chunk - 1) / chunk; }
};
// The chunk length for windows of T tokens: 64 (a product of 64×64 blocks
// keeps a chunk's operands in cache on a host core and fills a GPU's MMA
// tiles), or T itself when shorter.
inline index_t ssd_chunk(index_t T) { return T < 64 ? T : 64; }

// One buffer of a SsdScan: label and extents (in scalars).
struct SsdBuffer {
  std::string label;
  std::vector<index_t> extents;
};
// The buffers a SsdScan of this shape allocates: with backward, also every
// chunk's start state [Bt, chunks, H, P, N] and the reverse mode's operands.
std::vector<SsdBuffer> ssd_buffers(const SsdShape& sh, bool backward);

// The reverse mode's results: ∂L/∂x [M, E], ∂L/∂Δ per head [M, H] (Δ after
// softplus and the limit), ∂L/∂B, ∂L/∂C [M, G·N] (overwritten), ∂L/∂a and ∂L/∂D
// per head [H] (added to).
template <class S>
struct SsdGrads {
  View2<S> gx, gdelta, gbeta, ggamma;
  View1<S> ga, gD;
};

template <class S>
class SsdScan {
 public:
  SsdScan(const SsdShape& sh, bool backward);
  const SsdShape& shape() const { return sh_; }
  // s = the scan of act's inputs ([M, E]); with state_io [Bt·E, N] (h per
  // channel e = h·P + p), the scan starts from it and leaves the end state in it.
  void forward(const LayerActivations<S>& act, const Unmanaged1<S>& D, const DocStarts& docs, const View2<S>& s,
               const View2<S>& state_io, const ExecSpace& exec);
  // The VJP of forward with cotangent gs = ∂L/∂s [M, E], from the state h0
  // [Bt·E, N] (empty: zero). r_io [Bt·E, N] (empty: none): in, ∂L/∂ the end
  // state (a later token block's); out, ∂L/∂ h0 (what the block before gets).
  void backward(const LayerActivations<S>& act, const Unmanaged1<S>& D, const DocStarts& docs, const View2<S>& gs,
                const SsdGrads<S>& out, const ExecSpace& exec, const View2<S>& h0 = View2<S>(),
                const View2<S>& r_io = View2<S>());

  // Per (head or group, chunk row, ·): one chunk of one sequence at a time (the
  // host's order: its operands stay in cache; the chunk recurrence is serial).
  struct Chunk {
    View3<S> X, G, Y, dX;         // [H, Q, P]: x, ∂L/∂s, products; ∂L/∂x's products
    View3<S> Bq, Cq, dB, dC;      // [G, Q, N]
    View3<S> CB, MD, WD;          // CB [G, Q, Q]; (C_s·B_j) dec Δ_j, (g_s·x_j) dec Δ_j [H, Q, Q]
    View3<S> GX, XR, HC, Ts, Tp;  // [H, Q, Q] g·x; [H, Q, N] x R, g H₀; [H, Q, N] / [H, Q, P] scaled operands
    View2<S> dt, L, din, dout;    // [H, Q]: Δ, cumulative ℓ, e^{L_i} (0 past a start), e^{L_end−L_j} (0 before one)
    View2<S> colk, dl, cs;        // [H, Q]: ∂L/∂Δ's direct part, ∂L/∂ℓ, its intra-chunk steps
    View3<S> H0, R, Hn;           // [H, P, N]: the chunk's start state, ∂L/∂ its end state, the next state
    View1<S> acc;                 // [2H]: Σ Δ ∂L/∂ℓ and Σ g·x per head
  };

 private:
  SsdShape sh_;
  Chunk c_;
  Kokkos::View<index_t*, Kokkos::LayoutRight, MemSpace> seg_;  // [Q] a row's segment (documents started so far)
  View3<S> starts_;                                             // [Bt·chunks·H, P, N] every chunk's start state (backward)
};

}  // namespace ash
