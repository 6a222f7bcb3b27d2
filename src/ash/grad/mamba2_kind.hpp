#pragma once
// The Mamba-2 layer kind (model.arch = "mamba2", docs/design.md §1,
// transformers' Mamba2Block, n_groups = 1): the SSD block to the engines
// through the Mamba kind's members, which run its block (model/mamba2_layer.hpp)
// by overload. The state, carries and scratch are MambaKind's, sized by the
// model (the conv's state and carry over C = E + 2N channels, h over E); its own
// are its name, its parameter type and views, and the gated norm's place: the
// gate's VJP reads s, so E3 forms a block's activations through the gate.
#include "ash/grad/mamba_kind.hpp"

namespace ash {

struct Mamba2Kind : MambaKind {
  static constexpr const char* name = "mamba2";
  template <class S>
  using Params = Mamba2LayerParams<S>;
  template <class S>
  static Params<S> layer(const ParamSet<S>& ps, int k) {
    return ps.mamba2_layer(k);
  }
  // f(name, view, rows, cols) for every view of a block's parameters (cols -1: a vector).
  template <class S, class F>
  static void for_each_tensor(const Params<S>& p, const ModelDims& d, F&& f) {
    const index_t D = d.width, E = d.inner(), C = d.conv_dim(), H = d.head_count(), Kc = d.conv_kernel;
    f("norm", p.norm, D, index_t(-1));
    f("in_proj (z rows)", p.in_z, E, D);
    f("in_proj (x, B, C rows)", p.in_xbc, C, D);
    f("in_proj (dt rows)", p.in_dt, H, D);
    f("conv_weight", p.conv_weight, C, Kc);
    f("conv_bias", p.conv_bias, C, index_t(-1));
    f("dt_bias", p.dt_bias, H, index_t(-1));
    f("A_log", p.A_log, H, index_t(-1));
    f("D", p.D, H, index_t(-1));
    f("gated_norm", p.gated_norm, E, index_t(-1));
    f("out_proj", p.out_proj, D, E);
  }

  // E3 on a whole window in the SSD's chunked matrix form (model/ssd_scan.hpp):
  // the block's activations through the gate, the gate's VJP, the scan's VJP
  // chunk by chunk (GEMMs per chunk and head, the chunk states kept), the dense
  // VJPs. Token blocks and windows keep MambaKind's wave form (their carries are
  // per channel).
  template <class S, class P>
  static void backward_exact(AdjointExactLayer<S>& e3, const P& p, const ModelDims& d, int k,
                             ActivationStore<S>& store, const View2<S>& g, const P& grad);
  // backward_exact's buffers beside the kept activations: the cotangents and the SSD plan's.
  static PlanRows exact_window_rows(const EngineOptions& o, const ModelDims& d, index_t Bt, index_t T,
                                    std::size_t elem);
};

}  // namespace ash
