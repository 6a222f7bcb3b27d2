#include "ash/grad/blockwise_engine.hpp"

#include <algorithm>
#include <memory>
#include <utility>

#include "ash/core/error.hpp"
#include "ash/kernels/matmul.hpp"

namespace ash {

// One compute_range(): the layer range, its segments and what it keeps.
template <class S>
struct BlockwiseEngine<S>::Range {
  int k0 = 0, k1 = 0, K = 0;
  bool first = true, last = true;  // the range has the embedding, the head
  index_t Bt = 0, T = 0, targets = 0;
  const RangeLinks<S>* links = nullptr;
  const std::vector<View2<S>>* state = nullptr;
  LayerSegments seg;  // one process: starts 0, m, 2m, ...
  std::vector<StoredRows<S>> kept;  // [k - k0], k in [k0, K]: the kept inputs (empty: none, or y_0)
  std::unique_ptr<BlockwiseForward<S>> fw;
  LayerActivations<S> act;
  bool input_again = false;  // the range's input y_{k0} comes again from links->y_in in the backward
  // Whether segment start y_c is kept in the forward: not when it is recomputed
  // (the embedding's y_0) or read again (an input the caller holds).
  bool keeps(int c) const { return !(c == 0 && first) && !(c == k0 && !first && input_again); }
  const StoredRows<S>& kept_input(int k) const { return kept[std::size_t(k - k0)]; }
};

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

template <class S>
double BlockwiseEngine<S>::compute(const ParamSet<S>& params, const TokenView& x, const ParamSet<S>& grad) {
  const auto& d = params.dims();
  require(params.range().is_all(d) && grad.range().is_all(d), "BlockwiseEngine: needs the whole model");
  const index_t T = x.extent(1);
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
  Range r;
  r.k0 = lr.k0;
  r.k1 = lr.k1;
  r.K = int(d.layers);
  r.first = lr.embedding;
  r.last = lr.head;
  r.Bt = x.extent(0);
  r.T = x.extent(1);
  r.targets = targets;
  r.links = &links;
  r.state = state;
  r.input_again = !r.first && links.y_in_again;
  require((r.first || (links.y_in && links.g_out)) && (r.last || (links.y_out && links.g_in)),
          "BlockwiseEngine: a layer range without the embedding or the head needs its neighbours' links");
  const index_t P = d.width, N = d.state;
  if (state) {
    require(index_t(state->size()) == index_t(r.k1 - r.k0), "carried state: expected one state per layer");
    for (const auto& h : *state)
      require(index_t(h.extent(0)) == r.Bt * P && index_t(h.extent(1)) == N,
              "carried state: expected [batch·P, N] per layer");
  }
  r.seg = LayerSegments(r.k0, r.k1, r.K, r.last, opts_.layer_checkpoint);
  r.kept.resize(std::size_t(r.K - r.k0 + 1));
  for (const int c : r.seg.starts)
    if (r.keeps(c)) r.kept[std::size_t(c - r.k0)] = StoredRows<S>("ash::lowmem::y_kept", opts_.storage, r.Bt * r.T, P);
  grad.fill_zero();
  // The state before each (layer, block); block 0's is the carried state (or zero).
  r.fw = std::make_unique<BlockwiseForward<S>>(d, r.k0, r.k1, r.Bt, blocks, true);
  r.fw->set_documents(x);
  if (state)
    for (int k = r.k0; k < r.k1; ++k) r.fw->start_from(k, (*state)[std::size_t(k - r.k0)], layer_.execution_space());
  r.act = LayerActivations<S>(SeqShape{r.Bt, blocks.len}, d, LayerActivations<S>::projections_only);
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
  const index_t P = params.dims().width;
  View2<S> ya("ash::lowmem::y_block", r.Bt * blk.len, P), yb("ash::lowmem::y_block_next", r.Bt * blk.len, P);
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
  const index_t P = params.dims().width;
  const auto gglobal = grad.global();
  const int nseg = r.seg.longest();
  std::vector<View2<S>> yseg;
  for (int i = 0; i < nseg; ++i) yseg.emplace_back("ash::lowmem::y_segment", r.Bt * blk.len, P);
  View2<S> gb("ash::lowmem::g_block", r.Bt * blk.len, P);
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

template class BlockwiseEngine<float>;
template class BlockwiseEngine<double>;

}  // namespace ash
