#pragma once
// `ash grad` and Python's grad as one library call (the use-case floor,
// docs/architecture.md): the memory check, the windows, the "no target" rule, the
// run context (one process or this rank of dist.*), the loss and full gradient,
// and the gradient file when asked for. The front ends build the configuration
// from their options and print or convert the result.
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "ash/app/token_windows.hpp"
#include "ash/core/config.hpp"
#include "ash/distributed/pipeline_stats.hpp"
#include "ash/distributed/run_context.hpp"
#include "ash/model/params.hpp"

namespace ash {

struct GradFileOptions {
  std::string out;              // the gradient file to write (world rank 0, under the run lock); "": none
  std::uint64_t max_memory = 0; // check_memory's limit (0: the machine's)
  int fail_rank = -1;           // test seam: this world rank fails before the backward (RunContext)
};

template <class S>
struct GradFileResult {
  double loss = 0;
  double seconds = 0;                    // the gradient's wall time (barrier to barrier)
  std::string engine;                    // the engine's name
  ParamSet<S> grad;                      // this process's layers of the gradient
  bool distributed = false;
  std::optional<dist::PipelineStats> pipeline;  // distributed runs only
  std::vector<RankPlace> places;                // distributed runs only: every world rank's place
  std::vector<std::uint64_t> usage;      // per world rank: memory space peak, process HWM, bytes sent
  std::string memory;                    // MemoryTracker::summary() after the run
  double planned_peak = 0;               // plan_memory's total for this configuration (ash plan --for grad)
};

// The loss and gradient of the checkpoint's model (compute type S) over the first
// data.batch windows of data.seq_len tokens of `tokens` (document starts from
// data.separator), with cfg's settings (cfg: checkpoint_run_config and the verb's
// options). Throws ash::Error when the windows hold no target or the loss is not
// finite (nothing is written then). state (one process, data.carry_state): the
// carried state the windows start from (check_carried_state's shape), on return
// the state after them; the gradient treats it as a constant (Python's grad(state=)).
template <class S>
GradFileResult<S> grad_file(const std::string& checkpoint, const Config& cfg, const TokenSource& tokens,
                            const GradFileOptions& opts = {}, std::vector<View2<S>>* state = nullptr);

}  // namespace ash
