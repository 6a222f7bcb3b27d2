#pragma once
// Token windows on the device and the embedding y_0^t = E[x^t].
#include "ash/core/types.hpp"
#include "ash/model/ssm_layer.hpp"

namespace ash {

template <class S>
void embedding_forward(const Unmanaged2<S>& E, const TokenView& x, const View2<S>& y0,
                       const ExecSpace& exec = ExecSpace());

// gE[v, :] += Σ_{(b,t): x = v} g[m, :]; one thread per channel, tokens in order,
// so the sum is deterministic (no atomics). On a wide device the M rows are
// split into embedding_backward_segments(...) segments with private [V, P]
// copies of gE, added in a fixed order.
index_t embedding_backward_segments(index_t concurrency, index_t M, index_t V, index_t P);
template <class S>
void embedding_backward(const TokenView& x, const View2<S>& g, const Unmanaged2<S>& gE,
                        const ExecSpace& exec = ExecSpace());

}  // namespace ash
