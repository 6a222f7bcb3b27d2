#pragma once
// The block-wise forward (docs/design.md §8): layers [k0, k1) over token
// blocks [t0, t0+Tj) of every sequence, each layer's state h carried from one
// block to the next. With kept block states, the state before every
// (layer, block) is kept, so any block of any layer can be run again alone
// and gives the forward's values bit for bit (the block-wise E3 backward, the
// pipeline's reverse wavefront). The one block-wise forward of the local
// block-wise engine (grad/blockwise_engine.hpp) and the MPI pipeline.
#include <vector>

#include "ash/kernels/blocks.hpp"
#include "ash/model/ssm_layer.hpp"

namespace ash {

template <class S>
class BlockwiseForward {
 public:
  // Windows of Bt sequences in `blocks`; keep_block_states: keep h before
  // every (layer, block) (else only each layer's running state).
  BlockwiseForward(const ModelDims& d, int k0, int k1, index_t Bt, const TokenBlocks& blocks, bool keep_block_states);
  const TokenBlocks& blocks() const { return blocks_; }
  // The windows' tokens ([Bt, T]), for their document starts (default: none).
  void set_documents(const TokenView& x) { docs_ = DocStarts(x); }
  // Block j of every sequence: Bt sequences of blocks().size(j) tokens.
  SeqShape shape(index_t j) const { return SeqShape{Bt_, blocks_.size(j), docs_.from(blocks_.start(j))}; }
  index_t rows(index_t j) const { return Bt_ * blocks_.size(j); }

  // Layer k starts its first block from h0 ([Bt·P, N], copied) instead of zero.
  void start_from(int k, const View2<S>& h0, const ExecSpace& exec = ExecSpace());
  // Layer k on block j, blocks in order: y -> yo ([Bt·Tj, P] block rows;
  // act: projection scratch for them). Returns the layer's state after the
  // block (valid until the next call).
  View2<S> advance(const LayerParams<S>& p, int k, index_t j, const View2<S>& y, const LayerActivations<S>& act,
                   const View2<S>& yo, const ExecSpace& exec = ExecSpace());
  // Layer k on block j again, from the kept state before it (kept block states
  // only) or from `from` when given ([Bt·P, N]). Returns the state after the
  // block (valid until the next call).
  View2<S> replay(const LayerParams<S>& p, int k, index_t j, const View2<S>& y, const LayerActivations<S>& act,
                  const View2<S>& yo, const ExecSpace& exec = ExecSpace(), const View2<S>& from = View2<S>()) const;
  // h before block j of layer k (kept block states only).
  View2<S> state_before(int k, index_t j) const;

 private:
  int k0_;
  index_t Bt_;
  TokenBlocks blocks_;
  bool keep_;
  DocStarts docs_;
  std::vector<View3<S>> h_start_;  // keep: [nb, Bt·P, N] per layer; else: [1, Bt·P, N], the running state
  View2<S> h_run_;                 // keep: the state a layer's scan advances
};

}  // namespace ash
