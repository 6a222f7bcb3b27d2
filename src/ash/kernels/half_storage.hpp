#pragma once
// 16-bit storage types for kept activations (run.storage, docs/design.md §8):
// values are stored in 16 bits and computed in float or double. Our own
// bit-exact types, not Kokkos' half types (Kokkos 3.4 has no bf16 and its
// half is a CUDA type), so storage is identical on every backend; the
// conversions are plain integer arithmetic, callable in kernels.
//
//   bf16: 1 sign, 8 exponent, 7 mantissa bits (float's range)
//   fp16: 1 sign, 5 exponent, 10 mantissa bits (IEEE binary16, max 65504)
// Both round to nearest, ties to even; NaN stays NaN (quiet), ±inf stays ±inf,
// fp16 rounds overflow to ±inf and keeps subnormals (gradual underflow).
#include <cstdint>
#include <cstring>
#include <string>

#include "ash/core/options.hpp"
#include "ash/core/types.hpp"
#include "ash/kernels/blocks.hpp"

namespace ash {

namespace half {

KOKKOS_INLINE_FUNCTION std::uint32_t float_bits(float f) {
  std::uint32_t u;
  memcpy(&u, &f, 4);  // device-callable (std::memcpy is not on every backend)
  return u;
}
KOKKOS_INLINE_FUNCTION float bits_float(std::uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

KOKKOS_INLINE_FUNCTION std::uint16_t to_bf16(float f) {
  const std::uint32_t u = float_bits(f);
  if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu))  // NaN: keep it quiet
    return std::uint16_t((u >> 16) | 0x0040u);
  // Round to nearest even on the 16 dropped bits; a carry into the exponent
  // is the correct rounding (up to inf for the largest finite values).
  const std::uint32_t r = u + 0x7fffu + ((u >> 16) & 1u);
  return std::uint16_t(r >> 16);
}
KOKKOS_INLINE_FUNCTION float from_bf16(std::uint16_t h) { return bits_float(std::uint32_t(h) << 16); }

KOKKOS_INLINE_FUNCTION std::uint16_t to_fp16(float f) {
  const std::uint32_t u = float_bits(f);
  const std::uint16_t sign = std::uint16_t((u >> 16) & 0x8000u);
  const std::uint32_t a = u & 0x7fffffffu;
  if (a >= 0x7f800000u) return std::uint16_t(sign | (a > 0x7f800000u ? 0x7e00u : 0x7c00u));  // NaN, inf
  if (a >= 0x477ff000u) return std::uint16_t(sign | 0x7c00u);  // rounds to >= 65520: inf
  const int e = int(a >> 23) - 127;
  if (e >= -14) {  // normal in fp16: drop 13 mantissa bits, round to nearest even
    const std::uint32_t m = a & 0x007fffffu;
    std::uint32_t h = (std::uint32_t(e + 15) << 10) | (m >> 13);
    const std::uint32_t rest = m & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;  // a carry moves into the exponent
    return std::uint16_t(sign | h);
  }
  if (e < -25) return sign;  // below half the smallest subnormal (2^-25): ±0
  // Subnormal: value = m' · 2^-24 with m' = (1.m) · 2^(e+24), rounded to nearest even.
  const std::uint32_t m = (a & 0x007fffffu) | 0x00800000u;  // 24-bit significand, value m · 2^(e-23)
  const int shift = -1 - e;                                   // 14..24: m >> shift is m' truncated
  std::uint32_t h = m >> shift;
  const std::uint32_t rest = m & ((1u << shift) - 1u), halfway = 1u << (shift - 1);
  if (rest > halfway || (rest == halfway && (h & 1u))) ++h;  // may become the smallest normal: correct
  return std::uint16_t(sign | h);
}
KOKKOS_INLINE_FUNCTION float from_fp16(std::uint16_t h) {
  const std::uint32_t sign = std::uint32_t(h & 0x8000u) << 16;
  const std::uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  if (e == 0x1fu) return bits_float(sign | 0x7f800000u | (m << 13));  // inf, NaN
  if (e != 0) return bits_float(sign | ((e + 112u) << 23) | (m << 13));
  // subnormal (or zero): m · 2^-24, exact in float
  const float v = float(m) * 5.9604644775390625e-08f;
  return sign ? -v : v;
}

// Storage of a compute-type value s in format st (full is not packed here).
template <class S>
KOKKOS_INLINE_FUNCTION std::uint16_t pack(Storage st, S v) {
  return st == Storage::bf16 ? to_bf16(float(v)) : to_fp16(float(v));
}
template <class S>
KOKKOS_INLINE_FUNCTION S unpack(Storage st, std::uint16_t h) {
  return S(st == Storage::bf16 ? from_bf16(h) : from_fp16(h));
}

}  // namespace half

// A [rows, P] activation kept in the storage format: either the compute type
// itself (full) or 16-bit words. Rows are packed and unpacked in blocks.
template <class S>
class StoredRows {
 public:
  StoredRows() = default;
  StoredRows(const std::string& label, Storage st, index_t rows, index_t cols);
  Storage storage() const { return st_; }
  index_t rows() const { return rows_; }
  bool empty() const { return rows_ == 0; }
  std::size_t bytes() const;
  // Stores src [Bt·Tj, P] as tokens [t0, t0+Tj) of every sequence (T per sequence).
  void put(const View2<S>& src, index_t T, index_t t0, index_t Tj, const ExecSpace& exec = ExecSpace()) const;
  // The reverse: tokens [t0, t0+Tj) of every sequence into dst [Bt·Tj, P], in the compute type.
  void get(const View2<S>& dst, index_t T, index_t t0, index_t Tj, const ExecSpace& exec = ExecSpace()) const;

 private:
  Storage st_ = Storage::full;
  index_t rows_ = 0;
  View2<S> full_;
  View2<std::uint16_t> half_;
};

}  // namespace ash
