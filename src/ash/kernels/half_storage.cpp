#include "ash/kernels/half_storage.hpp"

#include "ash/core/error.hpp"

namespace ash {

template <class S>
StoredRows<S>::StoredRows(const std::string& label, Storage st, index_t rows, index_t cols) : st_(st), rows_(rows) {
  if (st == Storage::full)
    full_ = View2<S>(label, rows, cols);
  else
    half_ = View2<std::uint16_t>(label, rows, cols);
}

template <class S>
std::size_t StoredRows<S>::bytes() const {
  return st_ == Storage::full ? full_.span() * sizeof(S) : half_.span() * 2;
}

template <class S>
void StoredRows<S>::put(const View2<S>& src, index_t T, index_t t0, index_t Tj, const ExecSpace& exec) const {
  const index_t P = src.extent(1), rows = src.extent(0);
  const Storage st = st_;
  auto f = full_;
  auto h = half_;
  const BlockRows map{Tj, T, t0};
  Kokkos::parallel_for(
      "ash::store::put", Range2(exec, {0, 0}, {rows, P}), KOKKOS_LAMBDA(const index_t r, const index_t p) {
        const index_t m = map(r);
        if (st == Storage::full)
          f(m, p) = src(r, p);
        else
          h(m, p) = half::pack(st, src(r, p));
      });
}

template <class S>
void StoredRows<S>::get(const View2<S>& dst, index_t T, index_t t0, index_t Tj, const ExecSpace& exec) const {
  const index_t P = dst.extent(1), rows = dst.extent(0);
  const Storage st = st_;
  auto f = full_;
  auto h = half_;
  const BlockRows map{Tj, T, t0};
  Kokkos::parallel_for(
      "ash::store::get", Range2(exec, {0, 0}, {rows, P}), KOKKOS_LAMBDA(const index_t r, const index_t p) {
        const index_t m = map(r);
        dst(r, p) = st == Storage::full ? f(m, p) : half::unpack<S>(st, h(m, p));
      });
}

template class StoredRows<float>;
template class StoredRows<double>;

}  // namespace ash
