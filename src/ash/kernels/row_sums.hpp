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
  ash::require(n >= 0 && n <= index_t(0x7fffffff),
               "a kernel's team league of " + std::to_string(n) + " teams is past 2^31 - 1 (Kokkos' int league size)");
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

// out(c) += Σ_{m < M} value(m, c) for each of C columns, in two levels: one
// thread per (row block, column) adds its rows in order into part
// [row_blocks(M), ≥ C] (the caller's workspace), then one team per column adds
// its blocks in order. value is a device functor (a KOKKOS_LAMBDA).
template <class S, class Value, class Out>
void column_sums(const std::string& label, const ExecSpace& exec, index_t M, index_t C, const View2<S>& part,
                 const Value& value, const Out& out) {
  const index_t nblk = row_blocks(M);
  ash::require(index_t(part.extent(0)) >= nblk && index_t(part.extent(1)) >= C,
               label + ": partial sums of another size");
  Kokkos::parallel_for(
      label, Range(exec, 0, nblk * C), KOKKOS_LAMBDA(const index_t i) {
        const index_t blk = i / C, c = i % C;
        const index_t r1 = (blk + 1) * reduce_rows < M ? (blk + 1) * reduce_rows : M;
        S acc = 0;
        for (index_t m = blk * reduce_rows; m < r1; ++m) acc += value(m, c);
        part(blk, c) = acc;
      });
  Kokkos::parallel_for(
      label + "_sum", block_sum_policy(exec, C), KOKKOS_LAMBDA(const BlockSumMember& team) {
        const index_t c = team.league_rank();
        const S acc = team_block_sum<S>(team, nblk, [&](const index_t blk) { return part(blk, c); });
        Kokkos::single(Kokkos::PerTeam(team), [&]() { out(c) += acc; });
      });
}

}  // namespace ash::impl
