#pragma once
// E3 past memory (docs/design.md §8): the exact adjoint (or the paper's
// detached forms) over token blocks, with
//   - 16-bit storage of the kept layer inputs (run.storage = bf16 | fp16;
//     computed and accumulated in the compute type),
//   - layer-input checkpointing (grad.layer_checkpoint = m: y_k kept for
//     k = m, 2m, ... <= K; the others recomputed block by block),
//   - a carried state (data.carry_state: h before the window's first token).
//
// Forward, block by block (tokens [t0, t0+Tj) of every sequence): the
// embedding, then every layer with its state carried from the previous
// block; the state before each (layer, block) is kept ([Bt·P, N] each), and
// so are the kept layer inputs. Nothing else of the window is kept: no g, no
// projections, no y_K.
// Backward, blocks from the last to the first, and in each block the
// segments of m layers from the top: the segment's first input from storage
// (y_0 from the embedding), the others by re-running its layers on the block
// from the kept states (bitwise the forward's values), the head on y_K's
// rows (loss and g of the block), then AdjointExactLayer::backward_block for
// each layer, top down, carrying μ and A into the block before.
//
// Memory: Σ_kept Bt·T·P·bytes(storage) + K·nb·Bt·P·N states + O((m + 3)·Bt·blk·P)
// per block; with float storage the gradient is bitwise the same for every m.
#include <vector>

#include "ash/grad/adjoint_exact.hpp"

namespace ash {

// Tokens per block for a window of T tokens: opts.token_block (0: 4096),
// rounded up to whole E3 chunks; the whole window with a window T̄.
index_t low_memory_block_length(const EngineOptions& opts, index_t T);

template <class S>
class LowMemoryEngine final : public GradientEngine<S> {
 public:
  // Throws ash::Error unless opts.method is adjoint-exact.
  explicit LowMemoryEngine(const EngineOptions& opts);
  std::string name() const override;
  double compute(const ParamSet<S>& params, const TokenView& x, const ParamSet<S>& grad) override;
  void set_carried_state(std::vector<View2<S>>* state) override { state_ = state; }

  index_t block_length(index_t T) const { return low_memory_block_length(opts_, T); }

 private:
  EngineOptions opts_;
  AdjointExactLayer<S> layer_;
  std::vector<View2<S>>* state_ = nullptr;
};

}  // namespace ash
