#pragma once
// The Mamba-2 layer kind (model.arch = "mamba2", docs/design.md §1,
// transformers' Mamba2Block): the SSD block to the engines through the Mamba
// kind's members, which run its block (model/mamba2_layer.hpp) by overload. The
// state and scratch are MambaKind's, sized by the model (the conv's state over
// C = E + 2GN channels, h over E); its own are its name, its parameter type and
// views, and E3 in the SSD's chunked form (whole windows and token blocks, with
// its own carry): the gated norm reads s, so E3 forms a block's activations
// through the gate.
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

  // E3 on a token block in the SSD's chunked form: the carry between blocks is
  // ∂L/∂ the block's end state, h over E channels [Bt·E, N] (SsdScan's R), and
  // ∂L/∂ the conv state; the block's forward again from `before`, the gate's
  // VJP, the SSD's reverse mode from `before`'s h, the dense VJPs with the conv's
  // carry. A window T̄ (grad.truncate) and e3_fused = false keep MambaKind's wave
  // form, with its μ/A carry: the carry holds both.
  template <class S>
  struct Carry : MambaKind::Carry<S> {
    View2<S> R;  // ∂L/∂ h after the block [Bt·E, N] (zero after the window)
  };
  template <class S>
  static Carry<S> make_carry(const ModelDims& d, index_t Bt) {
    Carry<S> c;
    static_cast<MambaKind::Carry<S>&>(c) = MambaKind::make_carry<S>(d, Bt);
    c.R = make_view2<S>(carry_spec(d, Bt, sizeof(S)).buffers().at(1));
    return c;
  }
  template <class S>
  static Carry<S> make_range_carry(const ModelDims& d, index_t Bt) {
    Carry<S> c = make_carry<S>(d, Bt);
    static_cast<MambaKind::Carry<S>&>(c) = MambaKind::make_range_carry<S>(d, Bt);
    return c;
  }
  template <class S, class F>
  static void for_each_carry_view(Carry<S>& c, F&& f) {
    MambaKind::for_each_carry_view(static_cast<MambaKind::Carry<S>&>(c), f);
    f(c.R);
  }
  template <class S, class F>
  static void for_each_window_carry_view(Carry<S>& c, F&& f) {
    f(c.gconv);
  }
  template <class S>
  static void carry_arrived(Carry<S>& c, bool from_next_range) {
    MambaKind::carry_arrived(static_cast<MambaKind::Carry<S>&>(c), from_next_range);
  }

  template <class S, class P>
  static void backward_block(AdjointExactLayer<S>& e3, const P& p, const ModelDims& d, const SeqShape& s,
                             const View2<S>& y, const View2<S>& g, const State<S>& before, bool zero_before,
                             Carry<S>& carry, bool carries, const P& grad);
  template <class S, class P>
  static void backward_window_range(AdjointExactLayer<S>& e3, const P& p, const ModelDims& d,
                                    const SeqShape& s_ext, const View2<S>& y_ext, const View2<S>& g_ext,
                                    const State<S>& before, index_t own_T, Carry<S>& carry, const P& grad);
  // A block's SSD forward depends on where the block starts (its chunks do):
  // a range cut inside one of one process's blocks replays it.
  static constexpr bool replays_cut_block = true;
  static WorkspaceSpec carry_spec(const ModelDims& d, index_t Bt, std::size_t elem);  // make_carry's
  static PlanRows exact_block_rows(const EngineOptions& o, const ModelDims& d, index_t Bt, index_t T, bool halo,
                                   std::size_t elem);

  // E3 on a whole window in the SSD's chunked matrix form (model/ssd_scan.hpp):
  // the block's activations through the gate, the gate's VJP, the scan's VJP
  // chunk by chunk (GEMMs per chunk and head, the chunk states kept), the dense
  // VJPs.
  template <class S, class P>
  static void backward_exact(AdjointExactLayer<S>& e3, const P& p, const ModelDims& d, int k,
                             ActivationStore<S>& store, const View2<S>& g, const P& grad);
  // backward_exact's buffers beside the kept activations: the cotangents and the SSD plan's.
  static PlanRows exact_window_rows(const EngineOptions& o, const ModelDims& d, index_t Bt, index_t T,
                                    std::size_t elem);
};

}  // namespace ash
