#include "ash/grad/blockwise_engine.hpp"

#include <utility>

#include "ash/core/error.hpp"

namespace ash {

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
  std::string n = layer_.name();
  n.pop_back();  // the closing parenthesis
  return n + ", " + storage_name(opts_.storage) + " storage, layer checkpoint " +
         std::to_string(opts_.layer_checkpoint) + (opts_.carry_state ? ", carried state" : "") + ")";
}

index_t blockwise_block_length(const EngineOptions& opts, index_t T) {
  if (opts.truncate > 0 && opts.truncate < T) return T;  // the block method of T̄ needs the whole window
  const index_t C = opts.chunk < T ? opts.chunk : T;
  index_t want = opts.token_block > 0 ? opts.token_block : 4096;
  if (want > T) want = T;  // the whole window (and no overflow below)
  const index_t len = ((want + C - 1) / C) * C;  // whole chunks: the same chunk structure as one block
  return len < T ? len : T;
}

template <class S>
double BlockwiseEngine<S>::compute(const ParamSet<S>& params, const TokenView& x, const ParamSet<S>& grad) {
  const auto& d = params.dims();
  require(params.range().is_all(d) && grad.range().is_all(d), "BlockwiseEngine: needs the whole model");
  const index_t Bt = x.extent(0), T = x.extent(1), P = d.width, N = d.state;
  const int K = int(d.layers);
  const index_t m = segment_length(K);
  if (state_) {
    require(index_t(state_->size()) == K, "carried state: expected one state per layer");
    for (const auto& h : *state_)
      require(index_t(h.extent(0)) == Bt * P && index_t(h.extent(1)) == N,
              "carried state: expected [batch·P, N] per layer");
  }
  grad.fill_zero();
  // Kept layer inputs y_k, k = m, 2m, ... <= K (y_0 is the embedding's, recomputed).
  std::vector<StoredRows<S>> kept(K + 1);
  for (int k = int(m); k <= K; k += int(m)) kept[k] = StoredRows<S>("ash::lowmem::y_kept", opts_.storage, Bt * T, P);
  // The state before each (layer, block); block 0's is the carried state (or zero).
  BlockwiseForward<S> fw(d, 0, K, Bt, TokenBlocks(block_length(T), T), true);
  if (state_)
    for (int k = 0; k < K; ++k) fw.start_from(k, (*state_)[k], layer_.execution_space());
  const LayerActivations<S> act(SeqShape{Bt, fw.blocks().len}, d, LayerActivations<S>::projections_only);
  forward(params, x, fw, kept, act);
  const double loss = backward(params, x, fw, kept, act, grad);
  layer_.release();
  return loss;
}

// Blocks in order, the state of every layer carried along; the kept inputs stored.
template <class S>
void BlockwiseEngine<S>::forward(const ParamSet<S>& params, const TokenView& x, BlockwiseForward<S>& fw,
                                 const std::vector<StoredRows<S>>& kept, const LayerActivations<S>& act) {
  const ExecSpace& exec = layer_.execution_space();
  const TokenBlocks& blk = fw.blocks();
  const index_t Bt = x.extent(0), T = x.extent(1), P = params.dims().width;
  const int K = int(params.dims().layers);
  View2<S> ya("ash::lowmem::y_block", Bt * blk.len, P), yb("ash::lowmem::y_block_next", Bt * blk.len, P);
  for (index_t j = 0; j < blk.n; ++j) {
    const index_t rows = fw.rows(j);
    View2<S> y = first_rows(ya, rows), yo = first_rows(yb, rows);
    embedding_forward(params.global().embedding, token_block(x, blk.start(j), blk.size(j)), y, exec);
    const auto act_j = first_rows(act, rows);
    for (int k = 0; k < K; ++k) {
      const View2<S> h = fw.advance(params.layer(k), k, j, y, act_j, yo, exec);
      if (j + 1 == blk.n && state_) Kokkos::deep_copy(exec, (*state_)[k], h);
      std::swap(y, yo);
      if (!kept[k + 1].empty()) kept[k + 1].put(y, T, blk.start(j), blk.size(j), exec);
    }
  }
}

// Blocks last to first; in each, segments of m layers top down, each
// segment's inputs recomputed from its kept input and the kept states.
template <class S>
double BlockwiseEngine<S>::backward(const ParamSet<S>& params, const TokenView& x, const BlockwiseForward<S>& fw,
                                    const std::vector<StoredRows<S>>& kept, const LayerActivations<S>& act,
                                    const ParamSet<S>& grad) {
  const ExecSpace& exec = layer_.execution_space();
  const TokenBlocks& blk = fw.blocks();
  const index_t Bt = x.extent(0), T = x.extent(1), P = params.dims().width;
  const int K = int(params.dims().layers);
  const index_t m = segment_length(K);
  const auto gglobal = grad.global();
  const index_t nseg = m < index_t(K) + 1 ? m : index_t(K) + 1;  // inputs per segment
  std::vector<View2<S>> yseg;
  for (index_t i = 0; i < nseg; ++i) yseg.emplace_back("ash::lowmem::y_segment", Bt * blk.len, P);
  View2<S> gb("ash::lowmem::g_block", Bt * blk.len, P);
  std::vector<ExactCarry<S>> carry(K);
  const index_t targets = Bt * (T - 1);
  double loss = 0;
  const int c_top = int((K / m) * m);
  for (index_t j = blk.n - 1; j >= 0; --j) {
    const index_t t0 = blk.start(j), Tj = blk.size(j), rows = fw.rows(j);
    const TokenView xb = token_block(x, t0, Tj);
    const auto act_j = first_rows(act, rows);
    const View2<S> g = first_rows(gb, rows);
    for (int c = c_top; c >= 0; c -= int(m)) {
      const int e = c + int(nseg) - 1 < K ? c + int(nseg) - 1 : K;  // the segment's inputs: y_c .. y_e
      const View2<S> y0 = first_rows(yseg[0], rows);
      if (c == 0)
        embedding_forward(params.global().embedding, xb, y0, exec);
      else
        kept[c].get(y0, T, t0, Tj, exec);
      for (int k = c; k < e; ++k)  // y_{k+1} = layer k (y_k), from the state the forward saw
        fw.replay(params.layer(k), k, j, first_rows(yseg[k - c], rows), act_j, first_rows(yseg[k + 1 - c], rows),
                  exec);
      if (e == K) {  // the head on y_K's rows: the block's share of L and g_K
        const TokenView xh = token_block(x, t0, (blk.end(j) < T ? blk.end(j) + 1 : T) - t0);
        loss += head_loss<S>(params.global(), xh, first_rows(yseg[K - c], rows), g, &gglobal, opts_.head_chunk,
                             targets, exec);
      }
      for (int k = (e < K ? e : K - 1); k >= c; --k) {
        const View2<S> h0 = (j > 0 || state_) ? fw.state_before(k, j) : View2<S>();
        layer_.backward_block(params.layer(k), fw.shape(j), first_rows(yseg[k - c], rows), g, h0,
                              blk.n > 1 ? &carry[k] : nullptr, grad.layer(k));
      }
    }
    embedding_backward(xb, g, gglobal.embedding, exec);
  }
  return loss;
}

template class BlockwiseEngine<float>;
template class BlockwiseEngine<double>;

}  // namespace ash
