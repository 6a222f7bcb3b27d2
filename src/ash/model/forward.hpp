#pragma once
// The forward pass of DESIGN.md §1 (the paper's Alg. 1, evaluation mode).
#include <vector>

#include "ash/model/head.hpp"

namespace ash {

// Loss only, one layer's activations alive at a time (the memory floor of a forward).
template <class S>
double forward_loss(const ParamSet<S>& params, const TokenView& x, index_t head_chunk = 1024);

// What a gradient engine keeps from its forward pass.
template <class S>
struct ForwardTape {
  std::vector<View2<S>> ys;                  // y_0 .. y_K, [M, P] each
  std::vector<LayerActivations<S>> acts;     // per layer (empty unless kept)
  View2<S> g;                                // g^t = ∂L/∂y_K^t [M, P] (0 on each window's last token)
  double loss = 0;
};

// Forward storing every y_k, and per layer the activations `store` asks for
// when keep_acts (E1, E2); the head adds ∂L/∂Ω and ∂L/∂w_f to *head_grad.
template <class S>
ForwardTape<S> forward_tape(const ParamSet<S>& params, const TokenView& x, const GlobalParams<S>* head_grad,
                            typename LayerActivations<S>::Store store, bool keep_acts, index_t head_chunk = 1024);

}  // namespace ash
