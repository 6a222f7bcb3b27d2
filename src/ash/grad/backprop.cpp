#include "ash/grad/backprop.hpp"

#include <utility>
#include <vector>

#include "ash/model/head.hpp"

namespace ash {

template <class S>
double BackpropEngine<S>::compute(const ParamSet<S>& params, const TokenView& x, const ParamSet<S>& grad) {
  const auto& d = params.dims();
  const SeqShape s{index_t(x.extent(0)), index_t(x.extent(1))};
  // Forward, storing y_k and every intermediate of every layer.
  std::vector<View2<S>> ys;
  std::vector<LayerActivations<S>> acts;
  ys.emplace_back("ash::e1::y0", s.rows(), d.width);
  embedding_forward(params.global().embedding, x, ys[0]);
  for (int k = 0; k < d.layers; ++k) {
    acts.emplace_back(s, d, /*store_state=*/true);
    ys.emplace_back("ash::e1::y", s.rows(), d.width);
    ssm_layer_forward(params.layer(k), s, ys[k], acts[k], ys[k + 1]);
  }
  grad.fill_zero();
  const auto gglobal = grad.global();
  View2<S> g("ash::e1::g", s.rows(), d.width);
  View2<S> g_in("ash::e1::g_in", s.rows(), d.width);
  const double loss = head_loss<S>(params.global(), x, ys[d.layers], g, &gglobal, opts_.head_chunk);
  for (int k = d.layers - 1; k >= 0; --k) {
    ssm_layer_backward(params.layer(k), s, ys[k], acts[k], g, grad.layer(k), g_in, opts_.detach_inputs);
    std::swap(g, g_in);
    acts.pop_back();  // free as we go
  }
  embedding_backward(x, g, gglobal.embedding);
  return loss;
}

template class BackpropEngine<float>;
template class BackpropEngine<double>;

}  // namespace ash
