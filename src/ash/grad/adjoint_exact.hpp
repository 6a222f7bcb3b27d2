#pragma once
// E3: the exact O(T) adjoint (ours; derivation in docs/design.md §2, memory in
// §6). Layers in reverse: μ^i = g_k^i ⊗ γ^i + A^{i+1} ⊙ μ^{i+1} as a chunked
// scan, then the per-token VJPs of step i (cotangent μ^i) and output i
// (cotangent g_k^i), g_{k-1} = g_k + input VJP. A and h are recomputed chunk
// by chunk, in waves, from h at chunk boundaries. Modes: exact; detached
// (E2's full gradient in O(T)); detached with a window T̄ (E2's truncated sum
// in O(T) by the block method of §2).
#include <functional>
#include <memory>

#include "ash/grad/engine.hpp"
#include "ash/grad/workspace.hpp"

namespace ash {

// W, the tokens per sequence of one E3 wave over a window of T tokens: whole
// chunks (exact, detached) or whole blocks of T̄ (a window), about grad.wave
// of them. The buffers hold min(W, T) rows per sequence.
// grad.wave = 0 (auto) asks for 1024 tokens on a host backend (the wave's h,
// A and μ stay in cache) and, on a GPU, for enough tokens that a wave holds
// 2^24 state numbers (Bt·W·P·N; 64 MiB per buffer in float), so its kernels
// fill the device. `state_per_token` is Bt·P·N. The wave form's length (the
// fused form has no [W, P, N] buffers: e3_fused_waves).
index_t e3_wave_length(const EngineOptions& opts, index_t T, index_t state_per_token);

// The fused form's waves (grad/impl/e3_fused.hpp) on sh: `wave` tokens per
// sequence whose dense VJPs run at once, each wave's fused kernel launched
// over `launch` tokens at a time; both whole chunks, launch <= wave. A wave
// keeps per token only rows of P and N numbers (∂L/∂z, ∂L/∂ŷ, ∂L/∂β, ∂L/∂γ),
// per chunk the [P, N] partial sums, and per launched token the channel
// blocks' shares of ∂L/∂β and ∂L/∂γ ([nPB, N] twice, the largest per-token
// buffer at small team blocks). grad.wave (> 0) sets the wave as for
// e3_wave_length; auto is 1024 tokens on a host and, on a GPU, as many as
// keep the wave's rows and partial sums within 512 MiB. The launch is
// grad.e3_fused_launch (> 0), else the whole wave on a host and on a GPU as
// many tokens as keep the shares within 128 MiB. Both at most T.
struct E3FusedWaves {
  index_t wave = 1, launch = 1;
};
E3FusedWaves e3_fused_waves(const EngineOptions& opts, const LayerShape& sh);

// Whether E3 runs its fused per-chunk backward (grad/impl/e3_fused.hpp) on a
// window of T tokens: when asked for, outside a window T̄ < T, and not on a
// range with a halo after its own tokens, whose rows must reach μ but add no
// VJP (the wave form masks them).
bool e3_fused_form(const EngineOptions& opts, index_t T, bool halo = false);

// The buffers of one AdjointExactLayer::run on sh (docs/design.md §6): h at
// chunk ends or the running h, μ and products at chunk starts, one wave's
// h^{t-1}, A and μ (or the fused form's partial sums, shares and team
// scratch), the wave's cotangents. halo: a range with a halo after its own
// tokens (the wave form, as run keeps it). Kept from one layer (and token
// block) of a pass to the next while sh stays the same.
WorkspaceSpec adjoint_exact_workspace(const EngineOptions& opts, const LayerShape& sh, bool halo = false);
// The buffers of one carry map (backward_range, block_carry_map) on sh: the
// open carry and μ and products at chunk starts, allocated per call.
WorkspaceSpec adjoint_exact_carry_map_workspace(const EngineOptions& opts, const LayerShape& sh);
// The projections of one token block of sh (backward_block, backward_window_range,
// block_carry_map recompute them from the block's input), kept through a pass.
WorkspaceSpec adjoint_exact_block_workspace(const LayerShape& sh);
// The carry a token block leaves for the block before it (ExactCarry: μ and
// A at its first token), allocated by a layer's first block and kept by the
// caller through the pass.
WorkspaceSpec adjoint_exact_carry_workspace(const LayerShape& sh);

// E3's scan part on its own, over P = act.a.extent(0) channels (a layer
// kind's scan core, e.g. over the mixer's inner width): whole window, no carry, exact or with the window T̄ of
// opts.truncate (μ_T̄; detachment is the caller's, in its dense VJPs), in the
// wave form whatever grad.e3_fused says (the fused form forms an SSM-ResNet
// block's VJPs itself). From the scan's Δ, u (act.yhat), β, γ, decay rates a
// and the cotangent gy = ∂L/∂s of its output: h at chunk ends (or the running
// h) and μ at chunk starts (exact), then per wave of W tokens h^{t-1}, A^t and
// μ of its rows, handed in order to on_wave with the wave's rows and the
// workspace's cotangents for them (Bt·W rows). Buffers:
// adjoint_exact_scan_workspace, planned into `work`.
template <class S>
using ScanWaveFn = std::function<void(const BlockRows& rows, const View3<S>& mu, const View3<S>& hprev,
                                      const View3<S>& A, const LayerCotangents<S>& cot)>;
// On a token block (a kind's block backward in the block-wise engine): h0 ([Bt·P, N], empty:
// zero) the state before the block, carry as backward_block's (in: from the
// block after, out: for the block before; no window). own_T as run()'s: the
// rows past it are a window's halo, their μ and gy zeroed, waves past it skipped.
template <class S>
void adjoint_exact_scan_waves(const EngineOptions& opts, Workspace<S>& work, const SeqShape& s,
                              const LayerActivations<S>& act, const View2<S>& gy, const ScanWaveFn<S>& on_wave,
                              const ExecSpace& exec = ExecSpace(), const View2<S>& h0 = View2<S>(),
                              ExactCarry<S>* carry = nullptr, index_t own_T = 0);
// Its buffers: adjoint_exact_workspace's in the wave form.
WorkspaceSpec adjoint_exact_scan_workspace(const EngineOptions& opts, const LayerShape& sh);

// E3's scan part in the fused form (grad/impl/e3_fused.hpp; the reverse walk
// with opts.e3_walk) on a whole window or a token block (h0 and carry as
// adjoint_exact_scan_waves'; no halo), exact mode (detachment is the
// caller's), one group of β and γ: the per-token VJPs of the scan core formed
// in the kernels, handed per wave to on_wave as the wave's rows, its cotangent
// rows (gz = ∂L/∂(the pre-softplus Δ), gyhat = ∂L/∂u through the scan with
// its D term, gbeta, ggamma; Bt·W rows) and the partial sums of the A_log, D
// and bias gradients (selective_scan_param_sums adds them). D: the scan's skip
// weights. Buffers: adjoint_exact_scan_fused_workspace, planned into `work`.
template <class S>
using ScanFusedFn =
    std::function<void(const BlockRows& rows, const LayerCotangents<S>& cot, const ParamPartials<S>& parts)>;
template <class S>
void adjoint_exact_scan_fused(const EngineOptions& opts, Workspace<S>& work, const SeqShape& s,
                              const LayerActivations<S>& act, const View2<S>& gy, const Unmanaged1<S>& D,
                              const ScanFusedFn<S>& on_wave, const ExecSpace& exec = ExecSpace(),
                              const View2<S>& h0 = View2<S>(), ExactCarry<S>* carry = nullptr);
WorkspaceSpec adjoint_exact_scan_fused_workspace(const EngineOptions& opts, const LayerShape& sh);
// Whether a kind's scan core on T tokens (a whole window or a token block) runs the fused
// form: asked for (e3_scan_fused and e3_fused), no window T̄ < T, one group
// of β and γ.
bool e3_scan_fused_form(const EngineOptions& opts, index_t T, index_t groups = 1);

template <class S>
class AdjointExactLayer final : public LayerAdjoint<S>, public BlockAdjoint<S> {
 public:
  // Throws ash::Error for a window without detach_inputs.
  explicit AdjointExactLayer(const EngineOptions& opts);
  std::string name() const override;
  bool keeps_activations() const override { return false; }
  typename LayerAdjoint<S>::Store store() const override { return LayerActivations<S>::projections_only; }
  bool detached() const override { return opts_.detach_inputs; }
  // Layer k of any kind over the whole window: the kind's E3 (K::backward_exact).
  ASH_LAYER_ADJOINT_OVERRIDES
  void release() override;
  BlockAdjoint<S>* block_adjoint() override { return this; }

  // BlockAdjoint (layer_adjoint.hpp): a token block, a token range.
  void backward_block(const LayerParams<S>& p, const SeqShape& sb, const View2<S>& y_blk, const View2<S>& g_blk,
                      const View2<S>& h0, ExactCarry<S>* carry, const LayerParams<S>& grad) override;
  void backward_range(const LayerParams<S>& p, int k, ActivationStore<S>& store, const View2<S>& g,
                      const View2<S>& h0, const typename BlockAdjoint<S>::Exchange& exchange,
                      const LayerParams<S>& grad) override;
  void backward_window_range(const LayerParams<S>& p, const SeqShape& s_ext, const View2<S>& y_ext,
                             const View2<S>& g_ext, const View2<S>& h0, index_t own_T,
                             const LayerParams<S>& grad) override;
  void block_carry_map(const LayerParams<S>& p, const SeqShape& sb, const View2<S>& y_blk, const View2<S>& g_blk,
                       const View3<S>& M, const View3<S>& v) override;
  // What a kind's E3 (grad/layer_kinds.hpp) runs on: the options, the scan
  // waves' workspace (adjoint_exact_scan_waves), the kinds' scratch kept
  // through a pass (release() frees them all).
  const EngineOptions& options() const { return opts_; }
  Workspace<S>& scan_work() { return work_; }
  KindScratches<S>& scratch() { return scratch_; }

  // Implementation, public only because nvcc refuses an extended (KOKKOS_LAMBDA)
  // lambda inside a private or protected member function.
  // μ's carry map of the piece L covers (backward_range, block_carry_map).
  void carry_map(const LayerActivations<S>& act, const SeqShape& s, const View2<S>& g, const View3<S>& M,
                 const View3<S>& v);
  // The projections of one token block, sized for sb and filled with y's.
  const LayerActivations<S>& project_block(const LayerParams<S>& p, const SeqShape& sb, const View2<S>& y);
  template <class K>
  void backward_kind(const typename K::template Params<S>& p, const ModelDims& d, int k, ActivationStore<S>& store,
                     const View2<S>& g, const typename K::template Params<S>& grad) {
    K::backward_exact(*this, p, d, k, store, g, grad);
  }
  // own_T > 0: only the first own_T tokens of each sequence contribute (the
  // rest is a halo the window reads); those waves past it are skipped.
  void run(const LayerParams<S>& p, const SeqShape& s, const View2<S>& y, const LayerActivations<S>& act,
           const View2<S>& g, const View2<S>& h0, ExactCarry<S>* carry, const LayerParams<S>& grad,
           index_t own_T = 0);

 private:
  EngineOptions opts_;
  Workspace<S> block_work_;  // projections of one token block (adjoint_exact_block_workspace)
  Workspace<S> work_;  // run()'s buffers (adjoint_exact_workspace); freed by release()
  KindScratches<S> scratch_;  // the kinds' own, kept from layer (and block) to layer of a pass
};

}  // namespace ash
