#pragma once
// HDF5 checkpoints and gradient files (docs/design.md §5, format version 3:
// an XXH3-64 digest of every dataset's bytes and of the header, on top of
// HDF5's Fletcher-32 per chunk; versions 2 and 1 still load).
//
//   attributes  format_version, vocab, width, state, layers, seed, precision,
//               step, data_cursor, rng_state, engine, config (the full JSON configuration)
//   /params     embedding [V,P], final_norm [P], head [V,P],
//               layers/000/{norm, W_delta, b_delta, A_log, W_B, W_C, D}, ...
//   /optimizer  m/<param path>, v/<param path>, attribute step (after ash train)
//   /train      carry_state [K, Bt·P, N] (data.carry_state only)
//   gradients:  /loss (scalar), /grad/<same path as under /params>
// Files are built in memory, written to a new "<path>.tmp.XXXXXX", fsynced and
// renamed, so a failed write never replaces a good file. Reading is strict
// (docs/file_format.md): a closed schema (only hard links, only the format's
// objects, each dataset of the shape the model sizes give, checked before
// anything is read or allocated), float32/float64 only, checksums and
// digests, finite values. Writing refuses non-finite values (ash::Error
// naming the tensor), so nothing is written that a reader would refuse.
#include <cstdint>
#include <string>
#include <vector>

#include "ash/core/config.hpp"
#include "ash/model/params.hpp"

namespace ash {

constexpr int checkpoint_format_version = 3;

struct CheckpointInfo {
  int format_version = 0;
  ModelDims dims;
  std::string precision;  // "float" or "double": dtype of the stored parameters
  std::int64_t step = 0;
  std::int64_t data_cursor = 0;
  std::int64_t data_tokens = -1;       // the token file the cursor indexes: its size (-1: not stored)
  std::uint64_t data_fingerprint = 0;  // and its fingerprint (TokenDataset::fingerprint)
  Config config;
  struct Dataset {
    std::string path;
    std::vector<std::int64_t> shape;
    std::string dtype;
  };
  std::vector<Dataset> datasets;
  // inspect_checkpoint(Verify::all): the values read, every one finite (-1: not read).
  std::int64_t finite_values = -1;
};

// Adam state stored under /optimizer: m/<param path>, v/<param path>, attribute step.
template <class S>
struct OptimizerState {
  const ParamSet<S>* m = nullptr;
  const ParamSet<S>* v = nullptr;
  std::int64_t step = 0;
  // data.carry_state: the state each layer's next window starts from, stored
  // as /train/carry_state [K, Bt·P, N] (a Mamba's [K, Bt·E, Kc−1+N], ModelDims::carry_rows/cols)
  // so a resume continues bitwise.
  const std::vector<View2<S>>* carry = nullptr;
  // The token file the data cursor indexes (TokenDataset::fingerprint): its
  // token count and fingerprint, so a resume can tell another file (-1: none).
  std::int64_t data_tokens = -1;
  std::uint64_t data_fingerprint = 0;
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

// The header, configuration and /params shapes without reading the tensors;
// the header's digest is verified (Verify::header).
CheckpointInfo inspect_checkpoint(const std::string& path);
// How much inspect_checkpoint verifies of a format-3 file: nothing (a quick
// look at a damaged file, `ash inspect --no-verify`), the header digest, or
// every dataset too (reads the whole file, a block at a time, and requires
// every value finite; `ash inspect`). Checksums of format-2 files are checked
// by the reads of Verify::all. The structure is checked in every case, before
// anything is read: links, object names, and every dataset's shape (the one
// the model sizes give), type (float32 / float64) and storage (its declared
// bytes stored in the file).
enum class Verify { none, header, all };
CheckpointInfo inspect_checkpoint(const std::string& path, Verify verify);

template <class S>
void save_gradients(const std::string& path, const Config& cfg, double loss, const ParamSet<S>& grad);

// Reads /grad/* of a gradient file into a ParamSet with the given sizes.
ParamSet<double> load_gradients(const std::string& path, const ModelDims& dims, double* loss = nullptr);

// `ash inspect --upgrade`: rewrites a checkpoint or gradient file of format 1
// or 2 as format 3 at `out` (which may be `path`: the write is atomic, so the
// old file stays until the new one is complete). First every check its format
// has (inspect_checkpoint with Verify::all: the structure and shapes, Fletcher-32
// in format 2, every value finite), then every value read in its stored
// precision and written by save_checkpoint / save_gradients (the same tensors,
// header values and stored configuration, with digests), then `out` read back
// with every check of format 3. Returns the old file's information. ash::Error
// when a check fails (nothing is written) or the file is already format 3.
CheckpointInfo upgrade_checkpoint(const std::string& path, const std::string& out);

}  // namespace ash
