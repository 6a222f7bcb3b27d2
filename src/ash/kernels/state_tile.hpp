#pragma once
// The inner loops of the SSM kernels run over the state index n in tiles of a
// compile-time width NT (docs/design.md §6): one thread owns a (token range,
// channel) and keeps NT states in registers, so each decay A^t_pn is computed
// once per pass and the n-loops vectorise on the host (AVX/SSE lanes over n)
// and unroll into registers on a GPU. N need not be a power of two: the tile
// is the largest of 16, 8, 4, 2, 1 that divides N.
#include <cstdint>

#include "ash/core/types.hpp"

namespace ash::impl {

inline int state_tile(index_t N) { return N % 16 == 0 ? 16 : N % 8 == 0 ? 8 : N % 4 == 0 ? 4 : N % 2 == 0 ? 2 : 1; }

// Kernels whose tiles are independent (no sum over n) give each tile its own
// thread, tile index fastest. On the host the tile stays state_tile(N) (one
// thread per channel, SIMD lanes over n); on a GPU it is 1, so a warp's
// threads are 32 consecutive states: coalesced loads and Bt·T/C·P·N threads
// instead of Bt·T/C·P, which leaves most of an H100 idle.
inline int lane_tile(index_t N) { return host_backend ? state_tile(N) : 1; }

// Runs CALL with the constexpr int NT = state_tile(N) in scope. A switch, not
// a generic lambda: nvcc does not allow device lambdas inside generic lambdas.
#define ASH_WITH_TILE(TILE, CALL)     \
  switch (TILE) {                      \
    case 16: {                         \
      constexpr int NT = 16;           \
      CALL;                            \
      break;                           \
    }                                  \
    case 8: {                          \
      constexpr int NT = 8;            \
      CALL;                            \
      break;                           \
    }                                  \
    case 4: {                          \
      constexpr int NT = 4;            \
      CALL;                            \
      break;                           \
    }                                  \
    case 2: {                          \
      constexpr int NT = 2;            \
      CALL;                            \
      break;                           \
    }                                  \
    default: {                         \
      constexpr int NT = 1;            \
      CALL;                            \
      break;                           \
    }                                  \
  }

#define ASH_WITH_STATE_TILE(N, CALL) ASH_WITH_TILE(::ash::impl::state_tile(N), CALL)
#define ASH_WITH_LANE_TILE(N, CALL) ASH_WITH_TILE(::ash::impl::lane_tile(N), CALL)

// exp(x) without a library call, so loops over n vectorise (glibc's expf is
// scalar unless a whole translation unit is built with -ffast-math, which
// would also break the finite checks). Cephes' range reduction x = k ln2 + r
// and polynomial: within 2 ulp of the correctly rounded value on [-87, 88]
// (float) and [-708, 709] (double); 0 below, as exp underflows there. The
// 2^k scale is built in the exponent bits; rounding k uses the 1.5·2^23
// (2^52) trick, which needs IEEE arithmetic (no -ffast-math) — the default
// for every compiler the project builds with.
// On a GPU the float form is the device's own expf (a range reduction around
// the hardware's ex2 approximation, within 2 ulp), a few instructions against
// the polynomial's twenty; a host keeps the polynomial (its loops vectorise).
KOKKOS_INLINE_FUNCTION float exp_fast(float x) {
#if defined(__CUDA_ARCH__) || defined(__HIP_DEVICE_COMPILE__)
  return x < -87.0f ? 0.0f : expf(x);
#else
  const float xc = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
  const float k = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  float r = xc - k * 0.693359375f;
  r = r - k * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float e = p * (r * r) + r + 1.0f;
  union {
    std::int32_t i;
    float f;
  } scale;
  scale.i = (std::int32_t(k) + 127) << 23;
  return x < -87.0f ? 0.0f : e * scale.f;
#endif
}

KOKKOS_INLINE_FUNCTION double exp_fast(double x) {
  const double xc = x < -708.0 ? -708.0 : (x > 709.0 ? 709.0 : x);
  const double k = (xc * 1.4426950408889634074 + 6755399441055744.0) - 6755399441055744.0;
  double r = xc - k * 6.93145751953125e-1;
  r = r - k * 1.42860682030941723212e-6;
  const double rr = r * r;
  const double px = r * ((1.26177193074810590878e-4 * rr + 3.02994407707441961300e-2) * rr + 9.99999999999999999910e-1);
  const double qx =
      ((3.00198505138664455042e-6 * rr + 2.52448340349684104192e-3) * rr + 2.27265548208155028766e-1) * rr +
      2.00000000000000000009e0;
  const double e = 1.0 + 2.0 * px / (qx - px);
  union {
    std::int64_t i;
    double d;
  } scale;
  scale.i = std::int64_t(std::int32_t(k) + 1023) << 52;
  return x < -708.0 ? 0.0 : e * scale.d;
}

}  // namespace ash::impl
