#pragma once
// Sums over token rows in two levels (docs/design.md §6): partial sums over
// blocks of reduce_rows rows fill the device, then one team per output adds
// its column of partial sums in a fixed order, so sums are bitwise repeatable
// for a fixed build and team size. Used by every weight-gradient reduction.
#include "ash/core/error.hpp"
#include "ash/core/types.hpp"

namespace ash::impl {

// Rows per partial sum of a reduction over rows (two-level sums: the whole
// device works on the first level, and the order of additions is fixed).
// Fewer on a GPU, where a thread per (row block, channel) must still fill the
// device at one wave of tokens.
constexpr index_t reduce_rows = host_backend ? 128 : 16;
// Blocks of reduce_rows covering R rows (the first level's partial sums).
KOKKOS_INLINE_FUNCTION index_t row_blocks(index_t R) { return (R + reduce_rows - 1) / reduce_rows; }

// The second level: one team per output sums its column of partial sums.
// A GPU gives each team 64 threads, since P or P·N outputs alone would leave
// it idle while each walks thousands of blocks; a host a team of one, which
// adds the blocks in order. For a fixed build and team size the order of
// additions is fixed, so sums stay bitwise repeatable.
constexpr int block_sum_team = host_backend ? 1 : 64;
using BlockSumPolicy = Kokkos::TeamPolicy<ExecSpace>;
using BlockSumMember = BlockSumPolicy::member_type;
// A team league is an int: n teams, refused past 2^31 − 1 (a league of rows that
// long is past any device's memory today; splitting the launch is then due).
inline int league_size(index_t n) {
  ash::require(n >= 0 && n <= index_t(0x7fffffff), "a kernel's team league of " + std::to_string(n) +
                                                      " teams is past 2^31 - 1 (Kokkos' int league size)");
  return int(n);
}
// The block-sum policy of n teams of block_sum_team threads (league_size checked).
inline BlockSumPolicy block_sum_policy(const ExecSpace& exec, index_t n) {
  return BlockSumPolicy(exec, league_size(n), block_sum_team);
}
// Σ_{blk < nblk} part(blk) by the calling team.
template <class S, class F>
KOKKOS_INLINE_FUNCTION S team_block_sum(const BlockSumMember& team, index_t nblk, const F& part) {
  S acc = 0;
  Kokkos::parallel_reduce(
      Kokkos::TeamThreadRange(team, nblk), [&](const index_t blk, S& a) { a += part(blk); }, acc);
  return acc;
}

}  // namespace ash::impl
