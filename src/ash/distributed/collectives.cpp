#include "ash/distributed/collectives.hpp"

#include <string>
#include <vector>

#include "ash/core/error.hpp"
#include "ash/core/types.hpp"

namespace ash::dist {

template <>
MPI_Datatype mpi_type<float>() {
  return MPI_FLOAT;
}
template <>
MPI_Datatype mpi_type<double>() {
  return MPI_DOUBLE;
}

std::uint64_t& bytes_sent() {
  static std::uint64_t n = 0;
  return n;
}

namespace {

// MPI counts are int: long messages go in pieces.
constexpr std::size_t max_piece = std::size_t(1) << 30;

template <class S, class Fn>
void in_pieces(S* p, std::size_t n, Fn&& fn) {
  for (std::size_t off = 0; off < n; off += max_piece) fn(p + off, int(n - off < max_piece ? n - off : max_piece));
}

}  // namespace

template <class View>
void send(const View& v, int dest, int tag, MPI_Comm comm) {
  using S = typename View::non_const_value_type;
  require(v.span_is_contiguous(), "dist::send: View is not contiguous");
  Kokkos::fence();
  auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), v);
  in_pieces(h.data(), h.size(), [&](S* p, int n) { MPI_Send(p, n, mpi_type<S>(), dest, tag, comm); });
  bytes_sent() += h.size() * sizeof(S);
}

template <class View>
void recv(const View& v, int src, int tag, MPI_Comm comm) {
  using S = typename View::non_const_value_type;
  require(v.span_is_contiguous(), "dist::recv: View is not contiguous");
  auto h = Kokkos::create_mirror_view(Kokkos::HostSpace(), v);
  in_pieces(h.data(), h.size(),
            [&](S* p, int n) { MPI_Recv(p, n, mpi_type<S>(), src, tag, comm, MPI_STATUS_IGNORE); });
  Kokkos::deep_copy(v, h);
}

template <class View>
void broadcast(const View& v, int root, MPI_Comm comm) {
  using S = typename View::non_const_value_type;
  Kokkos::fence();
  auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), v);
  int me = 0, n = 1;
  MPI_Comm_rank(comm, &me);
  MPI_Comm_size(comm, &n);
  in_pieces(h.data(), h.size(), [&](S* p, int c) { MPI_Bcast(p, c, mpi_type<S>(), root, comm); });
  if (me == root) bytes_sent() += h.size() * sizeof(S) * std::uint64_t(n - 1);
  Kokkos::deep_copy(v, h);
}

template <class View>
void allreduce_sum(const View& v, MPI_Comm comm) {
  using S = typename View::non_const_value_type;
  int n = 1;
  MPI_Comm_size(comm, &n);
  if (n == 1) return;
  Kokkos::fence();
  auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), v);
  in_pieces(h.data(), h.size(), [&](S* p, int c) { MPI_Allreduce(MPI_IN_PLACE, p, c, mpi_type<S>(), MPI_SUM, comm); });
  bytes_sent() += h.size() * sizeof(S);  // about what a ring allreduce sends per rank (2(n-1)/n of it)
  Kokkos::deep_copy(v, h);
}

double allreduce_sum(double x, MPI_Comm comm) {
  MPI_Allreduce(MPI_IN_PLACE, &x, 1, MPI_DOUBLE, MPI_SUM, comm);
  return x;
}

std::uint64_t allreduce_max(std::uint64_t x, MPI_Comm comm) {
  unsigned long long v = x;
  MPI_Allreduce(MPI_IN_PLACE, &v, 1, MPI_UNSIGNED_LONG_LONG, MPI_MAX, comm);
  return v;
}

namespace {

// inout = in ∘ inout on interleaved (a, b) pairs: in holds the earlier ranks'
// map, applied first: x ↦ a2 (a1 x + b1) + b2.
template <class S>
void compose_affine(void* in, void* inout, int* len, MPI_Datatype*) {
  const S* l = static_cast<const S*>(in);
  S* r = static_cast<S*>(inout);
  for (int i = 0; i < *len; ++i) {
    const S a1 = l[2 * i], b1 = l[2 * i + 1], a2 = r[2 * i], b2 = r[2 * i + 1];
    r[2 * i] = a2 * a1;
    r[2 * i + 1] = a2 * b1 + b2;
  }
}

}  // namespace

template <class View>
void exscan_affine(const View& a, const View& b, MPI_Comm comm) {
  using S = typename View::non_const_value_type;
  int me = 0, n = 1;
  MPI_Comm_rank(comm, &me);
  MPI_Comm_size(comm, &n);
  if (n == 1) {
    Kokkos::deep_copy(a, S(1));
    Kokkos::deep_copy(b, S(0));
    return;
  }
  Kokkos::fence();
  auto ha = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), a);
  auto hb = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), b);
  const std::size_t m = ha.size();
  require(m < std::size_t(1) << 30, "exscan_affine: too many elements for one MPI call");
  std::vector<S> send(2 * m), recv(2 * m);
  for (std::size_t i = 0; i < m; ++i) {
    send[2 * i] = ha.data()[i];
    send[2 * i + 1] = hb.data()[i];
  }
  MPI_Datatype pair;
  MPI_Type_contiguous(2, mpi_type<S>(), &pair);
  MPI_Type_commit(&pair);
  MPI_Op op;
  MPI_Op_create(&compose_affine<S>, /*commute=*/0, &op);
  MPI_Exscan(send.data(), recv.data(), int(m), pair, op, comm);
  MPI_Op_free(&op);
  MPI_Type_free(&pair);
  bytes_sent() += 2 * m * sizeof(S);  // about what a log-step exscan sends per rank and step
  for (std::size_t i = 0; i < m; ++i) {
    ha.data()[i] = me == 0 ? S(1) : recv[2 * i];  // rank 0's result is undefined in MPI: the identity
    hb.data()[i] = me == 0 ? S(0) : recv[2 * i + 1];
  }
  Kokkos::deep_copy(a, ha);
  Kokkos::deep_copy(b, hb);
}

void run_on_root(MPI_Comm comm, const std::function<void()>& fn) {
  std::string err;
  int rank = 0;
  MPI_Comm_rank(comm, &rank);
  if (rank == 0) {
    try {
      fn();
    } catch (const Error& e) {
      err = e.what();
    }
  }
  int len = int(err.size());
  MPI_Bcast(&len, 1, MPI_INT, 0, comm);
  err.resize(std::size_t(len));
  if (len > 0) MPI_Bcast(&err[0], len, MPI_CHAR, 0, comm);
  require(err.empty(), err);
}

#define ASH_DIST_VIEWS(S)                                                            \
  template void send<View1<S>>(const View1<S>&, int, int, MPI_Comm);                 \
  template void send<View2<S>>(const View2<S>&, int, int, MPI_Comm);                 \
  template void send<View3<S>>(const View3<S>&, int, int, MPI_Comm);                 \
  template void recv<View1<S>>(const View1<S>&, int, int, MPI_Comm);                 \
  template void recv<View2<S>>(const View2<S>&, int, int, MPI_Comm);                 \
  template void recv<View3<S>>(const View3<S>&, int, int, MPI_Comm);                 \
  template void broadcast<View1<S>>(const View1<S>&, int, MPI_Comm);                 \
  template void broadcast<View2<S>>(const View2<S>&, int, MPI_Comm);                 \
  template void allreduce_sum<View1<S>>(const View1<S>&, MPI_Comm);                  \
  template void exscan_affine<View2<S>>(const View2<S>&, const View2<S>&, MPI_Comm); \
  template void exscan_affine<View3<S>>(const View3<S>&, const View3<S>&, MPI_Comm);
ASH_DIST_VIEWS(float)
ASH_DIST_VIEWS(double)

}  // namespace ash::dist
