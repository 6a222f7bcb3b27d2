#pragma once
// Chunked scans of the diagonal recurrence h^t = A^t ⊙ h^{t-1} + u^t
// (docs/design.md §2): chunk-local scans in parallel, then a short carry pass
// over chunks. Shared by the forward and E3.
#include "ash/core/types.hpp"

namespace ash::impl {

// Chunk c of a sequence covers tokens [c·C, min(T, (c+1)·C)).
struct Chunks {
  index_t C, nc, T;
  KOKKOS_INLINE_FUNCTION index_t start(index_t c) const { return c * C; }
  KOKKOS_INLINE_FUNCTION index_t end(index_t c) const { return (c + 1) * C < T ? (c + 1) * C : T; }  // exclusive
};

// What the scans of one layer read: its projections and (E3) the cotangent
// g_k, with A^t and u^t = Δ^t ŷ^t β^t recomputed on the fly.
template <class S>
struct ScanView {
  View2<S> delta, yhat, beta, gamma, gy;
  Unmanaged2<S> Alog;
  index_t T;
  KOKKOS_INLINE_FUNCTION S A(index_t m, index_t q, index_t n) const {
    return kmath::exp(delta(m, q) * -kmath::exp(Alog(q, n)));
  }
  KOKKOS_INLINE_FUNCTION S u(index_t m, index_t q, index_t n) const { return delta(m, q) * yhat(m, q) * beta(m, n); }
  KOKKOS_INLINE_FUNCTION S qv(index_t m, index_t q, index_t n) const { return gy(m, q) * gamma(m, n); }  // g ⊗ γ
};

// h at the end of every chunk: chunk-local scans from h = 0 in parallel, then
// a carry pass over chunks, H_c = h_c^local + (Π_c A) H_{c-1}, from H_{-1} =
// h0 ([Bt·P, N]; 0 when empty). Hb and PA are [Bt·nc, P, N]; on return Hb
// holds the true boundary states.
template <class S>
void boundary_states(const ScanView<S>& L, const Chunks ch, index_t Bt, const View3<S>& Hb, const View3<S>& PA,
                     const View2<S>& h0 = View2<S>(), const ExecSpace& exec = ExecSpace()) {
  const index_t P = Hb.extent(1), N = Hb.extent(2), T = L.T, nc = ch.nc;
  const bool has_h0 = h0.extent(0) > 0;
  Kokkos::parallel_for(
      "ash::chunk_scan_h", Range(exec, 0, Bt * nc * P * N), KOKKOS_LAMBDA(const index_t i) {
        const index_t bc = i / (P * N), q = (i / N) % P, n = i % N, b = bc / nc, c = bc % nc;
        S h = 0, pr = 1;
        for (index_t t = ch.start(c); t < ch.end(c); ++t) {
          const index_t m = b * T + t;
          const S a = L.A(m, q, n);
          h = a * h + L.u(m, q, n);
          pr *= a;
        }
        Hb(bc, q, n) = h;
        PA(bc, q, n) = pr;
      });
  Kokkos::parallel_for(
      "ash::carry_h", Range(exec, 0, Bt * P * N), KOKKOS_LAMBDA(const index_t i) {
        const index_t b = i / (P * N), q = (i / N) % P, n = i % N;
        S H = has_h0 ? h0(b * P + q, n) : S(0);
        for (index_t c = 0; c < nc; ++c) {
          H = Hb(b * nc + c, q, n) + PA(b * nc + c, q, n) * H;
          Hb(b * nc + c, q, n) = H;
        }
      });
}

}  // namespace ash::impl
