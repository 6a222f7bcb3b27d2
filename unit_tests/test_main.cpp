// GoogleTest main: Kokkos lives for the whole test run, memory tracking on.
#include <gtest/gtest.h>

#include "ash/core/memory.hpp"
#include <Kokkos_Core.hpp>

int main(int argc, char* argv[]) {
  ::testing::InitGoogleTest(&argc, argv);
  Kokkos::ScopeGuard kokkos(argc, argv);
  ash::MemoryTracker::install();
  return RUN_ALL_TESTS();
}
