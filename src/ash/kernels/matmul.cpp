#include "ash/kernels/matmul.hpp"

#include <atomic>

#include "ash/core/error.hpp"

#if defined(__GNUC__) && defined(__x86_64__) && defined(__ELF__)
// OpenBLAS's own query, when OpenBLAS is the BLAS linked (weak: absent otherwise).
extern "C" __attribute__((weak)) char* openblas_get_corename(void);
#define ASH_OPENBLAS_QUERY 1
#endif

namespace ash {

namespace {
std::atomic<int> mode_{int(Matmul::fp32)};
}

std::string blas_core_note() {
#ifdef ASH_OPENBLAS_QUERY
  if (openblas_get_corename == nullptr) return "";
  const std::string core = openblas_get_corename();
  std::string note = "OpenBLAS core " + core;
  const bool generic = core == "Prescott" || core == "Core2" || core == "Penryn" || core == "Dunnington" ||
                       core == "Nehalem" || core == "Atom" || core == "Katmai" || core == "Coppermine" ||
                       core == "Northwood" || core == "Banias";
  if (generic && __builtin_cpu_supports("avx2"))
    note += std::string(" on a CPU with ") + (__builtin_cpu_supports("avx512f") ? "AVX-512" : "AVX2") +
            " (OpenBLAS does not know this CPU model): its products run about 2x slower than with "
            "OPENBLAS_CORETYPE=" + (__builtin_cpu_supports("avx512f") ? "SkylakeX" : "Haswell");
  return note;
#else
  return "";
#endif
}

Matmul matmul_mode() { return Matmul(mode_.load(std::memory_order_relaxed)); }

MatmulScope::MatmulScope(Matmul m, std::size_t scalar_bytes) : prev_(matmul_mode()) {
  require(m == Matmul::fp32 || scalar_bytes == sizeof(float),
          "run.matmul = " + matmul_name(m) + " rounds float products: it needs float (run.precision, --precision)");
  mode_.store(int(m), std::memory_order_relaxed);
}

MatmulScope::~MatmulScope() { mode_.store(int(prev_), std::memory_order_relaxed); }

}  // namespace ash
