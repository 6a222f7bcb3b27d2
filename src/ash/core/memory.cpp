#include "ash/core/memory.hpp"

#include <sys/resource.h>
#include <unistd.h>

#include <Kokkos_Core.hpp>
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <mutex>
#include <sstream>

namespace ash {

namespace {

struct State {
  std::mutex mu;
  std::map<std::string, SpaceUsage> spaces;
  // Per space: live bytes per label now, and a copy taken at the peak.
  std::map<std::string, std::map<std::string, std::uint64_t>> live, at_peak;
  bool installed = false;
};

State& state() {
  static State s;
  return s;
}

void on_alloc(const Kokkos::Tools::SpaceHandle h, const char* label, const void*, const std::uint64_t size) {
  auto& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  auto& u = s.spaces[h.name];
  u.space = h.name;
  u.current += size;
  u.allocations += 1;
  u.allocated_bytes += size;
  auto& live = s.live[h.name];
  live[label ? label : ""] += size;
  if (u.current > u.peak) {
    u.peak = u.current;
    s.at_peak[h.name] = live;
  }
}

void on_dealloc(const Kokkos::Tools::SpaceHandle h, const char* label, const void*, const std::uint64_t size) {
  auto& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  auto& u = s.spaces[h.name];
  u.current = u.current >= size ? u.current - size : 0;
  auto& live = s.live[h.name];
  auto it = live.find(label ? label : "");
  if (it != live.end()) {
    it->second = it->second >= size ? it->second - size : 0;
    if (it->second == 0) live.erase(it);
  }
}

}  // namespace

void MemoryTracker::install() {
  auto& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  if (s.installed) return;
  // Kokkos 3.4 only calls the data callbacks when it believes a tool library is
  // loaded, which it decides from the init callback; a no-op one satisfies it.
  // (A generic lambda converts to the device-info pointer type of either version.)
  Kokkos::Tools::Experimental::set_init_callback([](const int, const std::uint64_t, const std::uint32_t, auto*) {});
  Kokkos::Tools::Experimental::set_allocate_data_callback(on_alloc);
  Kokkos::Tools::Experimental::set_deallocate_data_callback(on_dealloc);
  s.installed = true;
}

bool MemoryTracker::installed() {
  auto& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  return s.installed;
}

std::vector<SpaceUsage> MemoryTracker::usage() {
  auto& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  std::vector<SpaceUsage> out;
  for (const auto& kv : s.spaces) out.push_back(kv.second);
  return out;
}

std::uint64_t MemoryTracker::current(const std::string& space) {
  auto& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  auto it = s.spaces.find(space);
  return it == s.spaces.end() ? 0 : it->second.current;
}

std::uint64_t MemoryTracker::peak(const std::string& space) {
  auto& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  auto it = s.spaces.find(space);
  return it == s.spaces.end() ? 0 : it->second.peak;
}

std::uint64_t MemoryTracker::allocations(const std::string& space) {
  auto& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  auto it = s.spaces.find(space);
  return it == s.spaces.end() ? 0 : it->second.allocations;
}

std::uint64_t MemoryTracker::allocated_bytes(const std::string& space) {
  auto& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  auto it = s.spaces.find(space);
  return it == s.spaces.end() ? 0 : it->second.allocated_bytes;
}

void MemoryTracker::reset_peak() {
  auto& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  for (auto& kv : s.spaces) kv.second.peak = kv.second.current;
  s.at_peak = s.live;
}

std::vector<std::pair<std::string, std::uint64_t>> MemoryTracker::peak_breakdown(const std::string& space,
                                                                                 std::size_t top) {
  auto& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  std::vector<std::pair<std::string, std::uint64_t>> rows;
  const auto it = s.at_peak.find(space);
  if (it != s.at_peak.end()) rows.assign(it->second.begin(), it->second.end());
  std::stable_sort(rows.begin(), rows.end(), [](const auto& a, const auto& b) { return a.second > b.second; });
  if (rows.size() > top) rows.resize(top);
  return rows;
}

std::uint64_t MemoryTracker::process_hwm_bytes() {
  std::ifstream in("/proc/self/status");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("VmHWM:", 0) == 0) {
      std::istringstream ss(line.substr(6));
      std::uint64_t kb = 0;
      ss >> kb;
      return kb * 1024;
    }
  }
  return 0;
}

std::string format_bytes(std::uint64_t b) {
  char buf[64];
  if (b >= (1ull << 30))
    std::snprintf(buf, sizeof buf, "%.2f GiB", double(b) / double(1ull << 30));
  else if (b >= (1ull << 20))
    std::snprintf(buf, sizeof buf, "%.2f MiB", double(b) / double(1ull << 20));
  else if (b >= 1024)
    std::snprintf(buf, sizeof buf, "%.1f KiB", double(b) / 1024.0);
  else
    std::snprintf(buf, sizeof buf, "%llu B", static_cast<unsigned long long>(b));
  return buf;
}

std::string MemoryTracker::summary() {
  std::string out;
  for (const auto& u : usage()) out += u.space + " peak " + format_bytes(u.peak) + ", ";
  return out + "process HWM " + format_bytes(process_hwm_bytes());
}

namespace {
// Debian's OpenBLAS (libopenblas0-pthread) maps one 128 MiB buffer per thread that
// runs a product (blas_memory_alloc); its thread count: OPENBLAS_NUM_THREADS,
// GOTO_NUM_THREADS, OMP_NUM_THREADS, else every core.
constexpr std::uint64_t openblas_buffer_bytes = std::uint64_t(128) << 20;
std::uint64_t blas_threads() {
  for (const char* v : {"OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "OMP_NUM_THREADS"})
    if (const char* e = std::getenv(v); e && std::atoi(e) > 0) return std::uint64_t(std::min(std::atoi(e), 256));
  const long n = ::sysconf(_SC_NPROCESSORS_ONLN);
  return n > 0 ? std::uint64_t(std::min(n, 256L)) : 1;
}
}  // namespace

std::uint64_t address_space_headroom() {
  rlimit lim{};
  if (::getrlimit(RLIMIT_AS, &lim) != 0 || lim.rlim_cur == RLIM_INFINITY) return ~std::uint64_t(0);
  std::uint64_t mapped = 0;  // /proc/self/statm: the first field is the mapped size in pages
  if (std::FILE* f = std::fopen("/proc/self/statm", "r")) {
    unsigned long long pages = 0;
    if (std::fscanf(f, "%llu", &pages) == 1) mapped = pages * std::uint64_t(::sysconf(_SC_PAGESIZE));
    std::fclose(f);
  }
  const std::uint64_t used = mapped + blas_threads() * openblas_buffer_bytes;
  return std::uint64_t(lim.rlim_cur) > used ? std::uint64_t(lim.rlim_cur) - used : 0;
}

std::uint64_t physical_memory_bytes() {
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page <= 0) return 0;
  return std::uint64_t(pages) * std::uint64_t(page);
}

}  // namespace ash
