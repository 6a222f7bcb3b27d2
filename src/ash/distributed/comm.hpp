#pragma once
// E4's rank layout (docs/design.md §2): MPI_COMM_WORLD as a Cartesian grid of
// D data replicas × R layer ranks × S sequence ranks. World rank
// w = (d·R + r)·S + s; with S = 1 a replica's pipeline is R consecutive ranks.
//   layer communicator:   the R ranks of one (replica, token range): y forward, g back, g broadcast
//   sequence communicator: the S ranks of one (replica, layer block): the state and μ carries
//   data communicator:    the D ranks of one (layer block, token range)
//   replica communicator: the D·S ranks that own the same layers (gradient and loss sums)
#include <mpi.h>

#include <cstdint>
#include <functional>
#include <string>
#include <utility>

#include "ash/core/config.hpp"
#include "ash/core/types.hpp"
#include "ash/model/params.hpp"

namespace ash::dist {

struct Layout {
  int R = 1, D = 1, S = 1;        // layer ranks, data ranks, sequence ranks
  int layer_rank = 0, data_rank = 0, seq_rank = 0;
  int world_rank = 0, world_size = 1;
  bool first() const { return layer_rank == 0; }
  bool last() const { return layer_rank == R - 1; }
  // This rank's tokens [begin, end) of a window of T (uneven when S does not divide T).
  std::int64_t seq_begin(std::int64_t T) const { return T * seq_rank / S; }
  std::int64_t seq_end(std::int64_t T) const { return T * (seq_rank + 1) / S; }
  // This replica's windows [first, second) of a batch of B (uneven when D does not divide B).
  std::pair<std::int64_t, std::int64_t> windows(std::int64_t B) const { return {B * data_rank / D, B * (data_rank + 1) / D}; }
  // The same layout as seen by world rank w: its coordinates in the grid.
  Layout for_rank(int w) const;
  // The layout of dist.* on a world of `world_size` ranks; throws ash::Error
  // when it does not fit (R·S·D != world, R > K, S > T, D > batch).
  static Layout from_settings(const Settings& st, int world_rank, int world_size);
  static Layout from_config(const Config& cfg, int world_rank, int world_size) {
    return from_settings(cfg.settings(), world_rank, world_size);
  }
};

// Owns the communicators of a Layout (freed on destruction).
class Grid {
 public:
  Grid(const Settings& st, MPI_Comm world = MPI_COMM_WORLD);
  Grid(const Config& cfg, MPI_Comm world = MPI_COMM_WORLD) : Grid(cfg.settings(), world) {}
  ~Grid();
  Grid(const Grid&) = delete;
  Grid& operator=(const Grid&) = delete;

  const Layout& layout() const { return lay_; }
  MPI_Comm world() const { return world_; }
  MPI_Comm layers() const { return layer_comm_; }
  MPI_Comm data() const { return data_comm_; }
  MPI_Comm seq() const { return seq_comm_; }
  MPI_Comm seq_reversed() const { return seq_rev_; }  // the sequence ranks, last first
  MPI_Comm replicas() const { return replica_comm_; }
  // This rank's layers (and embedding / head) for a model of these sizes.
  LayerRange range(const ModelDims& d) const { return LayerRange::block(d, lay_.layer_rank, lay_.R); }

 private:
  Layout lay_;
  MPI_Comm world_ = MPI_COMM_NULL, cart_ = MPI_COMM_NULL, layer_comm_ = MPI_COMM_NULL, data_comm_ = MPI_COMM_NULL,
           seq_comm_ = MPI_COMM_NULL, seq_rev_ = MPI_COMM_NULL, replica_comm_ = MPI_COMM_NULL;
};

template <class S>
MPI_Datatype mpi_type();

// Point-to-point and collectives on contiguous Views; a View in a memory space
// the host cannot read (CUDA without CUDA-aware MPI) is staged through a host
// mirror. Bytes sent are added to bytes_sent() (per process, for reports).
template <class View>
void send(const View& v, int dest, int tag, MPI_Comm comm);
template <class View>
void recv(const View& v, int src, int tag, MPI_Comm comm);
template <class View>
void broadcast(const View& v, int root, MPI_Comm comm);
template <class View>
void allreduce_sum(const View& v, MPI_Comm comm);
double allreduce_sum(double x, MPI_Comm comm);
// Exclusive scan of elementwise affine maps x ↦ a ⊙ x + b over comm's ranks:
// on return rank i holds in (a, b) the composition of ranks 0..i-1's maps
// (first rank 0's, then 1's, ...); rank 0 gets the identity (a = 1, b = 0).
// O(size of a) bytes per rank, whatever the sequence length.
template <class View>
void exscan_affine(const View& a, const View& b, MPI_Comm comm);
std::uint64_t allreduce_max(std::uint64_t x, MPI_Comm comm);

std::uint64_t& bytes_sent();

// True when an MPI launcher (mpiexec, mpirun, srun) started this process: its
// environment names the process's rank (Open MPI, MPICH/Hydra, PMI, PMIx, Slurm).
bool launched_by_mpi();

// MPI_Init when needed, MPI_Finalize at scope exit. only_under_launcher: no
// MPI at all unless launched_by_mpi() (a one-process `ash` needs no MPI
// start-up, which forks a singleton runtime); else also as a singleton.
class Session {
 public:
  Session(int* argc, char*** argv, bool only_under_launcher = false);
  ~Session();
  int rank() const { return rank_; }
  int size() const { return size_; }

 private:
  bool owns_ = false;
  int rank_ = 0, size_ = 1;
};

// Runs fn on world rank 0 of comm and makes its ash::Error an error on every
// rank (a failed write is an error everywhere, never a hang). Collective.
void run_on_root(MPI_Comm comm, const std::function<void()>& fn);

// Ends every rank with exit code `code` after printing msg once: rank 0
// prints; another rank waits a moment (if rank 0 fails alike, its abort ends
// this rank first), then prints with its rank number. Never returns.
[[noreturn]] void fail_all(const std::string& msg, int code);

}  // namespace ash::dist
