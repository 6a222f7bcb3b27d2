#pragma once
// What a layer kind supplies to the engines (docs/design.md, "Layer kinds"),
// and the small types its members take. A kind is a struct of types and
// static members, one per architecture (ssm_resnet_kind.hpp is the reference;
// layer_kinds.hpp lists them):
//   name, Params<S>, layer(ParamSet, k)          its parameter views
//   for_each_tensor                              each view with its name and extents (checks, copies)
//   State<S>, BlockStates<S>, make_state, copy,  its recurrent state over a batch,
//   from_carried, to_carried                     and data.carry_state's view of it
//   BlockActs<S>, make_block_acts, forward_block one token block's forward from a state
//   forward_window                               a whole window's forward from a zero state
//   Carry<S>, make_carry, backward_block         E3 on a token block, carry to the block before
//   scan_shape, window_cotangents, backward_window   E1/E2: the VJPs around the method's μ
//   backward_exact                               E3 on a whole window
//   Scratch<S>                                   what the kind keeps from layer to layer of a pass
//   stack_whole_window, stack_input_again        how a layer stack alone runs E3 (grad/stack_adjoint.hpp)
// and for sequence ranks (dist::SequenceBlockwise; with range maps Carry<S>::mu is an ExactCarry):
//   for_each_view                                the state's views, sent range to range
//   range_maps                                   true: block_carry_map (the ranges scan μ's carry
//                                                maps at once); false: make_range_carry,
//                                                for_each_carry_view and carry_arrived (a reverse
//                                                wavefront)
//   replays_cut_block                            a range cut inside a block always takes one
//                                                process's replay there (false: only 16-bit storage)
//   for_each_window_carry_view, backward_window_range   the window T̄ on a range + halo
// and, in a section of its own, the WorkspaceSpecs of what it allocates (its
// state, block states, activations, carries, cotangents and E3's scratch) with
// the rows and PlanStyle the memory planner (plan/memory_plan.cpp) sums.
// The engines are written once over a kind K and instantiated per kind.
#include <functional>
#include <string>
#include <vector>

#include "ash/core/options.hpp"
#include "ash/core/types.hpp"
#include "ash/grad/workspace.hpp"
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

// One row of a memory plan: a label and the buffers it counts (a kind's spec).
struct PlanRow {
  std::string label;
  WorkspaceSpec spec;
  // E3 scratch a one-block pass allocates only after the head: the planner
  // counts the larger of the two (unless the kind's style gives the head a phase).
  bool weighed = false;
};
using PlanRows = std::vector<PlanRow>;

// How `ash plan` words and groups a kind's rows, as each kind's plans read.
struct PlanStyle {
  const char* unit;        // a whole window's: "backward of the top <unit>", "<unit> projections (one <unit>)"
  bool names_kind;         // engine names add E3's options (detached, T-bar) and "(model.arch=<name>)"
  const char* states;      // block-wise: the states at block starts
  bool states_hold_run;    // the running state counted in that row (else in the block activations' row)
  const char* block_acts;  // block-wise: one block's activations
  const char* block_io;    // block-wise forward: a block's y and next y
  const char* carries;     // block-wise: the layers' carries (Carry without E3's μ); "" when it allocates none
  const char* carry;       // sequence ranks: one layer's carry, handed range to range
  const char* mu_carries;  // E3's μ and A carries between token blocks, one per layer
  bool head_own_phase;     // a one-block pass: the head a phase of its own (else weighed against E3's scratch)
  // Sequence ranks: dist::SequenceBlockwise composes μ's carry maps over a
  // range (else it passes the kind's state and carries range to range, and
  // runs the kind block-wise there without a memory lever).
  bool sequence_carry_maps;
};

}  // namespace ash
