#include "ash/core/profiler.hpp"

#include <Kokkos_Core.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>
#include <mutex>

#include "ash/core/memory.hpp"

namespace ash {

namespace {

using Clock = std::chrono::steady_clock;

struct Open {
  std::string name;
  Clock::time_point t0;
};

struct State {
  std::mutex mu;
  std::map<std::string, KernelProfiler::Entry> tally;
  std::map<std::uint64_t, Open> open;  // kernels in flight by id
  std::vector<Open> regions;           // region stack
  std::uint64_t next_id = 0;
};

State& state() {
  static State s;
  return s;
}

void add(const std::string& name, Clock::time_point t0) {
  auto& e = state().tally[name];
  e.name = name;
  e.calls += 1;
  e.seconds += std::chrono::duration<double>(Clock::now() - t0).count();
}

void begin_kernel(const char* name, const std::uint32_t, std::uint64_t* id) {
  auto& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  *id = s.next_id++;
  s.open[*id] = Open{name, Clock::now()};
}

void end_kernel(const std::uint64_t id) {
  auto& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  const auto it = s.open.find(id);
  if (it == s.open.end()) return;
  add(it->second.name, it->second.t0);
  s.open.erase(it);
}

// The project's regions wrap library calls (cuBLAS) that Kokkos' kernel
// callbacks do not see, and that run asynchronously on a GPU: fence at both
// ends so a region's time is its own, not charged to the next kernel.
bool own_region(const std::string& name) { return name.rfind("ash::", 0) == 0; }

void push_region(const char* name) {
  if (own_region(name)) Kokkos::fence();
  auto& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  s.regions.push_back(Open{name, Clock::now()});
}

// Only the project's own regions are tallied: libraries nest theirs inside
// (KokkosBlas names each gemm again), which would count the time twice.
void pop_region() {
  auto& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  if (s.regions.empty()) return;
  if (own_region(s.regions.back().name)) {
    Kokkos::fence();
    add(s.regions.back().name, s.regions.back().t0);
  }
  s.regions.pop_back();
}

}  // namespace

void KernelProfiler::start() {
  MemoryTracker::install();  // the no-op init callback Kokkos 3.4 needs before it calls any tool callback
  {
    auto& s = state();
    std::lock_guard<std::mutex> lock(s.mu);
    s.tally.clear();
    s.open.clear();
    s.regions.clear();
  }
  namespace kt = Kokkos::Tools::Experimental;
  kt::set_begin_parallel_for_callback(begin_kernel);
  kt::set_end_parallel_for_callback(end_kernel);
  kt::set_begin_parallel_reduce_callback(begin_kernel);
  kt::set_end_parallel_reduce_callback(end_kernel);
  kt::set_begin_parallel_scan_callback(begin_kernel);
  kt::set_end_parallel_scan_callback(end_kernel);
  kt::set_push_region_callback(push_region);
  kt::set_pop_region_callback(pop_region);
}

void KernelProfiler::stop() {
  namespace kt = Kokkos::Tools::Experimental;
  kt::set_begin_parallel_for_callback(nullptr);
  kt::set_end_parallel_for_callback(nullptr);
  kt::set_begin_parallel_reduce_callback(nullptr);
  kt::set_end_parallel_reduce_callback(nullptr);
  kt::set_begin_parallel_scan_callback(nullptr);
  kt::set_end_parallel_scan_callback(nullptr);
  kt::set_push_region_callback(nullptr);
  kt::set_pop_region_callback(nullptr);
}

std::vector<KernelProfiler::Entry> KernelProfiler::entries() {
  auto& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  std::vector<Entry> out;
  for (const auto& kv : s.tally) out.push_back(kv.second);
  std::sort(out.begin(), out.end(), [](const Entry& a, const Entry& b) { return a.seconds > b.seconds; });
  return out;
}

std::string KernelProfiler::table(double total_seconds) {
  std::string out;
  char line[256];
  std::snprintf(line, sizeof line, "  %-44s %8s %11s %7s\n", "kernel", "calls", "seconds", "share");
  out += line;
  double sum = 0;
  for (const auto& e : entries()) {
    sum += e.seconds;
    std::snprintf(line, sizeof line, "  %-44s %8llu %11.4f %6.1f%%\n", e.name.c_str(),
                  static_cast<unsigned long long>(e.calls), e.seconds,
                  total_seconds > 0 ? 100.0 * e.seconds / total_seconds : 0.0);
    out += line;
  }
  std::snprintf(line, sizeof line, "  %-44s %8s %11.4f %6.1f%%\n", "(all timed)", "", sum,
                total_seconds > 0 ? 100.0 * sum / total_seconds : 0.0);
  out += line;
  return out;
}

}  // namespace ash
