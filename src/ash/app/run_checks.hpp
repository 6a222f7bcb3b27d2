#pragma once
// The rules every verb checks before it writes or reports (the use-case floor,
// docs/architecture.md): an output that would replace an input, windows that hold
// no target, a checkpoint format with weaker checks.
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "ash/io/checkpoint.hpp"

namespace ash {

// How a front end reads a checkpoint's header (inspect_checkpoint with
// Verify::header; the tool also warns about old formats, format_warning).
using CheckpointReader = std::function<CheckpointInfo(const std::string& path)>;

// The same file by path or by inode (a hard link, "./x" vs "x").
bool same_file(const std::string& a, const std::string& b);

// Throws ash::Error when `out` is one of the inputs, given as (flag, path) pairs
// ("" paths skipped; the same file by name, through links, or by inode): ash grad
// --checkpoint X --out X would replace the model with a gradient file; and when
// `out` breaks the output rule (io::require_output_path: not absent or a regular
// file), before any work.
void require_distinct_output(const std::string& out, const std::vector<std::pair<std::string, std::string>>& inputs);

// The message for windows that hold no target (data.separator only: a window of
// T >= 2 tokens without document starts has T - 1 targets). source names the tokens
// ("token file 'x'"), windows the windows ("its windows").
std::string no_targets_message(const std::string& source, const std::string& windows);

// Throws ash::Error when a checkpoint holds some of its /params datasets and not
// the others (info from inspect_checkpoint): no verified checkpoint, and every verb
// that loads it refuses it (ash inspect lists what is there first).
void require_complete(const std::string& path, const CheckpointInfo& info);

// The warning a checkpoint of a format with weaker checks than format 3 deserves
// (docs/file_format.md, Versioning), or "" for format 3 and later.
std::string format_warning(const std::string& path, const CheckpointInfo& info);

}  // namespace ash
