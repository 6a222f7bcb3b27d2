#include "ash/distributed/run_context.hpp"

#include <algorithm>

#include "ash/core/error.hpp"
#include "ash/core/memory.hpp"
#include "ash/model/forward.hpp"
#ifdef ASH_HAVE_MPI
#include "ash/distributed/collectives.hpp"
#include "ash/distributed/distributed_engine.hpp"
#include "ash/distributed/sharded_io.hpp"
#endif

namespace ash {

#ifdef ASH_HAVE_MPI
template <class S>
struct RunContext<S>::Mpi {
  std::unique_ptr<dist::Grid> grid;
  dist::DistributedEngine<S>* engine = nullptr;
};
#else
template <class S>
struct RunContext<S>::Mpi {};
#endif

template <class S>
RunContext<S>::RunContext(const Settings& st) : range_(LayerRange::all(st.model)), batch_(st.data.batch) {
#ifdef ASH_HAVE_MPI
  int inited = 0, world = 1, rank = 0;
  MPI_Initialized(&inited);
  if (inited) {
    MPI_Comm_size(MPI_COMM_WORLD, &world);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  }
  if (world > 1 || st.dist.multi_rank()) {
    require(inited, "dist.* asks for several ranks: run under mpiexec");
    mpi_ = std::make_unique<Mpi>();
    mpi_->grid = std::make_unique<dist::Grid>(st);
    range_ = mpi_->grid->range(st.model);
    root_ = rank == 0;
    auto e = std::make_unique<dist::DistributedEngine<S>>(*mpi_->grid, st.grad, st.model, st.dist.pipeline_blocks);
    mpi_->engine = e.get();
    engine_ = std::move(e);
    return;
  }
#else
  require(!st.dist.multi_rank(),
          "dist.* asks for several ranks: that needs the MPI build of AdjointSharding (ASH_ENABLE_MPI)");
#endif
  engine_ = make_engine<S>(st.grad);
}

template <class S>
RunContext<S>::~RunContext() = default;

template <class S>
bool RunContext<S>::distributed() const {
  return mpi_ != nullptr;
}

template <class S>
int RunContext<S>::world_size() const {
#ifdef ASH_HAVE_MPI
  if (mpi_) return mpi_->grid->layout().world_size;
#endif
  return 1;
}

template <class S>
const dist::PipelineStats* RunContext<S>::pipeline_stats() const {
#ifdef ASH_HAVE_MPI
  if (mpi_) return &mpi_->engine->stats();
#endif
  return nullptr;
}

template <class S>
double RunContext<S>::loss(const ParamSet<S>& params, const TokenView& x) {
#ifdef ASH_HAVE_MPI
  if (mpi_) return mpi_->engine->loss(params, x);
#endif
  const index_t nv = x.extent(0), T = x.extent(1);
  if (nv <= batch_) return forward_loss(params, x);
  double sum = 0;
  index_t count = 0;
  for (index_t i0 = 0; i0 < nv; i0 += batch_) {
    const index_t n = std::min(batch_, nv - i0);
    TokenView xs("ash::train::valid_windows", n, T);
    Kokkos::deep_copy(xs, Kokkos::subview(x, Kokkos::make_pair(i0, i0 + n), Kokkos::ALL()));
    // Weighted by targets: T - 1 per window less document starts (in units of
    // T - 1, so windows without starts weigh exactly n as before).
    const index_t c = target_count(xs);
    sum += forward_loss(params, xs) * (double(c) / double(T - 1));
    count += c;
  }
  return count > 0 ? sum / (double(count) / double(T - 1)) : 0.0;
}

template <class S>
ParamSet<S> RunContext<S>::load(const std::string& path, CheckpointInfo* info) const {
  return load_checkpoint<S>(path, range_, info);
}

template <class S>
void RunContext<S>::save_checkpoint(const std::string& path, const Config& cfg, const ParamSet<S>& params,
                                    std::int64_t step, std::int64_t cursor, const OptimizerState<S>& opt) {
#ifdef ASH_HAVE_MPI
  if (mpi_) return dist::save_checkpoint(*mpi_->grid, path, cfg, params, step, cursor, opt);
#endif
  ash::save_checkpoint(path, cfg, params, step, cursor, opt);
}

template <class S>
void RunContext<S>::save_gradients(const std::string& path, const Config& cfg, double loss, const ParamSet<S>& grad) {
#ifdef ASH_HAVE_MPI
  if (mpi_) return dist::save_gradients(*mpi_->grid, path, cfg, loss, grad);
#endif
  ash::save_gradients(path, cfg, loss, grad);
}

template <class S>
std::function<double(double)> RunContext<S>::norm_reducer(const ParamSet<S>& grad) const {
#ifdef ASH_HAVE_MPI
  if (mpi_) {
    const MPI_Comm lc = mpi_->grid->layers();
    const auto& lay = mpi_->grid->layout();
    const auto& d = grad.dims();
    double copy_ss = 0;  // the last rank's copy of a tied embedding (the first rank counts it)
    if (d.tied_head() && lay.R > 1 && lay.last()) {
      const auto e = grad.flat(grad.tensor("embedding"));
      Kokkos::parallel_reduce(
          "ash::dist::tied_copy_norm", Range(0, index_t(e.extent(0))),
          KOKKOS_LAMBDA(const index_t i, double& acc) { acc += double(e(i)) * double(e(i)); }, copy_ss);
    }
    return [lc, copy_ss](double ss) { return dist::allreduce_sum(ss - copy_ss, lc); };
  }
#endif
  return {};
}

template <class S>
bool RunContext<S>::any(bool mine) const {
#ifdef ASH_HAVE_MPI
  if (mpi_) return dist::allreduce_max(std::uint64_t(mine), mpi_->grid->world()) != 0;
#endif
  return mine;
}

template <class S>
int RunContext<S>::max_signal(int mine) const {
#ifdef ASH_HAVE_MPI
  if (mpi_) return int(dist::allreduce_max(std::uint64_t(mine), mpi_->grid->world()));
#endif
  return mine;
}

template <class S>
void RunContext<S>::on_root(const std::function<void()>& fn) const {
#ifdef ASH_HAVE_MPI
  if (mpi_) return dist::run_on_root(mpi_->grid->world(), fn);
#endif
  fn();
}

template <class S>
std::vector<std::uint64_t> RunContext<S>::allgather(const std::vector<std::uint64_t>& mine) const {
#ifdef ASH_HAVE_MPI
  if (mpi_) {
    std::vector<std::uint64_t> all(mine.size() * std::size_t(world_size()));
    MPI_Allgather(mine.data(), int(mine.size()), MPI_UINT64_T, all.data(), int(mine.size()), MPI_UINT64_T,
                  mpi_->grid->world());
    return all;
  }
#endif
  return mine;
}

template <class S>
void RunContext<S>::barrier() const {
#ifdef ASH_HAVE_MPI
  if (mpi_) MPI_Barrier(mpi_->grid->world());
#endif
}

template <class S>
void RunContext<S>::fail_before_backward(int rank) {
#ifdef ASH_HAVE_MPI
  if (!mpi_) return;
  const int me = mpi_->grid->layout().world_rank;
  mpi_->engine->set_before_backward([rank, me] {
    require(rank != me, "injected failure on rank " + std::to_string(me) + " (ASH_DEBUG_FAIL_RANK)");
  });
#else
  (void)rank;
#endif
}

template <class S>
std::vector<RankPlace> RunContext<S>::places(const ModelDims& d, std::int64_t T) const {
#ifdef ASH_HAVE_MPI
  if (mpi_) {
    const auto& lay = mpi_->grid->layout();
    std::vector<RankPlace> out;
    for (int r = 0; r < lay.world_size; ++r) {
      const dist::Layout lr = lay.for_rank(r);
      out.push_back({r, LayerRange::block(d, lr.layer_rank, lay.R), lr.seq_begin(T), lr.seq_end(T), lr.data_rank});
    }
    return out;
  }
#endif
  return {RankPlace{0, LayerRange::all(d), 0, T, 0}};
}

template class RunContext<float>;
template class RunContext<double>;

}  // namespace ash
