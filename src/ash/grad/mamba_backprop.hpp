#pragma once
// E1 for a Mamba (model.arch = "mamba", docs/design.md §2): the whole window in
// one process, every intermediate of every block kept (h^{t-1} and A^t of the
// scan over E channels too), then the blocks' reverse mode from K-1 to 0 with
// E1's reverse scan for μ. With grad.engine=adjoint-exact, E3 instead: only
// each block's input is kept, one block's projections are recomputed at a
// time and E3's scan waves (adjoint_exact_scan_waves) form μ, h^{t-1} and A^t.
// LocalEngine runs it for a Mamba ParamSet; nothing else (E2, E3's detached
// and windowed modes, the memory levers, MPI) takes a Mamba yet.
#include "ash/core/options.hpp"
#include "ash/model/params.hpp"

namespace ash {

// Overwrites grad with ∂L/∂θ for the windows in x ([Bt, T]) and returns L.
// opts: grad.engine must be backprop or adjoint-exact, without detach_inputs or truncate
// (ash::Error naming the key otherwise); grad.chunk and grad.head_chunk apply.
template <class S>
double mamba_backprop(const EngineOptions& opts, const ParamSet<S>& params, const TokenView& x,
                      const ParamSet<S>& grad, const ExecSpace& exec = ExecSpace());

}  // namespace ash
