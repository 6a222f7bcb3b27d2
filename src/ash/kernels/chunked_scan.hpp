#pragma once
// Chunked scans of the diagonal recurrence h^t = A^t ⊙ h^{t-1} + u^t
// (docs/design.md §2): chunk-local scans in parallel, then a short carry pass
// over chunks. Shared by the forward and E3. One thread owns a (sequence,
// chunk, channel, state tile) and keeps its NT states in registers
// (lane_tile in state_tile.hpp).
#include "ash/kernels/state_tile.hpp"

namespace ash::impl {

// Chunk c of a sequence covers tokens [c·C, min(T, (c+1)·C)).
struct Chunks {
  index_t C, nc, T;
  KOKKOS_INLINE_FUNCTION index_t start(index_t c) const { return c * C; }
  KOKKOS_INLINE_FUNCTION index_t end(index_t c) const { return (c + 1) * C < T ? (c + 1) * C : T; }  // exclusive
};

// What the scans of one layer read: its projections, the decay rates
// a = -exp(Alog) ([P, N], computed once per layer) and (E3) the cotangent g_k;
// A^t = exp(Δ^t a) and u^t = Δ^t ŷ^t β^t are recomputed on the fly.
template <class S>
struct ScanView {
  View2<S> delta, yhat, beta, gamma, gy;
  View2<S> a;
  index_t T;
  KOKKOS_INLINE_FUNCTION S A(index_t m, index_t q, index_t n) const { return exp_fast(delta(m, q) * a(q, n)); }
  KOKKOS_INLINE_FUNCTION S u(index_t m, index_t q, index_t n) const { return delta(m, q) * yhat(m, q) * beta(m, n); }
  KOKKOS_INLINE_FUNCTION S qv(index_t m, index_t q, index_t n) const { return gy(m, q) * gamma(m, n); }  // g ⊗ γ
};

// h at the end of every chunk: chunk-local scans from h = 0 in parallel, then
// a carry pass over chunks, H_c = h_c^local + (Π_c A) H_{c-1}, from H_{-1} =
// h0 ([Bt·P, N]; 0 when empty). Hb and PA are [Bt·nc, P, N]; on return Hb
// holds the true boundary states.
template <int NT, class S>
void chunk_local_states(const ScanView<S>& L, const Chunks ch, index_t Bt, const View3<S>& Hb, const View3<S>& PA,
                        const ExecSpace& exec) {
  const index_t P = Hb.extent(1), N = Hb.extent(2), T = L.T, nc = ch.nc;
  Kokkos::parallel_for(
        "ash::chunk_scan_h", Range(exec, 0, Bt * nc * P * (N / NT)), KOKKOS_LAMBDA(const index_t i) {
          const index_t ntile = N / NT, bcq = i / ntile, n0 = (i % ntile) * NT;
          const index_t bc = bcq / P, q = bcq % P, b = bc / nc, c = bc % nc;
          {
            S h[NT], pr[NT], av[NT];
            for (int j = 0; j < NT; ++j) {
              h[j] = 0;
              pr[j] = 1;
              av[j] = L.a(q, n0 + j);
            }
            for (index_t t = ch.start(c); t < ch.end(c); ++t) {
              const index_t m = b * T + t;
              const S dq = L.delta(m, q), du = dq * L.yhat(m, q);
              for (int j = 0; j < NT; ++j) {
                const S A = exp_fast(dq * av[j]);
                h[j] = A * h[j] + du * L.beta(m, n0 + j);
                pr[j] *= A;
              }
            }
            for (int j = 0; j < NT; ++j) {
              Hb(bc, q, n0 + j) = h[j];
              PA(bc, q, n0 + j) = pr[j];
            }
          }
        });
}

template <class S>
void boundary_states(const ScanView<S>& L, const Chunks ch, index_t Bt, const View3<S>& Hb, const View3<S>& PA,
                     const View2<S>& h0 = View2<S>(), const ExecSpace& exec = ExecSpace()) {
  const index_t P = Hb.extent(1), N = Hb.extent(2), nc = ch.nc;
  const bool has_h0 = h0.extent(0) > 0;
  ASH_WITH_LANE_TILE(N, chunk_local_states<NT>(L, ch, Bt, Hb, PA, exec));
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

// a = -exp(Alog) ([P, N]): the decay rates, once per layer and pass.
template <class S, class AlogView>
void decay_rates(const AlogView& Alog, const View2<S>& a, const ExecSpace& exec = ExecSpace()) {
  const index_t PN = a.extent(0) * a.extent(1), N = a.extent(1);
  Kokkos::parallel_for(
      "ash::decay_rates", Range(exec, 0, PN),
      KOKKOS_LAMBDA(const index_t i) { a(i / N, i % N) = -kmath::exp(Alog(i / N, i % N)); });
}

}  // namespace ash::impl
