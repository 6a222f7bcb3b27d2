#include "ash/grad/stack_adjoint.hpp"

#include <string>
#include <type_traits>

#include "ash/core/error.hpp"
#include "ash/core/sizes.hpp"
#include "ash/kernels/blocks.hpp"
#include "ash/kernels/matmul.hpp"

namespace ash {

namespace {
// The block pass's links for a whole layer stack in one process: block j's
// input from y0's rows, its g_K from g's, its ∂L/∂y_0 back into g's rows (g
// is read before it is written, block by block, last first); y_K is dropped
// (the caller's head gave g). y_in_again: the pass reads y0 again in the
// backward rather than keeping it (K::stack_input_again).
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

// "StackAdjoint<kind>: ", the start of every refusal.
template <class K>
std::string who() {
  return std::string("StackAdjoint<") + K::name + ">: ";
}

// The tokens a stack's block pass reads: only their shape (no embedding, no
// head) and their document starts, when s has them.
template <class K>
TokenView stack_tokens(const SeqShape& s) {
  require(s.docs.x.extent(0) == 0 ||
              (index_t(s.docs.x.extent(0)) == s.batch && index_t(s.docs.x.extent(1)) == s.T && s.docs.t0 == 0),
          who<K>() + "document starts must be a [batch, T] token view from its first token");
  return s.docs.x.extent(0) > 0 ? s.docs.x : TokenView("ash::stack::no_tokens", s.batch, s.T);
}

template <class V>
index_t extent_or(const V& v, int i) {
  return i < int(V::rank) ? index_t(v.extent(i)) : index_t(-1);
}

std::string extents(index_t r, index_t c) {
  return "[" + std::to_string(r) + (c >= 0 ? ", " + std::to_string(c) : "") + "]";
}

// to's tensors = from's, each copied as its contiguous span.
template <class S, class K>
void copy_blocks(const std::vector<typename K::template Params<S>>& from,
                 const std::vector<typename K::template Params<S>>& to, const ModelDims& d, const ExecSpace& exec) {
  for (std::size_t k = 0; k < from.size(); ++k) {
    std::vector<Unmanaged1<S>> spans;
    K::for_each_tensor(from[k], d,
                       [&](const char*, const auto& v, index_t, index_t) { spans.emplace_back(v.data(), v.span()); });
    std::size_t i = 0;
    K::for_each_tensor(to[k], d, [&](const char*, const auto& v, index_t, index_t) {
      Kokkos::deep_copy(exec, Unmanaged1<S>(v.data(), v.span()), spans[i++]);
    });
  }
}
}  // namespace

template <class S, class K>
StackAdjoint<S, K>::StackAdjoint(const ModelDims& d, const EngineOptions& opts) : dims_(d), opts_(opts) {
  require(with_layer_kind(d, [](auto kind) { return std::is_same<decltype(kind), K>::value; }),
          who<K>() + "the model is a " + arch_name(d.arch) + ", not model.arch=" + K::name);
  require(opts.method == Method::adjoint_exact,
          who<K>() + "grad.engine must be adjoint-exact, got " + method_name(opts.method));
  // E3's modes (exact, detached, windowed) are the per-layer method's, checked
  // when it is made; the memory levers the block-wise engine's.
  check_grad_numbers(opts);
  require(opts.truncate == 0 || opts.detach_inputs, "grad.truncate needs grad.detach_inputs (the paper's window)");
  require(opts.layer_checkpoint >= 1, "grad.layer_checkpoint must be >= 1 for a layer stack");
  require(opts.token_block >= 0, "grad.token_block must be >= 0");
  require(!opts.carry_state,
          "data.carry_state=true is not available for a layer stack (every call starts from a zero state)");
}

template <class S, class K>
bool StackAdjoint<S, K>::blockwise() const {
  return !K::stack_whole_window || opts_.blockwise_levers();
}

template <class S, class K>
typename StackAdjoint<S, K>::Blocks StackAdjoint<S, K>::blocks(const ParamSet<S>& layers) {
  const auto& d = layers.dims();
  require(layers.range() == range(d), who<K>() + "the parameters must cover layers [0, K) without embedding and head");
  Blocks out;
  for (int k = 0; k < int(d.layers); ++k) out.push_back(K::layer(layers, k));
  return out;
}

// The layers (K of them, each view of its extents), the rows of y0 and y
// ([batch·T, width], y not y0's buffer).
template <class S, class K>
void StackAdjoint<S, K>::check(const Blocks& blocks, const SeqShape& s, const View2<S>& y0, const View2<S>& y,
                               const char* y_name, const char* what) const {
  const auto& d = dims_;
  require(index_t(blocks.size()) == index_t(d.layers), who<K>() + what + " has " + std::to_string(blocks.size()) +
                                                           " layers, expected K = " + std::to_string(d.layers));
  for (std::size_t k = 0; k < blocks.size(); ++k)
    K::for_each_tensor(blocks[k], d, [&](const char* name, const auto& v, index_t r, index_t c) {
      require(extent_or(v, 0) == r && extent_or(v, 1) == c && (r == 0 || c == 0 || v.data() != nullptr),
              who<K>() + what + " of layer " + std::to_string(k) + ": " + name + " is " +
                  extents(extent_or(v, 0), c >= 0 ? extent_or(v, 1) : index_t(-1)) + ", expected " + extents(r, c));
    });
  require(s.batch >= 1 && s.T >= 1, who<K>() + "batch and T must be >= 1");
  const auto rows = [&](const View2<S>& v, const char* name) {
    require(index_t(v.extent(0)) == s.rows() && index_t(v.extent(1)) == index_t(d.width),
            who<K>() + name + " must be [batch·T, width] = " + extents(s.rows(), d.width) + ", got " +
                extents(index_t(v.extent(0)), index_t(v.extent(1))));
  };
  rows(y0, "y0");
  rows(y, y_name);
  require(y0.data() != y.data(), who<K>() + y_name + " must not be y0");
}

template <class S, class K>
void StackAdjoint<S, K>::check(const ParamSet<S>& layers, const char* what) const {
  require(layers.range() == range(dims_) && layers.dims() == dims_,
          who<K>() + what + " must be the stack's sizes and cover layers [0, K) without embedding and head");
}

template <class S, class K>
void StackAdjoint<S, K>::forward(const Blocks& blocks, const SeqShape& s, const View2<S>& y0,
                                 const View2<S>& yK) const {
  const auto& d = dims_;
  check(blocks, s, y0, yK, "yK", "the parameters");
  const ExecSpace exec;
  if (d.layers == 0) {
    Kokkos::deep_copy(exec, yK, y0);
    exec.fence();
    return;
  }
  const MatmulScope matmul(opts_.matmul, sizeof(S));
  const auto act = K::template make_block_acts<S>(s, d);
  // Ping-pong between yK and one scratch so that the last layer writes yK.
  const View2<S> other = d.layers > 1 ? View2<S>("ash::stack::y", s.rows(), d.width) : View2<S>();
  View2<S> in = y0;
  for (int k = 0; k < int(d.layers); ++k) {
    const View2<S> out = (int(d.layers) - 1 - k) % 2 == 0 ? yK : other;
    K::forward_window(blocks[std::size_t(k)], d, s, in, act, out, exec);
    in = out;
  }
  exec.fence();
}

template <class S, class K>
void StackAdjoint<S, K>::forward(const ParamSet<S>& layers, const SeqShape& s, const View2<S>& y0,
                                 const View2<S>& yK) const {
  check(layers, "the parameters");
  forward(blocks(layers), s, y0, yK);
}

template <class S, class K>
void StackAdjoint<S, K>::backward(const Blocks& blocks, const SeqShape& s, const View2<S>& y0, const View2<S>& g,
                                  const Blocks& grad) const {
  const auto& d = dims_;
  check(blocks, s, y0, g, "g", "the parameters");
  check(grad, s, y0, g, "g", "the gradient");
  const ExecSpace exec;
  for (const auto& gk : grad)
    K::for_each_tensor(gk, d, [&](const char*, const auto& v, index_t, index_t) { Kokkos::deep_copy(exec, v, S(0)); });
  if (d.layers == 0) {
    exec.fence();
    return;
  }
  const MatmulScope matmul(opts_.matmul, sizeof(S));
  if (!blockwise()) {
    backward_window(blocks, s, y0, g, grad);
    return;
  }
  // The block-wise engine takes a ParamSet: the blocks (views of the caller's
  // tensors) copied into one and the gradient out of one, O(parameters) per call.
  const ParamSet<S> params(d, range(d)), gs(d, range(d));
  copy_blocks<S, K>(blocks, this->blocks(params), d, exec);
  backward_blockwise(params, s, y0, g, gs);
  copy_blocks<S, K>(this->blocks(gs), grad, d, exec);
  exec.fence();
}

template <class S, class K>
void StackAdjoint<S, K>::backward(const ParamSet<S>& layers, const SeqShape& s, const View2<S>& y0, const View2<S>& g,
                                  const ParamSet<S>& grad) const {
  check(layers, "the parameters");
  check(grad, "the gradient");
  if (!blockwise()) {
    backward(blocks(layers), s, y0, g, blocks(grad));
    return;
  }
  check(blocks(layers), s, y0, g, "g", "the parameters");
  if (dims_.layers == 0) {
    grad.fill_zero();
    return;
  }
  backward_blockwise(layers, s, y0, g, grad);
}

// The engines' own per-layer E3 (AdjointExactLayer; the layers' parameter type
// selects the kind's backward): the layer inputs y_0 (a copy of the caller's)
// .. y_{K-1} recomputed into a store that keeps nothing else, then layer by
// layer from K-1 down, each layer's activations recomputed by the store.
template <class S, class K>
void StackAdjoint<S, K>::backward_window(const Blocks& blocks, const SeqShape& s, const View2<S>& y0,
                                         const View2<S>& g, const Blocks& grad) const {
  const auto& d = dims_;
  const int L = int(d.layers);
  const ExecSpace exec;
  const auto layer = make_layer_adjoint<S>(opts_);
  ActivationStore<S> store(s, d, 0, L, layer->store(), false);
  Kokkos::deep_copy(exec, store.input(0), y0);
  {
    const auto act = K::template make_block_acts<S>(s, d);  // freed before the backward's own
    for (int k = 0; k < L - 1; ++k)
      K::forward_window(blocks[std::size_t(k)], d, s, store.input(k), act, store.input(k + 1), exec);
  }
  store.release_output();
  for (int k = L - 1; k >= 0; --k) {
    layer->backward(blocks[std::size_t(k)], d, k, store, g, grad[std::size_t(k)]);
    store.release(k);
  }
  layer->release();
  exec.fence();
}

// The block-wise engine's pass over the layer range [0, K) without embedding
// and head (BlockwiseEngine::compute_range), fed by the whole-stack links.
template <class S, class K>
void StackAdjoint<S, K>::backward_blockwise(const ParamSet<S>& layers, const SeqShape& s, const View2<S>& y0,
                                            const View2<S>& g, const ParamSet<S>& grad) const {
  BlockwiseEngine<S> engine(opts_);
  const ExecSpace& exec = engine.execution_space();
  const TokenBlocks tb(engine.block_length(s.T), s.T);
  engine.compute_range(layers, stack_tokens<K>(s), s.rows(), tb,
                       whole_stack_links(y0, g, s, tb, K::stack_input_again, exec), nullptr, grad);
  exec.fence();
}

#define ASH_INSTANTIATE(K)               \
  template class StackAdjoint<float, K>; \
  template class StackAdjoint<double, K>;
ASH_FOR_EACH_LAYER_KIND(ASH_INSTANTIATE)
#undef ASH_INSTANTIATE

}  // namespace ash
