// GoogleTest main: Kokkos lives for the whole test run, memory tracking on.
//
// Every run prints the backend it runs on, as ctest names it: the lower-case
// name of the default execution space (the library's ash::ExecSpace), with
// ".t<threads>" for a multi-threaded host space ("serial", "openmp.t2",
// "cuda"). ctest runs the engine tests once per backend variant of the build
// (unit_tests/CMakeLists.txt) and passes that name as --ash-backend=NAME; a run
// whose Kokkos is something else (another space, another thread count because
// Kokkos ignored the thread option) fails before any test instead of passing
// on the wrong backend.
#include <gtest/gtest.h>

#include <cctype>
#include <cstdio>
#include <cstring>
#include <string>

#include "ash/core/memory.hpp"
#include "ash/core/types.hpp"
#include <Kokkos_Core.hpp>

namespace {

// Removes --ash-backend=NAME from argv (Kokkos and GoogleTest never see it); returns NAME.
std::string take_backend_flag(int& argc, char* argv[]) {
  static const char flag[] = "--ash-backend=";
  std::string value;
  int out = 1;
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], flag, sizeof(flag) - 1) == 0)
      value = argv[i] + sizeof(flag) - 1;
    else
      argv[out++] = argv[i];
  }
  argc = out;
  argv[argc] = nullptr;
  return value;
}

std::string backend_now() {
  std::string name = ash::ExecSpace::name();
  for (char& c : name) c = char(std::tolower(static_cast<unsigned char>(c)));
  const int threads = int(ash::ExecSpace().concurrency());
  // Serial has one thread by definition, a GPU's concurrency is not a thread count.
  if (ash::host_backend && name != "serial") name += ".t" + std::to_string(threads);
  return name;
}

}  // namespace

int main(int argc, char* argv[]) {
  ::testing::InitGoogleTest(&argc, argv);
  const std::string expected = take_backend_flag(argc, argv);
  Kokkos::ScopeGuard kokkos(argc, argv);
  ash::MemoryTracker::install();
  if (GTEST_FLAG_GET(list_tests)) return RUN_ALL_TESTS();  // ctest parses this listing: print nothing else
  const std::string backend = backend_now();
  std::printf("[ash] backend %s (Kokkos %d.%d.%d)\n", backend.c_str(), KOKKOS_VERSION / 10000, KOKKOS_VERSION / 100 % 100,
              KOKKOS_VERSION % 100);
  if (!expected.empty() && expected != backend) {
    std::fprintf(stderr, "[ash] this run was to be on backend %s but Kokkos runs it on %s\n", expected.c_str(),
                 backend.c_str());
    return 1;
  }
  std::fflush(stdout);
  return RUN_ALL_TESTS();
}
