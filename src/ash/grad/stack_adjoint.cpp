#include "ash/grad/stack_adjoint.hpp"

#include <string>
#include <utility>

#include "ash/core/error.hpp"
#include "ash/kernels/blocks.hpp"
#include "ash/kernels/matmul.hpp"

namespace ash {

namespace {
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
  RangeLinks<S> links;
  links.y_in = [&](index_t j, const View2<S>& y) {
    copy_block_rows(y0, y, BlockRows{blocks.size(j), s.T, blocks.start(j)}, true, exec);
  };
  links.g_in = [&](index_t j, const View2<S>& gb) {
    copy_block_rows(g, gb, BlockRows{blocks.size(j), s.T, blocks.start(j)}, true, exec);
  };
  links.g_out = [&](index_t j, const View2<S>& gb) {
    copy_block_rows(g, gb, BlockRows{blocks.size(j), s.T, blocks.start(j)}, false, exec);
  };
  links.y_out = [](index_t, const View2<S>&) {};  // y_K is not needed: g_K comes from the caller
  links.y_in_again = true;
  // The block pass reads only the shape of the tokens (no embedding, no head)
  // and their document starts, when s has them.
  require(s.docs.x.extent(0) == 0 || (index_t(s.docs.x.extent(0)) == s.batch &&
                                      index_t(s.docs.x.extent(1)) == s.T && s.docs.t0 == 0),
          "StackAdjoint: document starts must be a [batch, T] token view from its first token");
  const TokenView x = s.docs.x.extent(0) > 0 ? s.docs.x : TokenView("ash::stack::no_tokens", s.batch, s.T);
  engine_.compute_range(layers, x, s.rows(), blocks, links, nullptr, grad);
  exec.fence();
}

template class StackAdjoint<float>;
template class StackAdjoint<double>;

}  // namespace ash
