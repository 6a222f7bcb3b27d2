#pragma once
// run.matmul (docs/design.md §6): the mode of every dense product in float.
//   fp32  exact float products (OpenBLAS, cuBLAS SGEMM): the default
//   tf32  both inputs rounded to TF32 (10 mantissa bits), FP32 accumulation
//   bf16  both inputs rounded to bf16 (7 mantissa bits), FP32 accumulation
// On CUDA, tf32 is cuBLAS's CUBLAS_COMPUTE_32F_FAST_TF32 on the float data (the
// tensor cores round the inputs themselves) and bf16 a cuBLAS product of bf16
// copies of the inputs with FP32 accumulation. On a host they are
// emulated: rounded copies of the inputs, then the float product — the same
// input rounding with another summation order, for studying the error, and
// slower than fp32. Double products are never rounded.
#include <cstdint>
#include <string>

#include "ash/core/options.hpp"
#include "ash/kernels/half_storage.hpp"

namespace ash {

// The mode in effect (process-wide; fp32 unless a MatmulScope says otherwise).
Matmul matmul_mode();

// Which kernels the host BLAS runs, when it is OpenBLAS ("" otherwise): its
// core name, and a warning when that core is one of its generic SSE ones on a
// CPU with AVX2 (OpenBLAS falls back to Prescott for a CPU model its table does
// not know, as on some VMs: its products are then about 2x slower; setting
// OPENBLAS_CORETYPE, e.g. to SkylakeX or Haswell, picks the right kernels).
std::string blas_core_note();

// Sets the mode for its lifetime (an engine's compute, a training run); S is
// the compute type: a rounding mode with double is an ash::Error.
class MatmulScope {
 public:
  MatmulScope(Matmul m, std::size_t scalar_bytes);
  ~MatmulScope();
  MatmulScope(const MatmulScope&) = delete;
  MatmulScope& operator=(const MatmulScope&) = delete;

 private:
  Matmul prev_;
};

namespace half {

// Round to nearest even at 10 mantissa bits (TF32's), in a float; NaN and inf kept.
KOKKOS_INLINE_FUNCTION float round_tf32(float f) {
  const std::uint32_t u = float_bits(f);
  if ((u & 0x7f800000u) == 0x7f800000u) return f;
  return bits_float((u + 0x0fffu + ((u >> 13) & 1u)) & 0xffffe000u);
}
// Round to nearest even at 7 mantissa bits (bf16's), in a float.
KOKKOS_INLINE_FUNCTION float round_bf16(float f) { return from_bf16(to_bf16(f)); }

}  // namespace half

namespace impl {

// cuBLAS GEMM on row-major matrices, FP32 accumulation and output (CUDA builds
// only; kernels/impl/cublas_gemm.cpp): C = α op(A) op(B) + β C, C m×n, op(A) m×k;
// lda, ldb, ldc: row strides; stream: a cudaStream_t. tf32: float inputs, which
// the tensor cores round; bf16: inputs already rounded to bf16 (their bits).
void cublas_gemm_tf32(bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k, float alpha,
                      const float* a, std::int64_t lda, const float* b, std::int64_t ldb, float beta, float* c,
                      std::int64_t ldc, void* stream);
void cublas_gemm_bf16(bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k, float alpha,
                      const std::uint16_t* a, std::int64_t lda, const std::uint16_t* b, std::int64_t ldb, float beta,
                      float* c, std::int64_t ldc, void* stream);

}  // namespace impl

}  // namespace ash
