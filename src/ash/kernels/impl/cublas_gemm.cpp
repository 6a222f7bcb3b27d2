// run.matmul's tensor-core products on CUDA (ash/kernels/matmul.hpp): one
// cublasGemmEx on the float data with CUBLAS_COMPUTE_32F_FAST_TF32 or
// _FAST_16BF. Compiled only in CUDA builds; includes no Kokkos header.
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

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

}  // namespace

// Row-major C = op(A) op(B) is column-major Cᵀ = op(B)ᵀ op(A)ᵀ, and a row-major
// matrix read column-major is its transpose: so B comes first, each with its own op.
void cublas_gemm_fast(bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k, float alpha,
                      const float* a, std::int64_t lda, const float* b, std::int64_t ldb, float beta, float* c,
                      std::int64_t ldc, Matmul mode, void* stream) {
  const cublasComputeType_t compute =
      mode == Matmul::bf16 ? CUBLAS_COMPUTE_32F_FAST_16BF : CUBLAS_COMPUTE_32F_FAST_TF32;
  cublasHandle_t h = handle();
  require(cublasSetStream(h, static_cast<cudaStream_t>(stream)) == CUBLAS_STATUS_SUCCESS,
          "run.matmul: cublasSetStream failed");
  const cublasOperation_t ob = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, oa = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
#if CUBLAS_VER_MAJOR >= 12  // 64-bit sizes: rows = batch·T can pass 2^31
  const cublasStatus_t st = cublasGemmEx_64(h, ob, oa, n, m, k, &alpha, b, CUDA_R_32F, ldb, a, CUDA_R_32F, lda, &beta,
                                            c, CUDA_R_32F, ldc, compute, CUBLAS_GEMM_DEFAULT);
#else
  const std::int64_t most = 2147483647;
  require(m <= most && n <= most && k <= most && lda <= most && ldb <= most && ldc <= most,
          "run.matmul: a product larger than 2^31 rows needs cuBLAS 12 or later");
  const cublasStatus_t st = cublasGemmEx(h, ob, oa, int(n), int(m), int(k), &alpha, b, CUDA_R_32F, int(ldb), a,
                                         CUDA_R_32F, int(lda), &beta, c, CUDA_R_32F, int(ldc), compute,
                                         CUBLAS_GEMM_DEFAULT);
#endif
  require(st == CUBLAS_STATUS_SUCCESS, "run.matmul: cublasGemmEx failed (status " + std::to_string(int(st)) + ")");
}

}  // namespace ash::impl
