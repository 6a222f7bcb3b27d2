#pragma once
// E1 for a Mamba (model.arch = "mamba", docs/design.md §2): the whole window in
// one process, every intermediate of every block kept (h^{t-1} and A^t of the
// scan over E channels too), then the blocks' reverse mode from K-1 to 0 with
// E1's reverse scan for μ. With grad.engine=adjoint-exact, E3 instead: only
// each block's input is kept, one block's projections are recomputed at a
// time and E3's scan waves (adjoint_exact_scan_waves) form μ, h^{t-1} and A^t.
// LocalEngine runs it for a Mamba ParamSet; nothing else (E2, E3's detached
// and windowed modes, the memory levers, MPI) takes a Mamba yet.
// mamba_e3_block_backward is E3's step for one block, which the layer stack
// (grad/stack_adjoint.hpp, MambaStackAdjoint) calls too.
#include "ash/core/options.hpp"
#include "ash/grad/workspace.hpp"
#include "ash/model/mamba_layer.hpp"
#include "ash/model/params.hpp"

namespace ash {

// Overwrites grad with ∂L/∂θ for the windows in x ([Bt, T]) and returns L.
// opts: grad.engine must be backprop or adjoint-exact, without detach_inputs or truncate
// (ash::Error naming the key otherwise); grad.chunk and grad.head_chunk apply.
template <class S>
double mamba_backprop(const EngineOptions& opts, const ParamSet<S>& params, const TokenView& x,
                      const ParamSet<S>& grad, const ExecSpace& exec = ExecSpace());

// E3's reverse step through one Mamba block (exact; docs/design.md §2): the
// block's projections recomputed from its input y_in into act (its output into
// y_scratch, unread), the gate's VJP, E3's scan waves over the E channels
// (adjoint_exact_scan_waves; buffers planned into work) and the rest of the
// block. Adds the block's gradient into grad; g is ∂L/∂y_out on entry and
// ∂L/∂y_in on return (the residual's identity plus the block's input VJP).
// opts: grad.chunk and grad.wave apply (the mode is always exact).
template <class S>
void mamba_e3_block_backward(const EngineOptions& opts, Workspace<S>& work, const MambaLayerParams<S>& p,
                             const ModelDims& d, const SeqShape& s, const View2<S>& y_in,
                             const MambaActivations<S>& act, const MambaCotangents<S>& cot,
                             const View2<S>& y_scratch, const MambaLayerParams<S>& grad, const View2<S>& g,
                             const ExecSpace& exec = ExecSpace());

}  // namespace ash
