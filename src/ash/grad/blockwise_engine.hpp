#pragma once
// E3 past memory (docs/design.md §8): the exact adjoint (or the paper's
// detached forms) over token blocks with the memory levers: 16-bit storage of
// the kept layer inputs (run.storage), layer-input checkpointing
// (grad.layer_checkpoint = m) and a carried state (data.carry_state).
// Forward block by block through the one block-wise forward
// (model/blockwise_forward.hpp), keeping every m-th layer input and the state
// before each (layer, block); backward blocks last to first, segments of m
// layers recomputed from the kept states, E3's backward_block per layer.
// With float storage the gradient is bitwise the same for every m.
#include <vector>

#include "ash/grad/adjoint_exact.hpp"
#include "ash/kernels/half_storage.hpp"
#include "ash/model/blockwise_forward.hpp"

namespace ash {

// Tokens per block for a window of T tokens: opts.token_block (0: 4096),
// rounded up to whole E3 chunks; the whole window with a window T̄.
index_t blockwise_block_length(const EngineOptions& opts, index_t T);

template <class S>
class BlockwiseEngine final : public GradientEngine<S> {
 public:
  // Throws ash::Error unless opts.method is adjoint-exact.
  explicit BlockwiseEngine(const EngineOptions& opts);
  std::string name() const override;
  double compute(const ParamSet<S>& params, const TokenView& x, const ParamSet<S>& grad) override;
  void set_carried_state(std::vector<View2<S>>* state) override { state_ = state; }

  index_t block_length(index_t T) const { return blockwise_block_length(opts_, T); }

 private:
  // m, the layers per checkpointed segment: grad.layer_checkpoint, at most
  // K + 1 (any larger m keeps no input but y_0 alike; layer indices stay 32-bit).
  index_t segment_length(int K) const {
    return opts_.layer_checkpoint < index_t(K) + 1 ? opts_.layer_checkpoint : index_t(K) + 1;
  }
  void forward(const ParamSet<S>& params, const TokenView& x, BlockwiseForward<S>& fw,
               const std::vector<StoredRows<S>>& kept, const LayerActivations<S>& act);
  double backward(const ParamSet<S>& params, const TokenView& x, const BlockwiseForward<S>& fw,
                  const std::vector<StoredRows<S>>& kept, const LayerActivations<S>& act, const ParamSet<S>& grad);
  EngineOptions opts_;
  AdjointExactLayer<S> layer_;
  std::vector<View2<S>>* state_ = nullptr;
};

// The former name.
template <class S>
using LowMemoryEngine = BlockwiseEngine<S>;

}  // namespace ash
