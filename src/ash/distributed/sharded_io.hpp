#pragma once
// Checkpoints and gradient files of a layer-sharded run (docs/file_format.md,
// "Distributed runs"): the same HDF5 format as one process. A gathering
// writer: the layer ranks of replica 0 send their shards to world rank 0,
// which assembles the whole model and writes it through a temp file and a
// rename (atomic, one writer, no parallel-HDF5 build needed; parameters and
// Adam moments are small next to activations, so one rank can hold them).
// Reading needs no communication: every rank reads its own tensors.
#include <string>

#include "ash/distributed/layout.hpp"
#include "ash/io/checkpoint.hpp"

namespace ash::dist {

// The whole model on world rank 0 (an empty ParamSet elsewhere), from the
// shards of replica 0. Collective over the grid.
template <class S>
ParamSet<S> gather(const Grid& grid, const ParamSet<S>& shard);

// Collective: rank 0 writes. opt.m and opt.v (Adam moments, shards) may be
// null. A carried state (opt.carry: every layer's [B·P, N], of which each rank
// holds its layers' rows of its windows) is summed onto rank 0 from the ranks
// that hold it (sequence rank S-1, where a window ends).
template <class S>
void save_checkpoint(const Grid& grid, const std::string& path, const Config& cfg, const ParamSet<S>& params,
                     std::int64_t step, std::int64_t cursor, const OptimizerState<S>& opt);

template <class S>
void save_gradients(const Grid& grid, const std::string& path, const Config& cfg, double loss,
                    const ParamSet<S>& grad);

}  // namespace ash::dist
