// run.matmul's tensor-core products on CUDA (ash/kernels/matmul.hpp): one
// cublasGemmEx, tf32 on the float data with CUBLAS_COMPUTE_32F_FAST_TF32, bf16 on
// bf16 copies of the inputs with CUBLAS_COMPUTE_32F. Compiled only in CUDA
// builds; includes no Kokkos header.
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "ash/core/error.hpp"
#include "ash/core/options.hpp"

namespace ash::impl {

namespace {

cublasHandle_t handle() {
  static cublasHandle_t h = [] {
    cublasHandle_t made = nullptr;
    require(cublasCreate(&made) == CUBLAS_STATUS_SUCCESS, "run.matmul: cublasCreate failed");
    return made;
  }();
  return h;
}

// Row-major C = op(A) op(B) is column-major Cᵀ = op(B)ᵀ op(A)ᵀ, and a row-major
// matrix read column-major is its transpose: so B comes first, each with its own op.
// in_type: CUDA_R_32F (a, b float) or CUDA_R_16BF (a, b bf16 bits).
void gemm_ex(bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k, float alpha, const void* a,
             std::int64_t lda, const void* b, std::int64_t ldb, cudaDataType_t in_type, float beta, float* c,
             std::int64_t ldc, cublasComputeType_t compute, void* stream) {
  cublasHandle_t h = handle();
  require(cublasSetStream(h, static_cast<cudaStream_t>(stream)) == CUBLAS_STATUS_SUCCESS,
          "run.matmul: cublasSetStream failed");
  const cublasOperation_t ob = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, oa = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
#if CUBLAS_VER_MAJOR >= 12  // 64-bit sizes: rows = batch·T can pass 2^31
  const cublasStatus_t st = cublasGemmEx_64(h, ob, oa, n, m, k, &alpha, b, in_type, ldb, a, in_type, lda, &beta,
                                            c, CUDA_R_32F, ldc, compute, CUBLAS_GEMM_DEFAULT);
#else
  const std::int64_t most = 2147483647;
  require(m <= most && n <= most && k <= most && lda <= most && ldb <= most && ldc <= most,
          "run.matmul: a product larger than 2^31 rows needs cuBLAS 12 or later");
  const cublasStatus_t st = cublasGemmEx(h, ob, oa, int(n), int(m), int(k), &alpha, b, in_type, int(ldb), a,
                                         in_type, int(lda), &beta, c, CUDA_R_32F, int(ldc), compute,
                                         CUBLAS_GEMM_DEFAULT);
#endif
  require(st == CUBLAS_STATUS_SUCCESS, "run.matmul: cublasGemmEx failed (status " + std::to_string(int(st)) + ")");
}

}  // namespace

void cublas_gemm_tf32(bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k, float alpha,
                      const float* a, std::int64_t lda, const float* b, std::int64_t ldb, float beta, float* c,
                      std::int64_t ldc, void* stream) {
  gemm_ex(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, CUDA_R_32F, beta, c, ldc, CUBLAS_COMPUTE_32F_FAST_TF32,
          stream);
}

// Not CUBLAS_COMPUTE_32F_FAST_16BF on the float data: that only allows bf16, and on
// an H100 (cuBLAS 13) it gave the tf32 result (issue 32's first run of test_matmul).
void cublas_gemm_bf16(bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k, float alpha,
                      const std::uint16_t* a, std::int64_t lda, const std::uint16_t* b, std::int64_t ldb, float beta,
                      float* c, std::int64_t ldc, void* stream) {
  gemm_ex(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, CUDA_R_16BF, beta, c, ldc, CUBLAS_COMPUTE_32F, stream);
}

}  // namespace ash::impl
