#include "ash/distributed/comm.hpp"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

#include "ash/core/error.hpp"

namespace ash::dist {

Layout Layout::from_settings(const Settings& st, int world_rank, int world_size) {
  Layout l;
  l.world_rank = world_rank;
  l.world_size = world_size;
  const auto R = st.dist.layer_ranks;
  const auto Dcfg = st.dist.data_ranks;
  const auto Sq = st.dist.seq_ranks;
  const auto K = st.model.layers;
  const auto T = st.data.seq_len;
  require(Sq >= 1 && Sq <= T, "dist.seq_ranks = " + std::to_string(Sq) + " would leave a token range empty (data.seq_len = " +
                                  std::to_string(T) + ")");
  require(R >= 1 && R <= K, "dist.layer_ranks = " + std::to_string(R) + " does not fit model.layers = " +
                                std::to_string(K) + " (each layer rank needs at least one layer)");
  require(world_size % (R * Sq) == 0, "the world has " + std::to_string(world_size) + " ranks, not a multiple of "
                                          "dist.layer_ranks × dist.seq_ranks = " + std::to_string(R * Sq));
  const std::int64_t D = Dcfg > 0 ? Dcfg : world_size / (R * Sq);
  require(R * Sq * D == world_size, "dist.layer_ranks × dist.seq_ranks × dist.data_ranks = " + std::to_string(R) +
                                        " × " + std::to_string(Sq) + " × " + std::to_string(D) + " = " +
                                        std::to_string(R * Sq * D) + ", but the world has " +
                                        std::to_string(world_size) + " ranks");
  const auto B = st.data.batch;
  require(B >= D, "data.batch = " + std::to_string(B) + " windows cannot be shared by dist.data_ranks = " +
                      std::to_string(D) + " replicas (each needs at least one window)");
  l.R = int(R);
  l.D = int(D);
  l.S = int(Sq);
  return l.for_rank(world_rank);
}

Layout Layout::for_rank(int w) const {
  Layout l = *this;  // w = (d·R + r)·S + s
  l.world_rank = w;
  l.seq_rank = w % S;
  l.layer_rank = (w / S) % R;
  l.data_rank = w / (S * R);
  return l;
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

Grid::Grid(const Settings& st, MPI_Comm world) : world_(world) {
  int r = 0, n = 1;
  MPI_Comm_rank(world, &r);
  MPI_Comm_size(world, &n);
  lay_ = Layout::from_settings(st, r, n);
  int dims[3] = {lay_.D, lay_.R, lay_.S}, periods[3] = {0, 0, 0};
  MPI_Cart_create(world, 3, dims, periods, /*reorder=*/0, &cart_);
  int keep_layers[3] = {0, 1, 0}, keep_data[3] = {1, 0, 0}, keep_seq[3] = {0, 0, 1}, keep_rep[3] = {1, 0, 1};
  MPI_Cart_sub(cart_, keep_layers, &layer_comm_);
  MPI_Cart_sub(cart_, keep_data, &data_comm_);
  MPI_Cart_sub(cart_, keep_seq, &seq_comm_);
  MPI_Cart_sub(cart_, keep_rep, &replica_comm_);
  MPI_Comm_split(seq_comm_, 0, lay_.S - 1 - lay_.seq_rank, &seq_rev_);
  int lr = 0, dr = 0, sr = 0;
  MPI_Comm_rank(layer_comm_, &lr);
  MPI_Comm_rank(data_comm_, &dr);
  MPI_Comm_rank(seq_comm_, &sr);
  require(lr == lay_.layer_rank && dr == lay_.data_rank && sr == lay_.seq_rank,
          "MPI_Cart_sub gave an unexpected rank order");
}

Grid::~Grid() {
  for (MPI_Comm* c : {&seq_rev_, &replica_comm_, &seq_comm_, &data_comm_, &layer_comm_, &cart_})
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

namespace {
// A copy of MPI_COMM_WORLD used only by fail_all, so its barrier can never
// match a barrier of the run itself.
MPI_Comm g_failure_comm = MPI_COMM_NULL;
}  // namespace

bool launched_by_mpi() {
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS",
                        "MV2_COMM_WORLD_SIZE", "SLURM_PROCID"})
    if (std::getenv(v)) return true;
  return false;
}

Session::Session(int* argc, char*** argv, bool only_under_launcher) {
  int inited = 0;
  MPI_Initialized(&inited);
  if (!inited && only_under_launcher && !launched_by_mpi()) return;  // rank 0 of 1, no MPI
  if (!inited) {
    int provided = 0;
    MPI_Init_thread(argc, argv, MPI_THREAD_FUNNELED, &provided);
    owns_ = true;
  }
  MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
  MPI_Comm_size(MPI_COMM_WORLD, &size_);
  if (g_failure_comm == MPI_COMM_NULL) MPI_Comm_dup(MPI_COMM_WORLD, &g_failure_comm);
}

Session::~Session() {
  int fin = 0;
  MPI_Finalized(&fin);
  if (!owns_ || fin) return;
  if (g_failure_comm != MPI_COMM_NULL) MPI_Comm_free(&g_failure_comm);
  MPI_Finalize();
}

namespace {

// True when every rank reaches fail_all within `wait` (they all met the same
// error, e.g. a bad configuration or layout): then no abort is needed.
bool all_ranks_failed(std::chrono::milliseconds wait) {
  if (g_failure_comm == MPI_COMM_NULL) return false;
  MPI_Request req;
  MPI_Ibarrier(g_failure_comm, &req);
  const auto until = std::chrono::steady_clock::now() + wait;
  int done = 0;
  while (!done && std::chrono::steady_clock::now() < until) {
    MPI_Test(&req, &done, MPI_STATUS_IGNORE);
    if (!done) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return done != 0;  // a pending request is abandoned: the abort below ends the job
}
}  // namespace

void fail_all(const std::string& msg, int code) {
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  if (size > 1 && all_ranks_failed(std::chrono::milliseconds(1500))) {
    // One message, and an orderly end with the error's exit code (no abort banner).
    if (rank == 0) std::fprintf(stderr, "ash: error: %s\n", msg.c_str());
    std::fflush(stderr);
    MPI_Comm_free(&g_failure_comm);
    MPI_Finalize();
    std::exit(code);
  }
  if (size > 1 && rank != 0)
    std::fprintf(stderr, "ash: error (rank %d): %s\n", rank, msg.c_str());
  else
    std::fprintf(stderr, "ash: error: %s\n", msg.c_str());
  std::fflush(stderr);
  // Give mpiexec's output forwarding time to pass the message on before the
  // abort tears the job down (seen lost under load without it).
  if (size > 1) std::this_thread::sleep_for(std::chrono::milliseconds(300));
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
  template void allreduce_sum<View1<S>>(const View1<S>&, MPI_Comm);                 \
  template void exscan_affine<View2<S>>(const View2<S>&, const View2<S>&, MPI_Comm); \
  template void exscan_affine<View3<S>>(const View3<S>&, const View3<S>&, MPI_Comm);
ASH_DIST_VIEWS(float)
ASH_DIST_VIEWS(double)

}  // namespace ash::dist
