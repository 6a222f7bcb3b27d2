#pragma once
// The use-case floor (docs/architecture.md): what the `ash` tool and the Python
// module both do before a run, written once. Front ends parse, convert and print.
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "ash/core/config.hpp"

namespace ash {

// The typed options a front end gives for a run on a checkpoint (`ash grad` / `ash eval`'s
// flags, Python's grad / evaluate keywords). The one rule, the same for every front end
// (docs/cli.md "ash grad", docs/python.md "grad"): an option left unset keeps the checkpoint's
// stored value (or what `sets` made of it); an option given replaces it.
struct RunOverrides {
  std::vector<std::string> sets;  // the user's key=value assignments (--set, set=), before the options below
  // data.separator back to "" before `sets` (Python's ids=: every row is one whole sequence;
  // `sets` may still set a separator).
  bool rows_are_sequences = false;
  std::optional<std::string> engine;               // grad.engine
  std::optional<std::int64_t> truncate;            // grad.truncate
  std::optional<bool> detach_inputs;               // grad.detach_inputs
  std::optional<std::int64_t> chunk;               // grad.chunk
  std::optional<std::int64_t> layer_checkpoint;    // grad.layer_checkpoint
  std::optional<std::int64_t> token_block;         // grad.token_block
  std::optional<std::string> storage;              // run.storage
  std::optional<std::int64_t> seq_len, batch;      // data.seq_len, data.batch
  std::optional<bool> carry_state;                 // data.carry_state (true: data.sequential too)
};

// The configuration of a run on a checkpoint (ash grad / eval / generate, Python's
// grad and evaluate), from the checkpoint's stored one (CheckpointInfo::config): its
// dist section back to the defaults (the rank layout is this run's, not the writer's),
// then the overrides (`sets` first, then each option given); validated. The model
// sizes are the checkpoint's: an assignment that changes them is an error.
Config checkpoint_run_config(Config stored, const RunOverrides& overrides = {});

// ash train's configuration (Python's train): over the defaults, or over a resumed
// checkpoint's stored configuration (resumed; dist reset, as above), the configuration
// file and JSON text ("" for none) and then the assignments; validated.
Config train_config(const Config* resumed, const std::string& config_file, const std::string& config_json,
                    const std::vector<std::string>& sets);

}  // namespace ash
