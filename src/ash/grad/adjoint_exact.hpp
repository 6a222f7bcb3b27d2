#pragma once
// E3: the exact O(T) adjoint (ours, docs/design.md §2).
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
// scan F of docs/design.md §2 — only products and sums, nothing subtracted).
#include <functional>
#include <memory>

#include "ash/grad/engine.hpp"

namespace ash {

// What the reverse pass over token blocks (the exact-mode pipeline of E4)
// carries from one block into the one before it: μ and A at the first token
// of the later block, per (sequence, channel, state), [Bt, P, N].
template <class S>
struct ExactCarry {
  View3<S> mu, A;
  bool valid = false;  // false: the later block does not exist (end of the window)
};

// W, the tokens per sequence of one E3 wave over a window of T tokens: whole
// chunks (exact, detached) or whole blocks of T̄ (a window), about grad.wave
// of them. The buffers hold min(W, T) rows per sequence.
// grad.wave = 0 (auto) asks for 1024 tokens on a host backend (the wave's h,
// A and μ stay in cache) and, on a GPU, for enough tokens that a wave holds
// 2^24 state numbers (Bt·W·P·N; 64 MiB per buffer in float), so its kernels
// fill the device. `state_per_token` is Bt·P·N.
index_t e3_wave_length(const EngineOptions& opts, index_t T, index_t state_per_token);

template <class S>
class AdjointExactLayer final : public LayerAdjoint<S> {
 public:
  // Throws ash::Error for a window without detach_inputs.
  explicit AdjointExactLayer(const EngineOptions& opts);
  std::string name() const override;
  bool keeps_activations() const override { return false; }
  typename LayerAdjoint<S>::Store store() const override { return LayerActivations<S>::projections_only; }
  bool detached() const override { return opts_.detach_inputs; }
  void backward(const LayerParams<S>& p, int k, ActivationStore<S>& store, const View2<S>& g,
                const LayerParams<S>& grad) override;
  void release() override;

  // Exact mode on one token block of every sequence, blocks taken from the
  // last to the first: sb.T tokens per sequence (a multiple of the chunk but
  // for the last block), y_blk and g_blk [Bt·sb.T, P] in block-row order
  // (g_k in, g_{k-1} out), h0 [Bt·P, N] the state before the block's first
  // token (empty: zero), carry in: from the block after, out: for the block before.
  // Exact or detached mode; a window (T̄) needs the whole window as one block,
  // with carry == nullptr (no block after or before).
  void backward_block(const LayerParams<S>& p, const SeqShape& sb, const View2<S>& y_blk, const View2<S>& g_blk,
                      const View2<S>& h0, ExactCarry<S>* carry, const LayerParams<S>& grad);
  // One token range of a longer window (context parallelism; exact or
  // detached, no window): g (g_k of the range) in, g_{k-1} out; h0 the state
  // before the range (empty: zero). `exchange` gets the range's carry map
  // c_before = M ⊙ c_after + v ([Bt, P, N] each; c = A μ at a range's first
  // token) and returns c_after, the carry from the later ranges (empty: zero).
  void backward_range(const LayerParams<S>& p, int k, ActivationStore<S>& store, const View2<S>& g,
                      const View2<S>& h0, const std::function<View3<S>(const View3<S>&, const View3<S>&)>& exchange,
                      const LayerParams<S>& grad);

 private:
  void run(const LayerParams<S>& p, const SeqShape& s, const View2<S>& y, const LayerActivations<S>& act,
           const View2<S>& g, const View2<S>& h0, ExactCarry<S>* carry, const LayerParams<S>& grad);
  EngineOptions opts_;
  LayerActivations<S> block_act_;  // projections of one token block (backward_block)
  // run()'s buffers, kept from one layer (and token block) to the next of a
  // pass while their sizes stay the same; freed by release().
  struct Work {
    View3<S> Hb, scratch, Ms, hbuf, Abuf, mubuf;
    View2<S> hrun;  // the sequential form's running state [Bt·P, N]
    std::unique_ptr<LayerCotangents<S>> cot;
  };
  Work work_;
};

}  // namespace ash
