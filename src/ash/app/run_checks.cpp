#include "ash/app/run_checks.hpp"

#include <filesystem>

#include "ash/core/error.hpp"
#include "ash/io/atomic_write.hpp"

namespace ash {

bool same_file(const std::string& a, const std::string& b) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (fs::weakly_canonical(a, ec) == fs::weakly_canonical(b, ec) && !ec) return true;
  return fs::exists(a, ec) && fs::exists(b, ec) && fs::equivalent(a, b, ec) && !ec;
}

void require_distinct_output(const std::string& out, const std::vector<std::pair<std::string, std::string>>& inputs) {
  for (const auto& [flag, path] : inputs)
    if (!path.empty()) require(!same_file(out, path), "--out '" + out + "' is the same file as " + flag + " '" + path + "'");
  io::require_output_path(out, "--out");  // checked again when written; here before any work
}

std::string no_targets_message(const std::string& source, const std::string& windows) {
  return source + ": " + windows +
         " hold no target: every token after the first of a window starts a document (data.separator), so there "
         "is nothing to predict and no loss";
}

void require_complete(const std::string& path, const CheckpointInfo& info) {
  std::string missing;
  std::size_t present = 0;
  for (const auto& d : info.datasets) {
    if (d.dtype == "missing")
      missing += (missing.empty() ? "" : ", ") + d.path;
    else
      ++present;
  }
  require(present == 0 || missing.empty(),
          "'" + path + "' is incomplete: " + missing + " missing (every verb that loads it refuses it)");
}

std::string format_warning(const std::string& path, const CheckpointInfo& info) {
  if (info.format_version >= 3) return "";
  if (info.format_version == 2)
    return "'" + path +
           "' is checkpoint format 2: its data is checked by Fletcher-32 only, without format 3's XXH3 digests (some "
           "corruptions and any edit made through HDF5 go unseen)";
  return "'" + path + "' is checkpoint format 1: nothing checks its data (no Fletcher-32 checksums, no digests)";
}

}  // namespace ash
