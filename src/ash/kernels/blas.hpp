#pragma once
// Dense products through Kokkos Kernels (OpenBLAS / cuBLAS behind it).
// Only the 7-argument gemm exists in Kokkos Kernels 3.4 (Debian's Trilinos 13.2 packages).
#include <KokkosBlas3_gemm.hpp>

namespace ash::impl {

// C = alpha op(A) op(B) + beta C
// The region names the dense products for KernelProfiler (core/profiler.hpp).
template <class S, class A, class B, class C>
void gemm(const char* ta, const char* tb, S alpha, const A& a, const B& b, S beta, const C& c) {
  Kokkos::Profiling::pushRegion("ash::gemm");
  KokkosBlas::gemm(ta, tb, alpha, a, b, beta, c);
  Kokkos::Profiling::popRegion();
}

}  // namespace ash::impl
