#pragma once
// E4: the gradient engines over MPI (docs/design.md §2, E4; the paper's §4.4,
// Alg. 1 and 4). Each rank holds only its layers' parameters, activations and
// gradients (a LayerRange of the model); replicas share the batch's windows.
//
//  E3        (S = 1) each rank runs the block-wise pass of one process
//            (grad/blockwise_engine.hpp) on its layers: token blocks of y flow
//            rank to rank forward, the last rank's head makes g per block in
//            the backward, and g blocks flow back from the last block to the
//            first (μ carries from later to earlier tokens, so this reverse
//            wavefront is exact; in paper mode g passes through unchanged).
//            Every layer's state is kept at block starts; the memory levers
//            apply per rank.
//  E1, E2    whole windows: y flows rank to rank, the last rank's head makes
//            g; paper mode (E2, E1 --detach-inputs) broadcasts g and every
//            rank differentiates its layers at once; E1 exact hands g back once.
//  sequence  (context parallelism, E3 only) each rank holds one token range of
//            every window; per layer, the state before the range comes from an
//            exclusive scan of the ranges' affine state maps, and μ's carry
//            from the later ranges from the same scan in reverse: O(Bt·P·N)
//            bytes per layer and rank, whatever T is. With a memory lever the
//            range runs in token blocks, layer by layer
//            (distributed/sequence_blockwise.hpp).
//  replicas  the gradient is summed over the ranks that own the same layers
//            (data and sequence); the loss and g are already scaled by the
//            whole batch's target count.
//  kinds     every engine is written over the layer kind (grad/layer_kinds.hpp),
//            chosen once from the model. E3 with S = 1 runs the block-wise pass
//            on each rank's layer range (a state kept before every (layer,
//            block); a kind's block carries stay within a layer, so only y and g
//            blocks cross ranks). Sequence ranks without a lever take the
//            affine-map scans above where the kind has range maps
//            (K::range_maps); a kind without them always runs
//            SequenceBlockwise (without a lever one block per range): its state
//            passes to the next range forward, its carry back. A tied head
//            (ModelDims::tied_head) with R > 1: the first and last layer ranks
//            each hold the embedding and exchange their gradient parts, so both
//            hold the sum. A carried state (data.carry_state): this rank's
//            layers' rows of its windows (d.carry_rows() per window).
#include <chrono>
#include <functional>
#include <memory>
#include <vector>

#include "ash/distributed/layout.hpp"
#include "ash/distributed/pipeline_stats.hpp"
#include "ash/distributed/sequence_blockwise.hpp"
#include "ash/grad/blockwise_engine.hpp"
#include "ash/grad/engine.hpp"
#include "ash/kernels/blocks.hpp"

namespace ash::dist {


template <class S>
class DistributedEngine final : public GradientEngine<S> {
 public:
  // d: the model, whose layer kind picks the pass on sequence ranks.
  // pipeline_blocks: token blocks per window for E3 (0: 4 per layer rank).
  DistributedEngine(const Grid& grid, const EngineOptions& opts, const ModelDims& d, index_t pipeline_blocks = 0);
  std::string name() const override;
  // params and grad are this rank's shard (LayerRange grid.range(dims)); x is
  // the whole batch, the same on every rank. Returns L on every rank.
  double compute(const ParamSet<S>& params, const TokenView& x, const ParamSet<S>& grad) override;
  // Forward only: L on every rank (validation).
  double loss(const ParamSet<S>& params, const TokenView& x);
  const PipelineStats& stats() const { return stats_; }
  // data.carry_state: one state per layer of the whole model and batch
  // (check_carried_state's shape: [B·carry_rows(), carry_cols()]); this rank
  // reads and writes its layers' rows of its windows.
  void set_carried_state(std::vector<View2<S>>* state) override;
  // A test seam: fn runs on every rank between the head and the backward of
  // compute() (the CLI's fault injection for "a failing rank ends every rank").
  void set_before_backward(std::function<void()> fn) { before_backward_ = std::move(fn); }

 private:
  struct Pass;  // one compute(): this rank's tokens, store, g and block states
  TokenView my_windows(const TokenView& x) const;
  std::pair<index_t, index_t> my_window_range(index_t B) const;  // this replica's windows [b0, b1)
  // E3 with S = 1: the block-wise pass (and its memory levers) on this rank's
  // layer range, y and g blocks handed between the layer ranks.
  double compute_blockwise(const ParamSet<S>& params, const TokenView& x_all, const ParamSet<S>& grad);
  // E3 with S > 1 and a memory lever (a kind without range maps: always): each range in token blocks, layer by layer.
  double compute_sequence_blockwise(const ParamSet<S>& params, const TokenView& x_all, const ParamSet<S>& grad);
  // data.carry_state: this rank's layers' states of this replica's windows.
  std::vector<View2<S>> my_carried_rows(const ParamSet<S>& params, index_t B) const;
  // Without levers: the forward pipeline, the head, one backward mode.
  double compute_pipeline(const ParamSet<S>& params, const TokenView& x_all, const ParamSet<S>& grad);
  // Layers [k0, k1) on this rank's token range, store.input(k0) filled: with
  // sequence ranks, each layer's state before the range comes from an
  // exclusive scan of the ranges' state maps (kept in h_start for the backward;
  // a kind with range maps), else from the range before (pass_states).
  void forward_range(const ParamSet<S>& params, ActivationStore<S>& store, std::vector<View2<S>>& h_start);
  // A kind K without range maps on sequence ranks (the forward-only loss): each
  // layer's state passed range to range.
  template <class K>
  void pass_states(const ParamSet<S>& params, ActivationStore<S>& store);
  // The forward over the layer ranks: whole ranges, or token blocks in a pipeline.
  void forward(const ParamSet<S>& params, Pass& ps);
  // The backward modes of docs/design.md §2 (E4).
  void backward_ranges(const ParamSet<S>& params, Pass& ps, const ParamSet<S>& grad);     // sequence ranks (E3)
  void backward_window_ranges(const ParamSet<S>& params, Pass& ps, const ParamSet<S>& grad);  // ... with a window T̄
  void backward_detached(const ParamSet<S>& params, Pass& ps, const ParamSet<S>& grad);   // paper mode
  void backward_whole(const ParamSet<S>& params, Pass& ps, const ParamSet<S>& grad);      // g_k handed over once
  void layers_backward(const ParamSet<S>& params, Pass& ps, const ParamSet<S>& grad);     // the layer method, top down
  // Replica sums of the gradient and loss, the loss on every rank, stats.
  double finish(double loss, const ParamSet<S>& grad);
  // A tied head on R > 1: the first rank's embedding part plus the last
  // rank's head part, on both (a + b on one, b + a on the other: bitwise equal).
  void sum_tied_embedding(const ParamSet<S>& grad);
  template <class Fn>
  void timed(Fn&& fn) {  // time spent in MPI, for the busy fraction
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    comm_s_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }

  const Grid& grid_;
  EngineOptions opts_;
  index_t pipeline_blocks_;
  Arch arch_;  // the model's, whose layer kind chose the passes below
  std::unique_ptr<LayerAdjoint<S>> layer_;
  BlockAdjoint<S>* blockwise_ = nullptr;  // layer_'s block and range forms (E3), else nullptr
  std::unique_ptr<LayerAdjoint<S>> untruncated_;  // sequence ranks, T̄ >= T: the same method without a window
  std::unique_ptr<BlockwiseEngine<S>> block_pass_;  // E3 with S = 1: the block-wise pass (levers or not), else nullptr
  std::unique_ptr<SequenceBlockwise<S>> seq_pass_;  // E3 with S > 1 and a lever (no range maps: any), else nullptr
  std::vector<View2<S>>* carried_ = nullptr;
  std::function<void()> before_backward_;
  PipelineStats stats_;
  double comm_s_ = 0;  // time inside MPI calls during compute()
};

}  // namespace ash::dist
