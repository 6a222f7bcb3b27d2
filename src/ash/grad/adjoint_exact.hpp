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

// W, the tokens per sequence of one E3 wave over a window of T tokens: whole
// chunks (exact, detached) or whole blocks of T̄ (a window), about grad.wave
// of them. The buffers hold min(W, T) rows per sequence.
// grad.wave = 0 (auto) asks for 1024 tokens on a host backend (the wave's h,
// A and μ stay in cache) and, on a GPU, for enough tokens that a wave holds
// 2^24 state numbers (Bt·W·P·N; 64 MiB per buffer in float), so its kernels
// fill the device. `state_per_token` is Bt·P·N.
index_t e3_wave_length(const EngineOptions& opts, index_t T, index_t state_per_token);

template <class S>
class AdjointExactLayer final : public LayerAdjoint<S>, public BlockAdjoint<S> {
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
  BlockAdjoint<S>* block_adjoint() override { return this; }

  // BlockAdjoint (layer_adjoint.hpp): a token block, a token range.
  void backward_block(const LayerParams<S>& p, const SeqShape& sb, const View2<S>& y_blk, const View2<S>& g_blk,
                      const View2<S>& h0, ExactCarry<S>* carry, const LayerParams<S>& grad) override;
  void backward_range(const LayerParams<S>& p, int k, ActivationStore<S>& store, const View2<S>& g,
                      const View2<S>& h0, const typename BlockAdjoint<S>::Exchange& exchange,
                      const LayerParams<S>& grad) override;

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
