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
  const LayerActivations<S> act(s, d, LayerActivations<S>::projections_only);
  for (int k = 0; k < d.layers; ++k) {
    ssm_layer_forward(params.layer(k), s, y, act, y_next);
    std::swap(y, y_next);
  }
  return head_loss<S>(params.global(), x, y, View2<S>(), nullptr, head_chunk);
}

template <class S>
ForwardTape<S> forward_tape(const ParamSet<S>& params, const TokenView& x, const GlobalParams<S>* head_grad,
                            typename LayerActivations<S>::Store store, bool keep_acts, index_t head_chunk) {
  const auto& d = params.dims();
  const SeqShape s{index_t(x.extent(0)), index_t(x.extent(1))};
  ForwardTape<S> tape;
  tape.ys.emplace_back("ash::tape::y0", s.rows(), d.width);
  embedding_forward(params.global().embedding, x, tape.ys[0]);
  LayerActivations<S> scratch;
  if (!keep_acts) scratch = LayerActivations<S>(s, d, store);
  for (int k = 0; k < d.layers; ++k) {
    if (keep_acts) tape.acts.emplace_back(s, d, store);
    tape.ys.emplace_back("ash::tape::y", s.rows(), d.width);
    ssm_layer_forward(params.layer(k), s, tape.ys[k], keep_acts ? tape.acts[k] : scratch, tape.ys[k + 1]);
  }
  tape.g = View2<S>("ash::tape::g", s.rows(), d.width);
  tape.loss = head_loss<S>(params.global(), x, tape.ys[d.layers], tape.g, head_grad, head_chunk);
  return tape;
}

#define ASH_INSTANTIATE(S)                                                                                  \
  template double forward_loss<S>(const ParamSet<S>&, const TokenView&, index_t);                          \
  template ForwardTape<S> forward_tape<S>(const ParamSet<S>&, const TokenView&, const GlobalParams<S>*,     \
                                          typename LayerActivations<S>::Store, bool, index_t);
ASH_INSTANTIATE(float)
ASH_INSTANTIATE(double)

}  // namespace ash
