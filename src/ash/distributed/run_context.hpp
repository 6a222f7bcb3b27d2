#pragma once
// Where a run's work happens (docs/design.md §2, E4): one process, or this
// rank of the MPI layout of dist.*. The trainer and the CLI's `grad` build one
// from the settings and ask it for the engine, this process's layers, the
// checkpoint and gradient writers and the collective decisions of §7; they
// never ask whether MPI is there. Without the MPI build it is the plain
// single-process form (and a dist.* layout of several ranks is an error).
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "ash/core/config.hpp"
#include "ash/distributed/pipeline_stats.hpp"
#include "ash/grad/engine.hpp"
#include "ash/io/checkpoint.hpp"

namespace ash {

// One world rank's place in a distributed run, for reports.
struct RankPlace {
  int world_rank = 0;
  LayerRange layers;                    // its layers (and embedding / head)
  std::int64_t t_begin = 0, t_end = 0;  // its tokens of a window (the whole window without sequence ranks)
  int replica = 0;                      // its data replica
};

template <class S>
class RunContext {
 public:
  // MPI when launched with more than one rank or when dist.* asks for
  // several; throws ash::Error when that is asked for and cannot be had.
  explicit RunContext(const Settings& st);
  ~RunContext();
  RunContext(const RunContext&) = delete;
  RunContext& operator=(const RunContext&) = delete;

  bool distributed() const;
  bool root() const { return root_; }  // world rank 0: prints, writes metrics
  int world_size() const;
  // This process's layers (every layer on one process).
  const LayerRange& range() const { return range_; }
  GradientEngine<S>& engine() { return *engine_; }
  // The pipeline's measurements of the last compute() (distributed runs only; else nullptr).
  const dist::PipelineStats* pipeline_stats() const;

  // Forward only: the loss over the windows x (validation), data.batch windows
  // at a time on one process, so scoring never needs more memory than a step.
  double loss(const ParamSet<S>& params, const TokenView& x);
  // This process's tensors of a checkpoint.
  ParamSet<S> load(const std::string& path, CheckpointInfo* info = nullptr) const;
  // Collective writers (world rank 0 writes, after gathering the shards).
  void save_checkpoint(const std::string& path, const Config& cfg, const ParamSet<S>& params, std::int64_t step,
                       std::int64_t cursor, const OptimizerState<S>& opt);
  void save_gradients(const std::string& path, const Config& cfg, double loss, const ParamSet<S>& grad);
  // Sum of squares over the layer shards (the gradient norm of grad, this
  // rank's shard); empty on one process. A tied head's embedding copy on the
  // last layer rank counts once (its squares are taken out there).
  std::function<double(double)> norm_reducer(const ParamSet<S>& grad) const;

  // Collective decisions (§7): true on every rank when mine is true on any;
  // the largest value of any rank; fn on the root, its ash::Error an error on every rank.
  bool any(bool mine) const;
  int max_signal(int mine) const;
  void on_root(const std::function<void()>& fn) const;
  // Every world rank's values, in rank order, on every rank.
  std::vector<std::uint64_t> allgather(const std::vector<std::uint64_t>& mine) const;
  void barrier() const;
  // A test seam: world rank `rank` fails with an ash::Error between the head
  // and the backward of compute(), while the others wait in MPI (distributed runs only).
  void fail_before_backward(int rank);
  // Every world rank's place for a window of T tokens.
  std::vector<RankPlace> places(const ModelDims& d, std::int64_t T) const;

 private:
  struct Mpi;  // the grid and the distributed engine (MPI build)
  std::unique_ptr<Mpi> mpi_;
  LayerRange range_;
  bool root_ = true;
  index_t batch_ = 1;
  std::unique_ptr<GradientEngine<S>> engine_;
};

}  // namespace ash
