#pragma once
// What a layer kind supplies to the engines (docs/design.md, "Layer kinds"),
// and the small types its members take. A kind is a struct of types and
// static members, one per architecture (ssm_resnet_kind.hpp is the reference;
// layer_kinds.hpp lists them):
//   name, Params<S>, layer(ParamSet, k)          its parameter views
//   State<S>, BlockStates<S>, make_state, copy,  its recurrent state over a batch,
//   from_carried, to_carried                     and data.carry_state's view of it
//   BlockActs<S>, make_block_acts, forward_block one token block's forward from a state
//   Carry<S>, make_carry, backward_block         E3 on a token block, carry to the block before
//   scan_shape, window_cotangents, backward_window   E1/E2: the VJPs around the method's μ
//   backward_exact                               E3 on a whole window
//   Scratch<S>                                   what the kind keeps from layer to layer of a pass
// and for sequence ranks (dist::SequenceBlockwise; Carry<S>::mu is an ExactCarry):
//   for_each_view                                the state's views, sent range to range
//   range_maps                                   true: block_carry_map (the ranges scan μ's carry
//                                                maps at once); false: make_range_carry and
//                                                for_each_carry_view (a reverse wavefront)
//   replays_cut_block                            a range cut inside a block always takes one
//                                                process's replay there (false: only 16-bit storage)
//   for_each_window_carry_view, backward_window_range   the window T̄ on a range + halo
// The engines are written once over a kind K and instantiated per kind.
#include <functional>

#include "ash/core/types.hpp"
#include "ash/model/ssm_layer.hpp"

namespace ash {

template <class S>
class AdjointExactLayer;

// What E3's reverse pass over token blocks (the block-wise engine, the MPI
// pipeline's reverse wavefront, sequence ranks) carries from one block into
// the one before it: μ and A at the first token of the later block, per
// (sequence, channel, state), [Bt, P, N] (P: the scan's channels).
template <class S>
struct ExactCarry {
  View3<S> mu, A;
  bool valid = false;  // false: the later block does not exist (end of the window)
};

// A whole-window method's μ (E1: the reverse scan of the kept h and A; E2: the
// paper's window sums) of a kind's scan core: from the scan's activations and
// the cotangent gy of its output, into the method's μ [rows, P, N].
template <class S>
using FormMu = std::function<void(const LayerActivations<S>& scan, const View2<S>& gy)>;

}  // namespace ash
