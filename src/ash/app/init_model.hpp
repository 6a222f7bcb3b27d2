#pragma once
// `ash init` and Python's init as one library call (the use-case floor,
// docs/architecture.md): the memory check, a seeded initialisation, and the
// checkpoint when asked for.
#include <cstdint>
#include <functional>
#include <string>

#include "ash/core/config.hpp"
#include "ash/model/params.hpp"

namespace ash {

// A model of cfg's sizes initialised from model.seed, after check_memory's
// Workload::init estimate against max_memory (0: the machine's).
template <class S>
ParamSet<S> init_params(const Config& cfg, std::uint64_t max_memory = 0);

// ash init: init_params, written as the checkpoint `out` (under the run lock: not
// while a train of that run directory runs). config_file: the file cfg was read
// from ("" for none), which `out` may not replace. Returns the model.
template <class S>
ParamSet<S> init_file(const Config& cfg, const std::string& config_file, const std::string& out,
                      std::uint64_t max_memory = 0);

// Python's save: the checkpoint `out` of cfg's model at `step`, its parameters written by
// `fill` into a ParamSet of cfg's layout. Refused before anything is allocated: a negative
// step (every reader refuses it), or a run directory whose train runs (the run lock, held
// until the file is written, as ash init holds it).
template <class S>
void save_file(const std::string& out, const Config& cfg, std::int64_t step,
               const std::function<void(const ParamSet<S>&)>& fill);

}  // namespace ash
