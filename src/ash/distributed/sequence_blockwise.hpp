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
// A Mamba (model.arch = mamba; levers or not: without one, the range is one
// block) runs the same per-layer steps with a MambaState for h: forward, the
// state before the range is the conv's last Kc − 1 inputs before it (the
// halo; from a range shorter than that, partly older ranges') and h, received
// from the range before; every block runs from the state kept before it
// (with 16-bit storage a cut block is replayed as above, from the MambaState
// one process's replay reaches). Backward, per layer a reverse wavefront: ∂L/∂ the conv
// state the next range read (the halo's scatter onto this range's inputs) and
// μ's carry (μ, A at its first token) arrive from it, E3's
// block backward runs per block, last first, and this range's first
// block hands both on. A carried state (data.carry_state) starts the first
// range's block 0 and is every range's end state after, as an SSM-ResNet's h.
// With a window T̄ the range is one block: per layer the
// halo of T̄ − 1 tokens of y_k and g from the next range as above, ∂L/∂ the
// conv state from the next range (no μ carry: μ_T̄ reads the halo), E3's
// window backward over the range + halo from the state before it, and the
// conv's scatter on to the range before.
// Whole-range buffers: y and the next y (forward), y_k and g (backward), in
// block-major row order (block j's Bt·Tj rows contiguous, so a block is a
// subview). Layer ranks exchange whole ranges (R × S).
#include <functional>
#include <vector>

#include "ash/distributed/layout.hpp"
#include "ash/grad/adjoint_exact.hpp"
#include "ash/grad/blockwise_engine.hpp"
#include "ash/kernels/half_storage.hpp"
#include "ash/model/blockwise_forward.hpp"

namespace ash::dist {

template <class S>
class SequenceBlockwise {
 public:
  // opts: adjoint-exact with a memory lever (a Mamba: with or without);
  // grid.layout().S > 1. mamba: the model is a Mamba (model.arch = mamba).
  SequenceBlockwise(const Grid& grid, const EngineOptions& opts, bool mamba = false);
  std::string name() const { return blockwise_name(layer_.name(), opts_); }
  // This rank's range of windows of T_all tokens in blocks: one process's blocks
  // cut at the range's ends (sequence_blocks); a Mamba without a lever: the
  // whole range (one process runs its whole window at once).
  TokenBlocks range_blocks(index_t T_all) const;
  // x_rows: this replica's windows [Bt, T_all]; targets: the whole batch's
  // target count; carried (or null): this rank's layers' states of these
  // windows (read on the first range, written on every rank from the last).
  // Returns the head's share of L (0 off the last layer rank); grad zeroed first.
  // timed(fn) runs an MPI call fn (the engine counts the time).
  double compute(const ParamSet<S>& params, const TokenView& x_rows, index_t targets,
                 const std::vector<View2<S>>* carried, const ParamSet<S>& grad,
                 const std::function<void(const std::function<void()>&)>& timed,
                 const std::function<void()>& before_backward);

 private:
  struct Pass;  // one compute(): the range, its blocks, segments and buffers
  void forward(const ParamSet<S>& params, Pass& ps);
  double head(const ParamSet<S>& params, Pass& ps, const ParamSet<S>& grad);
  void backward(const ParamSet<S>& params, Pass& ps, const ParamSet<S>& grad);
  // The layers' backward: with μ carried over the ranges (exact, detached), or a window's halos.
  void layers_carried(const ParamSet<S>& params, Pass& ps, const View2<S>& g, const ParamSet<S>& grad);
  void layers_window(const ParamSet<S>& params, Pass& ps, const View2<S>& g, const ParamSet<S>& grad);
  // A Mamba: the conv's cotangent and μ's carry handed range to range, layer by layer.
  void layers_mamba(const ParamSet<S>& params, Pass& ps, const View2<S>& g, const ParamSet<S>& grad);
  // A Mamba's layer k in a window: gconv in from the next range, E3's window
  // backward over the range + halo (s_ext, y_ext, g_ext), gconv on to the range before.
  void window_mamba(const ParamSet<S>& params, Pass& ps, int k, const SeqShape& s_ext, const View2<S>& y_ext,
                    const View2<S>& g_ext, const View2<S>& gconv, const ParamSet<S>& grad);
  // A Mamba's layer k over the range (the state from the range before, to the next).
  void forward_mamba(const ParamSet<S>& params, Pass& ps, int k);
  // A Mamba's layer k on block j from the MambaState kept before the block (or
  // `from`: a replay's); ps.run holds the state after it.
  void advance_mamba(const ParamSet<S>& params, Pass& ps, int k, index_t j, const View2<S>& y, const View2<S>& yo,
                     const MambaState<S>* from = nullptr);
  void send_state(const MambaState<S>& st, int to, int tag) const;
  void recv_state(const MambaState<S>& st, int from, int tag) const;
  // y_k of every block into ps.y from its segment's start c.
  void recompute(const ParamSet<S>& params, Pass& ps, int c, int k);
  // h of layer k before the range as one process's backward has it (its replay
  // from the block start before the range, received), or the kept state.
  View2<S> replayed_start(const ParamSet<S>& params, Pass& ps, int k);
  // The same for a Mamba: the MambaState before the range's first block.
  MambaState<S> replayed_mamba_start(const ParamSet<S>& params, Pass& ps, int k);
  bool window(index_t T_all) const { return opts_.truncate > 0 && opts_.truncate < T_all; }
  EngineOptions whole_opts() const {
    EngineOptions o = opts_;
    o.truncate = 0;
    return o;
  }
  const Grid& grid_;
  EngineOptions opts_;
  bool mamba_;
  AdjointExactLayer<S> layer_;  // the options' method (a window's backward)
  AdjointExactLayer<S> whole_;  // without a window: the carry maps and blocks of the exact or detached pass
};

}  // namespace ash::dist
