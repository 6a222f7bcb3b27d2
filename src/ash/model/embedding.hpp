#pragma once
// Token windows on the device and the embedding y_0^t = E[x^t].
#include "ash/core/types.hpp"
#include "ash/model/ssm_layer.hpp"

namespace ash {

template <class S>
void embedding_forward(const Unmanaged2<S>& E, const TokenView& x, const View2<S>& y0,
                       const ExecSpace& exec = ExecSpace());

// gE[v, :] += Σ_{(b,t): x = v} g[m, :]; one thread per channel, tokens in order,
// so the sum is deterministic (no atomics).
template <class S>
void embedding_backward(const TokenView& x, const View2<S>& g, const Unmanaged2<S>& gE,
                        const ExecSpace& exec = ExecSpace());

}  // namespace ash
