#pragma once
// The use-case floor (docs/architecture.md): what the `ash` tool and the Python
// module both do before a run, written once. Front ends parse, convert and print.
#include <string>
#include <vector>

#include "ash/core/config.hpp"

namespace ash {

// The configuration of a run on a checkpoint (ash grad / eval / generate, Python's
// grad and evaluate), from the checkpoint's stored one (CheckpointInfo::config): its
// dist section back to the defaults (the rank layout is this run's, not the writer's),
// then the `key=value` assignments. The model sizes are the checkpoint's: an
// assignment that changes them is an error.
Config checkpoint_run_config(Config stored, const std::vector<std::string>& sets);

// ash train's configuration (Python's train): over the defaults, or over a resumed
// checkpoint's stored configuration (resumed; dist reset, as above), the configuration
// file and JSON text ("" for none) and then the assignments; validated.
Config train_config(const Config* resumed, const std::string& config_file, const std::string& config_json,
                    const std::vector<std::string>& sets);

}  // namespace ash
