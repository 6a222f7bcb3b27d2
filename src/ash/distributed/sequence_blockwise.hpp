#pragma once
// E3 with the memory levers on sequence ranks (docs/design.md §2 E4, §8):
// each rank holds one token range of every window, cut into token blocks.
// The state before a range is where the range before it ended, so the pass
// runs layer by layer over the range:
//  forward   layer k starts from the end state of layer k on the previous
//            range (a wavefront over the sequence ranks: the bits one process
//            carries, so a range stores exactly one process's values, §2) and
//            runs the one block-wise forward, keeping the state before every
//            (layer, block) and every m-th layer input in the storage format
//            (run.storage).
//  backward  layers top down: y_k recomputed block by block from its
//            segment's kept input and the kept states (a range that starts
//            inside one of one process's blocks replays its first block from
//            the state the range before it reaches there, as one process
//            replays that block from its start); μ's carry map over the
//            range composed from the blocks' (last first) and scanned over the
//            ranks in reverse; then E3's backward_block per block, last first.
//            With a window T̄ (paper mode) the range is one block and each
//            layer's backward reads a halo of T̄ − 1 tokens of y_k and g from
//            the next range instead (window_halo.hpp), as without levers.
// A range's blocks are one process's blocks cut at the range's ends
// (sequence_blocks), so it keeps the states one process keeps and replays
// what one process replays: 16-bit storage rounds the same values (issue 35).
// The pass is written once over the layer kind K (grad/layer_kinds.hpp; each
// kind's file says what its members are), with a K::State for h: forward, the
// state before the range is what the range before ended the layer with (all
// of K::for_each_view's views); every block runs from the state kept before
// it. Backward, a kind with range maps (K::range_maps) scans μ's carry maps as
// above; one without runs per layer a reverse wavefront: every view of the
// carry (K::for_each_carry_view, e.g. μ's carry and ∂L/∂ a conv state the next
// range read) arrives from the next range, E3's block backward runs per block,
// last first, and this range's first block hands the carry on. A kind whose
// replay from a kept state gives the forward's bits (!K::replays_cut_block)
// replays a cut block only with 16-bit storage. Without a lever (only a kind
// without range maps runs here then) the range is one block. A carried state
// (data.carry_state) starts the first range's block 0 and is every range's end
// state after. With a window T̄ the range is one block: per layer the halo of
// T̄ − 1 tokens of y_k and g from the next range as above, the views of
// K::for_each_window_carry_view from the next range (no μ carry: μ_T̄ reads
// the halo), the kind's window backward over the range + halo from the state
// before it (K::backward_window_range), those views on to the range before.
// Whole-range buffers: y and the next y (forward), y_k and g (backward), in
// block-major row order (block j's Bt·Tj rows contiguous, so a block is a
// subview). Layer ranks exchange whole ranges (R × S).
#include <functional>
#include <vector>

#include "ash/distributed/layout.hpp"
#include "ash/grad/adjoint_exact.hpp"
#include "ash/grad/blockwise_engine.hpp"
#include "ash/kernels/half_storage.hpp"

namespace ash::dist {

template <class S>
class SequenceBlockwise {
 public:
  // opts: adjoint-exact; a memory lever unless the model's kind has no range
  // maps (K::range_maps); grid.layout().S > 1.
  SequenceBlockwise(const Grid& grid, const EngineOptions& opts);
  std::string name() const { return blockwise_name(layer_.name(), opts_); }
  // This rank's range of windows of T_all tokens in blocks: one process's blocks
  // cut at the range's ends (sequence_blocks); without a lever the whole range
  // (one process runs its whole window at once).
  TokenBlocks range_blocks(index_t T_all) const;
  // x_rows: this replica's windows [Bt, T_all]; targets: the whole batch's
  // target count; carried (or null): this rank's layers' states of these
  // windows (read on the first range, written on every rank from the last).
  // Returns the head's share of L (0 off the last layer rank); grad zeroed first.
  // timed(fn) runs an MPI call fn (the engine counts the time). The pass is
  // params' layer kind's (with_layer_kind).
  double compute(const ParamSet<S>& params, const TokenView& x_rows, index_t targets,
                 const std::vector<View2<S>>* carried, const ParamSet<S>& grad,
                 const std::function<void(const std::function<void()>&)>& timed,
                 const std::function<void()>& before_backward);

 private:
  bool window(index_t T_all) const { return opts_.truncate > 0 && opts_.truncate < T_all; }
  EngineOptions whole_opts() const {
    EngineOptions o = opts_;
    o.truncate = 0;
    return o;
  }
  const Grid& grid_;
  EngineOptions opts_;
  AdjointExactLayer<S> layer_;  // the options' method (a window's backward)
  AdjointExactLayer<S> whole_;  // without a window: the carry maps and blocks of the exact or detached pass
};

}  // namespace ash::dist
