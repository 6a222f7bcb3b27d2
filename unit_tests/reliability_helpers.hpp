#pragma once
// Shared by the test_reliability_*.cpp files (docs/design.md §7): the ash tool run
// as a user would (a clear error is exit 2 with a message), `ash train` as a child
// process for the lock and signal tests, and the small model and corpus they use.
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <stdexcept>
#include <string>
#include <vector>

#include "cli_runner.hpp"
#include "test_helpers.hpp"

namespace ash::test {

namespace fs = std::filesystem;

inline std::string corpus_file() { return word_corpus(tmp_path("corpus.txt")); }

// Exit 2 (a user error), the message, no crash and no "internal error".
#define EXPECT_CLEAR_ERROR(res, needle)                                             \
  do {                                                                              \
    const auto r2_ = (res);                                                         \
    EXPECT_EQ(r2_.code, 2) << r2_.out;                                              \
    EXPECT_NE(r2_.out.find(needle), std::string::npos) << "output was:\n" << r2_.out; \
    EXPECT_EQ(r2_.out.find("internal error"), std::string::npos) << r2_.out;        \
  } while (0)

inline const std::string small_model =
    "--set model.width=8 --set model.state=4 --set model.layers=2 --set data.seq_len=32 ";

// `ash train` as a child process of its own (so signals reach ash itself, not
// a shell), its stdout and stderr on a pipe.
class Child {
 public:
  explicit Child(const std::vector<std::string>& args) {
    int fds[2];
    if (::pipe(fds) != 0) throw std::runtime_error("pipe");
    pid_ = ::fork();
    if (pid_ == 0) {
      ::dup2(fds[1], 1);
      ::dup2(fds[1], 2);
      ::close(fds[0]);
      ::close(fds[1]);
      std::vector<char*> argv{const_cast<char*>(cli_path())};
      for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
      argv.push_back(nullptr);
      ::execv(cli_path(), argv.data());
      ::_exit(127);
    }
    ::close(fds[1]);
    fd_ = fds[0];
  }
  ~Child() {
    if (pid_ > 0 && !waited_) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
    if (fd_ >= 0) ::close(fd_);
  }
  pid_t pid() const { return pid_; }
  // Reads until `needle` appears in the output (true) or EOF / timeout.
  bool wait_for(const std::string& needle, double seconds = 60) {
    const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
    while (out_.find(needle) == std::string::npos) {
      const auto left = std::chrono::duration<double>(end - std::chrono::steady_clock::now()).count();
      if (left <= 0) return false;
      pollfd p{fd_, POLLIN, 0};
      if (::poll(&p, 1, int(left * 1000) + 1) <= 0) return false;
      char buf[4096];
      const ssize_t n = ::read(fd_, buf, sizeof buf);
      if (n <= 0) return out_.find(needle) != std::string::npos;
      out_.append(buf, std::size_t(n));
    }
    return true;
  }
  // Reads to EOF and reaps; the raw wait status.
  int finish() {
    wait_for("\x01never\x01", 120);
    int st = 0;
    ::waitpid(pid_, &st, 0);
    waited_ = true;
    return st;
  }
  const std::string& out() const { return out_; }

 private:
  pid_t pid_ = -1;
  int fd_ = -1;
  bool waited_ = false;
  std::string out_;
};

inline std::vector<std::string> train_args(const std::string& dir, const std::string& corpus, long long steps) {
  return {"train",       "--set", "model.width=8",         "--set", "model.state=4",
          "--set",       "model.layers=2", "--set", "data.seq_len=64", "--set",
          "data.train=" + corpus, "--set", "optim.steps=" + std::to_string(steps), "--set",
          "run.log_every=1", "--set", "run.ckpt_every=0", "--set", "run.eval_every=0",
          "--set", "run.out_dir=" + dir};
}

// Every verb that reads a checkpoint, on `file` (train resumes from it, with train_sets).
inline std::vector<std::string> reading_verbs(const std::string& file, const std::string& corpus,
                                              const std::string& train_sets = "") {
  return {"inspect " + file,
          "inspect --no-verify " + file,
          "generate --checkpoint " + file + " --prompt ab --tokens 2",
          "grad --checkpoint " + file + " --tokens " + corpus + " --out " + tmp_path("g.h5"),
          "eval --checkpoint " + file + " --tokens " + corpus,
          "train " + small_model + "--set data.train=" + corpus + " --set run.out_dir=" + tmp_path("run") + " " +
              train_sets + "--resume " + file};
}

inline std::int64_t checkpoint_step(const std::string& path) {
  CheckpointInfo info;
  load_checkpoint<float>(path, &info);
  return info.step;
}

// Flips one bit inside the stored bytes of layer 1's W_B (its raw little-endian
// doubles appear once in the file); returns the file's new bytes ("" if not found).
inline std::string flip_bit_in_w_b(const std::string& path, const ParamSet<double>& ps) {
  auto bytes = slurp(path);
  const auto& t = ps.tensor("layers/001/W_B");
  const auto host = to_host(ps);
  std::string raw(std::size_t(t.size()) * 8, '\0');
  std::memcpy(&raw[0], host.data() + t.offset, raw.size());
  const auto at = bytes.find(raw);
  if (at == std::string::npos) return "";
  bytes[at + 13] ^= 0x04;
  write(path, bytes);
  return bytes;
}

// `ash ARGS` under a timeout (a hang is status 124).
inline CliResult timed(const std::string& args) {
  return run_shell("timeout 120 " + std::string(cli_path()) + " " + args);
}

}  // namespace ash::test
