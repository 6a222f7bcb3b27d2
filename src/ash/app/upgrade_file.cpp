#include "ash/app/upgrade_file.hpp"

#include "ash/app/run_checks.hpp"
#include "ash/core/error.hpp"
#include "ash/io/atomic_write.hpp"
#include "ash/io/run_lock.hpp"

namespace ash {

UpgradeResult upgrade_file(const std::string& path, const std::string& out, bool in_place) {
  require(out.empty() != !in_place, in_place ? "--upgrade: give --out NEW.h5 or --in-place, not both"
                                             : "--upgrade: give --out NEW.h5 (a new file) or --in-place");
  if (in_place)
    io::require_output_path(path, "--in-place: the checkpoint");  // a link is refused, its target untouched
  else
    require_distinct_output(out, {{"the checkpoint", path}});
  UpgradeResult r;
  r.before = inspect_checkpoint(path, Verify::all);
  require_complete(path, r.before);
  if (r.before.format_version >= checkpoint_format_version) return r;
  const std::string target = in_place ? path : out;
  const auto lock = RunLock::for_output(target);
  upgrade_checkpoint(path, target);
  r.written = target;
  return r;
}

}  // namespace ash
