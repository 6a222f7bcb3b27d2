#pragma once
// The FalconMamba layer kind (model.arch = "falcon_mamba", docs/design.md §1,
// transformers' FalconMambaBlock): a Mamba-1 block whose x_proj outputs δ, B
// and C pass weightless RMSNorms (model/mamba_layer.hpp). Its parameters,
// state, carries and backward forms are the Mamba kind's, run by the same
// members; its own are its name, the parameter type the engines dispatch on,
// and the norms' r [M, 3] in its activations (MambaKind::acts_spec counts
// them for a model with mixer_norms()).
#include "ash/grad/mamba_kind.hpp"

namespace ash {

// A FalconMamba block's parameters: the Mamba block's tensors (the norms have
// no weight), a type of its own so that LayerAdjoint::backward has one
// overload per kind.
template <class S>
struct FalconMambaLayerParams : MambaLayerParams<S> {};

struct FalconMambaKind : MambaKind {
  static constexpr const char* name = "falcon_mamba";
  template <class S>
  using Params = FalconMambaLayerParams<S>;
  template <class S>
  static Params<S> layer(const ParamSet<S>& ps, int k) {
    return Params<S>{ps.mamba_layer(k)};
  }
};

}  // namespace ash
