#pragma once
// E3 past memory (docs/design.md §8): the exact adjoint (or the paper's
// detached forms) over token blocks with the memory levers: 16-bit storage of
// the kept layer inputs (run.storage), layer-input checkpointing
// (grad.layer_checkpoint = m) and a carried state (data.carry_state).
// Forward block by block, keeping every m-th layer input and the state
// before each (layer, block); backward blocks last to first, segments of m
// layers recomputed from the kept states, the layer kind's block backward
// per layer (grad/layer_kinds.hpp: one pass, written once over the kind).
// With float storage the gradient is bitwise the same for every m.
//
// The same pass runs on a layer range [k0, k1) of an MPI layer pipeline
// (distributed/distributed_engine.hpp): RangeLinks hand a block's y to the
// next range and its g to the one before, so the levers compose with every
// rank layout. A range's segments start at its first layer k0 and every m-th
// after it; the first input (unless it is y_0, recomputed from the
// embedding) arrives from another rank and is kept; the per-(layer, block)
// states and carries stay on the layer's rank.
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "ash/grad/adjoint_exact.hpp"
#include "ash/kernels/blocks.hpp"
#include "ash/kernels/half_storage.hpp"

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
// The blocks of a sequence rank's range [t_a, t_b) of windows of T_all: one
// process's blocks (blockwise_block_length of T_all) cut at the range's ends, so
// that a block starts where one process's does or at the range's start; with a
// window T̄ < T_all the whole range (one process's window is one block). The
// longest is at most sequence_block_length(opts, t_b − t_a, T_all).
TokenBlocks sequence_blocks(const EngineOptions& opts, index_t T_all, index_t t_a, index_t t_b);

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
  // starts.size() and longest() without building the starts (a plan may ask for K = 2^30 layers).
  struct Counts {
    index_t starts = 0, longest = 0;
  };
  static Counts counts(int k0, int k1, int K, bool last, index_t layer_checkpoint);
  // Whether a pass keeps segment start y_c in the forward: not when it is
  // recomputed (the embedding's y_0, first: the range has the embedding) or
  // read again (the range's input y_k0 that the caller holds, input_again).
  static bool keeps(int c, int k0, bool first, bool input_again) {
    return !(c == 0 && first) && !(c == k0 && !first && input_again);
  }
};

// The shape of one block-wise pass: layers [k0, k1) of K (first: with the
// embedding, last: with the head; input_again: RangeLinks::y_in_again), Bt
// sequences of T tokens (a sequence rank's range) in token blocks of blen, P
// channels, N states, scalars of scalar_bytes.
struct BlockwiseShape {
  int k0 = 0, k1 = 0, K = 0;
  bool first = true, last = true, input_again = false;
  index_t Bt = 0, T = 0, blen = 0, P = 0, N = 0;
  std::size_t scalar_bytes = 0;
  index_t blocks() const { return (T + blen - 1) / blen; }
  LayerShape block() const { return LayerShape{Bt, blen, P, N, scalar_bytes}; }
};

// What a block-wise pass allocates besides its layer method's workspace and
// the layer kind's own buffers (its states, a block's activations, carries and
// E3 scratch: the kind's specs, grad/*_kind.hpp; docs/design.md §8), by phase.
struct BlockwiseWorkspace {
  WorkspaceSpec kept;      // the kept segment inputs (run.storage), through the pass
  WorkspaceSpec block;     // SequenceBlockwise: one block's projections (the forward's and the replay's), through the pass
  WorkspaceSpec forward;   // BlockwiseEngine: a block's y and next y. SequenceBlockwise: the range maps
  WorkspaceSpec backward;  // a segment's inputs and g of a block (SequenceBlockwise: a recomputed block's in, out)
  WorkspaceSpec range;     // SequenceBlockwise: whole-range y and next y (or g), through the pass
  WorkspaceSpec carry_maps;  // SequenceBlockwise: μ's carry maps over the range and a block, the ones
  WorkspaceSpec window;      // SequenceBlockwise with a window T̄: the range + halo of y and g, g's halo
};
BlockwiseWorkspace blockwise_workspace(const EngineOptions& opts, const BlockwiseShape& sh);
// The same for dist::SequenceBlockwise on a sequence rank's range of sh.T
// tokens of windows of T_all (a window's halo: H tokens of the next range) of
// layer kind K. With range maps (K::range_maps): μ's carry maps and the block
// projections, and [Bt·P, N] states at the range's end and for a replay as
// `ash plan` lists them (the pass sends its running state and allocates a
// replay's only where its range starts inside a block: up to two states
// fewer); without: none of these (its states, block activations and carries
// are the kind's).
template <class K>
BlockwiseWorkspace sequence_blockwise_workspace(const EngineOptions& opts, const BlockwiseShape& sh, index_t T_all,
                                                index_t H);

// The kept inputs of a block-wise pass over sh's layer range with segments
// seg, in the storage format, as ws.kept says: [k - k0], k in [k0, K] (empty:
// not kept). Checks that LayerSegments::counts (the workspace's) agrees with seg.
template <class S>
std::vector<StoredRows<S>> make_kept_inputs(const EngineOptions& opts, const BlockwiseShape& sh,
                                            const LayerSegments& seg, const BlockwiseWorkspace& ws);

// What one block-wise pass over a layer range holds besides its kind's states,
// set up alike by BlockwiseEngine::compute_range and dist::SequenceBlockwise::compute.
template <class S>
struct BlockwisePass {
  int k0 = 0, k1 = 0, K = 0;
  bool first = true, last = true;  // the range starts with the embedding (its layer 0), ends with the head
  bool input_again = false;        // the range's input y_{k0} comes again from the caller in the backward
  index_t Bt = 0, T = 0, targets = 0, P = 0, N = 0;
  DocStarts docs;  // of the pass's tokens
  LayerSegments seg;
  std::vector<StoredRows<S>> kept;  // [k - k0], k in [k0, K]: the kept inputs (empty: none, or y_0)
  BlockwiseWorkspace ws;            // what start() allocated the kept inputs from; the phases' buffers

  // For params' layer range over x ([Bt, T]: the pass's tokens) in blocks of
  // at most blen tokens: checks the carried `state` (or null: one per layer of
  // the range, check_carried_state's shape), allocates the kept inputs that
  // `spec` (blockwise_workspace or sequence_blockwise_workspace of this pass)
  // describes and zeroes grad.
  void start(const ParamSet<S>& params, const TokenView& x, index_t targets_, index_t blen, const EngineOptions& opts,
             const std::vector<View2<S>>* state, bool input_again_,
             const std::function<BlockwiseWorkspace(const BlockwiseShape&)>& spec, const ParamSet<S>& grad);
  bool keeps(int c) const { return LayerSegments::keeps(c, k0, first, input_again); }
  StoredRows<S>& kept_input(int k) { return kept[std::size_t(k - k0)]; }
  BlockwiseShape shape(index_t blen) const {
    return BlockwiseShape{k0, k1, K, first, last, input_again, Bt, T, blen, P, N, sizeof(S)};
  }
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
  EngineOptions opts_;
  AdjointExactLayer<S> layer_;
  std::vector<View2<S>>* state_ = nullptr;
};

}  // namespace ash
