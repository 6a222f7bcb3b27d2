#include "ash/kernels/matmul.hpp"

#include <atomic>

#include "ash/core/error.hpp"

namespace ash {

namespace {
std::atomic<int> mode_{int(Matmul::fp32)};
}

Matmul matmul_mode() { return Matmul(mode_.load(std::memory_order_relaxed)); }

MatmulScope::MatmulScope(Matmul m, std::size_t scalar_bytes) : prev_(matmul_mode()) {
  require(m == Matmul::fp32 || scalar_bytes == sizeof(float),
          "run.matmul = " + matmul_name(m) + " rounds float products: it needs float (run.precision, --precision)");
  mode_.store(int(m), std::memory_order_relaxed);
}

MatmulScope::~MatmulScope() { mode_.store(int(prev_), std::memory_order_relaxed); }

}  // namespace ash
