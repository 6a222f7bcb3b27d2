#pragma once
// Runs the `ash` executable from tests and captures its exit code and output.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>

#ifndef ASH_CLI
#error "ASH_CLI must be the path of the ash executable"
#endif

namespace ash::test {

// The ash executable: $ASH_CLI where set (a build moved to another machine, e.g. the GPU
// bundle of perf_tests/gpu/bundle.sh), else the path this test was built with.
inline const char* cli_path() {
  const char* e = std::getenv("ASH_CLI");
  return e && *e ? e : ASH_CLI;
}

struct CliResult {
  int code;
  std::string out;
};

// A shell command's exit code and output (stdout and stderr).
inline CliResult run_shell(const std::string& cmd) {
  FILE* p = popen((cmd + " 2>&1").c_str(), "r");
  std::string out;
  char buf[4096];
  while (std::size_t n = fread(buf, 1, sizeof buf, p)) out.append(buf, n);
  const int st = pclose(p);
  return {WIFEXITED(st) ? WEXITSTATUS(st) : -1, out};
}

inline CliResult run(const std::string& args) { return run_shell(std::string(cli_path()) + " " + args); }

inline void write(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary) << text;
}

// A clear message, a non-zero exit, and no crash report.
#define EXPECT_FAILS_WITH(res, needle)                                              \
  do {                                                                              \
    const auto r_ = (res);                                                          \
    EXPECT_NE(r_.code, 0) << r_.out;                                                \
    EXPECT_NE(r_.out.find(needle), std::string::npos) << "output was:\n" << r_.out; \
    EXPECT_EQ(r_.out.find("internal error"), std::string::npos) << r_.out;          \
  } while (0)

}  // namespace ash::test
