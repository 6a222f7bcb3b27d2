#include "ash/grad/engine.hpp"

#include "ash/core/error.hpp"
#include "ash/core/sizes.hpp"
#include "ash/grad/adjoint.hpp"
#include "ash/grad/adjoint_exact.hpp"
#include "ash/grad/backprop.hpp"
#include "ash/grad/blockwise_engine.hpp"
#include "ash/kernels/matmul.hpp"


namespace ash {

template <class S>
std::unique_ptr<LayerAdjoint<S>> make_layer_adjoint(const EngineOptions& opts) {
  check_grad_numbers(opts);
  switch (opts.method) {
    case Method::backprop: return std::make_unique<BackpropLayer<S>>(opts);
    case Method::adjoint: return std::make_unique<AdjointLayer<S>>(opts);
    case Method::adjoint_exact: return std::make_unique<AdjointExactLayer<S>>(opts);
  }
  throw Error("unknown grad.engine (expected backprop, adjoint or adjoint-exact)");
}

WorkspaceSpec layer_workspace(const EngineOptions& opts, const LayerShape& sh) {
  switch (opts.method) {
    case Method::backprop: return backprop_workspace(opts, sh);
    case Method::adjoint: return adjoint_workspace(opts, sh);
    case Method::adjoint_exact: return adjoint_exact_workspace(opts, sh);
  }
  throw Error("unknown grad.engine (expected backprop, adjoint or adjoint-exact)");
}

template <class S>
LocalEngine<S>::LocalEngine(const EngineOptions& opts) : opts_(opts), layer_(make_layer_adjoint<S>(opts)) {}

template <class S>
double LocalEngine<S>::compute(const ParamSet<S>& params, const TokenView& x, const ParamSet<S>& grad) {
  const MatmulScope matmul(opts_.matmul, sizeof(S));
  const auto& d = params.dims();
  require(params.range().is_all(d) && grad.range().is_all(d), "LocalEngine: needs the whole model");
  const SeqShape s = SeqShape::of(x);
  grad.fill_zero();
  const auto gglobal = grad.global();
  const ExecSpace& exec = layer_->execution_space();
  // With keep_buffers, a call on windows of the last call's shape reuses its
  // layer inputs, g and the layer's workspace (every value is written anew:
  // the forward fills the inputs, the head every row of g); else they are
  // freed as the backward passes them.
  const bool keep = opts_.keep_buffers;
  if (keep && store_ && store_->fits(s, d, 0, int(d.layers)))
    store_->rebind(s);
  else {
    store_.reset();  // the old buffers first
    store_ = std::make_unique<ActivationStore<S>>(s, d, 0, int(d.layers), layer_->store(), layer_->keeps_activations());
  }
  ActivationStore<S>& store = *store_;
  embedding_forward(params.global().embedding, x, store.input(0), exec);
  forward_layers(params, store, exec);
  if (!keep || index_t(g_.extent(0)) != s.rows() || index_t(g_.extent(1)) != index_t(d.width))
    g_ = View2<S>("ash::g", s.rows(), d.width);  // g_K, then g_k in place (unchanged when detached)
  const View2<S> g = g_;
  const double loss = head_loss<S>(params.global(), x, store.output(), g, &gglobal, opts_.head_chunk, 0, exec);
  if (!keep) store.release_output();
  with_layer_kind(d, [&](auto kind) {
    using K = decltype(kind);
    for (int k = int(d.layers) - 1; k >= 0; --k) {
      layer_->backward(K::layer(params, k), d, k, store, g, K::layer(grad, k));
      if (!keep) store.release(k);
    }
  });
  if (!keep) layer_->release();
  embedding_backward(x, g, gglobal.embedding, exec);
  if (!keep) {
    store_.reset();
    g_ = View2<S>();
  }
  return loss;
}

template <class S>
std::unique_ptr<GradientEngine<S>> make_engine(const EngineOptions& opts) {
  if (opts.blockwise_levers()) return std::make_unique<BlockwiseEngine<S>>(opts);
  return std::make_unique<LocalEngine<S>>(opts);
}

template std::unique_ptr<LayerAdjoint<float>> make_layer_adjoint<float>(const EngineOptions&);
template std::unique_ptr<LayerAdjoint<double>> make_layer_adjoint<double>(const EngineOptions&);
template class LocalEngine<float>;
template class LocalEngine<double>;
template std::unique_ptr<GradientEngine<float>> make_engine<float>(const EngineOptions&);
template std::unique_ptr<GradientEngine<double>> make_engine<double>(const EngineOptions&);

}  // namespace ash
