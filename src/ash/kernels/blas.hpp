#pragma once
// Dense products through Kokkos Kernels (OpenBLAS / cuBLAS behind it), in the
// mode of run.matmul (ash/kernels/matmul.hpp) for float.
// Kokkos Kernels 3.4 (Debian's Trilinos 13.2 packages) has only the 7-argument gemm on
// the default instance; 4.x takes the instance (gemm_on).
#include <type_traits>

#include <KokkosBlas3_gemm.hpp>
#include <KokkosKernels_config.h>

#include "ash/kernels/matmul.hpp"

namespace ash::impl {

// KokkosBlas::gemm on the execution-space instance exec, so a product is ordered with
// the kernels around it on that instance (its stream on a GPU). Kokkos Kernels 3.4
// (Debian's, Serial only) has only the default instance's gemm, which is then the same.
template <class A, class B, class C>
void gemm_on(const ExecSpace& exec, const char* ta, const char* tb, typename C::const_value_type alpha, const A& a,
             const B& b, typename C::const_value_type beta, const C& c) {
#if defined(KOKKOSKERNELS_VERSION) && KOKKOSKERNELS_VERSION >= 40000
  KokkosBlas::gemm(exec, ta, tb, alpha, a, b, beta, c);
#else
  (void)exec;
  KokkosBlas::gemm(ta, tb, alpha, a, b, beta, c);
#endif
}

// A copy of the [rows, cols] view v with every value rounded as mode's tensor-core inputs.
template <class V>
View2<float> rounded_copy(const V& v, Matmul mode, const ExecSpace& exec) {
  const index_t rows = v.extent(0), cols = v.extent(1);
  View2<float> out(Kokkos::view_alloc(std::string("ash::gemm::rounded_input"), Kokkos::WithoutInitializing), rows,
                   cols);
  const bool tf32 = mode == Matmul::tf32;
  Kokkos::parallel_for(
      "ash::gemm_round_inputs", Range(exec, 0, rows * cols), KOKKOS_LAMBDA(const index_t i) {
        const index_t r = i / cols, c = i % cols;
        const float x = v(r, c);
        out(r, c) = tf32 ? half::round_tf32(x) : half::round_bf16(x);
      });
  return out;
}

#if defined(KOKKOS_ENABLE_CUDA)
// The bf16 bits (round to nearest even) of a [rows, cols] view, row-contiguous: cuBLAS's bf16 inputs.
template <class V>
View2<std::uint16_t> bf16_copy(const V& v, const ExecSpace& exec) {
  const index_t rows = v.extent(0), cols = v.extent(1);
  View2<std::uint16_t> out(Kokkos::view_alloc(std::string("ash::gemm::bf16_input"), Kokkos::WithoutInitializing), rows,
                           cols);
  Kokkos::parallel_for(
      "ash::gemm_bf16_inputs", Range(exec, 0, rows * cols), KOKKOS_LAMBDA(const index_t i) {
        const index_t r = i / cols, c = i % cols;
        out(r, c) = half::to_bf16(float(v(r, c)));
      });
  return out;
}
#endif

// The float product in a rounding mode (tf32, bf16): cuBLAS's tensor cores on
// row-contiguous device views, else the product of rounded copies.
template <class A, class B, class C>
void rounded_gemm(const ExecSpace& exec, const char* ta, const char* tb, float alpha, const A& a, const B& b,
                  float beta, const C& c, Matmul mode) {
#if defined(KOKKOS_ENABLE_CUDA)
  using Space = typename C::memory_space;
  if (!Kokkos::SpaceAccessibility<Kokkos::HostSpace, Space>::accessible && a.stride(1) == 1 && b.stride(1) == 1 &&
      c.stride(1) == 1) {
    const bool tra = ta[0] == 'T', trb = tb[0] == 'T';
    const index_t m = c.extent(0), n = c.extent(1), k = tra ? a.extent(0) : a.extent(1);
    if (mode == Matmul::bf16) {
      const auto a16 = bf16_copy(a, exec), b16 = bf16_copy(b, exec);
      cublas_gemm_bf16(tra, trb, m, n, k, alpha, a16.data(), index_t(a16.extent(1)), b16.data(),
                       index_t(b16.extent(1)), beta, c.data(), index_t(c.stride(0)), exec.cuda_stream());
    } else {
      cublas_gemm_tf32(tra, trb, m, n, k, alpha, a.data(), index_t(a.stride(0)), b.data(), index_t(b.stride(0)), beta,
                       c.data(), index_t(c.stride(0)), exec.cuda_stream());
    }
    return;
  }
#endif
  gemm_on(exec, ta, tb, alpha, rounded_copy(a, mode, exec), rounded_copy(b, mode, exec), beta, c);
}

// C = alpha op(A) op(B) + beta C on the instance exec.
// The region names the dense products for KernelProfiler (core/profiler.hpp).
template <class S, class A, class B, class C>
void gemm(const ExecSpace& exec, const char* ta, const char* tb, S alpha, const A& a, const B& b, S beta,
          const C& c) {
  Kokkos::Profiling::pushRegion("ash::gemm");
  bool rounded = false;
  if constexpr (std::is_same_v<S, float>) {
    const Matmul mode = matmul_mode();
    rounded = mode != Matmul::fp32;
    if (rounded) rounded_gemm(exec, ta, tb, alpha, a, b, beta, c, mode);
  }
  if (!rounded) gemm_on(exec, ta, tb, alpha, a, b, beta, c);
  Kokkos::Profiling::popRegion();
}

}  // namespace ash::impl
