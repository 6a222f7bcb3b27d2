#include "ash/model/forward.hpp"

#include <utility>

namespace ash {

template <class S>
double forward_loss(const ParamSet<S>& params, const TokenView& x, index_t head_chunk) {
  const auto& d = params.dims();
  const SeqShape s{index_t(x.extent(0)), index_t(x.extent(1))};
  View2<S> y("ash::fwd::y", s.rows(), d.width);
  View2<S> y_next("ash::fwd::y_next", s.rows(), d.width);
  embedding_forward(params.global().embedding, x, y);
  LayerActivations<S> act(s, d, LayerActivations<S>::projections_only);
  for (int k = 0; k < d.layers; ++k) {
    ssm_layer_forward(params.layer(k), s, y, act, y_next);
    std::swap(y, y_next);
  }
  return head_loss<S>(params.global(), x, y, View2<S>(), nullptr, head_chunk);
}

template double forward_loss<float>(const ParamSet<float>&, const TokenView&, index_t);
template double forward_loss<double>(const ParamSet<double>&, const TokenView&, index_t);

}  // namespace ash
