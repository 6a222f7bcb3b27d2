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
#include <utility>

#include "ash/core/config.hpp"
#include "ash/core/types.hpp"
#include "ash/model/params.hpp"

namespace ash::dist {

struct Layout {
  int R = 1, D = 1, S = 1;  // layer ranks, data ranks, sequence ranks
  int layer_rank = 0, data_rank = 0, seq_rank = 0;
  int world_rank = 0, world_size = 1;
  bool first() const { return layer_rank == 0; }
  bool last() const { return layer_rank == R - 1; }
  // This rank's tokens [begin, end) of a window of T (uneven when S does not divide T).
  std::int64_t seq_begin(std::int64_t T) const { return T * seq_rank / S; }
  std::int64_t seq_end(std::int64_t T) const { return T * (seq_rank + 1) / S; }
  // This replica's windows [first, second) of a batch of B (uneven when D does not divide B).
  std::pair<std::int64_t, std::int64_t> windows(std::int64_t B) const {
    return {B * data_rank / D, B * (data_rank + 1) / D};
  }
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

}  // namespace ash::dist
