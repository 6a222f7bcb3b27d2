#pragma once
// Pieces of a window of T tokens (docs/design.md §6, §8): the chunks of the
// scans, the token blocks of the block-wise engine and of the MPI pipeline,
// the waves of E3. One type for the pieces and one map from a block buffer's
// rows to the rows of the whole window.
#include <string>

#include "ash/core/types.hpp"

namespace ash {

// B and C in groups (a Mamba-2's n_groups): the scan core's β and γ are [M, G·N]
// and channel q of P reads group q / (P/G)'s N columns; the first of them. One
// group (every other architecture): 0, so the indexing is exactly the plain one.
KOKKOS_INLINE_FUNCTION index_t group_col(index_t q, index_t P, index_t N, index_t GN) {
  return GN == N ? 0 : (q / (P * N / GN)) * N;
}

// [0, T) in pieces of `len` tokens (the last may be shorter): piece j covers
// [start(j), end(j)). With a phase p (0 ≤ p < len), the pieces are those of a
// grid of `len` that started p tokens before 0, cut at 0: the first is len − p
// tokens (a sequence rank's range on one process's block grid).
struct TokenBlocks {
  index_t len = 1, n = 1, T = 1, phase = 0;
  TokenBlocks() = default;
  KOKKOS_INLINE_FUNCTION TokenBlocks(index_t len_, index_t T_, index_t phase_ = 0)
      : len(len_), n((T_ + phase_ + len_ - 1) / len_), T(T_), phase(phase_) {}
  KOKKOS_INLINE_FUNCTION index_t start(index_t j) const { return j == 0 ? 0 : j * len - phase; }
  KOKKOS_INLINE_FUNCTION index_t end(index_t j) const {  // exclusive
    return (j + 1) * len - phase < T ? (j + 1) * len - phase : T;
  }
  KOKKOS_INLINE_FUNCTION index_t size(index_t j) const { return end(j) - start(j); }
};

// Row r of a buffer holding tokens [t0, t0+W) of every sequence (row
// b·W + (t - t0)) is row map(r) = b·T + t of the window's [Bt·T, ·] activations.
struct BlockRows {
  index_t W, T, t0;
  KOKKOS_INLINE_FUNCTION index_t operator()(index_t r) const { return (r / W) * T + t0 + r % W; }
};
// The identity map: the buffer is the whole window.
struct IdentityRows {
  KOKKOS_INLINE_FUNCTION index_t operator()(index_t r) const { return r; }
};

// blk [Bt·W, P] <-> rows map(r) of full [Bt·T, P]: into the block (to_block) or back.
template <class S>
void copy_block_rows(const View2<S>& full, const View2<S>& blk, const BlockRows map, bool to_block,
                     const ExecSpace& exec = ExecSpace()) {
  const index_t P = full.extent(1), rows = blk.extent(0);
  Kokkos::parallel_for(
      "ash::block_rows", Range(exec, 0, rows * P), KOKKOS_LAMBDA(const index_t i) {
        const index_t r = i / P, p = i % P, m = map(r);
        if (to_block)
          blk(r, p) = full(m, p);
        else
          full(m, p) = blk(r, p);
      });
}

// Tokens [t0, t0+Tj) of every window of x, as a new [Bt, Tj] view (token
// blocks of the block-wise engines and of context parallelism).
inline TokenView token_block(const TokenView& x, index_t t0, index_t Tj) {
  TokenView xb("ash::x_block", x.extent(0), Tj);
  Kokkos::deep_copy(xb, Kokkos::subview(x, Kokkos::ALL(), Kokkos::make_pair(t0, t0 + Tj)));
  return xb;
}

}  // namespace ash
