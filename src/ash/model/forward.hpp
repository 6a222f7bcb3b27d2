#pragma once
// The forward pass of DESIGN.md §1 in evaluation mode: loss only, with one
// layer's activations alive at a time (the memory floor of a forward).
#include "ash/model/head.hpp"

namespace ash {

template <class S>
double forward_loss(const ParamSet<S>& params, const TokenView& x, index_t head_chunk = 1024);

}  // namespace ash
