#pragma once
// One writer per run directory (docs/design.md §7): a flock on <dir>/.lock,
// held by `ash train` for the whole run and by every other writer of a file in
// a directory that has one (`ash init --out`, `ash grad --out`); the kernel
// drops it when the holder dies, so a stale lock never blocks. The file holds
// the holder's PID for the message.
#include <memory>
#include <string>

namespace ash {

class RunLock {
 public:
  // Takes the lock (creating <dir>/.lock), or throws ash::Error naming the
  // holder's PID. `what` names the directory in the message.
  explicit RunLock(const std::string& dir, const std::string& what = "run.out_dir");
  ~RunLock();
  RunLock(const RunLock&) = delete;
  RunLock& operator=(const RunLock&) = delete;

  // For a writer of `file`: the lock of its directory when that directory is
  // a run directory (it has a .lock), else nothing.
  static std::unique_ptr<RunLock> for_output(const std::string& file);

 private:
  std::string path_;
  int fd_ = -1;
};

}  // namespace ash
