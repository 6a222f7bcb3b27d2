#include "ash/dist/comm.hpp"

#include <chrono>
#include <cstdio>
#include <thread>

#include "ash/core/error.hpp"

namespace ash::dist {

Layout Layout::from_config(const Config& cfg, int world_rank, int world_size) {
  Layout l;
  l.world_rank = world_rank;
  l.world_size = world_size;
  const auto R = cfg.get<std::int64_t>("dist.layer_ranks");
  const auto Dcfg = cfg.get<std::int64_t>("dist.data_ranks");
  const auto Sq = cfg.get<std::int64_t>("dist.seq_ranks");
  const auto K = cfg.model().layers;
  require(Sq == 1, "dist.seq_ranks = " + std::to_string(Sq) +
                       ": sequence (context) parallelism is not built yet; use dist.layer_ranks and dist.data_ranks");
  require(R >= 1 && R <= K, "dist.layer_ranks = " + std::to_string(R) + " does not fit model.layers = " +
                                std::to_string(K) + " (each layer rank needs at least one layer)");
  require(world_size % R == 0, "the world has " + std::to_string(world_size) + " ranks, not a multiple of "
                                   "dist.layer_ranks = " + std::to_string(R));
  const std::int64_t D = Dcfg > 0 ? Dcfg : world_size / R;
  require(R * D == world_size, "dist.layer_ranks × dist.data_ranks = " + std::to_string(R) + " × " +
                                   std::to_string(D) + " = " + std::to_string(R * D) + ", but the world has " +
                                   std::to_string(world_size) + " ranks");
  const auto B = cfg.get<std::int64_t>("data.batch");
  require(B >= D, "data.batch = " + std::to_string(B) + " windows cannot be shared by dist.data_ranks = " +
                      std::to_string(D) + " replicas (each needs at least one window)");
  l.R = int(R);
  l.D = int(D);
  l.layer_rank = world_rank % l.R;
  l.data_rank = world_rank / l.R;
  return l;
}

Grid::Grid(const Config& cfg, MPI_Comm world) : world_(world) {
  int r = 0, n = 1;
  MPI_Comm_rank(world, &r);
  MPI_Comm_size(world, &n);
  lay_ = Layout::from_config(cfg, r, n);
  int dims[2] = {lay_.D, lay_.R}, periods[2] = {0, 0};
  MPI_Cart_create(world, 2, dims, periods, /*reorder=*/0, &cart_);
  int keep_layers[2] = {0, 1}, keep_data[2] = {1, 0};
  MPI_Cart_sub(cart_, keep_layers, &layer_comm_);
  MPI_Cart_sub(cart_, keep_data, &data_comm_);
  int lr = 0, dr = 0;
  MPI_Comm_rank(layer_comm_, &lr);
  MPI_Comm_rank(data_comm_, &dr);
  require(lr == lay_.layer_rank && dr == lay_.data_rank, "MPI_Cart_sub gave an unexpected rank order");
}

Grid::~Grid() {
  for (MPI_Comm* c : {&data_comm_, &layer_comm_, &cart_})
    if (*c != MPI_COMM_NULL) MPI_Comm_free(c);
}

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

template <class View>
constexpr bool host_readable() {
  return Kokkos::SpaceAccessibility<Kokkos::HostSpace, typename View::memory_space>::accessible;
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
  in_pieces(h.data(), h.size(), [&](S* p, int n) { MPI_Recv(p, n, mpi_type<S>(), src, tag, comm, MPI_STATUS_IGNORE); });
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

Session::Session(int* argc, char*** argv) {
  int inited = 0;
  MPI_Initialized(&inited);
  if (!inited) {
    int provided = 0;
    MPI_Init_thread(argc, argv, MPI_THREAD_FUNNELED, &provided);
    owns_ = true;
  }
  MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
  MPI_Comm_size(MPI_COMM_WORLD, &size_);
}

Session::~Session() {
  int fin = 0;
  MPI_Finalized(&fin);
  if (owns_ && !fin) MPI_Finalize();
}

void fail_all(const std::string& msg, int code) {
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  if (size > 1 && rank != 0) std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  if (size > 1 && rank != 0)
    std::fprintf(stderr, "ash: error (rank %d): %s\n", rank, msg.c_str());
  else
    std::fprintf(stderr, "ash: error: %s\n", msg.c_str());
  std::fflush(stderr);
  if (size == 1) {
    MPI_Finalize();
    std::exit(code);
  }
  MPI_Abort(MPI_COMM_WORLD, code);
  std::exit(code);
}

#define ASH_DIST_VIEWS(S)                                                       \
  template void send<View1<S>>(const View1<S>&, int, int, MPI_Comm);            \
  template void send<View2<S>>(const View2<S>&, int, int, MPI_Comm);            \
  template void recv<View1<S>>(const View1<S>&, int, int, MPI_Comm);            \
  template void recv<View2<S>>(const View2<S>&, int, int, MPI_Comm);            \
  template void broadcast<View1<S>>(const View1<S>&, int, MPI_Comm);            \
  template void broadcast<View2<S>>(const View2<S>&, int, MPI_Comm);            \
  template void allreduce_sum<View1<S>>(const View1<S>&, MPI_Comm);
ASH_DIST_VIEWS(float)
ASH_DIST_VIEWS(double)

}  // namespace ash::dist
