#include "ash/distributed/distributed_engine.hpp"

#include <algorithm>
#include <chrono>
#include <utility>

#include "ash/core/error.hpp"
#include "ash/distributed/collectives.hpp"
#include "ash/distributed/window_halo.hpp"
#include "ash/grad/layer_kinds.hpp"
#include "ash/kernels/matmul.hpp"

namespace ash::dist {

namespace {

// tag_state: a kind's state goes as one message per view, tags 15, 16, ...
constexpr int tag_y = 11, tag_g = 12, tag_halo = 13, tag_tied = 14, tag_state = 15;

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// sum += part, elementwise (a free function: CUDA's extended lambdas may not sit in a private member).
template <class S>
void add_into(const ExecSpace& exec, const View1<S>& part, const Unmanaged1<S>& sum) {
  Kokkos::parallel_for(
      "ash::dist::tied_embedding_sum", Range(exec, 0, part.extent(0)),
      KOKKOS_LAMBDA(const index_t i) { sum(i) += part(i); });
}

}  // namespace

// What one compute() works on: this replica's windows and this sequence
// rank's token range, the layers' inputs, g, and the states the backward reads.
template <class S>
struct DistributedEngine<S>::Pass {
  TokenView x, x_head;     // this rank's tokens (x_head: one more, the last row's target, unless the window ends)
  TokenView x_rows;        // this replica's whole windows (a window's halo tokens)
  index_t T = 0, Bt = 0;   // tokens per sequence of this rank's range, sequences
  index_t T_all = 0;       // tokens per window
  index_t targets = 0;     // the whole batch's target count (the loss is its mean)
  ActivationStore<S> store;
  std::vector<View2<S>> h_range;               // [layer]: h before this sequence rank's range
  View2<S> g;                                  // g_k, [Bt·T, P]
  SeqShape shape() const { return SeqShape{Bt, T, DocStarts(x)}; }
};

template <class S>
DistributedEngine<S>::DistributedEngine(const Grid& grid, const EngineOptions& opts, const ModelDims& d,
                                        index_t pipeline_blocks)
    : grid_(grid),
      opts_(opts),
      pipeline_blocks_(pipeline_blocks),
      arch_(d.arch),
      layer_(make_layer_adjoint<S>(opts)) {
  blockwise_ = layer_->block_adjoint();
  require(pipeline_blocks >= 0, "dist.pipeline_blocks must be >= 0");
  require(grid.layout().S == 1 || opts.exact_adjoint(),
          "dist.seq_ranks > 1 runs adjoint-exact (exact, grad.detach_inputs, or a window grad.truncate with "
          "grad.detach_inputs): E1 and E2 keep whole windows");
  // E3 on layer and data ranks: the block-wise pass on each rank's layer
  // range, token blocks of y and g flowing both ways (the levers, when set);
  // on sequence ranks with a lever, each range in token blocks; a kind
  // without range maps always so (without a lever each range one block): its
  // state and carries pass range to range. E1 and E2 whole windows.
  const bool range_maps = with_layer_kind(d, [](auto kind) { return decltype(kind)::range_maps; });
  if (opts.exact_adjoint() && grid.layout().S == 1)
    block_pass_ = std::make_unique<BlockwiseEngine<S>>(opts);
  else if (opts.exact_adjoint() && (opts.blockwise_levers() || !range_maps))
    seq_pass_ = std::make_unique<SequenceBlockwise<S>>(grid, opts);
  if (!seq_pass_ && grid.layout().S > 1 && opts.truncate > 0) {
    EngineOptions whole = opts;
    whole.truncate = 0;
    untruncated_ = make_layer_adjoint<S>(whole);
  }
}

template <class S>
void DistributedEngine<S>::set_carried_state(std::vector<View2<S>>* state) {
  require(state == nullptr || block_pass_ != nullptr || seq_pass_ != nullptr,
          name() + ": this engine does not carry state across windows (data.carry_state selects the block-wise one)");
  carried_ = state;
}

template <class S>
std::string DistributedEngine<S>::name() const {
  const auto& l = grid_.layout();
  return (block_pass_ ? block_pass_->name() : seq_pass_ ? seq_pass_->name() : layer_->name()) + " on " + std::to_string(l.R) + " layer rank(s) x " +
         (l.S > 1 ? std::to_string(l.S) + " sequence rank(s) x " : std::string()) + std::to_string(l.D) +
         " data rank(s)" + (layer_->detached() ? ", paper mode" : ", exact mode");
}

template <class S>
std::pair<index_t, index_t> DistributedEngine<S>::my_window_range(index_t B) const {
  const auto& l = grid_.layout();
  require(B >= l.D, "a batch of " + std::to_string(B) + " windows cannot be shared by " + std::to_string(l.D) +
                        " data replicas");
  return l.windows(B);
}

template <class S>
TokenView DistributedEngine<S>::my_windows(const TokenView& x) const {
  const index_t B = x.extent(0);
  const auto [b0, b1] = my_window_range(B);
  if (b0 == 0 && b1 == B) return x;
  TokenView mine("ash::dist::x", b1 - b0, x.extent(1));
  Kokkos::deep_copy(mine, Kokkos::subview(x, Kokkos::make_pair(b0, b1), Kokkos::ALL()));
  return mine;
}

template <class S>
void DistributedEngine<S>::forward_range(const ParamSet<S>& params, ActivationStore<S>& store,
                                         std::vector<View2<S>>& h_start) {
  const auto& lay = grid_.layout();
  const ExecSpace& exec = layer_->execution_space();
  h_start.assign(std::size_t(store.k1() - store.k0()), View2<S>());
  if (lay.S == 1) return forward_layers(params, store, exec);
  const bool range_maps = with_layer_kind(params.dims(), [&](auto kind) {
    using K = decltype(kind);
    if constexpr (!K::range_maps) pass_states<K>(params, store);
    return K::range_maps;
  });
  if (!range_maps) return;
  const auto& s = store.shape();
  const index_t P = params.dims().width, N = params.dims().state;
  for (int k = store.k0(); k < store.k1(); ++k) {
    const auto layer = params.layer(k);
    const auto& act = store.keeps_acts() ? store.kept(k) : store.scratch();
    ssm_layer_project(layer, store.input(k), act, exec);
    View2<S> prod("ash::dist::range_prod", s.batch * P, N), h("ash::dist::range_h", s.batch * P, N);
    ssm_layer_state_map(layer, s, act, prod, h, exec);
    timed([&] { exscan_affine(prod, h, grid_.seq()); });  // h: the state before this range
    View2<S> io;
    if (lay.seq_rank > 0) {
      h_start[k - store.k0()] = h;
      io = View2<S>("ash::dist::range_state", s.batch * P, N);
      Kokkos::deep_copy(io, h);  // the scan overwrites its state with the end state
    }
    ssm_layer_scan(layer, s, store.input(k), act, store.input(k + 1), io, exec);
  }
}

// A kind without range maps on this rank's token range (the forward-only
// loss): per layer the state the range before ended with starts the range
// (zero on the first), and its end state goes to the next range.
template <class S>
template <class K>
void DistributedEngine<S>::pass_states(const ParamSet<S>& params, ActivationStore<S>& store) {
  const auto& lay = grid_.layout();
  const auto& d = params.dims();
  const ExecSpace& exec = layer_->execution_space();
  const MPI_Comm sc = grid_.seq();
  const auto& s = store.shape();
  const auto act = K::template make_block_acts<S>(s, d);
  const auto state = K::template make_state<S>(d, s.batch);
  const auto views = [&](const auto& f) { K::for_each_view(state, f); };
  for (int k = store.k0(); k < store.k1(); ++k) {
    if (lay.seq_rank > 0)
      timed([&] { recv_each(views, lay.seq_rank - 1, tag_state, sc); });
    else  // every layer starts the window from zero
      views([&](const auto& v) { Kokkos::deep_copy(exec, v, S(0)); });
    K::forward_block(K::layer(params, k), d, s, store.input(k), act, store.input(k + 1), state, exec);
    exec.fence();
    if (lay.seq_rank + 1 < lay.S) timed([&] { send_each(views, lay.seq_rank + 1, tag_state, sc); });
  }
}

template <class S>
void DistributedEngine<S>::forward(const ParamSet<S>& params, Pass& ps) {
  const auto& lay = grid_.layout();
  const MPI_Comm lc = grid_.layers();
  const int k0 = ps.store.k0();
  if (lay.first())
    embedding_forward(params.global().embedding, ps.x, ps.store.input(k0), layer_->execution_space());
  else
    timed([&] { recv(ps.store.input(k0), lay.layer_rank - 1, tag_y, lc); });
  forward_range(params, ps.store, ps.h_range);
  if (!lay.last()) {
    timed([&] { send(ps.store.output(), lay.layer_rank + 1, tag_y, lc); });
    ps.store.release_output();
  }
}

// E3 on token ranges: per layer, μ's carry from the later ranges.
template <class S>
void DistributedEngine<S>::backward_ranges(const ParamSet<S>& params, Pass& ps, const ParamSet<S>& grad) {
  require(blockwise_ != nullptr, "distributed engine: sequence ranks need adjoint-exact");
  const auto& lay = grid_.layout();
  const MPI_Comm lc = grid_.layers();
  const bool tail = lay.seq_rank == lay.S - 1;
  auto exchange = [&](const View3<S>& M, const View3<S>& v) {
    timed([&] { exscan_affine(M, v, grid_.seq_reversed()); });  // the later ranges' maps, last first
    return tail ? View3<S>() : v;                                 // composed maps applied to 0
  };
  if (!lay.last()) {
    ps.g = View2<S>("ash::g", ps.shape().rows(), params.dims().width);
    if (layer_->detached())
      timed([&] { broadcast(ps.g, lay.R - 1, lc); });
    else
      timed([&] { recv(ps.g, lay.layer_rank + 1, tag_g, lc); });
  } else if (layer_->detached()) {
    timed([&] { broadcast(ps.g, lay.R - 1, lc); });
  }
  if (opts_.truncate > 0 && opts_.truncate < ps.T_all) return backward_window_ranges(params, ps, grad);
  BlockAdjoint<S>* method = untruncated_ ? untruncated_->block_adjoint() : blockwise_;  // T̄ >= T: no window
  for (int k = ps.store.k1() - 1; k >= ps.store.k0(); --k) {
    method->backward_range(params.layer(k), k, ps.store, ps.g, ps.h_range[k - ps.store.k0()], exchange,
                               grad.layer(k));
    ps.store.release(k);
  }
  if (!lay.first() && !layer_->detached()) timed([&] { send(ps.g, lay.layer_rank - 1, tag_g, lc); });
}

// The paper's window T̄ over sequence ranks (paper mode: g is every layer's
// cotangent): μ_T̄ of a range's last T̄-1 tokens reads the next range's first
// T̄-1 tokens, so each rank receives that halo of g once and of every layer's
// input from the next rank, Bt·(T̄-1)·P values each; the state before the
// range is the forward's. Only the range's own tokens add to the gradient.
template <class S>
void DistributedEngine<S>::backward_window_ranges(const ParamSet<S>& params, Pass& ps, const ParamSet<S>& grad) {
  const auto& lay = grid_.layout();
  const ExecSpace& exec = layer_->execution_space();
  const index_t P = params.dims().width, Bt = ps.Bt, T = ps.T, T_all = ps.T_all;
  require_window_halos(T_all, lay.S, opts_.truncate);
  WindowHalo<S> halo(lay, Bt, P, T_all, opts_.truncate, tag_halo, grid_.seq(),
                     [this](const std::function<void()>& fn) { timed(fn); });
  const index_t Te = halo.extended();
  const TokenView x_ext = token_block(ps.x_rows, lay.seq_begin(T_all), Te);  // own tokens, then the halo's
  View2<S> g_halo("ash::dist::g_halo", Bt * halo.halo(), P), y_ext("ash::dist::y_ext", Bt * Te, P),
      g_ext("ash::dist::g_ext", Bt * Te, P);
  halo.exchange(ps.g, g_halo, exec);
  for (int k = ps.store.k1() - 1; k >= ps.store.k0(); --k) {
    halo.exchange(ps.store.input(k), exec);
    halo.extend(ps.store.input(k), halo.received(), y_ext, exec);
    halo.extend(ps.g, g_halo, g_ext, exec);  // again per layer: the halo rows are masked
    blockwise_->backward_window_range(params.layer(k), SeqShape{Bt, Te, DocStarts(x_ext)}, y_ext, g_ext,
                                      ps.h_range[k - ps.store.k0()], T, grad.layer(k));
    ps.store.release(k);
  }
}

// Paper mode: one broadcast of g, then no communication.
template <class S>
void DistributedEngine<S>::backward_detached(const ParamSet<S>& params, Pass& ps, const ParamSet<S>& grad) {
  const auto& lay = grid_.layout();
  if (!lay.last()) ps.g = View2<S>("ash::g", ps.shape().rows(), params.dims().width);
  timed([&] { broadcast(ps.g, lay.R - 1, grid_.layers()); });
  layers_backward(params, ps, grad);
}

// The layer method over this rank's layers, top down (any kind), each layer's storage freed when done.
template <class S>
void DistributedEngine<S>::layers_backward(const ParamSet<S>& params, Pass& ps, const ParamSet<S>& grad) {
  const auto& d = params.dims();
  with_layer_kind(d, [&](auto kind) {
    using K = decltype(kind);
    for (int k = ps.store.k1() - 1; k >= ps.store.k0(); --k) {
      layer_->backward(K::layer(params, k), d, k, ps.store, ps.g, K::layer(grad, k));
      ps.store.release(k);
    }
  });
}

// E1 (or E3 in one block): g_k hands over once per rank.
template <class S>
void DistributedEngine<S>::backward_whole(const ParamSet<S>& params, Pass& ps, const ParamSet<S>& grad) {
  const auto& lay = grid_.layout();
  const MPI_Comm lc = grid_.layers();
  if (!lay.last()) {
    ps.g = View2<S>("ash::g", ps.shape().rows(), params.dims().width);
    timed([&] { recv(ps.g, lay.layer_rank + 1, tag_g, lc); });
  }
  layers_backward(params, ps, grad);
  if (!lay.first()) timed([&] { send(ps.g, lay.layer_rank - 1, tag_g, lc); });
}

// E3 on this rank's layer range: the block-wise pass of one process
// with y and g blocks handed between layer ranks (a pipeline over token
// blocks in both directions, exact or paper mode alike).
template <class S>
double DistributedEngine<S>::compute_blockwise(const ParamSet<S>& params, const TokenView& x_all,
                                               const ParamSet<S>& grad) {
  const auto& lay = grid_.layout();
  const MPI_Comm lc = grid_.layers();
  const TokenView x = my_windows(x_all);
  const index_t T = x.extent(1);
  RangeLinks<S> links;
  if (!lay.first()) {
    links.y_in = [&](index_t, const View2<S>& y) { timed([&] { recv(y, lay.layer_rank - 1, tag_y, lc); }); };
    links.g_out = [&](index_t, const View2<S>& g) { timed([&] { send(g, lay.layer_rank - 1, tag_g, lc); }); };
  }
  if (!lay.last()) {
    links.y_out = [&](index_t, const View2<S>& y) { timed([&] { send(y, lay.layer_rank + 1, tag_y, lc); }); };
    links.g_in = [&](index_t, const View2<S>& g) { timed([&] { recv(g, lay.layer_rank + 1, tag_g, lc); }); };
  }
  std::vector<View2<S>> state = my_carried_rows(params, x_all.extent(0));
  if (before_backward_) links.before_backward = before_backward_;
  const index_t blen = pipeline_block_length(opts_, T, grid_.layout().R, pipeline_blocks_);
  stats_.blocks = (T + blen - 1) / blen;
  const double loss = block_pass_->compute_range(params, x, target_count(x_all), TokenBlocks(blen, T),
                                             links, carried_ ? &state : nullptr, grad);
  return finish(loss, grad);
}

template <class S>
std::vector<View2<S>> DistributedEngine<S>::my_carried_rows(const ParamSet<S>& params, index_t B) const {
  std::vector<View2<S>> state;
  if (!carried_) return state;
  const auto [b0, b1] = my_window_range(B);
  const LayerRange range = params.range();
  const auto& d = params.dims();
  check_carried_state(*carried_, d, d.layers, B);
  const index_t rows = d.carry_rows();  // per window (the kind's)
  for (int k = range.k0; k < range.k1; ++k)
    state.push_back(
        Kokkos::subview((*carried_)[std::size_t(k)], Kokkos::make_pair(b0 * rows, b1 * rows), Kokkos::ALL()));
  return state;
}

template <class S>
double DistributedEngine<S>::compute_sequence_blockwise(const ParamSet<S>& params, const TokenView& x_all,
                                                        const ParamSet<S>& grad) {
  const TokenView x = my_windows(x_all);
  const std::vector<View2<S>> state = my_carried_rows(params, x_all.extent(0));
  stats_.blocks = seq_pass_->range_blocks(x.extent(1)).n;
  const double loss = seq_pass_->compute(
      params, x, target_count(x_all), carried_ ? &state : nullptr, grad,
      [this](const std::function<void()>& fn) { timed(fn); }, before_backward_);
  return finish(loss, grad);
}

template <class S>
double DistributedEngine<S>::compute(const ParamSet<S>& params, const TokenView& x_all, const ParamSet<S>& grad) {
  const MatmulScope matmul(opts_.matmul, sizeof(S));
  const auto t_start = Clock::now();
  const std::uint64_t sent0 = bytes_sent();
  comm_s_ = 0;
  const auto& lay = grid_.layout();
  const auto& d = params.dims();
  const LayerRange range = grid_.range(d);
  require(params.range() == range && grad.range() == range,
          "distributed engine: the parameters are not this rank's shard of the layout");
  require(d.arch == arch_, "distributed engine: built for another model.arch (its layer kind picks the passes)");
  const double loss = block_pass_ ? compute_blockwise(params, x_all, grad)
                      : seq_pass_ ? compute_sequence_blockwise(params, x_all, grad)
                                  : compute_pipeline(params, x_all, grad);
  Kokkos::fence();
  const double wall = seconds_since(t_start);
  const MPI_Comm lc = grid_.layers();
  stats_.bytes_sent = bytes_sent() - sent0;
  double sums[2] = {wall - comm_s_, 0};
  MPI_Allreduce(MPI_IN_PLACE, sums, 1, MPI_DOUBLE, MPI_SUM, lc);
  double wmax = wall;
  MPI_Allreduce(MPI_IN_PLACE, &wmax, 1, MPI_DOUBLE, MPI_MAX, lc);
  stats_.wall_s = wmax;
  stats_.busy_fraction = wmax > 0 ? sums[0] / (double(lay.R) * wmax) : 1.0;
  stats_.max_bytes_sent = allreduce_max(stats_.bytes_sent, grid_.world());
  return loss;
}

// Without levers: the forward pipeline, the head, one backward mode, finish.
template <class S>
double DistributedEngine<S>::compute_pipeline(const ParamSet<S>& params, const TokenView& x_all,
                                              const ParamSet<S>& grad) {
  const auto& lay = grid_.layout();
  const auto& d = params.dims();
  const LayerRange range = grid_.range(d);
  const ExecSpace& exec = layer_->execution_space();
  // This replica's windows, then this sequence rank's token range [t_a, t_b).
  Pass ps;
  const TokenView x_rows = my_windows(x_all);
  const index_t T_all = x_rows.extent(1);
  const index_t t_a = lay.seq_begin(T_all), t_b = lay.seq_end(T_all);
  ps.x = lay.S > 1 ? token_block(x_rows, t_a, t_b - t_a) : x_rows;
  ps.x_head = lay.S > 1 ? token_block(x_rows, t_a, (t_b < T_all ? t_b + 1 : t_b) - t_a) : x_rows;
  ps.T = ps.x.extent(1);
  ps.T_all = T_all;
  ps.Bt = ps.x.extent(0);
  ps.targets = target_count(x_all);
  ps.x_rows = x_rows;
  grad.fill_zero();
  const auto gglobal = grad.global();
  ps.store = ActivationStore<S>(ps.shape(), d, range.k0, range.k1, layer_->store(), layer_->keeps_activations());

  forward(params, ps);
  double loss = 0;
  if (lay.last()) {  // the head: L and g_K
    ps.g = View2<S>("ash::g", ps.shape().rows(), d.width);
    loss = head_loss<S>(params.global(), ps.x_head, ps.store.output(), ps.g, &gglobal, opts_.head_chunk, ps.targets,
                        exec);
    ps.store.release_output();
  }
  if (before_backward_) before_backward_();
  if (lay.S > 1)
    backward_ranges(params, ps, grad);
  else if (layer_->detached())
    backward_detached(params, ps, grad);
  else
    backward_whole(params, ps, grad);
  layer_->release();
  if (untruncated_) untruncated_->release();
  if (lay.first()) embedding_backward(ps.x, ps.g, gglobal.embedding, exec);  // the residual stream's g_0
  stats_.blocks = 1;
  return finish(loss, grad);
}

template <class S>
double DistributedEngine<S>::finish(double loss, const ParamSet<S>& grad) {
  const auto& lay = grid_.layout();
  if (lay.D * lay.S > 1) {  // the ranks that own the same layers
    timed([&] { allreduce_sum(grad.data(), grid_.replicas()); });
    loss = allreduce_sum(loss, grid_.replicas());
  }
  sum_tied_embedding(grad);
  MPI_Bcast(&loss, 1, MPI_DOUBLE, lay.R - 1, grid_.layers());
  return loss;
}

template <class S>
void DistributedEngine<S>::sum_tied_embedding(const ParamSet<S>& grad) {
  const auto& lay = grid_.layout();
  const auto& d = grad.dims();
  if (!d.tied_head() || lay.R == 1 || !(lay.first() || lay.last())) return;
  const MPI_Comm lc = grid_.layers();
  const auto& t = grad.tensor("embedding");
  const Unmanaged1<S> mine = grad.flat(t);
  View1<S> out("ash::dist::tied_out", t.size()), in("ash::dist::tied_in", t.size());
  Kokkos::deep_copy(out, mine);
  timed([&] {  // first sends then receives, last the other way round: no deadlock
    if (lay.first()) {
      send(out, lay.R - 1, tag_tied, lc);
      recv(in, lay.R - 1, tag_tied, lc);
    } else {
      recv(in, 0, tag_tied, lc);
      send(out, 0, tag_tied, lc);
    }
  });
  add_into(layer_->execution_space(), in, mine);
}

template <class S>
double DistributedEngine<S>::loss(const ParamSet<S>& params, const TokenView& x_all) {
  const auto& lay = grid_.layout();
  const auto& d = params.dims();
  const MPI_Comm lc = grid_.layers();
  const ExecSpace& exec = layer_->execution_space();
  const TokenView x_rows = my_windows(x_all);
  const index_t T_all = x_rows.extent(1), t_a = lay.seq_begin(T_all), t_b = lay.seq_end(T_all);
  const TokenView x = lay.S > 1 ? token_block(x_rows, t_a, t_b - t_a) : x_rows;
  const TokenView x_head = lay.S > 1 ? token_block(x_rows, t_a, (t_b < T_all ? t_b + 1 : t_b) - t_a) : x_rows;
  const SeqShape s = SeqShape::of(x);
  const auto range = params.range();
  ActivationStore<S> store(s, d, range.k0, range.k1, LayerActivations<S>::projections_only, false);
  if (lay.first())
    embedding_forward(params.global().embedding, x, store.input(range.k0), exec);
  else
    recv(store.input(range.k0), lay.layer_rank - 1, tag_y, lc);
  std::vector<View2<S>> h_range;
  forward_range(params, store, h_range);
  double loss = 0;
  if (!lay.last())
    send(store.output(), lay.layer_rank + 1, tag_y, lc);
  else
    loss = head_loss<S>(params.global(), x_head, store.output(), View2<S>(), nullptr, opts_.head_chunk,
                        target_count(x_all), exec);
  if (lay.D * lay.S > 1) loss = allreduce_sum(loss, grid_.replicas());
  MPI_Bcast(&loss, 1, MPI_DOUBLE, lay.R - 1, lc);
  return loss;
}

template class DistributedEngine<float>;
template class DistributedEngine<double>;

}  // namespace ash::dist
