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
//
// The same pass runs on a layer range [k0, k1) of an MPI layer pipeline
// (distributed/distributed_engine.hpp): RangeLinks hand a block's y to the
// next range and its g to the one before, so the levers compose with every
// rank layout. A range's segments start at its first layer k0 and every m-th
// after it; the first input (unless it is y_0, recomputed from the
// embedding) arrives from another rank and is kept.
#include <functional>
#include <string>
#include <vector>

#include "ash/grad/adjoint_exact.hpp"
#include "ash/kernels/half_storage.hpp"
#include "ash/model/blockwise_forward.hpp"

namespace ash {

// Tokens per block for a window of T tokens: opts.token_block (0: 4096),
// rounded up to whole E3 chunks; the whole window with a window T̄.
index_t blockwise_block_length(const EngineOptions& opts, index_t T);
// The same over R layer ranks (the MPI pipeline): grad.token_block when set,
// else `blocks` blocks per window, else (blocks = 0) the one-process length
// when a memory lever is set and 4 blocks per layer rank when none is; whole
// chunks each.
index_t pipeline_block_length(const EngineOptions& opts, index_t T, index_t R, index_t blocks);
// The same on a sequence rank's range of T tokens of windows of T_all
// (dist::SequenceBlockwise): the whole range with a window T̄ < T_all (its
// backward reads a halo past the range), else one process's length without a window.
index_t sequence_block_length(const EngineOptions& opts, index_t T, index_t T_all);

// "adjoint-exact (..., bf16 storage, layer checkpoint m[, carried state])": a
// method's name with the levers of opts.
std::string blockwise_name(std::string method, const EngineOptions& opts);

// The checkpointed segments of a layer range [k0, k1) of K layers
// (grad.layer_checkpoint = m, at most K + 1): segment starts k0, k0 + m, ...
// up to top(), the highest layer input the range holds (y_K, the head's
// input, on the range with the head). A segment's inputs run from its start
// to the next start - 1 (to top() for the last).
struct LayerSegments {
  int k0 = 0, k1 = 0, K = 0;
  bool last = true;  // the range has the head
  std::vector<int> starts;
  LayerSegments() = default;
  LayerSegments(int k0_, int k1_, int K_, bool last_, index_t layer_checkpoint);
  int top() const { return last ? K : k1 - 1; }
  int end_of(std::size_t i) const { return i + 1 < starts.size() ? starts[i + 1] - 1 : top(); }
  int longest() const;  // inputs of the longest segment
};

// How a layer range meets the ranges before and after it, one token block j
// at a time ([Bt·Tj, P] block rows). Empty functions: the range has the
// embedding (no y_in / g_out) or the head (no y_out / g_in).
template <class S>
struct RangeLinks {
  std::function<void(index_t j, const View2<S>& y)> y_in, y_out;  // forward: receive y_{k0}, send y_{k1}
  std::function<void(index_t j, const View2<S>& g)> g_in, g_out;  // backward: receive g_{k1}, send g_{k0}
  std::function<void()> before_backward;                           // a test seam: between the two passes
  // True when y_in may be called again for the same block in the backward
  // (the caller holds the range's input: a stack of layers alone,
  // grad/stack_adjoint.hpp); false (a pipeline receiving from a rank): the
  // range keeps its input in the storage format.
  bool y_in_again = false;
};

template <class S>
class BlockwiseEngine final : public GradientEngine<S> {
 public:
  // Throws ash::Error unless opts.method is adjoint-exact.
  explicit BlockwiseEngine(const EngineOptions& opts);
  std::string name() const override;
  double compute(const ParamSet<S>& params, const TokenView& x, const ParamSet<S>& grad) override;
  void set_carried_state(std::vector<View2<S>>* state) override { state_ = state; }

  // The pass on params' layer range (a shard of the model): x the windows of
  // this replica, `targets` the whole batch's target count (the loss is their
  // mean), blocks the token blocks, state (when not null) the carried state
  // of layer k at index k - k0. Returns the head's share of the loss (0
  // without the head). grad is zeroed first.
  double compute_range(const ParamSet<S>& params, const TokenView& x, index_t targets, const TokenBlocks& blocks,
                       const RangeLinks<S>& links, const std::vector<View2<S>>* state, const ParamSet<S>& grad);

  index_t block_length(index_t T) const { return blockwise_block_length(opts_, T); }
  const ExecSpace& execution_space() const { return layer_.execution_space(); }

 private:
  struct Range;  // one compute_range(): the range, its segments and kept inputs
  void forward(const ParamSet<S>& params, const TokenView& x, Range& r);
  double backward(const ParamSet<S>& params, const TokenView& x, Range& r, const ParamSet<S>& grad);
  EngineOptions opts_;
  AdjointExactLayer<S> layer_;
  std::vector<View2<S>>* state_ = nullptr;
};

// The former name.
template <class S>
using LowMemoryEngine = BlockwiseEngine<S>;

}  // namespace ash
