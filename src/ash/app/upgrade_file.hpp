#pragma once
// `ash inspect --upgrade` (docs/cli.md, docs/file_format.md "Versioning"): a
// checkpoint or gradient file of format 1 or 2 rewritten as format 3.
#include <string>

#include "ash/io/checkpoint.hpp"

namespace ash {

struct UpgradeResult {
  CheckpointInfo before;  // the old file, verified with its format's checks
  std::string written;    // the format-3 file written; "" when the file already was format 3
};

// Exactly one of `out` (a new file, not `path` itself) and `in_place` (replace
// `path`, atomically). A file of format 3 is verified with every check and left
// alone. The write holds the run lock of its directory when that is a run
// directory (RunLock::for_output). ash::Error when the old file fails a check
// of its format: nothing is written.
UpgradeResult upgrade_file(const std::string& path, const std::string& out, bool in_place);

}  // namespace ash
