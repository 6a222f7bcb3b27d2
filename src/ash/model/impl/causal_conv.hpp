#pragma once
// The Mamba blocks' causal depthwise conv over C channels (docs/design.md §1) and
// its VJP, shared by the Mamba-1 block (C = E: x) and the Mamba-2 block (C = E +
// 2·G·N: x, B and C), and SiLU. Rows are tokens m = b·T + t; a conv state is
// [Bt·C, Kc−1], row b·C + c, oldest column first. Included by model/*.cpp only.
#include "ash/core/types.hpp"
#include "ash/kernels/row_sums.hpp"
#include "ash/model/ssm_layer.hpp"

namespace ash::impl {

using RowTeams = Kokkos::TeamPolicy<ExecSpace>;  // a team per token row

// SiLU(v) = v σ(v) and its derivative σ(v) (1 + v (1 - σ(v))).
template <class S>
KOKKOS_INLINE_FUNCTION S sigmoid(S v) {
  return S(1) / (S(1) + kmath::exp(-v));
}
template <class S>
KOKKOS_INLINE_FUNCTION S silu(S v) {
  return v * sigmoid(v);
}
template <class S>
KOKKOS_INLINE_FUNCTION S silu_grad(S v) {
  const S sg = sigmoid(v);
  return sg * (S(1) + v * (S(1) - sg));
}

// c^t_ch = b_ch + Σ_k w[ch, Kc−1−k] x^{t−k}_ch, handed to out(m, ch, c). Taps walk
// back from the token itself and stop after a document's first token (the conv
// sees nothing before a start, as mamba-ssm's seq_idx) or the window's; with a
// carried state cs (non-empty), the taps before the window's first token read it.
template <class S, class W, class B, class Out>
void causal_conv_forward(const SeqShape& s, const View2<S>& x, const W& w, const B& bias, const View2<S>& cs,
                         const Out& out, const ExecSpace& exec) {
  const index_t M = x.extent(0), C = x.extent(1), T = s.T, Kc = w.extent(1);
  const bool carry = cs.extent(0) > 0;
  const DocStarts docs = s.docs;
  // A team per token, its threads over channels (coalesced on a GPU; a host's
  // team walks the channels in a loop it vectorises): the token's taps are
  // found once, then every channel adds them in the same order.
  Kokkos::parallel_for(
      "ash::mamba::conv_forward", RowTeams(exec, league_size(M), Kokkos::AUTO),
      KOKKOS_LAMBDA(const RowTeams::member_type& team) {
        const index_t m = team.league_rank(), b = m / T, t = m % T;
        index_t nk = 0;  // taps 0..nk-1 read the window: back to the document's first token or the window's
        while (nk < Kc && nk <= t) {
          ++nk;
          if (docs.at(b, t - nk + 1)) break;
        }
        // the rest read the carried state, unless a document start cut the taps (at token 0 too)
        const bool state_taps = carry && nk == t + 1 && nk < Kc && !docs.at(b, 0);
        Kokkos::parallel_for(Kokkos::TeamThreadRange(team, C), [&](const index_t e) {
          S acc = bias(e);
          for (index_t k = 0; k < nk; ++k) acc += w(e, Kc - 1 - k) * x(m - k, e);
          if (state_taps)
            for (index_t k = nk; k < Kc; ++k) acc += w(e, Kc - 1 - k) * cs(b * C + e, Kc - 1 - (k - t));
          out(m, e, acc);
        });
      });
}

// The conv state after the window: x of its last Kc−1 tokens (older ones from
// the state, ascending so a column is read before it is overwritten), 0 for a
// token before the last document start.
template <class S>
void causal_conv_state(const SeqShape& s, const View2<S>& x, const View2<S>& cs, const ExecSpace& exec) {
  const index_t C = x.extent(1), T = s.T, Kc = index_t(cs.extent(1)) + 1;
  if (Kc <= 1) return;
  const DocStarts docs = s.docs;
  Kokkos::parallel_for(
      "ash::mamba::conv_state", Range(exec, 0, s.batch * C), KOKKOS_LAMBDA(const index_t i) {
        const index_t b = i / C, e = i % C, first = T - (Kc - 1);  // the token of column 0
        index_t start = -Kc;  // the last start after column 0's token (none: before every column)
        for (index_t t = T - 1; t > first && t >= 0; --t)
          if (docs.at(b, t)) {
            start = t;
            break;
          }
        for (index_t j = 0; j < Kc - 1; ++j) {
          const index_t t = first + j;
          cs(i, j) = t < start ? S(0) : t >= 0 ? x(b * T + t, e) : cs(i, j + T);
        }
      });
}

// The conv's VJPs, given gc = ∂L/∂c [M, C]: into x (gx, overwritten: each token
// feeds the next Kc − 1 outputs of its document; in a token block, also across
// the block's ends), and into w_conv and b_conv (added to gw, gb). A token block
// when gcs is given: cb is the conv state before it, gcs ∂L/∂ the conv state after
// it (in; the state after token own − 1) and before it (out); own: the block's own
// tokens per sequence (the rest a window's halo with zero cotangents). part:
// the caller's workspace, at least [row_blocks(M), C·(Kc+1)].
template <class S, class W, class GW, class GB>
void causal_conv_backward(const SeqShape& s, const W& w, const View2<S>& x, const View2<S>& gc, const View2<S>& gx,
                          const View2<S>& cb, const View2<S>& gcs, index_t own, const View2<S>& part, const GW& gw,
                          const GB& gb, const ExecSpace& exec) {
  const bool block = gcs.extent(0) > 0;
  const index_t M = x.extent(0), E = x.extent(1), T = s.T, Bt = s.batch, Kc = w.extent(1);
  const DocStarts docs = s.docs;
  Kokkos::parallel_for(
      "ash::mamba::conv_backward_x", RowTeams(exec, league_size(M), Kokkos::AUTO),
      KOKKOS_LAMBDA(const RowTeams::member_type& team) {
        const index_t m = team.league_rank(), b = m / T, t = m % T;
        index_t nk = 0;  // the later tokens whose taps read this one: up to the next document start
        while (nk < Kc && t + nk < T && !(nk > 0 && docs.at(b, t + nk))) ++nk;
        Kokkos::parallel_for(Kokkos::TeamThreadRange(team, E), [&](const index_t e) {
          S acc = 0;
          for (index_t k = 0; k < nk; ++k) acc += w(e, Kc - 1 - k) * gc(m + k, e);
          gx(m, e) = acc;
        });
      });
  // Across the block's start: the later blocks' cotangent of the conv state
  // after this block goes to the x rows it holds (older columns, of a block
  // shorter than Kc−1, pass on to the state before), and the taps of the
  // block's first tokens into the state before it add theirs.
  if (block && Kc > 1)
    Kokkos::parallel_for(
        "ash::mamba::conv_backward_carry", Range(exec, 0, Bt * E), KOKKOS_LAMBDA(const index_t i) {
          const index_t b = i / E, e = i % E, first = own - (Kc - 1);  // the token of the state after's column 0
          index_t start = -Kc;  // the last start after column 0's token, as the forward's conv_state
          for (index_t t = own - 1; t > first && t >= 0; --t)
            if (docs.at(b, t)) {
              start = t;
              break;
            }
          for (index_t j = 0; j < Kc - 1; ++j) {  // first: every column that holds this block's x
            const index_t t = first + j;
            if (t >= 0 && t >= start) gx(b * T + t, e) += gcs(i, j);
          }
          index_t open = own;  // tokens [0, open) of the block read the state before (no start among them)
          for (index_t t = 0; t < own; ++t)
            if (docs.at(b, t)) {
              open = t;
              break;
            }
          for (index_t c = Kc - 2; c >= 0; --c) {  // descending: column c reads column c - own, not yet rewritten
            S acc = 0;
            if (c - own >= 0 && first + (c - own) >= start) acc += gcs(i, c - own);
            for (index_t t = 0; t <= c && t < open; ++t) acc += w(e, c - t) * gc(b * T + t, e);
            gcs(i, c) = acc;
          }
        });
  // Into w_conv and b_conv in two levels (kernels/row_sums.hpp): one thread per
  // (row block, channel) walks its rows in order and adds each tap into its
  // partial sums (consecutive channels read adjacent memory, where one thread per
  // (channel, tap) over the whole window read a new cache line per token), then
  // each (channel, tap) adds its blocks in order: bitwise repeatable.
  const index_t taps = Kc + 1, nblk = row_blocks(M);  // tap Kc is the bias
  ash::require(index_t(part.extent(0)) >= nblk && index_t(part.extent(1)) >= E * taps,
               "causal_conv_backward: conv partial sums of another size");
  Kokkos::parallel_for(
      "ash::mamba::conv_backward_w", Range(exec, 0, nblk * E), KOKKOS_LAMBDA(const index_t i) {
        const index_t blk = i / E, e = i % E, c0 = e * taps;
        const index_t r1 = (blk + 1) * reduce_rows < M ? (blk + 1) * reduce_rows : M;
        for (index_t j = 0; j < taps; ++j) part(blk, c0 + j) = 0;
        for (index_t m = blk * reduce_rows; m < r1; ++m) {
          const index_t b = m / T, t = m % T;
          const S gcm = gc(m, e);
          part(blk, c0 + Kc) += gcm;
          // the forward's taps: back from the token, none before its document; in a
          // token block, the taps before the block's first token read the conv state
          // before it (unless a document starts in between)
          index_t k = 0;
          bool cut = false;
          for (; k < Kc && k <= t; ++k) {
            part(blk, c0 + Kc - 1 - k) += gcm * x(m - k, e);
            if (docs.at(b, t - k)) {
              cut = true;
              break;
            }
          }
          if (block && !cut)
            for (; k < Kc; ++k) part(blk, c0 + Kc - 1 - k) += gcm * cb(b * E + e, Kc - 1 - (k - t));
        }
      });
  Kokkos::parallel_for(
      "ash::mamba::conv_backward_w_sum", block_sum_policy(exec, E * taps),
      KOKKOS_LAMBDA(const BlockSumMember& team) {
        const index_t c = team.league_rank(), e = c / taps, j = c % taps;
        const S acc = team_block_sum<S>(team, nblk, [&](const index_t blk) { return part(blk, c); });
        Kokkos::single(Kokkos::PerTeam(team), [&]() {
          if (j == Kc)
            gb(e) += acc;
          else
            gw(e, j) += acc;
        });
      });
}

}  // namespace ash::impl
