#include "ash/grad/blockwise_engine.hpp"

#include <algorithm>
#include <memory>
#include <string>
#include <utility>

#include "ash/core/error.hpp"
#include "ash/grad/layer_kinds.hpp"
#include "ash/kernels/matmul.hpp"

namespace ash {

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
  w.forward.add(y_block, e, {rb, sh.P}, true).add(y_block_next, e, {rb, sh.P}, true);
  const auto n = LayerSegments::counts(sh.k0, sh.k1, sh.K, sh.last, opts.layer_checkpoint);
  w.backward.add(y_segment, e, {rb, sh.P}, true, n.longest).add(g_block, e, {rb, sh.P}, true);
  return w;
}

template <class K>
BlockwiseWorkspace sequence_blockwise_workspace(const EngineOptions& opts, const BlockwiseShape& sh, index_t T_all,
                                                index_t H) {
  const std::size_t e = sh.scalar_bytes;
  const index_t rb = sh.Bt * sh.blen;
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
  // a recomputed block's input and output
  w.backward.add("ash::seqblocks::y_block", e, {rb, sh.P}, true)
      .add("ash::seqblocks::y_block_next", e, {rb, sh.P}, true);
  if constexpr (K::range_maps) {
    const index_t BP = sh.Bt * sh.P, N = sh.N;
    w.block.projections(rb, sh.P, N, e);
    w.forward.add("ash::seqblocks::h_end", e, {BP, N}, true);
    w.backward.add("ash::seqblocks::h_replay", e, {BP, N}, true);
    // A named array, not a braced list in the range-for: nvcc's front end refuses that form.
    const char* const maps[] = {"ash::seqblocks::carry_M", "ash::seqblocks::carry_v", "ash::seqblocks::block_M",
                                "ash::seqblocks::block_v", "ash::seqblocks::ones"};
    for (const char* l : maps) w.carry_maps.add(l, e, {sh.Bt, sh.P, N}, true);
  }
  return w;
}
#define ASH_INSTANTIATE(K)                                                                                 \
  template BlockwiseWorkspace sequence_blockwise_workspace<K>(const EngineOptions&, const BlockwiseShape&, \
                                                              index_t, index_t);
ASH_FOR_EACH_LAYER_KIND(ASH_INSTANTIATE)
#undef ASH_INSTANTIATE

template <class S>
std::vector<StoredRows<S>> make_kept_inputs(const EngineOptions& opts, const BlockwiseShape& sh,
                                            const LayerSegments& seg, const BlockwiseWorkspace& ws) {
  const auto n = LayerSegments::counts(sh.k0, sh.k1, sh.K, sh.last, opts.layer_checkpoint);
  require(n.starts == index_t(seg.starts.size()) && n.longest == index_t(seg.longest()),
          "block-wise pass: LayerSegments::counts disagrees with the segments");
  const BufferSpec& kb = ws.kept.buffers().at(0);
  std::vector<StoredRows<S>> kept(std::size_t(sh.K - sh.k0 + 1));
  index_t made = 0;
  for (const int c : seg.starts)
    if (LayerSegments::keeps(c, sh.k0, sh.first, sh.input_again)) {
      kept[std::size_t(c - sh.k0)] = StoredRows<S>(kb.label, opts.storage, kb.extents[0], kb.extents[1]);
      ++made;
    }
  require(made == kb.copies, "block-wise pass: kept " + std::to_string(made) + " inputs, its workspace spec " +
                                 std::to_string(kb.copies));
  return kept;
}
template std::vector<StoredRows<float>> make_kept_inputs(const EngineOptions&, const BlockwiseShape&,
                                                         const LayerSegments&, const BlockwiseWorkspace&);
template std::vector<StoredRows<double>> make_kept_inputs(const EngineOptions&, const BlockwiseShape&,
                                                          const LayerSegments&, const BlockwiseWorkspace&);

template <class S>
void BlockwisePass<S>::start(const ParamSet<S>& params, const TokenView& x, index_t targets_, index_t blen,
                             const EngineOptions& opts, const std::vector<View2<S>>* state, bool input_again_,
                             const std::function<BlockwiseWorkspace(const BlockwiseShape&)>& spec,
                             const ParamSet<S>& grad) {
  const auto& d = params.dims();
  const LayerRange& lr = params.range();
  k0 = lr.k0;
  k1 = lr.k1;
  K = int(d.layers);
  first = lr.embedding && lr.k0 == 0;  // a last layer rank may hold the embedding as its tied head
  last = lr.head;
  input_again = !first && input_again_;
  Bt = x.extent(0);
  T = x.extent(1);
  targets = targets_;
  P = d.width;
  N = d.state;
  docs = DocStarts::of(x);
  if (state) check_carried_state(*state, d, k1 - k0, Bt);  // the kind's carried shape per layer
  seg = LayerSegments(k0, k1, K, last, opts.layer_checkpoint);
  ws = spec(shape(blen < T ? blen : T));  // the longest block (a range may be shorter than the grid)
  kept = make_kept_inputs<S>(opts, shape(blen < T ? blen : T), seg, ws);
  grad.fill_zero();
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
  if (blocks == 0 && opts.blockwise_levers()) return blockwise_block_length(opts, T);
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
  return compute_range(params, x, target_count(x), TokenBlocks(block_length(T), T), RangeLinks<S>{}, state_, grad);
}

namespace {

// One block-wise pass over a layer range of kind K (docs/design.md §8): the
// state before every (layer, block) kept (K::BlockStates), so any block of any
// layer runs again alone bit for bit; blocks in order forward, keeping every
// m-th layer input in the storage format; blocks last to first backward,
// segments top down, each segment's inputs recomputed from its kept input and
// the kept states, the kind's block backward per layer with its carry
// (K::Carry) from the block after. A carried state (data.carry_state; on a
// layer range its layers' views, of this replica's windows) is block 0's state
// before, a constant (no gradient flows into it); the state after the last
// block replaces it. On a layer range of an MPI pipeline the links hand a
// block's y and g to the neighbouring ranges: the states and carries belong to
// a layer and never cross a rank.
template <class S, class K>
class KindPass {
 public:
  using State = typename K::template State<S>;
  KindPass(const EngineOptions& opts, AdjointExactLayer<S>& e3, const ParamSet<S>& params, const TokenView& x,
           index_t targets, const TokenBlocks& blk, const RangeLinks<S>& links, const std::vector<View2<S>>* state,
           const ParamSet<S>& grad)
      : opts_(opts), e3_(e3), params_(params), d_(params.dims()), x_(x), blk_(blk), links_(links), state_(state),
        grad_(grad), exec_(e3.execution_space()) {
    // the layer range, segments and kept inputs as every block-wise pass sets them up; grad zeroed
    p_.start(params, x, targets, blk.len, opts, state, links.y_in_again,
             [&](const BlockwiseShape& sh) { return blockwise_workspace(opts, sh); }, grad);
    const index_t blen = blk.len < p_.T ? blk.len : p_.T;  // the longest block
    for (int k = p_.k0; k < p_.k1; ++k) states_.emplace_back(d_, p_.Bt, blk.n);
    if (state)
      for (int k = p_.k0; k < p_.k1; ++k) K::from_carried((*state)[std::size_t(k - p_.k0)], before(k, 0), exec_);
    run_ = K::template make_state<S>(d_, p_.Bt);
    act_ = K::template make_block_acts<S>(SeqShape{p_.Bt, blen, DocStarts()}, d_);
  }

  double run() {
    forward();
    if (links_.before_backward) links_.before_backward();
    const double loss = backward();
    e3_.release();
    return loss;
  }

 private:
  SeqShape shape(index_t j) const { return SeqShape{p_.Bt, blk_.size(j), p_.docs.from(blk_.start(j))}; }
  State before(int k, index_t j) const { return states_[std::size_t(k - p_.k0)].at(j); }
  StoredRows<S>& kept_input(int k) { return p_.kept_input(k); }
  // Layer k on block j, y -> yo, from the state kept before the block (forward and recomputation alike).
  void advance(int k, index_t j, const View2<S>& y, const View2<S>& yo) {
    K::copy(exec_, run_, before(k, j));
    K::forward_block(K::layer(params_, k), d_, shape(j), y, act_, yo, run_, exec_);
  }

  // Blocks in order, the state of every layer carried along; the kept inputs stored.
  void forward() {
    Workspace<S> ws;  // freed on return
    ws.plan(p_.ws.forward);
    View2<S> ya = ws.view2(y_block), yb = ws.view2(y_block_next);
    for (index_t j = 0; j < blk_.n; ++j) {
      const index_t rows = p_.Bt * blk_.size(j);
      View2<S> y = first_rows(ya, rows), yo = first_rows(yb, rows);
      if (p_.first)
        embedding_forward(params_.global().embedding, token_block(x_, blk_.start(j), blk_.size(j)), y, exec_);
      else
        links_.y_in(j, y);
      if (!kept_input(p_.k0).empty()) kept_input(p_.k0).put(y, p_.T, blk_.start(j), blk_.size(j), exec_);
      for (int k = p_.k0; k < p_.k1; ++k) {
        advance(k, j, y, yo);
        if (j + 1 < blk_.n)
          K::copy(exec_, before(k, j + 1), run_);
        else if (state_)  // the state after the window: the next window's
          K::to_carried(run_, (*state_)[std::size_t(k - p_.k0)], exec_);
        std::swap(y, yo);
        if (k + 1 <= p_.seg.top() && !kept_input(k + 1).empty())
          kept_input(k + 1).put(y, p_.T, blk_.start(j), blk_.size(j), exec_);
      }
      if (!p_.last) links_.y_out(j, y);
    }
  }

  // Blocks last to first; in each, segments top down, each segment's inputs
  // recomputed from its kept input and the kept states.
  double backward() {
    const auto gglobal = grad_.global();
    Workspace<S> ws;  // the segment's inputs and g of a block
    ws.plan(p_.ws.backward);
    std::vector<View2<S>> yseg;
    for (int i = 0; i < p_.seg.longest(); ++i) yseg.push_back(ws.view2(y_segment, i));
    const View2<S> gb = ws.view2(g_block);
    std::vector<typename K::template Carry<S>> carry;
    for (int k = p_.k0; k < p_.k1; ++k) carry.push_back(K::template make_carry<S>(d_, p_.Bt));
    double loss = 0;
    for (index_t j = blk_.n - 1; j >= 0; --j) {
      const index_t t0 = blk_.start(j), Tj = blk_.size(j), rows = p_.Bt * Tj;
      const TokenView xb = token_block(x_, t0, Tj);
      const View2<S> g = first_rows(gb, rows);
      if (!p_.last) links_.g_in(j, g);
      for (std::size_t i = p_.seg.starts.size(); i-- > 0;) {
        const int c = p_.seg.starts[i], e = p_.seg.end_of(i);  // the segment's inputs: y_c .. y_e
        const View2<S> y0 = first_rows(yseg[0], rows);
        if (c == 0 && p_.first)
          embedding_forward(params_.global().embedding, xb, y0, exec_);
        else if (c == p_.k0 && p_.input_again)
          links_.y_in(j, y0);
        else
          kept_input(c).get(y0, p_.T, t0, Tj, exec_);
        for (int k = c; k < e; ++k)  // y_{k+1} = layer k (y_k), from the state the forward saw
          advance(k, j, first_rows(yseg[std::size_t(k - c)], rows), first_rows(yseg[std::size_t(k + 1 - c)], rows));
        if (p_.last && e == p_.K) {  // the head on y_K's rows: the block's share of L and g_K
          const TokenView xh = token_block(x_, t0, (blk_.end(j) < p_.T ? blk_.end(j) + 1 : p_.T) - t0);
          loss += head_loss<S>(params_.global(), xh, first_rows(yseg[std::size_t(p_.K - c)], rows), g, &gglobal,
                               opts_.head_chunk, p_.targets, exec_);
        }
        for (int k = std::min(e, p_.k1 - 1); k >= c; --k)
          K::backward_block(e3_, K::layer(params_, k), d_, shape(j), first_rows(yseg[std::size_t(k - c)], rows), g,
                            before(k, j), j == 0 && !state_, carry[std::size_t(k - p_.k0)], blk_.n > 1,
                            K::layer(grad_, k));
      }
      if (p_.first)
        embedding_backward(xb, g, gglobal.embedding, exec_);
      else
        links_.g_out(j, g);
    }
    return loss;
  }

  const EngineOptions& opts_;
  AdjointExactLayer<S>& e3_;
  const ParamSet<S>& params_;
  const ModelDims& d_;
  const TokenView& x_;
  const TokenBlocks& blk_;
  const RangeLinks<S>& links_;
  const std::vector<View2<S>>* state_;
  const ParamSet<S>& grad_;
  const ExecSpace& exec_;
  BlockwisePass<S> p_;  // the layer range, its segments, kept inputs and phase buffers
  std::vector<typename K::template BlockStates<S>> states_;  // [k - k0]: the states before each block
  State run_;                                                 // the state a block's forward advances
  typename K::template BlockActs<S> act_;                     // one block's activations
};

}  // namespace

template <class S>
double BlockwiseEngine<S>::compute_range(const ParamSet<S>& params, const TokenView& x, index_t targets,
                                         const TokenBlocks& blocks, const RangeLinks<S>& links,
                                         const std::vector<View2<S>>* state, const ParamSet<S>& grad) {
  const MatmulScope matmul(opts_.matmul, sizeof(S));
  const LayerRange& lr = params.range();
  require(grad.range() == lr, "BlockwiseEngine: the gradient is not the parameters' range");
  require((lr.embedding || (links.y_in && links.g_out)) && (lr.head || (links.y_out && links.g_in)),
          "BlockwiseEngine: a layer range without the embedding or the head needs its neighbours' links");
  return with_layer_kind(params.dims(), [&](auto kind) {
    return KindPass<S, decltype(kind)>(opts_, layer_, params, x, targets, blocks, links, state, grad).run();
  });
}

template class BlockwiseEngine<float>;
template class BlockwiseEngine<double>;

}  // namespace ash
