#include "ash/io/run_lock.hpp"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include "ash/core/error.hpp"

namespace ash {

RunLock::RunLock(const std::string& dir, const std::string& what) : path_(dir + "/.lock") {
  // The lock file is truncated and rewritten below, so it must be this
  // directory's own regular file: a symbolic link there is never followed (its
  // target, e.g. a checkpoint, would be overwritten with a PID), and a FIFO, a
  // device or a second hard link to another file is refused too.
  const std::string refused = "the lock file '" + path_ + "' of " + what + " '" + dir + "' ";
  const std::string fix = "; remove it (ash creates its own) or choose another " +
                          (what == "run.out_dir" ? what : std::string("path"));
  fd_ = ::open(path_.c_str(), O_RDWR | O_CREAT | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC, 0644);
  if (fd_ < 0 && errno == ELOOP) throw Error(refused + "is a symbolic link, which ash never follows" + fix);
  require(fd_ >= 0, "cannot open the lock file '" + path_ + "': " + std::strerror(errno));
  struct stat st {};
  const bool stat_ok = ::fstat(fd_, &st) == 0;
  if (!stat_ok || !S_ISREG(st.st_mode) || st.st_nlink != 1) {
    ::close(fd_);
    fd_ = -1;
    throw Error(refused + (!stat_ok ? std::string("cannot be examined")
                           : !S_ISREG(st.st_mode) ? std::string("is not a regular file")
                                                  : "has " + std::to_string(st.st_nlink) +
                                                        " hard links (it would overwrite another file)") +
                fix);
  }
  if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    char buf[32] = {0};
    const ssize_t n = ::pread(fd_, buf, sizeof buf - 1, 0);
    ::close(fd_);
    fd_ = -1;
    std::string pid = n > 0 ? std::string(buf, std::size_t(n)) : std::string("unknown");
    while (!pid.empty() && (pid.back() == '\n' || pid.back() == ' ')) pid.pop_back();
    throw Error(what + " '" + dir + "' is in use by another ash train (PID " + pid +
                "); wait for it to finish or choose another " + (what == "run.out_dir" ? what : "path"));
  }
  // The lock holds even if this fails; only the PID in messages is missing.
  const std::string me = std::to_string(::getpid()) + "\n";
  if (::ftruncate(fd_, 0) == 0) (void)!::pwrite(fd_, me.data(), me.size(), 0);
}

RunLock::~RunLock() {
  if (fd_ >= 0) ::close(fd_);  // releases the flock
}

std::unique_ptr<RunLock> RunLock::for_output(const std::string& file) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::path(file).parent_path().empty() ? fs::path(".") : fs::path(file).parent_path();
  std::error_code ec;
  // Whatever is there, a dangling symbolic link included: RunLock refuses what is not a lock file.
  if (!fs::exists(fs::symlink_status(dir / ".lock", ec))) return nullptr;
  return std::make_unique<RunLock>(dir.string(), "the directory of --out");
}

}  // namespace ash
