#include "ash/dist/distributed_engine.hpp"

#include "ash/io/tokens.hpp"

#include <chrono>
#include <cstdlib>
#include <utility>

#include "ash/core/error.hpp"
#include "ash/grad/adjoint_exact.hpp"

namespace ash::dist {

namespace {

constexpr int tag_y = 11, tag_g = 12;

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// Rows of token block [t0, t0+Tj) of every sequence: full row b·T + t <-> block row b·Tj + (t - t0).
template <class S>
void copy_block_rows(const View2<S>& full, const View2<S>& blk, index_t T, index_t t0, index_t Tj, bool to_block,
                     const ExecSpace& exec) {
  const index_t P = full.extent(1), rows = blk.extent(0);
  Kokkos::parallel_for(
      "ash::dist::block_rows", Range(exec, 0, rows * P), KOKKOS_LAMBDA(const index_t i) {
        const index_t r = i / P, p = i % P, m = (r / Tj) * T + t0 + r % Tj;
        if (to_block)
          blk(r, p) = full(m, p);
        else
          full(m, p) = blk(r, p);
      });
}


}  // namespace

template <class S>
DistributedEngine<S>::DistributedEngine(const Grid& grid, const EngineOptions& opts, index_t pipeline_blocks)
    : grid_(grid), opts_(opts), pipeline_blocks_(pipeline_blocks), layer_(make_layer_adjoint<S>(opts)) {
  require(pipeline_blocks >= 0, "dist.pipeline_blocks must be >= 0");
  require(!opts.low_memory(),
          "run.storage, grad.layer_checkpoint, grad.token_block and data.carry_state run in one process; "
          "they are not implemented for dist.* rank layouts yet");
  require(grid.layout().S == 1 || (opts.engine == "adjoint-exact" && opts.truncate == 0),
          "dist.seq_ranks > 1 runs adjoint-exact without a window (exact or --detach-inputs): E1 and E2 keep whole "
          "windows, and a window T-bar's block method would need the next rank's T-bar tokens (not exchanged)");
}

template <class S>
std::string DistributedEngine<S>::name() const {
  const auto& l = grid_.layout();
  return layer_->name() + " on " + std::to_string(l.R) + " layer rank(s) x " +
         (l.S > 1 ? std::to_string(l.S) + " sequence rank(s) x " : std::string()) + std::to_string(l.D) +
         " data rank(s)" + (layer_->detached() ? ", paper mode" : ", exact mode");
}

template <class S>
typename DistributedEngine<S>::Blocks DistributedEngine<S>::blocks_for(index_t T) const {
  Blocks b;
  b.len = T;
  if (layer_->keeps_activations() || grid_.layout().S > 1) return b;  // E1, E2, sequence ranks: whole ranges
  const index_t want = pipeline_blocks_ > 0 ? pipeline_blocks_ : 4 * grid_.layout().R;
  const index_t C = opts_.chunk < T ? opts_.chunk : T;
  // Block length: a whole number of E3 chunks, so the block-wise exact pass
  // sees the same chunks' structure as a whole-window one.
  index_t len = (T + want - 1) / want;
  len = ((len + C - 1) / C) * C;
  b.len = len < T ? len : T;
  b.n = (T + b.len - 1) / b.len;
  return b;
}

template <class S>
TokenView DistributedEngine<S>::my_windows(const TokenView& x) const {
  const auto& l = grid_.layout();
  const index_t B = x.extent(0);
  require(B >= l.D, "a batch of " + std::to_string(B) + " windows cannot be shared by " + std::to_string(l.D) +
                        " data replicas");
  const index_t b0 = B * l.data_rank / l.D, b1 = B * (l.data_rank + 1) / l.D;
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

template <class S>
double DistributedEngine<S>::compute(const ParamSet<S>& params, const TokenView& x_all, const ParamSet<S>& grad) {
  const auto t_start = Clock::now();
  const std::uint64_t sent0 = bytes_sent();
  comm_s_ = 0;
  const auto& lay = grid_.layout();
  const auto& d = params.dims();
  const LayerRange range = grid_.range(d);
  require(params.range() == range && grad.range() == range,
          "distributed engine: the parameters are not this rank's shard of the layout");
  const MPI_Comm lc = grid_.layers();
  const int prev = lay.layer_rank - 1, next = lay.layer_rank + 1;

  const ExecSpace& exec = layer_->execution_space();
  // This replica's windows, then this sequence rank's token range [t_a, t_b)
  // (x_head: one token more, the last row's target, unless the range ends the window).
  const TokenView x_rows = my_windows(x_all);
  const index_t T_all = x_rows.extent(1);
  const index_t t_a = lay.seq_begin(T_all), t_b = lay.seq_end(T_all);
  const TokenView x = lay.S > 1 ? token_block(x_rows, t_a, t_b - t_a) : x_rows;
  const TokenView x_head = lay.S > 1 ? token_block(x_rows, t_a, (t_b < T_all ? t_b + 1 : t_b) - t_a) : x_rows;
  const index_t T = x.extent(1), Bt = x.extent(0), P = d.width;
  const SeqShape s{Bt, T};
  const index_t targets = index_t(x_all.extent(0)) * (T_all - 1);
  const int k0 = range.k0, k1 = range.k1;
  grad.fill_zero();
  const auto gglobal = grad.global();
  ActivationStore<S> store(s, d, k0, k1, layer_->store(), layer_->keeps_activations());
  const Blocks blk = blocks_for(T);
  const bool exact_blocks = blk.n > 1 && !layer_->detached();
  std::vector<std::vector<View2<S>>> h_start(k1 - k0);  // [layer][block]: h before the block (exact mode)
  std::vector<View2<S>> h_range;                        // [layer]: h before this sequence rank's range

  // ---- forward ------------------------------------------------------------
  if (blk.n == 1) {
    if (lay.first())
      embedding_forward(params.global().embedding, x, store.input(k0), exec);
    else
      timed([&] { recv(store.input(k0), prev, tag_y, lc); });
    forward_range(params, store, h_range);
    if (!lay.last()) {
      timed([&] { send(store.output(), next, tag_y, lc); });
      store.release_output();
    }
  } else {
    View2<S> ya("ash::dist::y_block", Bt * blk.len, P), yb("ash::dist::y_block_next", Bt * blk.len, P);
    const LayerActivations<S> act(SeqShape{Bt, blk.len}, d, LayerActivations<S>::projections_only);
    std::vector<View2<S>> state;
    for (int k = k0; k < k1; ++k) state.emplace_back("ash::dist::h_carry", Bt * P, d.state);
    for (index_t j = 0; j < blk.n; ++j) {
      const index_t t0 = j * blk.len, Tj = (t0 + blk.len < T) ? blk.len : T - t0, rows = Bt * Tj;
      View2<S> y = first_rows(ya, rows), yo = first_rows(yb, rows);
      if (lay.first())
        embedding_forward(params.global().embedding, token_block(x, t0, Tj), y, exec);
      else
        timed([&] { recv(y, prev, tag_y, lc); });
      const auto act_j = first_rows(act, rows);
      for (int k = k0; k < k1; ++k) {
        copy_block_rows(store.input(k), y, T, t0, Tj, false, exec);
        if (exact_blocks) {
          View2<S> h0;
          if (j > 0) {
            h0 = View2<S>("ash::dist::h_block_start", Bt * P, d.state);
            Kokkos::deep_copy(h0, state[k - k0]);
          }
          h_start[k - k0].push_back(h0);
        }
        ssm_layer_forward(params.layer(k), SeqShape{Bt, Tj}, y, act_j, yo, state[k - k0], exec);
        std::swap(y, yo);
      }
      if (lay.last())
        copy_block_rows(store.output(), y, T, t0, Tj, false, exec);
      else
        timed([&] { send(y, next, tag_y, lc); });
    }
    if (!lay.last()) store.release_output();
  }

  // ---- head -----------------------------------------------------------------
  View2<S> g;
  double loss = 0;
  if (lay.last()) {
    g = View2<S>("ash::g", s.rows(), P);
    loss = head_loss<S>(params.global(), x_head, store.output(), g, &gglobal, opts_.head_chunk, targets, exec);
    store.release_output();
  }

  // ---- backward -------------------------------------------------------------
  // Fault injection for the tests of "an error on one rank ends every rank":
  // ASH_DEBUG_FAIL_RANK=r makes world rank r fail here, while its neighbours wait in MPI.
  if (const char* f = std::getenv("ASH_DEBUG_FAIL_RANK"))
    require(std::atoi(f) != lay.world_rank, "injected failure on rank " + std::to_string(lay.world_rank) +
                                               " (ASH_DEBUG_FAIL_RANK)");
  if (lay.S > 1) {  // E3 on token ranges: per layer, μ's carry from the later ranges
    auto* exact = dynamic_cast<AdjointExactLayer<S>*>(layer_.get());
    require(exact != nullptr, "distributed engine: sequence ranks need adjoint-exact");
    const bool tail = lay.seq_rank == lay.S - 1;
    auto exchange = [&](const View3<S>& M, const View3<S>& v) {
      timed([&] { exscan_affine(M, v, grid_.seq_reversed()); });  // the later ranges' maps, last first
      return tail ? View3<S>() : v;                                 // composed maps applied to 0
    };
    if (!lay.last()) {
      g = View2<S>("ash::g", s.rows(), P);
      if (layer_->detached())
        timed([&] { broadcast(g, lay.R - 1, lc); });
      else
        timed([&] { recv(g, next, tag_g, lc); });
    } else if (layer_->detached()) {
      timed([&] { broadcast(g, lay.R - 1, lc); });
    }
    for (int k = k1 - 1; k >= k0; --k) {
      exact->backward_range(params.layer(k), k, store, g, h_range[k - k0], exchange, grad.layer(k));
      store.release(k);
    }
    if (!lay.first() && !layer_->detached()) timed([&] { send(g, prev, tag_g, lc); });
  } else if (layer_->detached()) {  // paper mode: one broadcast, then no communication
    if (!lay.last()) g = View2<S>("ash::g", s.rows(), P);
    timed([&] { broadcast(g, lay.R - 1, lc); });
    for (int k = k1 - 1; k >= k0; --k) {
      layer_->backward(params.layer(k), k, store, g, grad.layer(k));
      store.release(k);
    }
  } else if (!exact_blocks) {  // E1 (or E3 in one block): g_k hands over once per rank
    if (!lay.last()) {
      g = View2<S>("ash::g", s.rows(), P);
      timed([&] { recv(g, next, tag_g, lc); });
    }
    for (int k = k1 - 1; k >= k0; --k) {
      layer_->backward(params.layer(k), k, store, g, grad.layer(k));
      store.release(k);
    }
    if (!lay.first()) timed([&] { send(g, prev, tag_g, lc); });
  } else {  // E3 exact: reverse wavefront over token blocks
    auto* exact = dynamic_cast<AdjointExactLayer<S>*>(layer_.get());
    require(exact != nullptr, "distributed engine: token blocks need adjoint-exact");
    if (lay.first() && !lay.last()) g = View2<S>("ash::g", s.rows(), P);
    View2<S> ga("ash::dist::g_block", Bt * blk.len, P), yk("ash::dist::y_layer_block", Bt * blk.len, P);
    std::vector<ExactCarry<S>> carry(k1 - k0);
    for (index_t j = blk.n - 1; j >= 0; --j) {
      const index_t t0 = j * blk.len, Tj = (t0 + blk.len < T) ? blk.len : T - t0, rows = Bt * Tj;
      const SeqShape sb{Bt, Tj};
      const View2<S> gj = first_rows(ga, rows), yj = first_rows(yk, rows);
      if (lay.last())
        copy_block_rows(g, gj, T, t0, Tj, true, exec);
      else
        timed([&] { recv(gj, next, tag_g, lc); });
      for (int k = k1 - 1; k >= k0; --k) {
        copy_block_rows(store.input(k), yj, T, t0, Tj, true, exec);
        exact->backward_block(params.layer(k), sb, yj, gj, h_start[k - k0][j], &carry[k - k0], grad.layer(k));
      }
      if (lay.first())
        copy_block_rows(g, gj, T, t0, Tj, false, exec);
      else
        timed([&] { send(gj, prev, tag_g, lc); });
    }
    for (int k = k0; k < k1; ++k) store.release(k);
  }
  layer_->release();
  if (lay.first()) embedding_backward(x, g, gglobal.embedding, exec);  // the residual stream's g_0

  // ---- replicas and the loss ------------------------------------------------
  if (lay.D * lay.S > 1) {  // the ranks that own the same layers
    timed([&] { allreduce_sum(grad.data(), grid_.replicas()); });
    loss = allreduce_sum(loss, grid_.replicas());
  }
  MPI_Bcast(&loss, 1, MPI_DOUBLE, lay.R - 1, lc);

  Kokkos::fence();
  const double wall = seconds_since(t_start);
  stats_.blocks = blk.n;
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
  const SeqShape s{index_t(x.extent(0)), index_t(x.extent(1))};
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
                        index_t(x_all.extent(0)) * (T_all - 1), exec);
  if (lay.D * lay.S > 1) loss = allreduce_sum(loss, grid_.replicas());
  MPI_Bcast(&loss, 1, MPI_DOUBLE, lay.R - 1, lc);
  return loss;
}

template class DistributedEngine<float>;
template class DistributedEngine<double>;

}  // namespace ash::dist
