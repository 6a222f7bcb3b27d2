// mamba-ssm's selective-scan binding (csrc/selective_scan/selective_scan.cpp) dispatches to
// every (input, weight) type pair, each compiled in its own .cu file. The GPU bundle
// (perf_tests/gpu/bundle.sh) compiles only the pairs the comparison with ash runs, float
// inputs with float weights (selective_scan_fwd_fp32.cu also holds float/complex). This
// file gives the other pairs a definition that raises a clear error, so the extension
// loads without their kernels; the symbols are the ones the .cu files would define.
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>
#include <c10/util/complex.h>
#include <cuda_runtime_api.h>

#include "selective_scan.h"

namespace {
[[noreturn]] void not_built() {
  TORCH_CHECK(false,
              "selective_scan_cuda (AdjointSharding's GPU bundle) holds the float kernels only: "
              "fp16/bf16 inputs and the complex backward are not compiled (perf_tests/gpu/bundle.sh)");
}
}  // namespace

template <typename input_t, typename weight_t>
void selective_scan_fwd_cuda(SSMParamsBase&, cudaStream_t) {
  not_built();
}
template <typename input_t, typename weight_t>
void selective_scan_bwd_cuda(SSMParamsBwd&, cudaStream_t) {
  not_built();
}

using cf = c10::complex<float>;
template void selective_scan_fwd_cuda<c10::Half, float>(SSMParamsBase&, cudaStream_t);
template void selective_scan_fwd_cuda<c10::Half, cf>(SSMParamsBase&, cudaStream_t);
template void selective_scan_fwd_cuda<c10::BFloat16, float>(SSMParamsBase&, cudaStream_t);
template void selective_scan_fwd_cuda<c10::BFloat16, cf>(SSMParamsBase&, cudaStream_t);
template void selective_scan_bwd_cuda<float, cf>(SSMParamsBwd&, cudaStream_t);
template void selective_scan_bwd_cuda<c10::Half, float>(SSMParamsBwd&, cudaStream_t);
template void selective_scan_bwd_cuda<c10::Half, cf>(SSMParamsBwd&, cudaStream_t);
template void selective_scan_bwd_cuda<c10::BFloat16, float>(SSMParamsBwd&, cudaStream_t);
template void selective_scan_bwd_cuda<c10::BFloat16, cf>(SSMParamsBwd&, cudaStream_t);
