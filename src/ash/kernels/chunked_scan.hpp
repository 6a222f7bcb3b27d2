#pragma once
// Chunked scans of the diagonal recurrence h^t = A^t ⊙ h^{t-1} + u^t
// (docs/design.md §2): chunk-local scans in parallel, then a short carry pass
// over chunks. Shared by the forward and E3. One thread owns a (sequence,
// chunk, channel, state tile) and keeps its NT states in registers
// (lane_tile in state_tile.hpp).
#include <string>

#include "ash/core/documents.hpp"
#include "ash/core/error.hpp"
#include "ash/kernels/blocks.hpp"
#include "ash/kernels/state_tile.hpp"

namespace ash::impl {

// Chunk c of a sequence covers tokens [c·C, min(T, (c+1)·C)): len = C, n = nc.
using Chunks = TokenBlocks;

// What the scans of one layer read: its projections, the decay rates
// a = -exp(Alog) ([P, N], computed once per layer), (E3) the cotangent g_k and
// the document starts; A^t = exp(Δ^t a) (0 where a document starts) and
// u^t = Δ^t ŷ^t β^t are recomputed on the fly.
template <class S>
struct ScanView {
  View2<S> delta, yhat, beta, gamma, gy;
  View2<S> a;
  index_t T;
  DocStarts docs;
  // The factor on A^t of token t of sequence b: 0 at a document start, else 1.
  KOKKOS_INLINE_FUNCTION S keep(index_t b, index_t t) const { return docs.keep<S>(b, t); }
  KOKKOS_INLINE_FUNCTION S A(index_t m, index_t q, index_t n) const {
    return keep(m / T, m % T) * exp_fast(delta(m, q) * a(q, n));
  }
  // β and γ's first column for channel q (group_col: B and C in groups).
  KOKKOS_INLINE_FUNCTION index_t gcol(index_t q) const {
    return group_col(q, a.extent(0), a.extent(1), beta.extent(1));
  }
  KOKKOS_INLINE_FUNCTION S u(index_t m, index_t q, index_t n) const {
    return delta(m, q) * yhat(m, q) * beta(m, gcol(q) + n);
  }
  KOKKOS_INLINE_FUNCTION S qv(index_t m, index_t q, index_t n) const { return gy(m, q) * gamma(m, gcol(q) + n); }  // g ⊗ γ
};

// h at the end of every chunk: chunk-local scans from h = 0 in parallel, then
// a carry pass over chunks, H_c = h_c^local + (Π_c A) H_{c-1}, from H_{-1} =
// h0 ([Bt·P, N]; 0 when empty). Hb and PA are [Bt·nc, P, N]; on return Hb
// holds the true boundary states.
template <int NT, class S>
void chunk_local_states(const ScanView<S>& L, const Chunks ch, index_t Bt, const View3<S>& Hb, const View3<S>& PA,
                        const ExecSpace& exec) {
  const index_t P = Hb.extent(1), N = Hb.extent(2), T = L.T, nc = ch.n;
  Kokkos::parallel_for(
        "ash::chunk_scan_h", Range(exec, 0, Bt * nc * P * (N / NT)), KOKKOS_LAMBDA(const index_t i) {
          const index_t ntile = N / NT, bcq = i / ntile, n0 = (i % ntile) * NT;
          const index_t bc = bcq / P, q = bcq % P, b = bc / nc, c = bc % nc, gc = L.gcol(q);
          {
            S h[NT], pr[NT], av[NT];
            for (int j = 0; j < NT; ++j) {
              h[j] = 0;
              pr[j] = 1;
              av[j] = L.a(q, n0 + j);
            }
            for (index_t t = ch.start(c); t < ch.end(c); ++t) {
              const index_t m = b * T + t;
              const S dq = L.delta(m, q), du = dq * L.yhat(m, q), kp = L.keep(b, t);
              for (int j = 0; j < NT; ++j) {
                const S A = kp * exp_fast(dq * av[j]);
                h[j] = A * h[j] + du * L.beta(m, gc + n0 + j);
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

// How many chunks one thread of carry_chunks' first pass takes (0: the plain
// pass). A host runs the plain pass: its Bt·P·N threads already fill the cores
// and each reads its chunks once. A GPU with Bt·P·N = 1024 threads walking
// nc = 16384 chunks each (T = 2^20) is latency-bound (13 % of E3 on an H100),
// so from nc = 512 it takes groups of ⌈√nc⌉ chunks: √nc steps per phase.
inline index_t carry_group(index_t nc) {
  if (host_backend || nc < 512) return 0;
  index_t g = 1;
  while (g * g < nc) ++g;
  return g;
}

// The carry pass over chunks, X_c ← X_c + F_c X_prev in scan order (forward:
// c = 0..nc-1, X_prev of c = 0 is init; reverse: c = nc-1..0, X_prev of nc-1
// is init), per (sequence, channel, state); X, F are [Bt·nc, P, N], init
// [Bt·P, N] or empty (zero). group = 0: one thread per (b, q, n) over all
// chunks. group > 0: chunks in groups of `group` scanned locally in parallel
// (the first group from init), a pass over groups that finishes each group's
// last chunk, then every other chunk fixed up from its group's carry-in,
// X_c += (Π F from the group start to c) · carry-in. F is left as it was.
// `label` names the kernels (the plain pass, then /local, /groups, /fixup).
// The groups' products and carries go to gbuf ([>= Bt·ng, P, N]: a caller's
// workspace, so a GPU's layer loop allocates nothing) or, when it is empty,
// to a buffer of this call's.
struct ScanOrder {  // the row of (sequence b, scan position k)
  index_t nc;
  bool reverse;
  KOKKOS_INLINE_FUNCTION index_t operator()(index_t b, index_t k) const { return b * nc + (reverse ? nc - 1 - k : k); }
};

template <class S>
void carry_chunks(const std::string& label, const View3<S>& X, const View3<S>& F, index_t Bt, index_t nc,
                  const View2<S>& init, bool reverse, index_t group, const ExecSpace& exec,
                  const View3<S>& gbuf = View3<S>()) {
  const index_t P = X.extent(1), N = X.extent(2);
  const bool has_init = init.extent(0) > 0;
  const ScanOrder row{nc, reverse};
  // Groups of scan positions, bounded like chunks of tokens: [start(g), end(g)).
  const index_t G = group > 0 && group < nc ? group : nc, ng = (nc + G - 1) / G;
  const Chunks groups(G, nc);
  // Per group: the product of its F, then (second pass) its carry-in. One
  // group is the plain pass, which needs neither.
  View3<S> gb = gbuf;
  if (ng > 1 && gb.extent(0) == 0)
    gb = View3<S>(Kokkos::view_alloc(std::string("ash::carry_groups"), Kokkos::WithoutInitializing), Bt * ng, P, N);
  require(ng == 1 || index_t(gb.extent(0)) >= Bt * ng,
          "carry_chunks: the group buffer is smaller than [Bt·ng, P, N]");
  Kokkos::parallel_for(
      ng == 1 ? label : label + "/local", Range(exec, 0, Bt * ng * P * N), KOKKOS_LAMBDA(const index_t i) {
        const index_t bg = i / (P * N), q = (i / N) % P, n = i % N, b = bg / ng, g = bg % ng;
        S x = g == 0 && has_init ? init(b * P + q, n) : S(0), f = 1;
        for (index_t k = groups.start(g); k < groups.end(g); ++k) {
          const index_t r = row(b, k);
          x = X(r, q, n) + F(r, q, n) * x;
          f *= F(r, q, n);
          X(r, q, n) = x;
        }
        if (ng > 1) gb(bg, q, n) = f;
      });
  if (ng == 1) return;
  Kokkos::parallel_for(
      label + "/groups", Range(exec, 0, Bt * P * N), KOKKOS_LAMBDA(const index_t i) {
        const index_t b = i / (P * N), q = (i / N) % P, n = i % N;
        S x = X(row(b, groups.end(0) - 1), q, n);  // the first group's last chunk is final
        for (index_t g = 1; g < ng; ++g) {
          const index_t last = row(b, groups.end(g) - 1);
          const S f = gb(b * ng + g, q, n);
          gb(b * ng + g, q, n) = x;
          x = X(last, q, n) + f * x;
          X(last, q, n) = x;
        }
      });
  Kokkos::parallel_for(
      label + "/fixup", Range(exec, 0, Bt * (ng - 1) * P * N), KOKKOS_LAMBDA(const index_t i) {
        const index_t bg = i / (P * N), q = (i / N) % P, n = i % N, b = bg / (ng - 1), g = bg % (ng - 1) + 1;
        const S x = gb(b * ng + g, q, n);
        S f = 1;
        for (index_t k = groups.start(g); k < groups.end(g) - 1; ++k) {  // the last chunk is done
          const index_t r = row(b, k);
          f *= F(r, q, n);
          X(r, q, n) += f * x;
        }
      });
}

// carry_chunks' group rows for nc chunks of Bt sequences (0: no groups).
inline index_t carry_group_rows(index_t Bt, index_t nc) {
  const index_t G = carry_group(nc);
  return G > 0 && G < nc ? Bt * ((nc + G - 1) / G) : 0;
}

template <class S>
void boundary_states(const ScanView<S>& L, const Chunks ch, index_t Bt, const View3<S>& Hb, const View3<S>& PA,
                     const View2<S>& h0 = View2<S>(), const ExecSpace& exec = ExecSpace(),
                     const View3<S>& gbuf = View3<S>()) {
  const index_t N = Hb.extent(2);
  ASH_WITH_LANE_TILE(N, chunk_local_states<NT>(L, ch, Bt, Hb, PA, exec));
  carry_chunks("ash::carry_h", Hb, PA, Bt, ch.n, h0, false, carry_group(ch.n), exec, gbuf);
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
