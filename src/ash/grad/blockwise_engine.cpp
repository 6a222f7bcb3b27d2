#include "ash/grad/blockwise_engine.hpp"

#include <algorithm>
#include <memory>
#include <string>
#include <utility>

#include "ash/core/error.hpp"
#include "ash/kernels/matmul.hpp"

namespace ash {

// One compute_range(): the pass and how the range meets its neighbours.
template <class S>
struct BlockwiseEngine<S>::Range : BlockwisePass<S> {
  const RangeLinks<S>* links = nullptr;
  const std::vector<View2<S>>* state = nullptr;
};

namespace {
constexpr const char* y_kept = "ash::lowmem::y_kept";
constexpr const char* y_block = "ash::lowmem::y_block";
constexpr const char* y_block_next = "ash::lowmem::y_block_next";
constexpr const char* y_segment = "ash::lowmem::y_segment";
constexpr const char* g_block = "ash::lowmem::g_block";
}  // namespace

LayerSegments::Counts LayerSegments::counts(int k0, int k1, int K, bool last, index_t layer_checkpoint) {
  const index_t m = std::min<index_t>(layer_checkpoint, index_t(K) + 1), top = last ? K : k1 - 1;
  const index_t n = (top - k0) / m;            // starts after k0: k0 + m, ..., k0 + n·m
  const index_t tail = top - (k0 + n * m) + 1;  // inputs of the top segment
  return Counts{n + 1, n > 0 ? std::max(m, tail) : tail};
}

// The kept inputs of a pass: every segment start after k0, and k0 unless recomputed or read again.
static index_t kept_count(const EngineOptions& opts, const BlockwiseShape& sh) {
  const auto n = LayerSegments::counts(sh.k0, sh.k1, sh.K, sh.last, opts.layer_checkpoint);
  return n.starts - 1 + (LayerSegments::keeps(sh.k0, sh.k0, sh.first, sh.input_again) ? 1 : 0);
}

BlockwiseWorkspace blockwise_workspace(const EngineOptions& opts, const BlockwiseShape& sh) {
  const std::size_t e = sh.scalar_bytes;
  const index_t rb = sh.Bt * sh.blen;
  BlockwiseWorkspace w;
  w.kept.stored_rows(y_kept, storage_bytes(opts.storage, e), sh.Bt * sh.T, sh.P, kept_count(opts, sh));
  w.block.projections(rb, sh.P, sh.N, e);
  w.forward.add(y_block, e, {rb, sh.P}, true).add(y_block_next, e, {rb, sh.P}, true);
  const auto n = LayerSegments::counts(sh.k0, sh.k1, sh.K, sh.last, opts.layer_checkpoint);
  w.backward.add(y_segment, e, {rb, sh.P}, true, n.longest).add(g_block, e, {rb, sh.P}, true);
  if (sh.blocks() > 1) w.carries.append(adjoint_exact_carry_workspace(sh.block()), sh.k1 - sh.k0);
  return w;
}

BlockwiseWorkspace sequence_blockwise_workspace(const EngineOptions& opts, const BlockwiseShape& sh, index_t T_all,
                                                index_t H, bool mamba) {
  const std::size_t e = sh.scalar_bytes;
  const index_t rb = sh.Bt * sh.blen, BP = sh.Bt * sh.P, N = sh.N;
  BlockwiseWorkspace w;
  w.kept.stored_rows("ash::seqblocks::y_kept", storage_bytes(opts.storage, e), sh.Bt * sh.T, sh.P,
                     kept_count(opts, sh));
  w.range.add("ash::seqblocks::y", e, {sh.Bt * sh.T, sh.P}, true).add("ash::seqblocks::y_next", e,
                                                                        {sh.Bt * sh.T, sh.P}, true);
  if (opts.truncate > 0 && opts.truncate < T_all) {  // a window: g's halo, the range + halo of y and g
    const index_t Te = sh.T + H;
    w.window.add("ash::seqblocks::g_halo", e, {sh.Bt * H, sh.P}, true)
        .add("ash::seqblocks::y_ext", e, {sh.Bt * Te, sh.P}, true)
        .add("ash::seqblocks::g_ext", e, {sh.Bt * Te, sh.P}, true);
  }
  if (mamba) {  // a recomputed block's input and output
    w.backward.add("ash::seqblocks::y_block", e, {rb, sh.P}, true)
        .add("ash::seqblocks::y_block_next", e, {rb, sh.P}, true);
    return w;
  }
  w.block.projections(rb, sh.P, sh.N, e);
  // the state at the range's end, sent to the next range (and received from the one before)
  w.forward.add("ash::seqblocks::h_end", e, {BP, N}, true);
  w.backward.add("ash::seqblocks::y_block", e, {rb, sh.P}, true)
      .add("ash::seqblocks::y_block_next", e, {rb, sh.P}, true)
      .add("ash::seqblocks::h_replay", e, {BP, N}, true);  // a replay's state from the range before
  for (const char* l : {"ash::seqblocks::carry_M", "ash::seqblocks::carry_v", "ash::seqblocks::block_M",
                        "ash::seqblocks::block_v", "ash::seqblocks::ones"})
    w.carry_maps.add(l, e, {sh.Bt, sh.P, N}, true);
  return w;
}

template <class S>
void BlockwisePass<S>::start(const ParamSet<S>& params, const TokenView& x, index_t targets_,
                             const TokenBlocks& blocks, const EngineOptions& opts,
                             const std::vector<View2<S>>* state, bool input_again_,
                             const std::function<BlockwiseWorkspace(const BlockwiseShape&)>& spec,
                             const ParamSet<S>& grad) {
  const auto& d = params.dims();
  const LayerRange& lr = params.range();
  k0 = lr.k0;
  k1 = lr.k1;
  K = int(d.layers);
  first = lr.embedding && lr.k0 == 0;  // a tied Mamba's last layer rank holds the embedding as its head
  last = lr.head;
  input_again = !first && input_again_;
  Bt = x.extent(0);
  T = x.extent(1);
  targets = targets_;
  P = d.width;
  N = d.state;
  if (state) check_carried_state(*state, d, k1 - k0, Bt);  // [Bt·P, N] per layer (a Mamba's [Bt·E, Kc−1+N])
  seg = LayerSegments(k0, k1, K, last, opts.layer_checkpoint);
  ws = spec(shape(blocks.len < T ? blocks.len : T));  // the longest block (a range may be shorter than the grid)
  const auto n = LayerSegments::counts(k0, k1, K, last, opts.layer_checkpoint);
  require(n.starts == index_t(seg.starts.size()) && n.longest == index_t(seg.longest()),
          "block-wise pass: LayerSegments::counts disagrees with the segments");
  const BufferSpec& kb = ws.kept.buffers().at(0);
  kept.resize(std::size_t(K - k0 + 1));
  index_t made = 0;
  for (const int c : seg.starts)
    if (keeps(c)) {
      kept[std::size_t(c - k0)] = StoredRows<S>(kb.label, opts.storage, kb.extents[0], kb.extents[1]);
      ++made;
    }
  require(made == kb.copies, "block-wise pass: kept " + std::to_string(made) + " inputs, its workspace spec " +
                                 std::to_string(kb.copies));
  grad.fill_zero();
  // The state before each (layer, block); block 0's is the carried state (or zero).
  // A Mamba's states are MambaStates its pass keeps itself: fw only cuts the blocks.
  fw = std::make_unique<BlockwiseForward<S>>(d, k0, d.mamba() ? k0 : k1, Bt, blocks, true);
  fw->set_documents(x);
  block_work.plan(ws.block);
  if (!d.mamba()) act = block_work.projections();
}

template struct BlockwisePass<float>;
template struct BlockwisePass<double>;

template <class S>
BlockwiseEngine<S>::BlockwiseEngine(const EngineOptions& opts) : opts_(opts), layer_(opts) {
  require(opts.exact_adjoint(),
          "run.storage, grad.layer_checkpoint, grad.token_block and data.carry_state need grad.engine = "
          "adjoint-exact (got '" +
              method_name(opts.method) + "')");
  require(opts.layer_checkpoint >= 1, "grad.layer_checkpoint must be resolved to >= 1");
  require(opts.token_block >= 0, "grad.token_block must be >= 0 (0: 4096 tokens)");
}

template <class S>
std::string BlockwiseEngine<S>::name() const {
  return blockwise_name(layer_.name(), opts_);
}

std::string blockwise_name(std::string n, const EngineOptions& opts) {
  n.pop_back();  // the closing parenthesis
  return n + ", " + storage_name(opts.storage) + " storage, layer checkpoint " + std::to_string(opts.layer_checkpoint) +
         (opts.carry_state ? ", carried state" : "") + ")";
}

LayerSegments::LayerSegments(int k0_, int k1_, int K_, bool last_, index_t layer_checkpoint)
    : k0(k0_), k1(k1_), K(K_), last(last_) {
  // m at most K + 1: any larger m keeps no input but y_0 alike (layer indices stay 32-bit).
  const index_t m = std::min<index_t>(layer_checkpoint, index_t(K) + 1);
  starts.push_back(k0);
  for (index_t c = index_t(k0) + m; c <= index_t(top()); c += m) starts.push_back(int(c));
}

int LayerSegments::longest() const {
  int n = 0;
  for (std::size_t i = 0; i < starts.size(); ++i) n = std::max(n, end_of(i) - starts[i] + 1);
  return n;
}

index_t blockwise_block_length(const EngineOptions& opts, index_t T) {
  if (opts.truncate > 0 && opts.truncate < T) return T;  // the block method of T̄ needs the whole window
  const index_t C = opts.chunk < T ? opts.chunk : T;
  index_t want = opts.token_block > 0 ? opts.token_block : 4096;
  if (want > T) want = T;  // the whole window (and no overflow below)
  const index_t len = ((want + C - 1) / C) * C;  // whole chunks: the same chunk structure as one block
  return len < T ? len : T;
}

index_t pipeline_block_length(const EngineOptions& opts, index_t T, index_t R, index_t blocks) {
  if (opts.token_block > 0 || (opts.truncate > 0 && opts.truncate < T)) return blockwise_block_length(opts, T);
  // A lever without dist.pipeline_blocks: the block length of one process (4096 tokens).
  if (blocks == 0 && opts.low_memory()) return blockwise_block_length(opts, T);
  const index_t asked = blocks > 0 ? blocks : 4 * R;
  const index_t want = asked < T ? asked : T;  // at most one token per block
  const index_t C = opts.chunk < T ? opts.chunk : T;
  index_t len = (T + want - 1) / want;
  len = ((len + C - 1) / C) * C;  // whole chunks: the same chunk structure as one block
  return len < T ? len : T;
}

index_t sequence_block_length(const EngineOptions& opts, index_t T, index_t T_all) {
  if (opts.truncate > 0 && opts.truncate < T_all) return T;
  EngineOptions whole = opts;
  whole.truncate = 0;
  return blockwise_block_length(whole, T);
}

TokenBlocks sequence_blocks(const EngineOptions& opts, index_t T_all, index_t t_a, index_t t_b) {
  if (opts.truncate > 0 && opts.truncate < T_all) return TokenBlocks(t_b - t_a, t_b - t_a);
  const index_t L = blockwise_block_length(opts, T_all);
  return TokenBlocks(L, t_b - t_a, t_a % L);
}

template <class S>
double BlockwiseEngine<S>::compute(const ParamSet<S>& params, const TokenView& x, const ParamSet<S>& grad) {
  const auto& d = params.dims();
  require(params.range().is_all(d) && grad.range().is_all(d), "BlockwiseEngine: needs the whole model");
  const index_t T = x.extent(1);
  if (d.mamba())
    return compute_mamba(params, x, target_count(x), TokenBlocks(block_length(T), T), RangeLinks<S>{}, state_, grad);
  const double loss = compute_range(params, x, target_count(x), TokenBlocks(block_length(T), T),
                                    RangeLinks<S>{}, state_, grad);
  return loss;
}

template <class S>
double BlockwiseEngine<S>::compute_range(const ParamSet<S>& params, const TokenView& x, index_t targets,
                                         const TokenBlocks& blocks, const RangeLinks<S>& links,
                                         const std::vector<View2<S>>* state, const ParamSet<S>& grad) {
  const MatmulScope matmul(opts_.matmul, sizeof(S));
  const auto& d = params.dims();
  const LayerRange& lr = params.range();
  require(grad.range() == lr, "BlockwiseEngine: the gradient is not the parameters' range");
  require((lr.embedding || (links.y_in && links.g_out)) && (lr.head || (links.y_out && links.g_in)),
          "BlockwiseEngine: a layer range without the embedding or the head needs its neighbours' links");
  if (d.mamba()) {  // the same pass over a Mamba's blocks: a MambaState per (layer, block), the conv's carry
    require(!links.y_in_again, "BlockwiseEngine: a Mamba's range keeps its input (no y_in_again)");
    return compute_mamba(params, x, targets, blocks, links, state, grad);
  }
  Range r;
  r.links = &links;
  r.state = state;
  r.start(params, x, targets, blocks, opts_, state, links.y_in_again,
          [&](const BlockwiseShape& sh) { return blockwise_workspace(opts_, sh); }, grad);
  if (state)
    for (int k = r.k0; k < r.k1; ++k) r.fw->start_from(k, (*state)[std::size_t(k - r.k0)], layer_.execution_space());
  forward(params, x, r);
  if (links.before_backward) links.before_backward();
  const double loss = backward(params, x, r, grad);
  layer_.release();
  return loss;
}

// Blocks in order, the state of every layer carried along; the kept inputs stored.
template <class S>
void BlockwiseEngine<S>::forward(const ParamSet<S>& params, const TokenView& x, Range& r) {
  const ExecSpace& exec = layer_.execution_space();
  const TokenBlocks& blk = r.fw->blocks();
  Workspace<S> ws;  // freed on return
  ws.plan(r.ws.forward);
  View2<S> ya = ws.view2(y_block), yb = ws.view2(y_block_next);
  for (index_t j = 0; j < blk.n; ++j) {
    const index_t rows = r.fw->rows(j);
    View2<S> y = first_rows(ya, rows), yo = first_rows(yb, rows);
    if (r.first)
      embedding_forward(params.global().embedding, token_block(x, blk.start(j), blk.size(j)), y, exec);
    else
      r.links->y_in(j, y);
    if (r.keeps(r.k0)) r.kept_input(r.k0).put(y, r.T, blk.start(j), blk.size(j), exec);
    const auto act_j = first_rows(r.act, rows);
    for (int k = r.k0; k < r.k1; ++k) {
      const View2<S> h = r.fw->advance(params.layer(k), k, j, y, act_j, yo, exec);
      if (j + 1 == blk.n && r.state) Kokkos::deep_copy(exec, (*r.state)[std::size_t(k - r.k0)], h);
      std::swap(y, yo);
      if (k + 1 <= r.seg.top() && !r.kept_input(k + 1).empty()) r.kept_input(k + 1).put(y, r.T, blk.start(j), blk.size(j), exec);
    }
    if (!r.last) r.links->y_out(j, y);
  }
}

// Blocks last to first; in each, segments top down, each segment's inputs
// recomputed from its kept input and the kept states.
template <class S>
double BlockwiseEngine<S>::backward(const ParamSet<S>& params, const TokenView& x, Range& r, const ParamSet<S>& grad) {
  const ExecSpace& exec = layer_.execution_space();
  const TokenBlocks& blk = r.fw->blocks();
  const auto gglobal = grad.global();
  // The segment's inputs and g (E3 allocates the carries at a layer's first block).
  Workspace<S> ws;
  ws.plan(r.ws.backward);
  std::vector<View2<S>> yseg;
  for (int i = 0; i < r.seg.longest(); ++i) yseg.push_back(ws.view2(y_segment, i));
  const View2<S> gb = ws.view2(g_block);
  std::vector<ExactCarry<S>> carry(std::size_t(r.k1 - r.k0));
  double loss = 0;
  for (index_t j = blk.n - 1; j >= 0; --j) {
    const index_t t0 = blk.start(j), Tj = blk.size(j), rows = r.fw->rows(j);
    const TokenView xb = token_block(x, t0, Tj);
    const auto act_j = first_rows(r.act, rows);
    const View2<S> g = first_rows(gb, rows);
    if (!r.last) r.links->g_in(j, g);
    for (std::size_t i = r.seg.starts.size(); i-- > 0;) {
      const int c = r.seg.starts[i], e = r.seg.end_of(i);  // the segment's inputs: y_c .. y_e
      const View2<S> y0 = first_rows(yseg[0], rows);
      if (c == 0 && r.first)
        embedding_forward(params.global().embedding, xb, y0, exec);
      else if (c == r.k0 && r.input_again)
        r.links->y_in(j, y0);
      else
        r.kept_input(c).get(y0, r.T, t0, Tj, exec);
      for (int k = c; k < e; ++k)  // y_{k+1} = layer k (y_k), from the state the forward saw
        r.fw->replay(params.layer(k), k, j, first_rows(yseg[k - c], rows), act_j, first_rows(yseg[k + 1 - c], rows),
                     exec);
      if (r.last && e == r.K) {  // the head on y_K's rows: the block's share of L and g_K
        const TokenView xh = token_block(x, t0, (blk.end(j) < r.T ? blk.end(j) + 1 : r.T) - t0);
        loss += head_loss<S>(params.global(), xh, first_rows(yseg[r.K - c], rows), g, &gglobal, opts_.head_chunk,
                             r.targets, exec);
      }
      for (int k = std::min(e, r.k1 - 1); k >= c; --k) {
        const View2<S> h0 = (j > 0 || r.state) ? r.fw->state_before(k, j) : View2<S>();
        layer_.backward_block(params.layer(k), r.fw->shape(j), first_rows(yseg[k - c], rows), g, h0,
                              blk.n > 1 ? &carry[std::size_t(k - r.k0)] : nullptr, grad.layer(k));
      }
    }
    if (r.first)
      embedding_backward(xb, g, gglobal.embedding, exec);
    else
      r.links->g_out(j, g);
  }
  return loss;
}

// A Mamba over token blocks (docs/design.md §8): as the SSM-ResNet's pass, the
// state before every (layer, block) kept, here a MambaState (the conv's last
// Kc−1 inputs and h), so any block of any layer runs again alone bit for bit
// (mamba_layer_forward's carried form). Backward blocks last to first: per
// layer the μ/A carry over E channels and the conv's carry, ∂L/∂ the conv
// state a block read, into the block before (AdjointExactLayer::backward_mamba_block).
// A carried state (data.carry_state; on a layer range its layers' views, of
// this replica's windows) is block 0's state before, a constant: ∂L/∂ it (the
// conv's carry and μ out of block 0) is dropped, as the SSM-ResNet's h0; the
// state after the last block replaces it.
// On a layer range [k0, k1) of an MPI pipeline the links hand a block's y and
// g to the neighbouring ranges, as in compute_range: the states and both
// carries belong to a layer, so they never cross a rank; the range keeps its
// received input y_k0 (the first segment's start) in the storage format.
template <class S>
double BlockwiseEngine<S>::compute_mamba(const ParamSet<S>& params, const TokenView& x, index_t targets,
                                         const TokenBlocks& blk, const RangeLinks<S>& links,
                                         const std::vector<View2<S>>* state, const ParamSet<S>& grad) {
  if (state) check_carried_state(*state, params.dims(), params.range().k1 - params.range().k0, x.extent(0));
  const MatmulScope matmul(opts_.matmul, sizeof(S));
  const ExecSpace& exec = layer_.execution_space();
  const auto& d = params.dims();
  const LayerRange& lr = params.range();
  const int K = int(d.layers), k0 = lr.k0, k1 = lr.k1;
  // first: the range starts the model (a tied Mamba's last range holds the embedding too, as its head).
  const bool first = lr.embedding && k0 == 0, last = lr.head;
  const index_t Bt = x.extent(0), T = x.extent(1), D = d.width, E = d.inner(), N = d.state;
  const index_t Kc1 = d.conv_kernel - 1;
  const DocStarts docs(x);
  const auto shape = [&](index_t j) { return SeqShape{Bt, blk.size(j), docs.from(blk.start(j))}; };
  const LayerSegments seg(k0, k1, K, last, opts_.layer_checkpoint);
  std::vector<StoredRows<S>> kept(std::size_t(K + 1));  // by layer index; y_0 of the first range: the embedding again
  for (const int c : seg.starts)
    if (LayerSegments::keeps(c, k0, first, false))
      kept[std::size_t(c)] = StoredRows<S>(std::string(y_kept), opts_.storage, Bt * T, D);
  // The state before block j of layer k: slot j of conv[k - k0], ssm[k - k0] (block 0's: the carried state, or zero).
  std::vector<View3<S>> conv, ssm;
  for (int k = k0; k < k1; ++k) {
    conv.emplace_back("ash::lowmem::mamba_conv_start", blk.n, Bt * E, Kc1);
    ssm.emplace_back("ash::lowmem::mamba_ssm_start", blk.n, Bt * E, N);
  }
  const auto before = [&](int k, index_t j) {
    MambaState<S> st;
    st.conv = Kokkos::subview(conv[std::size_t(k - k0)], j, Kokkos::ALL(), Kokkos::ALL());
    st.ssm = Kokkos::subview(ssm[std::size_t(k - k0)], j, Kokkos::ALL(), Kokkos::ALL());
    return st;
  };
  if (state)
    for (int k = k0; k < k1; ++k) mamba_state_from_carried((*state)[std::size_t(k - k0)], before(k, 0), exec);
  MambaState<S> run(Bt, d);
  const MambaActivations<S> act(shape(0), d, LayerActivations<S>::projections_only);  // one block's
  // The block's forward of layer k from the state kept before it (forward and recomputation alike).
  const auto advance = [&](int k, index_t j, const View2<S>& y, const View2<S>& yo) {
    const MambaState<S> b = before(k, j);
    Kokkos::deep_copy(exec, run.conv, b.conv);
    Kokkos::deep_copy(exec, run.ssm, b.ssm);
    mamba_layer_forward(params.mamba_layer(k), d, shape(j), y, first_rows(act, index_t(y.extent(0))), yo, run, exec);
  };
  grad.fill_zero();
  const index_t rb = Bt * blk.len;
  {  // forward: blocks in order, the kept inputs stored
    View2<S> ya(std::string(y_block), rb, D), yb(std::string(y_block_next), rb, D);
    for (index_t j = 0; j < blk.n; ++j) {
      const index_t rows = Bt * blk.size(j);
      View2<S> y = first_rows(ya, rows), yo = first_rows(yb, rows);
      if (first)
        embedding_forward(params.global().embedding, token_block(x, blk.start(j), blk.size(j)), y, exec);
      else
        links.y_in(j, y);
      if (!first) kept[std::size_t(k0)].put(y, T, blk.start(j), blk.size(j), exec);
      for (int k = k0; k < k1; ++k) {
        advance(k, j, y, yo);
        if (j + 1 < blk.n) {
          const MambaState<S> next = before(k, j + 1);
          Kokkos::deep_copy(exec, next.conv, run.conv);
          Kokkos::deep_copy(exec, next.ssm, run.ssm);
        } else if (state) {  // the state after the window: the next window's
          mamba_state_to_carried(run, (*state)[std::size_t(k - k0)], exec);
        }
        std::swap(y, yo);
        if (!kept[std::size_t(k + 1)].empty()) kept[std::size_t(k + 1)].put(y, T, blk.start(j), blk.size(j), exec);
      }
      if (!last) links.y_out(j, y);
    }
  }
  if (links.before_backward) links.before_backward();
  // Backward: blocks last to first, segments top down, each recomputed from its kept input.
  const auto gglobal = grad.global();
  std::vector<View2<S>> yseg;
  for (int i = 0; i < seg.longest(); ++i) yseg.emplace_back(std::string(y_segment), rb, D);
  const View2<S> gb(std::string(g_block), rb, D);
  std::vector<ExactCarry<S>> carry(static_cast<std::size_t>(k1 - k0));
  std::vector<View2<S>> gconv;  // ∂L/∂ the conv state after the block, per layer (zero after the window)
  for (int k = k0; k < k1; ++k) gconv.emplace_back("ash::lowmem::mamba_conv_carry", Bt * E, Kc1);
  double loss = 0;
  for (index_t j = blk.n - 1; j >= 0; --j) {
    const index_t t0 = blk.start(j), Tj = blk.size(j), rows = Bt * Tj;
    const TokenView xb = token_block(x, t0, Tj);
    const View2<S> g = first_rows(gb, rows);
    if (!last) links.g_in(j, g);
    for (std::size_t i = seg.starts.size(); i-- > 0;) {
      const int c = seg.starts[i], e = seg.end_of(i);
      const View2<S> y0 = first_rows(yseg[0], rows);
      if (c == 0 && first)
        embedding_forward(params.global().embedding, xb, y0, exec);
      else
        kept[std::size_t(c)].get(y0, T, t0, Tj, exec);
      for (int k = c; k < e; ++k) advance(k, j, first_rows(yseg[k - c], rows), first_rows(yseg[k + 1 - c], rows));
      if (last && e == K) {  // the head on y_K's rows: the block's share of L and g_K
        const TokenView xh = token_block(x, t0, (blk.end(j) < T ? blk.end(j) + 1 : T) - t0);
        loss += head_loss<S>(params.global(), xh, first_rows(yseg[K - c], rows), g, &gglobal, opts_.head_chunk,
                             targets, exec);
      }
      for (int k = std::min(e, k1 - 1); k >= c; --k)
        layer_.backward_mamba_block(params.mamba_layer(k), d, shape(j), first_rows(yseg[k - c], rows), g, before(k, j),
                                    blk.n > 1 ? &carry[std::size_t(k - k0)] : nullptr, gconv[std::size_t(k - k0)],
                                    grad.mamba_layer(k));
    }
    if (first)
      embedding_backward(xb, g, gglobal.embedding, exec);
    else
      links.g_out(j, g);
  }
  layer_.release();
  return loss;
}

template class BlockwiseEngine<float>;
template class BlockwiseEngine<double>;

}  // namespace ash
