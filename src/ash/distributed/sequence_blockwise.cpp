#include "ash/distributed/sequence_blockwise.hpp"

#include <algorithm>
#include <utility>

#include "ash/core/error.hpp"
#include "ash/distributed/collectives.hpp"
#include "ash/distributed/window_halo.hpp"
#include "ash/grad/layer_kinds.hpp"

namespace ash::dist {

namespace impl {  // (external linkage: nvcc refuses a KOKKOS_LAMBDA in a function with internal linkage)

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

}  // namespace impl

namespace {

constexpr int tag_y = 21, tag_g = 22, tag_halo = 23;
// A kind's state or carry goes as one message per view, tags t, t + 1, ... (at most 4 views).
constexpr int tag_state = 24, tag_replay = 28, tag_carry = 32;

using Timed = std::function<void(const std::function<void()>&)>;

// One SequenceBlockwise::compute of layer kind K: the range, its blocks,
// segments, states and buffers, and the pass over them.
template <class S, class K>
class SequencePass {
 public:
  using State = typename K::template State<S>;
  using Carry = typename K::template Carry<S>;

  SequencePass(const Grid& grid, const EngineOptions& opts, AdjointExactLayer<S>& layer, AdjointExactLayer<S>& whole,
               const ParamSet<S>& params, const TokenView& x_rows, index_t targets, const TokenBlocks& blocks,
               const std::vector<View2<S>>* carried, const ParamSet<S>& grad, const Timed& timed)
      : grid_(grid),
        lay_(grid.layout()),
        opts_(opts),
        layer_(layer),
        whole_(whole),
        params_(params),
        d_(params.dims()),
        grad_(grad),
        blk_(blocks),
        carried_(carried),
        timed_(timed),
        exec_(layer.execution_space()) {
    T_all_ = x_rows.extent(1);
    window_ = opts.truncate > 0 && opts.truncate < T_all_;
    const index_t t_a = lay_.seq_begin(T_all_), t_b = lay_.seq_end(T_all_);
    x_all_ = x_rows;
    x_ = token_block(x_rows, t_a, t_b - t_a);
    // and one more token (the last row's target) unless the window ends there
    x_head_ = token_block(x_rows, t_a, (t_b < T_all_ ? t_b + 1 : t_b) - t_a);
    // One process's blocks: the whole window with a window T̄, else blockwise_block_length.
    const index_t L = window_ ? T_all_ : blockwise_block_length(opts, T_all_);
    // Whether this range starts (ends) inside one of one process's blocks: then its
    // first block replays from the state the range before reaches (sends its own).
    const bool replays = K::replays_cut_block || opts.storage != Storage::full;
    replay_in_ = replays && lay_.seq_rank > 0 && t_a % L != 0;
    replay_out_ = replays && lay_.seq_rank + 1 < lay_.S && t_b % L != 0;
    const index_t H = window_ ? WindowHalo<S>::halo_length(lay_, T_all_, opts.truncate) : 0;
    ps_.start(
        params, x_, targets, blocks.len, opts, carried, false,
        [&](const BlockwiseShape& sh) { return sequence_blockwise_workspace<K>(opts, sh, T_all_, H); }, grad);
    // The state before every (layer, block) (block 0's: what the range before
    // ended the layer with; zero on the first range unless carried), the state a
    // block's forward advances, one block's activations.
    for (int k = ps_.k0; k < ps_.k1; ++k) states_.emplace_back(d_, ps_.Bt, blk_.n);
    run_ = K::template make_state<S>(d_, ps_.Bt);
    const index_t rows_max = blocks.len < ps_.T ? blocks.len : ps_.T;
    act_ = K::template make_block_acts<S>(SeqShape{ps_.Bt, rows_max, DocStarts()}, d_);
  }

  double run(const std::function<void()>& before_backward) {
    Workspace<S> range;  // y and the next y through the pass
    range.plan(ps_.ws.range);
    y_ = range.view2("ash::seqblocks::y");
    yo_ = range.view2("ash::seqblocks::y_next");
    forward();
    if (before_backward) before_backward();
    Workspace<S> recomputed;
    recomputed.plan(ps_.ws.backward);
    ta_ = recomputed.view2("ash::seqblocks::y_block");
    tb_ = recomputed.view2("ash::seqblocks::y_block_next");
    if (replay_in_) replayed_ = K::template make_state<S>(d_, ps_.Bt);
    const double loss = ps_.last ? head() : 0.0;
    backward();
    layer_.release();
    whole_.release();
    return loss;
  }

 private:
  SeqShape shape(index_t j) const { return SeqShape{ps_.Bt, blk_.size(j), ps_.docs.from(blk_.start(j))}; }
  index_t rows(index_t j) const { return ps_.Bt * blk_.size(j); }
  State before(int k, index_t j) const { return states_[std::size_t(k - ps_.k0)].at(j); }
  View2<S> blk(const View2<S>& v, index_t j) const {  // block j's rows of a whole-range buffer
    return Kokkos::subview(v, Kokkos::make_pair(ps_.Bt * blk_.start(j), ps_.Bt * blk_.end(j)), Kokkos::ALL());
  }
  bool head_range() const { return lay_.seq_rank == 0; }
  bool tail_range() const { return lay_.seq_rank + 1 == lay_.S; }

  void send_state(const State& st, int to, int tag) const {
    send_each([&](const auto& f) { K::for_each_view(st, f); }, to, tag, grid_.seq());
  }
  void recv_state(const State& st, int from, int tag) const {
    recv_each([&](const auto& f) { K::for_each_view(st, f); }, from, tag, grid_.seq());
  }
  // A carry's views from the next range (zero after the last range), and on to the range before.
  template <class ForEach>
  void carry_in(const ForEach& views) {
    if (tail_range()) {
      views([&](const auto& v) { Kokkos::deep_copy(exec_, v, S(0)); });
      return;
    }
    exec_.fence();
    timed_([&] { recv_each(views, lay_.seq_rank + 1, tag_carry, grid_.seq()); });
  }
  template <class ForEach>
  void carry_out(const ForEach& views) {
    if (head_range()) return;
    exec_.fence();
    timed_([&] { send_each(views, lay_.seq_rank - 1, tag_carry, grid_.seq()); });
  }

  // Layer k on block j, y -> yo, from the state kept before the block (or
  // from: a replay's): the forward and every recomputation alike, bit for bit;
  // run_ holds the state after it.
  void advance(int k, index_t j, const View2<S>& y, const View2<S>& yo, const State* from = nullptr) {
    K::copy(exec_, run_, from ? *from : before(k, j));
    K::forward_block(K::layer(params_, k), d_, shape(j), y, act_, yo, run_, exec_);
  }

  // Layer by layer over the range, the state passed from range to range: layer
  // k of range s starts from the state range s − 1 ended layer k with, so every
  // range scans its tokens from the bits one process carries to them and stores
  // (16-bit kept inputs, block states) exactly its values. A wavefront: range s
  // runs layer k while range s − 1 runs layer k + 1 (K + S − 1 steps, not K·S).
  void forward() {
    const MPI_Comm lc = grid_.layers();
    auto keep = [&](int c) {
      if (c <= ps_.seg.top() && !ps_.kept_input(c).empty())
        for (index_t j = 0; j < blk_.n; ++j)
          ps_.kept_input(c).put(blk(y_, j), ps_.T, blk_.start(j), blk_.size(j), exec_);
    };
    if (ps_.first)
      for (index_t j = 0; j < blk_.n; ++j)
        embedding_forward(params_.global().embedding, token_block(x_, blk_.start(j), blk_.size(j)), blk(y_, j), exec_);
    else
      timed_([&] { recv(y_, lay_.layer_rank - 1, tag_y, lc); });
    keep(ps_.k0);
    for (int k = ps_.k0; k < ps_.k1; ++k) {
      forward_layer(k);
      std::swap(y_, yo_);
      keep(k + 1);
    }
    if (carried_) {   // every range holds the window's end states (the next window's start), sent after
      exec_.fence();  // the wavefront so that no range waits on the last one layer by layer
      for (const auto& h0 : *carried_)
        if (h0.extent(0) > 0) timed_([&] { broadcast(h0, lay_.S - 1, grid_.seq()); });
    }
    if (!ps_.last) {
      exec_.fence();
      timed_([&] { send(y_, lay_.layer_rank + 1, tag_y, lc); });
    }
  }

  // Layer k over the range: the state before the range is the one the range
  // before ended layer k with, so the range computes one process's values;
  // every block from the state kept before it; the end state to the next
  // range. A carried state starts the first range and the last range's end
  // state replaces it (forward() then hands that to every range).
  void forward_layer(int k) {
    const State b0 = before(k, 0);  // zero on the first range, unless carried
    const View2<S> carried = carried_ ? (*carried_)[std::size_t(k - ps_.k0)] : View2<S>();
    if (!head_range())
      timed_([&] { recv_state(b0, lay_.seq_rank - 1, tag_state); });
    else if (carried_)
      K::from_carried(carried, b0, exec_);
    for (index_t j = 0; j < blk_.n; ++j) {
      advance(k, j, blk(y_, j), blk(yo_, j));
      if (j + 1 < blk_.n) K::copy(exec_, before(k, j + 1), run_);
    }
    exec_.fence();
    if (!tail_range())
      timed_([&] { send_state(run_, lay_.seq_rank + 1, tag_state); });
    else if (carried_)
      K::to_carried(run_, carried, exec_);
  }

  // One process replays a block from its kept state at the block's start. A
  // range that starts inside a block gets the state that replay reaches at its
  // first token from the range before (per layer), which sends it from its last
  // block; the last block goes first so that the next range waits least.
  // y_k of every block into y_ from its segment's start c.
  void recompute(int c, int k) {
    for (index_t i = 0; i < blk_.n; ++i) {
      const index_t j = i == 0 ? blk_.n - 1 : i - 1;
      const index_t t0 = blk_.start(j), Tj = blk_.size(j);
      const View2<S> dst = blk(y_, j);
      View2<S> a = k == c ? dst : first_rows(ta_, rows(j)), b = first_rows(tb_, rows(j));
      if (c == 0 && ps_.first)
        embedding_forward(params_.global().embedding, token_block(x_, t0, Tj), a, exec_);
      else
        ps_.kept_input(c).get(a, ps_.T, t0, Tj, exec_);
      for (int l = c; l < k; ++l) {  // y_{l+1} = layer l (y_l), from the state one process's replay has there
        const View2<S> out = l + 1 == k ? dst : b;
        const bool in = j == 0 && replay_in_, send_on = j + 1 == blk_.n && replay_out_;
        if (in) timed_([&] { recv_state(replayed_, lay_.seq_rank - 1, tag_replay); });
        advance(l, j, a, out, in ? &replayed_ : nullptr);
        if (send_on) {
          exec_.fence();
          timed_([&] { send_state(run_, lay_.seq_rank + 1, tag_replay); });
        }
        std::swap(a, b);
      }
    }
  }

  // Layer k's state before the range for its backward: one process's replay
  // of layer k (from y_k as recomputed) at the range's first token when the
  // range starts inside a block (the range before replays layer k on its last
  // block and sends the end state), else the kept state; exchanged before the
  // backward's carries, which wait on the later ranges.
  State replayed_start(int k) {
    if (replay_in_) timed_([&] { recv_state(replayed_, lay_.seq_rank - 1, tag_replay); });
    if (replay_out_) {
      const index_t j = blk_.n - 1;
      const bool from_in = j == 0 && replay_in_;
      advance(k, j, blk(y_, j), first_rows(tb_, rows(j)), from_in ? &replayed_ : nullptr);
      exec_.fence();
      timed_([&] { send_state(run_, lay_.seq_rank + 1, tag_replay); });
    }
    return replay_in_ ? replayed_ : before(k, 0);
  }

  // The head on y_K recomputed from its segment, like one process (so 16-bit
  // storage rounds the same inputs): L's share and g_K of every block into yo_.
  double head() {
    const auto gglobal = grad_.global();
    recompute(ps_.seg.starts.back(), ps_.K);
    double loss = 0;
    const index_t Th = x_head_.extent(1);
    for (index_t j = blk_.n - 1; j >= 0; --j) {
      const index_t t0 = blk_.start(j);
      const TokenView xh = token_block(x_head_, t0, (blk_.end(j) < Th ? blk_.end(j) + 1 : Th) - t0);
      loss +=
          head_loss<S>(params_.global(), xh, blk(y_, j), blk(yo_, j), &gglobal, opts_.head_chunk, ps_.targets, exec_);
    }
    return loss;
  }

  // g_K (from the head, the last layer rank's broadcast in paper mode, or the
  // next layer rank), the layers top down, the embedding or g to the previous rank.
  void backward() {
    const MPI_Comm lc = grid_.layers();
    const View2<S> g = yo_;
    if (layer_.detached()) {
      exec_.fence();
      timed_([&] { broadcast(g, lay_.R - 1, lc); });
    } else if (!ps_.last) {
      timed_([&] { recv(g, lay_.layer_rank + 1, tag_g, lc); });
    }
    if (window_)
      layers_window(g);
    else if constexpr (K::range_maps)
      layers_carried(g);
    else
      layers_wavefront(g);
    if (ps_.first) {
      const auto gglobal = grad_.global();
      for (index_t j = 0; j < blk_.n; ++j)
        embedding_backward(token_block(x_, blk_.start(j), blk_.size(j)), blk(g, j), gglobal.embedding, exec_);
    } else if (!layer_.detached()) {
      exec_.fence();
      timed_([&] { send(g, lay_.layer_rank - 1, tag_g, lc); });
    }
  }

  // The layers top down, each segment's inputs recomputed: f(k) per layer.
  template <class F>
  void layers_top_down(const F& f) {
    for (std::size_t i = ps_.seg.starts.size(); i-- > 0;) {
      const int c = ps_.seg.starts[i];
      for (int k = std::min(ps_.seg.end_of(i), ps_.k1 - 1); k >= c; --k) {
        recompute(c, k);
        f(k);
      }
    }
  }

  // A kind with range maps: each layer over the whole range, μ's carry map
  // composed from the blocks (last first) and scanned over the ranks in
  // reverse, then E3 per block, last first, from that carry.
  void layers_carried(const View2<S>& g) {
    Workspace<S> maps;  // μ's carry maps over the range and a block; the ones of a carry
    maps.plan(ps_.ws.carry_maps);
    const View3<S> Mr = maps.view3("ash::seqblocks::carry_M"), vr = maps.view3("ash::seqblocks::carry_v"),
                   Mj = maps.view3("ash::seqblocks::block_M"), vj = maps.view3("ash::seqblocks::block_v");
    layers_top_down([&](int k) {
      const auto p = K::layer(params_, k);
      Kokkos::deep_copy(exec_, Mr, S(1));
      Kokkos::deep_copy(exec_, vr, S(0));
      for (index_t j = blk_.n - 1; j >= 0; --j) {  // c_before = M ⊙ c_after + v over the range
        K::block_carry_map(whole_, p, shape(j), blk(y_, j), blk(g, j), Mj, vj);
        impl::compose_after(Mr, vr, Mj, vj, exec_);
      }
      exec_.fence();
      timed_([&] { exscan_affine(Mr, vr, grid_.seq_reversed()); });  // the later ranges' maps applied to 0
      Carry carry;  // A μ at the next range's first token (none after the last range)
      if (!tail_range()) {
        carry.mu.mu = vr;
        carry.mu.A = maps.view3("ash::seqblocks::ones");
        Kokkos::deep_copy(exec_, carry.mu.A, S(1));
        carry.mu.valid = true;
      }
      backward_blocks(k, g, replayed_start(k), carry);
    });
  }

  // A kind without range maps: the layers top down, each a reverse wavefront
  // over the ranges: from the range after it (zero after the last) every view
  // of the carry its first block left (K::for_each_carry_view); E3's block
  // backward per block, last first, as one process runs its blocks; this
  // range's first block's carry to the range before. The range before runs
  // layer k while this one runs layer k − 1.
  void layers_wavefront(const View2<S>& g) {
    // allocated here, every view to receive into (the block backward keeps buffers of its batch)
    Carry carry = K::template make_range_carry<S>(d_, ps_.Bt);
    const auto views = [&](const auto& f) { K::for_each_carry_view(carry, f); };
    layers_top_down([&](int k) {
      const State first = replayed_start(k);
      carry_in(views);
      K::carry_arrived(carry, !tail_range());
      backward_blocks(k, g, first, carry);
      carry_out(views);
    });
  }

  // E3's block backward of layer k, blocks last to first, block 0 from `first`.
  void backward_blocks(int k, const View2<S>& g, const State& first, Carry& carry) {
    for (index_t j = blk_.n - 1; j >= 0; --j)
      K::backward_block(whole_, K::layer(params_, k), d_, shape(j), blk(y_, j), blk(g, j),
                        j == 0 ? first : before(k, j), false, carry, true, K::layer(grad_, k));
  }

  // The paper's window T̄ (paper mode, the range one block): g's halo once, then
  // per layer y_k recomputed, its halo, the window's carry views from the next
  // range (K::for_each_window_carry_view; zero after the last), and the kind's
  // window backward over the range extended by the halo from the state before
  // the range; only the range's own tokens add to the gradient; the carry views
  // on to the range before.
  void layers_window(const View2<S>& g) {
    const index_t P = d_.width, Bt = ps_.Bt;
    require(blk_.n == 1, "SequenceBlockwise: a window runs each range as one block");
    Carry carry = K::template make_carry<S>(d_, Bt);  // what a window hands range to range
    const auto views = [&](const auto& f) { K::for_each_window_carry_view(carry, f); };
    WindowHalo<S> halo(lay_, Bt, P, T_all_, opts_.truncate, tag_halo, grid_.seq(), timed_);
    const index_t Te = halo.extended();
    require(index_t(ps_.ws.window.find("ash::seqblocks::g_halo")->extents[0]) == Bt * halo.halo(),
            "SequenceBlockwise: the workspace's halo is not the window's");
    const TokenView x_ext = token_block(x_all_, lay_.seq_begin(T_all_), Te);  // own tokens, then the halo's
    Workspace<S> ext;                                                         // the range + halo of y and g, g's halo
    ext.plan(ps_.ws.window);
    const View2<S> g_halo = ext.view2("ash::seqblocks::g_halo"), y_ext = ext.view2("ash::seqblocks::y_ext"),
                   g_ext = ext.view2("ash::seqblocks::g_ext");
    halo.exchange(g, g_halo, exec_);
    layers_top_down([&](int k) {
      halo.exchange(y_, exec_);
      halo.extend(y_, halo.received(), y_ext, exec_);
      halo.extend(g, g_halo, g_ext, exec_);  // again per layer: the halo rows are masked
      const State first = replayed_start(k);
      carry_in(views);
      K::backward_window_range(layer_, K::layer(params_, k), d_, SeqShape{Bt, Te, DocStarts(x_ext)}, y_ext, g_ext,
                               first, ps_.T, carry, K::layer(grad_, k));
      carry_out(views);
    });
  }

  const Grid& grid_;
  const Layout& lay_;
  const EngineOptions& opts_;
  AdjointExactLayer<S>& layer_;  // the options' method (a window's backward)
  AdjointExactLayer<S>& whole_;  // without a window: the carry maps and blocks
  const ParamSet<S>& params_;
  const ModelDims& d_;
  const ParamSet<S>& grad_;
  TokenBlocks blk_;
  const std::vector<View2<S>>* carried_;
  const Timed& timed_;
  const ExecSpace& exec_;
  index_t T_all_ = 0;
  bool window_ = false;
  TokenView x_all_, x_, x_head_;  // the replica's windows; the range's tokens; and the last row's target
  bool replay_in_ = false, replay_out_ = false;
  BlockwisePass<S> ps_;
  std::vector<typename K::template BlockStates<S>> states_;  // [k - k0]: the states before each block
  State run_, replayed_;                                     // replayed_: a replay's state from the range before
  typename K::template BlockActs<S> act_;                    // one block's activations
  View2<S> y_, yo_;   // whole range, block-major: y_k and y_{k+1} (forward); y_k and g (backward)
  View2<S> ta_, tb_;  // one block: the recomputation's inputs and outputs
};

}  // namespace

template <class S>
SequenceBlockwise<S>::SequenceBlockwise(const Grid& grid, const EngineOptions& opts)
    : grid_(grid), opts_(opts), layer_(opts), whole_(whole_opts()) {
  require(opts.exact_adjoint() && opts.layer_checkpoint >= 1 && opts.token_block >= 0,
          "sequence ranks with memory levers: adjoint-exact with a resolved grad.layer_checkpoint");
}

template <class S>
TokenBlocks SequenceBlockwise<S>::range_blocks(index_t T_all) const {
  const auto& l = grid_.layout();
  const index_t t_a = l.seq_begin(T_all), t_b = l.seq_end(T_all);
  // Without a lever one process runs its whole window at once: the range is one block.
  if (!opts_.blockwise_levers()) return TokenBlocks(t_b - t_a, t_b - t_a);
  return sequence_blocks(opts_, T_all, t_a, t_b);
}

template <class S>
double SequenceBlockwise<S>::compute(const ParamSet<S>& params, const TokenView& x_rows, index_t targets,
                                     const std::vector<View2<S>>* carried, const ParamSet<S>& grad,
                                     const std::function<void(const std::function<void()>&)>& timed,
                                     const std::function<void()>& before_backward) {
  const index_t T_all = x_rows.extent(1);
  if (window(T_all)) require_window_halos(T_all, grid_.layout().S, opts_.truncate);  // before any work
  const TokenBlocks blocks = range_blocks(T_all);
  return with_layer_kind(params.dims(), [&](auto kind) {
    return SequencePass<S, decltype(kind)>(grid_, opts_, layer_, whole_, params, x_rows, targets, blocks, carried,
                                           grad, timed)
        .run(before_backward);
  });
}

template class SequenceBlockwise<float>;
template class SequenceBlockwise<double>;

}  // namespace ash::dist
