#include "ash/grad/stack_adjoint.hpp"

#include <string>
#include <utility>

#include "ash/core/error.hpp"
#include "ash/core/sizes.hpp"
#include "ash/kernels/blocks.hpp"
#include "ash/kernels/matmul.hpp"

namespace ash {

namespace {
// The block pass's links for a whole layer stack in one process: block j's
// input from y0's rows, its g_K from g's, its ∂L/∂y_0 back into g's rows (g
// is read before it is written, block by block, last first); y_K is dropped
// (the caller's head gave g). y_in_again: the pass may read y0 twice (an
// SSM-ResNet's range does; a Mamba's keeps its input).
template <class S>
RangeLinks<S> whole_stack_links(const View2<S>& y0, const View2<S>& g, const SeqShape& s, const TokenBlocks& blocks,
                                bool y_in_again, const ExecSpace& exec) {
  RangeLinks<S> links;
  links.y_in = [=](index_t j, const View2<S>& y) {
    copy_block_rows(y0, y, BlockRows{blocks.size(j), s.T, blocks.start(j)}, true, exec);
  };
  links.g_in = [=](index_t j, const View2<S>& gb) {
    copy_block_rows(g, gb, BlockRows{blocks.size(j), s.T, blocks.start(j)}, true, exec);
  };
  links.g_out = [=](index_t j, const View2<S>& gb) {
    copy_block_rows(g, gb, BlockRows{blocks.size(j), s.T, blocks.start(j)}, false, exec);
  };
  links.y_out = [](index_t, const View2<S>&) {};
  links.y_in_again = y_in_again;
  return links;
}

// The tokens a stack's block pass reads: only their shape (no embedding, no
// head) and their document starts, when s has them.
inline TokenView stack_tokens(const SeqShape& s, const char* who) {
  require(s.docs.x.extent(0) == 0 || (index_t(s.docs.x.extent(0)) == s.batch &&
                                      index_t(s.docs.x.extent(1)) == s.T && s.docs.t0 == 0),
          std::string(who) + ": document starts must be a [batch, T] token view from its first token");
  return s.docs.x.extent(0) > 0 ? s.docs.x : TokenView("ash::stack::no_tokens", s.batch, s.T);
}

template <class S>
void check_stack(const ParamSet<S>& layers, const SeqShape& s, const View2<S>& y, const char* what) {
  const auto& d = layers.dims();
  require(layers.range() == StackAdjoint<S>::range(d),
          "StackAdjoint: the parameters must cover layers [0, K) without embedding and head");
  require(s.batch >= 1 && s.T >= 1, "StackAdjoint: batch and T must be >= 1");
  require(index_t(y.extent(0)) == s.rows() && index_t(y.extent(1)) == index_t(d.width),
          std::string("StackAdjoint: ") + what + " must be [batch·T, P] = [" + std::to_string(s.rows()) + ", " +
              std::to_string(d.width) + "], got [" + std::to_string(y.extent(0)) + ", " +
              std::to_string(y.extent(1)) + "]");
}
}  // namespace

template <class S>
StackAdjoint<S>::StackAdjoint(const EngineOptions& opts) : opts_(opts), engine_(opts) {
  require(!opts.carry_state, "StackAdjoint: data.carry_state is not supported (every window starts from h = 0)");
}

template <class S>
void StackAdjoint<S>::forward(const ParamSet<S>& layers, const SeqShape& s, const View2<S>& y0, const View2<S>& yK) {
  check_stack(layers, s, y0, "y0");
  check_stack(layers, s, yK, "yK");
  const MatmulScope matmul(opts_.matmul, sizeof(S));
  const auto& d = layers.dims();
  const ExecSpace& exec = engine_.execution_space();
  if (d.layers == 0) {
    Kokkos::deep_copy(exec, yK, y0);
    return;
  }
  const LayerActivations<S> act(s, d, LayerActivations<S>::projections_only);
  // Ping-pong between yK and one scratch so that the last layer writes yK.
  View2<S> other("ash::stack::y", s.rows(), d.width);
  View2<S> in = y0;
  for (int k = 0; k < int(d.layers); ++k) {
    const View2<S> out = (int(d.layers) - 1 - k) % 2 == 0 ? yK : other;
    ssm_layer_forward(layers.layer(k), s, in, act, out, View2<S>(), exec);
    in = out;
  }
}

template <class S>
void StackAdjoint<S>::backward(const ParamSet<S>& layers, const SeqShape& s, const View2<S>& y0, const View2<S>& g,
                               const ParamSet<S>& grad) {
  check_stack(layers, s, y0, "y0");
  check_stack(layers, s, g, "g");
  require(grad.range() == layers.range() && grad.dims() == layers.dims(),
          "StackAdjoint: the gradient must have the parameters' sizes and range");
  if (layers.dims().layers == 0) {
    grad.fill_zero();
    return;
  }
  const ExecSpace& exec = engine_.execution_space();
  const TokenBlocks blocks(engine_.block_length(s.T), s.T);
  const TokenView x = stack_tokens(s, "StackAdjoint");
  engine_.compute_range(layers, x, s.rows(), blocks, whole_stack_links(y0, g, s, blocks, true, exec), nullptr, grad);
  exec.fence();
}

template class StackAdjoint<float>;
template class StackAdjoint<double>;

namespace {

// Every view of a block's parameters, with its name and the extents a block of d has.
template <class S, class F>
void for_each_tensor(const MambaLayerParams<S>& p, const ModelDims& d, F&& f) {
  const index_t D = d.width, E = d.inner(), N = d.state, R = d.rank(), Kc = d.conv_kernel;
  f("norm", p.norm, D, index_t(-1));
  f("in_proj (x rows)", p.in_x, E, D);
  f("in_proj (z rows)", p.in_z, E, D);
  f("conv_weight", p.conv_weight, E, Kc);
  f("conv_bias", p.conv_bias, E, index_t(-1));
  f("x_proj (dt rows)", p.x_dt, R, E);
  f("x_proj (B rows)", p.x_B, N, E);
  f("x_proj (C rows)", p.x_C, N, E);
  f("dt_proj", p.dt_proj, E, R);
  f("dt_bias", p.dt_bias, E, index_t(-1));
  f("A_log", p.A_log, E, N);
  f("D", p.D, E, index_t(-1));
  f("out_proj", p.out_proj, D, E);
}

template <class V>
index_t extent_or(const V& v, int i) {
  return i < int(V::rank) ? index_t(v.extent(i)) : index_t(-1);
}

template <class S>
void check_blocks(const typename MambaStackAdjoint<S>::Blocks& blocks, const ModelDims& d, const char* what) {
  require(index_t(blocks.size()) == index_t(d.layers), std::string("MambaStackAdjoint: ") + what + " has " +
                                                           std::to_string(blocks.size()) + " blocks, expected K = " +
                                                           std::to_string(d.layers));
  for (std::size_t k = 0; k < blocks.size(); ++k)
    for_each_tensor(blocks[k], d, [&](const char* name, const auto& v, index_t r, index_t c) {
      require(extent_or(v, 0) == r && extent_or(v, 1) == c && (r == 0 || c == 0 || v.data() != nullptr),
              std::string("MambaStackAdjoint: ") + what + " of block " + std::to_string(k) + ": " + name +
                  " is [" + std::to_string(extent_or(v, 0)) + (c >= 0 ? ", " + std::to_string(extent_or(v, 1)) : "") +
                  "], expected [" + std::to_string(r) + (c >= 0 ? ", " + std::to_string(c) : "") + "]");
    });
}

template <class S>
void check_rows(const ModelDims& d, const SeqShape& s, const View2<S>& y, const char* what) {
  require(s.batch >= 1 && s.T >= 1, "MambaStackAdjoint: batch and T must be >= 1");
  require(index_t(y.extent(0)) == s.rows() && index_t(y.extent(1)) == index_t(d.width),
          std::string("MambaStackAdjoint: ") + what + " must be [batch·T, D] = [" + std::to_string(s.rows()) + ", " +
              std::to_string(d.width) + "], got [" + std::to_string(y.extent(0)) + ", " +
              std::to_string(y.extent(1)) + "]");
}

}  // namespace

template <class S>
MambaStackAdjoint<S>::MambaStackAdjoint(const ModelDims& d, const EngineOptions& opts) : dims_(d), opts_(opts) {
  require(d.mamba(), "MambaStackAdjoint: the model is not a Mamba (model.arch=mamba)");
  require(opts.method == Method::adjoint_exact,
          "MambaStackAdjoint: grad.engine must be adjoint-exact, got " + method_name(opts.method));
  // E3's modes (exact, detached, windowed) are the per-layer method's, checked
  // when it is made; the memory levers the block-wise engine's (backward).
  check_grad_numbers(opts);
  require(opts.truncate == 0 || opts.detach_inputs, "grad.truncate needs grad.detach_inputs (the paper's window)");
  require(opts.layer_checkpoint >= 1, "grad.layer_checkpoint must be >= 1 for a Mamba layer stack");
  require(opts.token_block >= 0, "grad.token_block must be >= 0 (0: the whole window)");
  require(!opts.carry_state,
          "data.carry_state=true is not available for a Mamba layer stack (every call starts from a zero state)");
}

template <class S>
bool MambaStackAdjoint<S>::levers() const {
  return opts_.storage != Storage::full || opts_.layer_checkpoint > 1 || opts_.token_block > 0;
}

template <class S>
typename MambaStackAdjoint<S>::Blocks MambaStackAdjoint<S>::blocks(const ParamSet<S>& layers) {
  const auto& d = layers.dims();
  require(layers.range() == range(d), "MambaStackAdjoint: the parameters must cover layers [0, K) without embedding "
                                      "and head");
  Blocks out;
  for (int k = 0; k < int(d.layers); ++k) out.push_back(layers.mamba_layer(k));
  return out;
}

template <class S>
void MambaStackAdjoint<S>::forward(const Blocks& blocks, const SeqShape& s, const View2<S>& y0,
                                   const View2<S>& yK) const {
  const auto& d = dims_;
  check_blocks<S>(blocks, d, "the parameters");
  check_rows(d, s, y0, "y0");
  check_rows(d, s, yK, "yK");
  require(y0.data() != yK.data(), "MambaStackAdjoint: yK must not be y0");
  const ExecSpace exec;
  if (d.layers == 0) {
    Kokkos::deep_copy(exec, yK, y0);
    exec.fence();
    return;
  }
  const MatmulScope matmul(opts_.matmul, sizeof(S));
  const MambaActivations<S> act(s, d, LayerActivations<S>::projections_only);
  // Ping-pong between yK and one scratch so that the last block writes yK.
  const View2<S> other = d.layers > 1 ? View2<S>("ash::mamba_stack::y", s.rows(), d.width) : View2<S>();
  View2<S> in = y0;
  for (int k = 0; k < int(d.layers); ++k) {
    const View2<S> out = (int(d.layers) - 1 - k) % 2 == 0 ? yK : other;
    mamba_layer_forward(blocks[std::size_t(k)], d, s, in, act, out, exec);
    in = out;
  }
  exec.fence();
}

template <class S>
void MambaStackAdjoint<S>::backward(const Blocks& blocks, const SeqShape& s, const View2<S>& y0, const View2<S>& g,
                                    const Blocks& grad) const {
  const auto& d = dims_;
  check_blocks<S>(blocks, d, "the parameters");
  check_blocks<S>(grad, d, "the gradient");
  check_rows(d, s, y0, "y0");
  check_rows(d, s, g, "g");
  require(y0.data() != g.data(), "MambaStackAdjoint: g must not be y0");
  const ExecSpace exec;
  for (const auto& gk : grad)
    for_each_tensor(gk, d, [&](const char*, const auto& v, index_t, index_t) { Kokkos::deep_copy(exec, v, S(0)); });
  const int K = int(d.layers);
  if (K == 0) {
    exec.fence();
    return;
  }
  const MatmulScope matmul(opts_.matmul, sizeof(S));
  if (levers()) {
    backward_blockwise(blocks, s, y0, g, grad);
    return;
  }
  // The engines' own per-layer E3 (AdjointExactLayer; the blocks' parameter
  // type selects the kind's backward): the block inputs y_0 (a copy of the caller's) ..
  // y_{K-1} recomputed into a store that keeps nothing else, then block by
  // block from K-1 down, each block's projections recomputed by the store.
  const auto layer = make_layer_adjoint<S>(opts_);
  ActivationStore<S> store(s, d, 0, K, layer->store(), false);
  Kokkos::deep_copy(exec, store.input(0), y0);
  for (int k = 0; k < K - 1; ++k)
    mamba_layer_forward(blocks[std::size_t(k)], d, s, store.input(k), store.mamba_scratch(), store.input(k + 1), exec);
  store.release_output();
  for (int k = K - 1; k >= 0; --k) {
    layer->backward(blocks[std::size_t(k)], d, k, store, g, grad[std::size_t(k)]);
    store.release(k);
  }
  layer->release();
  exec.fence();
}

// The memory levers: the block-wise engine's pass over a layer range
// without embedding and head (BlockwiseEngine::compute_range), fed by the
// whole-stack links. It takes a ParamSet, so the blocks (views of the
// caller's tensors) are copied into one and the gradient copied out: O(parameters)
// per call beside the O(T) pass.
template <class S>
void MambaStackAdjoint<S>::backward_blockwise(const Blocks& blocks, const SeqShape& s, const View2<S>& y0,
                                              const View2<S>& g, const Blocks& grad) const {
  const auto& d = dims_;
  const ExecSpace exec;
  const ParamSet<S> params(d, range(d)), gs(d, range(d));
  const auto flat = [&](const MambaLayerParams<S>& p) {  // every tensor as its contiguous span
    std::vector<Unmanaged1<S>> out;
    for_each_tensor(p, d, [&](const char*, const auto& v, index_t, index_t) { out.emplace_back(v.data(), v.span()); });
    return out;
  };
  const auto copy = [&](const MambaLayerParams<S>& from, const MambaLayerParams<S>& to) {
    const auto f = flat(from), t = flat(to);
    for (std::size_t i = 0; i < f.size(); ++i) Kokkos::deep_copy(exec, t[i], f[i]);
  };
  for (int k = 0; k < int(d.layers); ++k) copy(blocks[std::size_t(k)], params.mamba_layer(k));
  BlockwiseEngine<S> engine(opts_);
  const TokenBlocks tb(engine.block_length(s.T), s.T);
  engine.compute_range(params, stack_tokens(s, "MambaStackAdjoint"), s.rows(), tb,
                       whole_stack_links(y0, g, s, tb, false, exec), nullptr, gs);
  for (int k = 0; k < int(d.layers); ++k) copy(gs.mamba_layer(k), grad[std::size_t(k)]);
  exec.fence();
}

template class MambaStackAdjoint<float>;
template class MambaStackAdjoint<double>;

}  // namespace ash
