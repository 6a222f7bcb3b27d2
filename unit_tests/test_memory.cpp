// The memory tracker sees Views through the Kokkos Tools callbacks.
#include "test_helpers.hpp"

namespace ash::test {

TEST(Memory, SeesAKnownAllocation) {
  ASSERT_TRUE(MemoryTracker::installed());
  const std::string space = MemSpace::name();
  const auto before = MemoryTracker::current(space);
  MemoryTracker::reset_peak();
  const index_t n = 1 << 20;
  {
    View1<double> v("ash::test::known", n);
    const auto during = MemoryTracker::current(space);
    // Kokkos adds a small header to each allocation.
    EXPECT_GE(during - before, std::uint64_t(n * sizeof(double)));
    EXPECT_LE(during - before, std::uint64_t(n * sizeof(double) + 4096));
  }
  EXPECT_EQ(MemoryTracker::current(space), before);
  EXPECT_GE(MemoryTracker::peak(space) - before, std::uint64_t(n * sizeof(double)));
  MemoryTracker::reset_peak();
  EXPECT_EQ(MemoryTracker::peak(space), before);
  EXPECT_GT(MemoryTracker::process_hwm_bytes(), std::uint64_t(n * sizeof(double)));
}

// The peak is broken down by label as it stood at the peak: a View freed
// before the peak is absent, one freed after it is listed.
TEST(Memory, BreaksThePeakDownByLabel) {
  const std::string space = MemSpace::name();
  MemoryTracker::reset_peak();
  const index_t n = 1 << 18;
  { View1<float> early("ash::test::early", n / 2); }
  {
    View1<float> big("ash::test::big", n);
    View1<float> small("ash::test::small", n / 4);
  }
  const auto rows = MemoryTracker::peak_breakdown(space);
  auto bytes = [&](const std::string& label) -> std::uint64_t {
    for (const auto& r : rows)
      if (r.first == label) return r.second;
    return 0;
  };
  EXPECT_GE(bytes("ash::test::big"), std::uint64_t(n * sizeof(float)));
  EXPECT_LE(bytes("ash::test::big"), std::uint64_t(n * sizeof(float) + 4096));
  EXPECT_GE(bytes("ash::test::small"), std::uint64_t(n / 4 * sizeof(float)));
  EXPECT_EQ(bytes("ash::test::early"), 0u);
  ASSERT_GE(rows.size(), 2u);
  EXPECT_EQ(rows.front().first, "ash::test::big");  // largest first
}

TEST(Memory, BackpropPeakGrowsWithStoredState) {
  // E1 keeps A and h for every (token, channel, state): its peak must exceed
  // that storage for one layer, M·P·N·2 scalars.
  const auto d = tiny_dims(2, 17, 16, 8);
  auto ps = random_model<double>(d, 1);
  const auto x = random_tokens(2, 256, d.vocab, 2);
  ParamSet<double> g(d);
  // Warm-up: backends keep their own scratch (e.g. Kokkos::Serial::scratch_mem) for later kernels.
  make_engine<double>(EngineOptions{})->compute(ps, x, g);
  const std::string space = MemSpace::name();
  const auto base = MemoryTracker::current(space);
  MemoryTracker::reset_peak();
  make_engine<double>(EngineOptions{})->compute(ps, x, g);
  const std::uint64_t state_bytes = 2ull * 2 * 256 * 16 * 8 * sizeof(double) * d.layers;
  EXPECT_GE(MemoryTracker::peak(space) - base, state_bytes);
  EXPECT_EQ(MemoryTracker::current(space), base);  // nothing leaked
}

TEST(Memory, FormatsBytes) {
  EXPECT_EQ(format_bytes(512), "512 B");
  EXPECT_EQ(format_bytes(3 << 20), "3.00 MiB");
}

}  // namespace ash::test
