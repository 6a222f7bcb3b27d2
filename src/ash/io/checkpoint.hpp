#pragma once
// HDF5 checkpoints and gradient files (docs/design.md §5, format version 2:
// every dataset checksummed with Fletcher-32; version 1 files still load).
//
//   attributes  format_version, vocab, width, state, layers, seed, precision,
//               step, data_cursor, rng_state, engine, config (the full JSON configuration)
//   /params     embedding [V,P], final_norm [P], head [V,P],
//               layers/000/{norm, W_delta, b_delta, A_log, W_B, W_C, D}, ...
//   /optimizer  m/<param path>, v/<param path>, attribute step (after ash train)
//   /train      carry_state [K, Bt·P, N] (data.carry_state only)
//   gradients:  /loss (scalar), /grad/<same path as under /params>
// Files are built in memory, written to "<path>.tmp.<pid>", fsynced and
// renamed, so a failed write never replaces a good file. Reading is strict
// (docs/file_format.md): float32/float64 only, checksums, finite values.
#include <cstdint>
#include <string>
#include <vector>

#include "ash/core/config.hpp"
#include "ash/model/params.hpp"

namespace ash {

constexpr int checkpoint_format_version = 2;

struct CheckpointInfo {
  int format_version = 0;
  ModelDims dims;
  std::string precision;  // "float" or "double": dtype of the stored parameters
  std::int64_t step = 0;
  std::int64_t data_cursor = 0;
  Config config;
  struct Dataset {
    std::string path;
    std::vector<std::int64_t> shape;
    std::string dtype;
  };
  std::vector<Dataset> datasets;
};

// Adam state stored under /optimizer: m/<param path>, v/<param path>, attribute step.
template <class S>
struct OptimizerState {
  const ParamSet<S>* m = nullptr;
  const ParamSet<S>* v = nullptr;
  std::int64_t step = 0;
  // data.carry_state: the state each layer's next window starts from, stored
  // as /train/carry_state [K, Bt·P, N] so a resume continues bitwise.
  const std::vector<View2<S>>* carry = nullptr;
};

template <class S>
void save_checkpoint(const std::string& path, const Config& cfg, const ParamSet<S>& params, std::int64_t step = 0,
                     std::int64_t data_cursor = 0, const OptimizerState<S>& opt = {});

// Reads /optimizer into m and v (sizes from the checkpoint); false when the
// checkpoint has no optimizer state (a fresh `ash init` model).
template <class S>
bool load_optimizer_state(const std::string& path, const ParamSet<S>& m, const ParamSet<S>& v, std::int64_t* step);

// Reads /train/carry_state into state (K views [Bt·P, N], allocated by the
// caller); false when the checkpoint has none; an error when its shape differs.
template <class S>
bool load_carried_state(const std::string& path, const std::vector<View2<S>>& state);

// Reads and validates (version, sizes, every dataset and its shape); converts to S.
template <class S>
ParamSet<S> load_checkpoint(const std::string& path, CheckpointInfo* info = nullptr);
// Only the tensors of one layer range (a rank of a layer-sharded run): a file
// written from any rank layout restores on any other.
template <class S>
ParamSet<S> load_checkpoint(const std::string& path, const LayerRange& range, CheckpointInfo* info = nullptr);

CheckpointInfo inspect_checkpoint(const std::string& path);

template <class S>
void save_gradients(const std::string& path, const Config& cfg, double loss, const ParamSet<S>& grad);

// Reads /grad/* of a gradient file into a ParamSet with the given sizes.
ParamSet<double> load_gradients(const std::string& path, const ModelDims& dims, double* loss = nullptr);

}  // namespace ash
