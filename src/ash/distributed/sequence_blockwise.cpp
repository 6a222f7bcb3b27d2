#include "ash/distributed/sequence_blockwise.hpp"

#include <algorithm>
#include <memory>
#include <utility>

#include "ash/core/error.hpp"
#include "ash/distributed/window_halo.hpp"

namespace ash::dist {

namespace {

constexpr int tag_y = 21, tag_g = 22, tag_halo = 23, tag_h = 24, tag_replay = 25;
// A Mamba's: the conv state and h (forward), the conv's cotangent and μ's carry (backward).
// (A MambaState goes as two messages, tags t and t + 1.)
constexpr int tag_conv = 26, tag_gconv = 28, tag_mu = 29, tag_A = 30, tag_mamba_replay = 31;

// acc ← map ∘ acc for element-wise affine maps x ↦ a ⊙ x + b: acc_b = a ⊙ acc_b + b,
// acc_a = a ⊙ acc_a (contiguous views of one size).
template <class V>
void compose_after(const V& acc_a, const V& acc_b, const V& a, const V& b, const ExecSpace& exec) {
  using S = typename V::non_const_value_type;
  S *Aa = acc_a.data(), *Ab = acc_b.data();
  const S *ma = a.data(), *mb = b.data();
  Kokkos::parallel_for(
      "ash::dist::compose_maps", Range(exec, 0, index_t(acc_a.size())), KOKKOS_LAMBDA(const index_t i) {
        Ab[i] = ma[i] * Ab[i] + mb[i];
        Aa[i] = ma[i] * Aa[i];
      });
}

}  // namespace

template <class S>
struct SequenceBlockwise<S>::Pass : BlockwisePass<S> {
  index_t T_all = 0;
  // the replica's windows; the range's tokens; and one more (the last row's target) unless the window ends there
  TokenView x_all, x, x_head;
  View2<S> y, yo;  // whole range, block-major: y_k and y_{k+1} (forward); y_k and g (backward)
  View2<S> ta, tb;  // one block: the recomputation's inputs and outputs
  // Whether this range starts (ends) inside one of one process's blocks: then its
  // first block replays from the state the range before reaches (sends its own).
  bool replay_in = false, replay_out = false;
  View2<S> h_replay;  // [Bt·P, N]: such a state, received
  const std::vector<View2<S>>* carried = nullptr;
  std::function<void(const std::function<void()>&)> timed;
  // A Mamba (model.arch = mamba): the MambaState before every (layer, block),
  // slot j of conv[k − k0] and ssm[k − k0] (block 0's: what the range before
  // ended the layer with, received; zero on the first range), the state a
  // block's forward advances and one block's activations.
  bool mamba = false;
  std::vector<View3<S>> conv, ssm;
  MambaState<S> run, replayed;  // replayed: a replay's state from the range before
  MambaActivations<S> mact;
  MambaState<S> before(int k, index_t j) const {
    MambaState<S> st;
    st.conv = Kokkos::subview(conv[std::size_t(k - this->k0)], j, Kokkos::ALL(), Kokkos::ALL());
    st.ssm = Kokkos::subview(ssm[std::size_t(k - this->k0)], j, Kokkos::ALL(), Kokkos::ALL());
    return st;
  }

  View2<S> blk(const View2<S>& v, index_t j) const {  // block j's rows of a whole-range buffer
    const auto& b = this->blocks();
    return Kokkos::subview(v, Kokkos::make_pair(this->Bt * b.start(j), this->Bt * b.end(j)), Kokkos::ALL());
  }
};

template <class S>
SequenceBlockwise<S>::SequenceBlockwise(const Grid& grid, const EngineOptions& opts, bool mamba)
    : grid_(grid), opts_(opts), mamba_(mamba), layer_(opts), whole_(whole_opts()) {
  require(opts.exact_adjoint() && opts.layer_checkpoint >= 1 && opts.token_block >= 0,
          "sequence ranks with memory levers: adjoint-exact with a resolved grad.layer_checkpoint");
}

template <class S>
TokenBlocks SequenceBlockwise<S>::range_blocks(index_t T_all) const {
  const auto& l = grid_.layout();
  const index_t t_a = l.seq_begin(T_all), t_b = l.seq_end(T_all);
  // Without a lever one process runs a Mamba's whole window at once: the range is one block.
  if (mamba_ && !opts_.blockwise_levers()) return TokenBlocks(t_b - t_a, t_b - t_a);
  return sequence_blocks(opts_, T_all, t_a, t_b);
}

template <class S>
double SequenceBlockwise<S>::compute(const ParamSet<S>& params, const TokenView& x_rows, index_t targets,
                                     const std::vector<View2<S>>* carried, const ParamSet<S>& grad,
                                     const std::function<void(const std::function<void()>&)>& timed,
                                     const std::function<void()>& before_backward) {
  const auto& lay = grid_.layout();
  const index_t T_all = x_rows.extent(1);
  const index_t t_a = lay.seq_begin(T_all), t_b = lay.seq_end(T_all);
  const auto& d = params.dims();
  require(d.mamba() == mamba_, "SequenceBlockwise: built for another model.arch");
  if (window(T_all)) require_window_halos(T_all, lay.S, opts_.truncate);  // before any work
  Pass ps;
  ps.T_all = T_all;
  ps.x_all = x_rows;
  ps.x = token_block(x_rows, t_a, t_b - t_a);
  ps.x_head = token_block(x_rows, t_a, (t_b < T_all ? t_b + 1 : t_b) - t_a);
  ps.carried = carried;
  ps.timed = timed;
  const TokenBlocks blocks = range_blocks(T_all);
  // One process's blocks: the whole window with a window T̄, else blockwise_block_length.
  const index_t L = window(T_all) ? T_all : blockwise_block_length(opts_, T_all);
  // A Mamba's replay from a kept state gives the forward's bits unless the
  // inputs were rounded to 16 bits: only then does a cut block need one process's replay.
  ps.mamba = mamba_;
  const bool replays = !mamba_ || opts_.storage != Storage::full;
  ps.replay_in = replays && lay.seq_rank > 0 && t_a % L != 0;
  ps.replay_out = replays && lay.seq_rank + 1 < lay.S && t_b % L != 0;
  const index_t H = window(T_all) ? WindowHalo<S>::halo_length(lay, T_all, opts_.truncate) : 0;
  ps.start(params, ps.x, targets, blocks, opts_, carried, false,
           [&](const BlockwiseShape& sh) { return sequence_blockwise_workspace(opts_, sh, T_all, H, mamba_); }, grad);
  if (mamba_) {  // the states before every (layer, block), the running state, one block's activations
    const index_t rows_max = blocks.len < ps.T ? blocks.len : ps.T;
    for (int k = ps.k0; k < ps.k1; ++k) {
      ps.conv.emplace_back("ash::seqblocks::mamba_conv_start", blocks.n, ps.Bt * d.inner(), d.conv_kernel - 1);
      ps.ssm.emplace_back("ash::seqblocks::mamba_ssm_start", blocks.n, ps.Bt * d.inner(), d.state);
    }
    ps.run = MambaState<S>(ps.Bt, d);
    if (ps.replay_in) ps.replayed = MambaState<S>(ps.Bt, d);
    ps.mact = MambaActivations<S>(SeqShape{ps.Bt, rows_max, DocStarts()}, d, LayerActivations<S>::projections_only);
  }
  Workspace<S> range;  // y and the next y through the pass
  range.plan(ps.ws.range);
  ps.y = range.view2("ash::seqblocks::y");
  ps.yo = range.view2("ash::seqblocks::y_next");
  forward(params, ps);
  if (before_backward) before_backward();
  Workspace<S> recomputed;
  recomputed.plan(ps.ws.backward);
  ps.ta = recomputed.view2("ash::seqblocks::y_block");
  ps.tb = recomputed.view2("ash::seqblocks::y_block_next");
  if (!mamba_) ps.h_replay = recomputed.view2("ash::seqblocks::h_replay");
  const double loss = ps.last ? head(params, ps, grad) : 0.0;
  backward(params, ps, grad);
  layer_.release();
  whole_.release();
  return loss;
}

// Layer by layer over the range, the state passed from range to range: layer
// k of range s starts from the state range s − 1 ended layer k with, so every
// range scans its tokens from the bits one process carries to them and stores
// (16-bit kept inputs, block states) exactly its values. A wavefront: range s
// runs layer k while range s − 1 runs layer k + 1 (K + S − 1 steps, not K·S).
template <class S>
void SequenceBlockwise<S>::forward(const ParamSet<S>& params, Pass& ps) {
  const auto& lay = grid_.layout();
  const ExecSpace& exec = layer_.execution_space();
  const TokenBlocks& blk = ps.blocks();
  const bool head_range = lay.seq_rank == 0, tail_range = lay.seq_rank == lay.S - 1;
  auto keep = [&](int c) {
    if (c <= ps.seg.top() && !ps.kept_input(c).empty())
      for (index_t j = 0; j < blk.n; ++j) ps.kept_input(c).put(ps.blk(ps.y, j), ps.T, blk.start(j), blk.size(j), exec);
  };
  if (ps.first)
    for (index_t j = 0; j < blk.n; ++j)
      embedding_forward(params.global().embedding, token_block(ps.x, blk.start(j), blk.size(j)), ps.blk(ps.y, j), exec);
  else
    ps.timed([&] { recv(ps.y, lay.layer_rank - 1, tag_y, grid_.layers()); });
  keep(ps.k0);
  Workspace<S> maps;  // the state at the range's end, for the next range
  maps.plan(ps.ws.forward);
  const View2<S> h_end = ps.mamba ? View2<S>() : maps.view2("ash::seqblocks::h_end");
  for (int k = ps.k0; k < ps.k1; ++k) {
    if (ps.mamba) {
      forward_mamba(params, ps, k);
      std::swap(ps.y, ps.yo);
      keep(k + 1);
      continue;
    }
    const auto layer = params.layer(k);
    const View2<S> h0 = ps.carried ? (*ps.carried)[std::size_t(k - ps.k0)] : View2<S>();
    if (!head_range) {  // the state before the range: the previous range's end state
      ps.timed([&] { recv(h_end, lay.seq_rank - 1, tag_h, grid_.seq()); });
      ps.fw->start_from(k, h_end, exec);
    } else if (h0.extent(0) > 0) {
      ps.fw->start_from(k, h0, exec);  // the first range starts from the carried state
    }
    for (index_t j = 0; j < blk.n; ++j) {
      const View2<S> h = ps.fw->advance(layer, k, j, ps.blk(ps.y, j), first_rows(ps.act, ps.fw->rows(j)),
                                        ps.blk(ps.yo, j), exec);
      if (j + 1 == blk.n) Kokkos::deep_copy(exec, h_end, h);
    }
    exec.fence();
    if (!tail_range) ps.timed([&] { send(h_end, lay.seq_rank + 1, tag_h, grid_.seq()); });
    if (tail_range && h0.extent(0) > 0) Kokkos::deep_copy(exec, h0, h_end);
    std::swap(ps.y, ps.yo);
    keep(k + 1);
  }
  if (ps.carried) {  // every range holds the window's end states (the next window's start), sent after
    exec.fence();    // the wavefront so that no range waits on the last one layer by layer
    for (const auto& h0 : *ps.carried)
      if (h0.extent(0) > 0) ps.timed([&] { broadcast(h0, lay.S - 1, grid_.seq()); });
  }
  if (!ps.last) {
    exec.fence();
    ps.timed([&] { send(ps.y, lay.layer_rank + 1, tag_y, grid_.layers()); });
  }
}

// A Mamba's layer k over the range: the state before the range is the one
// the range before ended layer k with — the conv's last Kc − 1 inputs (the
// halo its first taps read; a range shorter than Kc − 1 tokens passes on the
// older ones it received) and h — so the range computes one process's values;
// every block from the state kept before it; the end state to the next range.
// A carried state starts the first range and the last range's end state
// replaces it (forward() then hands that to every range), as an SSM-ResNet's h.
template <class S>
void SequenceBlockwise<S>::forward_mamba(const ParamSet<S>& params, Pass& ps, int k) {
  const auto& lay = grid_.layout();
  const ExecSpace& exec = layer_.execution_space();
  const TokenBlocks& blk = ps.blocks();
  const MambaState<S> b0 = ps.before(k, 0);  // zero on the first range, unless carried
  const View2<S> carried = ps.carried ? (*ps.carried)[std::size_t(k - ps.k0)] : View2<S>();
  if (lay.seq_rank > 0)
    ps.timed([&] { recv_state(b0, lay.seq_rank - 1, tag_conv); });
  else if (ps.carried)
    mamba_state_from_carried(carried, b0, exec);
  for (index_t j = 0; j < blk.n; ++j) {
    advance_mamba(params, ps, k, j, ps.blk(ps.y, j), ps.blk(ps.yo, j));
    if (j + 1 < blk.n) {
      const MambaState<S> next = ps.before(k, j + 1);
      Kokkos::deep_copy(exec, next.conv, ps.run.conv);
      Kokkos::deep_copy(exec, next.ssm, ps.run.ssm);
    }
  }
  exec.fence();
  if (lay.seq_rank + 1 < lay.S)
    ps.timed([&] { send_state(ps.run, lay.seq_rank + 1, tag_conv); });
  else if (ps.carried)
    mamba_state_to_carried(ps.run, carried, exec);
}

// A MambaState to or from a neighbouring range: the conv state (tag), then h (tag + 1).
template <class S>
void SequenceBlockwise<S>::send_state(const MambaState<S>& st, int to, int tag) const {
  send(st.conv, to, tag, grid_.seq());
  send(st.ssm, to, tag + 1, grid_.seq());
}
template <class S>
void SequenceBlockwise<S>::recv_state(const MambaState<S>& st, int from, int tag) const {
  recv(st.conv, from, tag, grid_.seq());
  recv(st.ssm, from, tag + 1, grid_.seq());
}

// A Mamba's layer k on block j, y -> yo, from the state kept before the block (or from):
// the forward and every recomputation alike, bit for bit.
template <class S>
void SequenceBlockwise<S>::advance_mamba(const ParamSet<S>& params, Pass& ps, int k, index_t j, const View2<S>& y,
                                         const View2<S>& yo, const MambaState<S>* from) {
  const ExecSpace& exec = layer_.execution_space();
  const MambaState<S> b = from ? *from : ps.before(k, j);
  Kokkos::deep_copy(exec, ps.run.conv, b.conv);
  Kokkos::deep_copy(exec, ps.run.ssm, b.ssm);
  mamba_layer_forward(params.mamba_layer(k), params.dims(), ps.fw->shape(j), y, first_rows(ps.mact, ps.fw->rows(j)),
                      yo, ps.run, exec);
}

// One process replays a block from its kept state at the block's start. A
// range that starts inside a block gets the state that replay reaches at its
// first token from the range before (per layer), which sends it from its last
// block; the last block goes first so that the next range waits least.
template <class S>
void SequenceBlockwise<S>::recompute(const ParamSet<S>& params, Pass& ps, int c, int k) {
  const auto& lay = grid_.layout();
  const ExecSpace& exec = layer_.execution_space();
  const TokenBlocks& blk = ps.blocks();
  for (index_t i = 0; i < blk.n; ++i) {
    const index_t j = i == 0 ? blk.n - 1 : i - 1;
    const index_t t0 = blk.start(j), Tj = blk.size(j), rows = ps.fw->rows(j);
    const View2<S> dst = ps.blk(ps.y, j);
    View2<S> a = k == c ? dst : first_rows(ps.ta, rows), b = first_rows(ps.tb, rows);
    if (c == 0 && ps.first)
      embedding_forward(params.global().embedding, token_block(ps.x, t0, Tj), a, exec);
    else
      ps.kept_input(c).get(a, ps.T, t0, Tj, exec);
    const auto act_j = ps.mamba ? LayerActivations<S>() : first_rows(ps.act, rows);
    for (int l = c; l < k; ++l) {  // y_{l+1} = layer l (y_l), from the state one process's replay has there
      const View2<S> out = l + 1 == k ? dst : b;
      if (ps.mamba) {  // as below, the state a MambaState
        const bool in = j == 0 && ps.replay_in, send_on = j + 1 == blk.n && ps.replay_out;
        if (in) ps.timed([&] { recv_state(ps.replayed, lay.seq_rank - 1, tag_mamba_replay); });
        advance_mamba(params, ps, l, j, a, out, in ? &ps.replayed : nullptr);
        if (send_on) {
          exec.fence();
          ps.timed([&] { send_state(ps.run, lay.seq_rank + 1, tag_mamba_replay); });
        }
        std::swap(a, b);
        continue;
      }
      const bool in = j == 0 && ps.replay_in, send_on = j + 1 == blk.n && ps.replay_out;
      if (in) ps.timed([&] { recv(ps.h_replay, lay.seq_rank - 1, tag_replay, grid_.seq()); });
      const View2<S> h = ps.fw->replay(params.layer(l), l, j, a, act_j, out, exec, in ? ps.h_replay : View2<S>());
      if (send_on) {
        exec.fence();
        ps.timed([&] { send(h, lay.seq_rank + 1, tag_replay, grid_.seq()); });
      }
      std::swap(a, b);
    }
  }
}

// Layer k's state before the range for its backward: one process's replay of
// layer k (from y_k as recomputed) at the range's first token when the range
// starts inside a block (the range before replays layer k on its last block
// and sends the end state), else the kept state.
template <class S>
View2<S> SequenceBlockwise<S>::replayed_start(const ParamSet<S>& params, Pass& ps, int k) {
  const auto& lay = grid_.layout();
  const ExecSpace& exec = layer_.execution_space();
  const TokenBlocks& blk = ps.blocks();
  if (ps.replay_in) ps.timed([&] { recv(ps.h_replay, lay.seq_rank - 1, tag_replay, grid_.seq()); });
  if (ps.replay_out) {
    const index_t j = blk.n - 1;
    const bool from_in = j == 0 && ps.replay_in;
    const View2<S> h = ps.fw->replay(params.layer(k), k, j, ps.blk(ps.y, j), first_rows(ps.act, ps.fw->rows(j)),
                                     first_rows(ps.tb, ps.fw->rows(j)), exec, from_in ? ps.h_replay : View2<S>());
    exec.fence();
    ps.timed([&] { send(h, lay.seq_rank + 1, tag_replay, grid_.seq()); });
  }
  return ps.replay_in ? ps.h_replay : ps.fw->state_before(k, 0);
}

// The head on y_K recomputed from its segment, like one process (so 16-bit
// storage rounds the same inputs): L's share and g_K of every block into ps.yo.
template <class S>
double SequenceBlockwise<S>::head(const ParamSet<S>& params, Pass& ps, const ParamSet<S>& grad) {
  const ExecSpace& exec = layer_.execution_space();
  const TokenBlocks& blk = ps.blocks();
  const auto gglobal = grad.global();
  recompute(params, ps, ps.seg.starts.back(), ps.K);
  double loss = 0;
  const index_t Th = ps.x_head.extent(1);
  for (index_t j = blk.n - 1; j >= 0; --j) {
    const index_t t0 = blk.start(j);
    const TokenView xh = token_block(ps.x_head, t0, (blk.end(j) < Th ? blk.end(j) + 1 : Th) - t0);
    loss += head_loss<S>(params.global(), xh, ps.blk(ps.y, j), ps.blk(ps.yo, j), &gglobal, opts_.head_chunk,
                         ps.targets, exec);
  }
  return loss;
}

// g_K (from the head, the last layer rank's broadcast in paper mode, or the
// next layer rank), the layers top down, the embedding or g to the previous rank.
template <class S>
void SequenceBlockwise<S>::backward(const ParamSet<S>& params, Pass& ps, const ParamSet<S>& grad) {
  const auto& lay = grid_.layout();
  const MPI_Comm lc = grid_.layers();
  const ExecSpace& exec = layer_.execution_space();
  const TokenBlocks& blk = ps.blocks();
  const View2<S> g = ps.yo;
  if (layer_.detached()) {
    exec.fence();
    ps.timed([&] { broadcast(g, lay.R - 1, lc); });
  } else if (!ps.last) {
    ps.timed([&] { recv(g, lay.layer_rank + 1, tag_g, lc); });
  }
  if (window(ps.T_all))
    layers_window(params, ps, g, grad);
  else if (ps.mamba)
    layers_mamba(params, ps, g, grad);
  else
    layers_carried(params, ps, g, grad);
  if (ps.first) {
    const auto gglobal = grad.global();
    for (index_t j = 0; j < blk.n; ++j)
      embedding_backward(token_block(ps.x, blk.start(j), blk.size(j)), ps.blk(g, j), gglobal.embedding, exec);
  } else if (!layer_.detached()) {
    exec.fence();
    ps.timed([&] { send(g, lay.layer_rank - 1, tag_g, lc); });
  }
}

// Each layer over the whole range: y_k recomputed, μ's carry map composed from
// the blocks (last first) and scanned over the ranks in reverse, then E3 per
// block, last first, from that carry.
template <class S>
void SequenceBlockwise<S>::layers_carried(const ParamSet<S>& params, Pass& ps, const View2<S>& g,
                                          const ParamSet<S>& grad) {
  const auto& lay = grid_.layout();
  const ExecSpace& exec = layer_.execution_space();
  const TokenBlocks& blk = ps.blocks();
  const index_t P = params.dims().width, N = params.dims().state;
  const bool tail = lay.seq_rank == lay.S - 1;
  Workspace<S> maps;  // μ's carry maps over the range and a block; the ones of a carry
  maps.plan(ps.ws.carry_maps);
  const View3<S> Mr = maps.view3("ash::seqblocks::carry_M"), vr = maps.view3("ash::seqblocks::carry_v"),
                 Mj = maps.view3("ash::seqblocks::block_M"), vj = maps.view3("ash::seqblocks::block_v");
  for (std::size_t i = ps.seg.starts.size(); i-- > 0;) {
    const int c = ps.seg.starts[i];
    for (int k = std::min(ps.seg.end_of(i), ps.k1 - 1); k >= c; --k) {
      const auto layer = params.layer(k);
      recompute(params, ps, c, k);
      Kokkos::deep_copy(exec, Mr, S(1));
      Kokkos::deep_copy(exec, vr, S(0));
      for (index_t j = blk.n - 1; j >= 0; --j) {  // c_before = M ⊙ c_after + v over the range
        whole_.block_carry_map(layer, ps.fw->shape(j), ps.blk(ps.y, j), ps.blk(g, j), Mj, vj);
        compose_after(Mr, vr, Mj, vj, exec);
      }
      exec.fence();
      ps.timed([&] { exscan_affine(Mr, vr, grid_.seq_reversed()); });  // the later ranges' maps applied to 0
      ExactCarry<S> carry;  // A μ at the next range's first token (none after the last range)
      if (!tail) {
        carry.mu = vr;
        carry.A = maps.view3("ash::seqblocks::ones");
        Kokkos::deep_copy(exec, carry.A, S(1));
        carry.valid = true;
      }
      const View2<S> h_first = replayed_start(params, ps, k);
      for (index_t j = blk.n - 1; j >= 0; --j)
        whole_.backward_block(layer, ps.fw->shape(j), ps.blk(ps.y, j), ps.blk(g, j),
                              j == 0 ? h_first : ps.fw->state_before(k, j), &carry, grad.layer(k));
    }
  }
}

// A Mamba's layers over the range, top down, each a reverse wavefront over
// the ranges: y_k recomputed, then from the range after it (zero after the
// last) ∂L/∂ the conv state it read — the scatter of the forward's halo onto
// this range's last Kc − 1 inputs (and, from a range shorter than Kc − 1
// tokens, onto older ones, which this range passes on) — and μ's carry (μ
// and A at its first token); E3's block backward per block, last first,
// as one process runs its blocks; the two carries of the first block to the
// range before. The range before runs layer k while this one runs layer k − 1.
template <class S>
void SequenceBlockwise<S>::layers_mamba(const ParamSet<S>& params, Pass& ps, const View2<S>& g,
                                        const ParamSet<S>& grad) {
  const auto& lay = grid_.layout();
  const auto& d = params.dims();
  const ExecSpace& exec = layer_.execution_space();
  const TokenBlocks& blk = ps.blocks();
  const index_t E = d.inner(), N = d.state;
  const bool head_range = lay.seq_rank == 0, tail = lay.seq_rank == lay.S - 1;
  typename MambaKind::template Carry<S> both;  // allocated here: the block backward keeps buffers of its batch
  both.gconv = View2<S>("ash::seqblocks::mamba_conv_carry", ps.Bt * E, d.conv_kernel - 1);
  both.mu.mu = View3<S>("ash::seqblocks::mamba_carry_mu", ps.Bt, E, N);
  both.mu.A = View3<S>("ash::seqblocks::mamba_carry_A", ps.Bt, E, N);
  const View2<S> gconv = both.gconv;
  ExactCarry<S>& carry = both.mu;
  for (std::size_t i = ps.seg.starts.size(); i-- > 0;) {
    const int c = ps.seg.starts[i];
    for (int k = std::min(ps.seg.end_of(i), ps.k1 - 1); k >= c; --k) {
      recompute(params, ps, c, k);
      const MambaState<S> first_state = replayed_mamba_start(params, ps, k);
      if (tail) {
        Kokkos::deep_copy(exec, gconv, S(0));
        carry.valid = false;
      } else {
        exec.fence();
        ps.timed([&] {
          recv(gconv, lay.seq_rank + 1, tag_gconv, grid_.seq());
          recv(carry.mu, lay.seq_rank + 1, tag_mu, grid_.seq());
          recv(carry.A, lay.seq_rank + 1, tag_A, grid_.seq());
        });
        carry.valid = true;
      }
      for (index_t j = blk.n - 1; j >= 0; --j)
        MambaKind::backward_block(whole_, params.mamba_layer(k), d, ps.fw->shape(j), ps.blk(ps.y, j), ps.blk(g, j),
                                  j == 0 ? first_state : ps.before(k, j), false, both, true, grad.mamba_layer(k));
      if (!head_range) {
        exec.fence();
        ps.timed([&] {
          send(gconv, lay.seq_rank - 1, tag_gconv, grid_.seq());
          send(carry.mu, lay.seq_rank - 1, tag_mu, grid_.seq());
          send(carry.A, lay.seq_rank - 1, tag_A, grid_.seq());
        });
      }
    }
  }
}

// A Mamba's layer k: its state before the range for the backward as one
// process's replay has it (16-bit storage, a cut block: the range before
// replays its last block and sends it), else the kept state; exchanged before
// the backward's carries, which wait on the later ranges.
template <class S>
MambaState<S> SequenceBlockwise<S>::replayed_mamba_start(const ParamSet<S>& params, Pass& ps, int k) {
  const auto& lay = grid_.layout();
  const ExecSpace& exec = layer_.execution_space();
  const TokenBlocks& blk = ps.blocks();
  if (ps.replay_in) ps.timed([&] { recv_state(ps.replayed, lay.seq_rank - 1, tag_mamba_replay); });
  if (ps.replay_out) {
    const index_t j = blk.n - 1;
    const bool from_in = j == 0 && ps.replay_in;
    advance_mamba(params, ps, k, j, ps.blk(ps.y, j), first_rows(ps.tb, ps.fw->rows(j)),
                  from_in ? &ps.replayed : nullptr);
    exec.fence();
    ps.timed([&] { send_state(ps.run, lay.seq_rank + 1, tag_mamba_replay); });
  }
  return ps.replay_in ? ps.replayed : ps.before(k, 0);
}

// The paper's window T̄ (paper mode, the range one block): g's halo once, then
// per layer y_k recomputed, its halo, and E3's window backward over the range
// extended by the halo from the state before the range; only the range's own
// tokens add to the gradient (AdjointExactLayer::backward_window_range).
template <class S>
void SequenceBlockwise<S>::layers_window(const ParamSet<S>& params, Pass& ps, const View2<S>& g,
                                         const ParamSet<S>& grad) {
  const auto& lay = grid_.layout();
  const ExecSpace& exec = layer_.execution_space();
  const auto& d = params.dims();
  const index_t P = d.width, Bt = ps.Bt;
  require(ps.blocks().n == 1, "SequenceBlockwise: a window runs each range as one block");
  // A Mamba's ∂L/∂ the conv state after the range's own tokens, handed range to range.
  const View2<S> gconv = ps.mamba ? View2<S>("ash::seqblocks::mamba_conv_carry", Bt * d.inner(), d.conv_kernel - 1)
                                  : View2<S>();
  WindowHalo<S> halo(lay, Bt, P, ps.T_all, opts_.truncate, tag_halo, grid_.seq(), ps.timed);
  const index_t Te = halo.extended();
  require(index_t(ps.ws.window.find("ash::seqblocks::g_halo")->extents[0]) == Bt * halo.halo(),
          "SequenceBlockwise: the workspace's halo is not the window's");
  const TokenView x_ext = token_block(ps.x_all, lay.seq_begin(ps.T_all), Te);  // own tokens, then the halo's
  Workspace<S> ext;  // the range + halo of y and g, g's halo
  ext.plan(ps.ws.window);
  const View2<S> g_halo = ext.view2("ash::seqblocks::g_halo"), y_ext = ext.view2("ash::seqblocks::y_ext"),
                 g_ext = ext.view2("ash::seqblocks::g_ext");
  halo.exchange(g, g_halo, exec);
  for (std::size_t i = ps.seg.starts.size(); i-- > 0;) {
    const int c = ps.seg.starts[i];
    for (int k = std::min(ps.seg.end_of(i), ps.k1 - 1); k >= c; --k) {
      recompute(params, ps, c, k);
      halo.exchange(ps.y, exec);
      halo.extend(ps.y, halo.received(), y_ext, exec);
      halo.extend(g, g_halo, g_ext, exec);  // again per layer: the halo rows are masked
      const SeqShape s_ext{Bt, Te, DocStarts(x_ext)};
      if (ps.mamba) {
        window_mamba(params, ps, k, s_ext, y_ext, g_ext, gconv, grad);
        continue;
      }
      const View2<S> h_first = replayed_start(params, ps, k);
      layer_.backward_window_range(params.layer(k), s_ext, y_ext, g_ext, h_first, ps.T, grad.layer(k));
    }
  }
}

// A Mamba's layer k in a window: as layers_mamba's reverse wavefront without
// μ's carry (μ_T̄ reads the halo instead): ∂L/∂ the conv state the next range
// read arrives (zero after the last range), E3's window backward over the range
// and its halo from the state before the range (the forward's conv halo and h)
// adds its own tokens' part, and the conv's scatter onto the range before goes
// on. The halo of y and g is T̄ − 1 tokens: a halo token's conv reads this
// range's x (or the state before it), and the conv cotangent of the next
// range's tokens is that range's (its own μ_T̄), handed back in gconv.
template <class S>
void SequenceBlockwise<S>::window_mamba(const ParamSet<S>& params, Pass& ps, int k, const SeqShape& s_ext,
                                        const View2<S>& y_ext, const View2<S>& g_ext, const View2<S>& gconv,
                                        const ParamSet<S>& grad) {
  const auto& lay = grid_.layout();
  const ExecSpace& exec = layer_.execution_space();
  const MambaState<S> before = replayed_mamba_start(params, ps, k);
  if (lay.seq_rank + 1 == lay.S)
    Kokkos::deep_copy(exec, gconv, S(0));
  else
    ps.timed([&] { recv(gconv, lay.seq_rank + 1, tag_gconv, grid_.seq()); });
  MambaKind::backward_window_range(layer_, params.mamba_layer(k), params.dims(), s_ext, y_ext, g_ext, before, ps.T,
                                   gconv, grad.mamba_layer(k));
  if (lay.seq_rank > 0) {
    exec.fence();
    ps.timed([&] { send(gconv, lay.seq_rank - 1, tag_gconv, grid_.seq()); });
  }
}

template class SequenceBlockwise<float>;
template class SequenceBlockwise<double>;

}  // namespace ash::dist
