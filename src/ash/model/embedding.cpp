#include "ash/model/embedding.hpp"

namespace ash {

template <class S>
void embedding_forward(const Unmanaged2<S>& E, const TokenView& x, const View2<S>& y0, const ExecSpace& exec) {
  const index_t T = x.extent(1), P = E.extent(1);
  Kokkos::parallel_for(
      "ash::embedding_forward", Range2(exec, {0, 0}, {index_t(y0.extent(0)), P}),
      KOKKOS_LAMBDA(const index_t m, const index_t p) { y0(m, p) = E(x(m / T, m % T), p); });
}

template <class S>
void embedding_backward(const TokenView& x, const View2<S>& g, const Unmanaged2<S>& gE, const ExecSpace& exec) {
  const index_t T = x.extent(1), M = g.extent(0);
  Kokkos::parallel_for(
      "ash::embedding_backward", Range(exec, 0, index_t(gE.extent(1))), KOKKOS_LAMBDA(const index_t p) {
        for (index_t m = 0; m < M; ++m) gE(x(m / T, m % T), p) += g(m, p);
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
