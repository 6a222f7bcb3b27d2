#include "ash/model/embedding.hpp"

#include <algorithm>

namespace ash {

template <class S>
void embedding_forward(const Unmanaged2<S>& E, const TokenView& x, const View2<S>& y0, const ExecSpace& exec) {
  const index_t T = x.extent(1), P = E.extent(1);
  Kokkos::parallel_for(
      "ash::embedding_forward", Range2(exec, {0, 0}, {index_t(y0.extent(0)), P}),
      KOKKOS_LAMBDA(const index_t m, const index_t p) { y0(m, p) = E(token_id(x(m / T, m % T)), p); });
}

// gE[x[m], p] += g[m, p]. Rows scatter to token ids, so the sum runs per
// channel p over the rows in order (deterministic, no atomics); to use a wide
// device when P is small, the rows are split into `seg` segments summed into
// private copies of gE and then added in a fixed order (seg is 1 on a CPU).
index_t embedding_backward_segments(index_t concurrency, index_t M, index_t V, index_t P) {
  const index_t want = concurrency / (P > 0 ? P : 1);
  const index_t cap = std::max<index_t>(1, (index_t(1) << 24) / std::max<index_t>(1, V * P));  // ≤ 16M numbers
  return std::max<index_t>(1, std::min({want, cap, M, index_t(64)}));
}

template <class S>
void embedding_backward(const TokenView& x, const View2<S>& g, const Unmanaged2<S>& gE, const ExecSpace& exec) {
  const index_t T = x.extent(1), M = g.extent(0), V = gE.extent(0), P = gE.extent(1);
  const index_t seg = embedding_backward_segments(index_t(exec.concurrency()), M, V, P);
  if (seg == 1) {
    Kokkos::parallel_for(
        "ash::embedding_backward", Range(exec, 0, P), KOKKOS_LAMBDA(const index_t p) {
          for (index_t m = 0; m < M; ++m) gE(token_id(x(m / T, m % T)), p) += g(m, p);
        });
    return;
  }
  View3<S> part("ash::embedding_backward::partial", seg, V, P);
  const index_t len = (M + seg - 1) / seg;
  Kokkos::parallel_for(
      "ash::embedding_backward_segments", Range(exec, 0, seg * P), KOKKOS_LAMBDA(const index_t i) {
        const index_t sg = i / P, p = i % P, m1 = (sg + 1) * len < M ? (sg + 1) * len : M;
        for (index_t m = sg * len; m < m1; ++m) part(sg, token_id(x(m / T, m % T)), p) += g(m, p);
      });
  Kokkos::parallel_for(
      "ash::embedding_backward_sum", Range(exec, 0, V * P), KOKKOS_LAMBDA(const index_t i) {
        S acc = 0;
        for (index_t sg = 0; sg < seg; ++sg) acc += part(sg, i / P, i % P);
        gE(i / P, i % P) += acc;
      });
}

template void embedding_forward<float>(const Unmanaged2<float>&, const TokenView&, const View2<float>&,
                                       const ExecSpace&);
template void embedding_forward<double>(const Unmanaged2<double>&, const TokenView&, const View2<double>&,
                                        const ExecSpace&);
template void embedding_backward<float>(const TokenView&, const View2<float>&, const Unmanaged2<float>&,
                                        const ExecSpace&);
template void embedding_backward<double>(const TokenView&, const View2<double>&, const Unmanaged2<double>&,
                                         const ExecSpace&);

}  // namespace ash
