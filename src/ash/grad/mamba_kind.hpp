#pragma once
// The Mamba layer kind (model.arch = "mamba", docs/design.md §1, transformers'
// MambaBlock; members as kind_interface.hpp lists them), and the members the
// FalconMamba and Mamba-2 kinds take from it: those over a block's parameters
// are templates over its parameter type P, calling the block's functions by
// overload (model/mamba_layer.hpp, model/mamba2_layer.hpp). Its recurrent state
// is MambaState (the conv's last Kc − 1 inputs and h over E channels); its
// scan core runs over E channels with ∂L/∂s (from the gate's VJP) for g; a
// token block's backward carries μ and A over E channels and ∂L/∂ the conv
// state the block read.
#include <memory>

#include "ash/grad/kind_interface.hpp"
#include "ash/grad/workspace.hpp"
#include "ash/model/forward.hpp"

namespace ash {

struct MambaKind {
  static constexpr const char* name = "mamba";
  template <class S>
  using Params = MambaLayerParams<S>;
  template <class S>
  static Params<S> layer(const ParamSet<S>& ps, int k) {
    return ps.mamba_layer(k);
  }
  // f(name, view, rows, cols) for every view of a block's parameters with the
  // extents a block of d has (cols -1: a vector).
  template <class S, class F>
  static void for_each_tensor(const Params<S>& p, const ModelDims& d, F&& f) {
    const index_t D = d.width, E = d.inner(), N = d.state, R = d.rank(), Kc = d.conv_kernel;
    f("norm", p.norm, D, index_t(-1));
    f("in_proj (x rows)", p.in_x, E, D);
    f("in_proj (z rows)", p.in_z, E, D);
    f("conv_weight", p.conv_weight, E, Kc);
    f("conv_bias", p.conv_bias, E, index_t(-1));
    f("x_proj (dt rows)", p.x_dt, R, E);
    f("x_proj (B rows)", p.x_B, N, E);
    f("x_proj (C rows)", p.x_C, N, E);
    f("dt_proj", p.dt_proj, E, R);
    f("dt_bias", p.dt_bias, E, index_t(-1));
    f("A_log", p.A_log, E, N);
    f("D", p.D, E, index_t(-1));
    f("out_proj", p.out_proj, D, E);
  }

  template <class S>
  using State = MambaState<S>;
  template <class S>
  static State<S> make_state(const ModelDims& d, index_t Bt) {
    const WorkspaceSpec w = state_spec(d, Bt, sizeof(S));  // MambaState(Bt, d)'s buffers
    MambaState<S> st;
    st.conv = make_view2<S>(w.buffers().at(0));
    st.ssm = make_view2<S>(w.buffers().at(1));
    st.batch = Bt;
    return st;
  }
  template <class S>
  struct BlockStates {
    View3<S> conv, ssm;  // [blocks, Bt·C, Kc−1], [blocks, Bt·E, N]
    index_t batch = 0;
    BlockStates(const ModelDims& d, index_t Bt, index_t blocks) : batch(Bt) {
      const WorkspaceSpec w = block_states_spec(d, Bt, blocks, sizeof(S));
      conv = make_view3<S>(w.buffers().at(0));
      ssm = make_view3<S>(w.buffers().at(1));
    }
    State<S> at(index_t j) const {
      MambaState<S> st;
      st.conv = Kokkos::subview(conv, j, Kokkos::ALL(), Kokkos::ALL());
      st.ssm = Kokkos::subview(ssm, j, Kokkos::ALL(), Kokkos::ALL());
      st.batch = batch;
      return st;
    }
  };
  template <class S>
  static void copy(const ExecSpace& exec, const State<S>& to, const State<S>& from) {
    Kokkos::deep_copy(exec, to.conv, from.conv);
    Kokkos::deep_copy(exec, to.ssm, from.ssm);
  }
  // data.carry_state's [Bt·E, Kc−1+N] view of the layer and the state.
  template <class S>
  static void from_carried(const View2<S>& carried, const State<S>& st, const ExecSpace& exec) {
    mamba_state_from_carried(carried, st, exec);
  }
  template <class S>
  static void to_carried(const State<S>& st, const View2<S>& carried, const ExecSpace& exec) {
    mamba_state_to_carried(st, carried, exec);
  }

  template <class S>
  using BlockActs = MambaActivations<S>;
  template <class S>
  static BlockActs<S> make_block_acts(const SeqShape& s, const ModelDims& d) {
    return BlockActs<S>(s, d, LayerActivations<S>::projections_only);
  }
  template <class S, class P>
  static void forward_block(const P& p, const ModelDims& d, const SeqShape& s, const View2<S>& y,
                            const BlockActs<S>& act, const View2<S>& yo, const State<S>& st, const ExecSpace& exec) {
    mamba_layer_forward(p, d, s, y, first_rows(act, s.rows()), yo, st, exec);
  }

  // A whole window's forward from a zero state (nothing kept but act).
  template <class S, class P>
  static void forward_window(const P& p, const ModelDims& d, const SeqShape& s, const View2<S>& y,
                             const BlockActs<S>& act, const View2<S>& yo, const ExecSpace& exec) {
    mamba_layer_forward(p, d, s, y, act, yo, exec);
  }

  template <class S>
  struct Carry {
    ExactCarry<S> mu;  // μ and A over E channels at the block's first token
    View2<S> gconv;    // ∂L/∂ the conv state after the block [Bt·E, Kc−1] (zero after the window)
  };
  template <class S>
  static Carry<S> make_carry(const ModelDims& d, index_t Bt) {
    return {ExactCarry<S>(), make_view2<S>(carry_spec(d, Bt, sizeof(S)).buffers().at(0))};
  }
  // E3 on one token block: the block's forward again from `before` (the state
  // the forward started it from; zero_before unread: before is zero then), the
  // gate's VJP, the scan's waves with the μ/A carry over E channels (when
  // carries), the mixer's VJPs with the conv's carry.
  template <class S, class P>
  static void backward_block(AdjointExactLayer<S>& e3, const P& p, const ModelDims& d, const SeqShape& s,
                             const View2<S>& y, const View2<S>& g, const State<S>& before, bool zero_before,
                             Carry<S>& carry, bool carries, const P& grad);
  // E3's replay of a token block (or a range + halo): its forward again, bit for
  // bit the forward's, from `before`, into Scratch's activations (returned); its
  // output lands in the cotangents' ∂ŷ rows, unused until the norm's VJP.
  template <class S, class P>
  static const MambaActivations<S>& replay_block(AdjointExactLayer<S>& e3, const P& p, const ModelDims& d,
                                                 const SeqShape& s, const View2<S>& y, const State<S>& before);

  // A sequence rank's pass (dist::SequenceBlockwise): the state's views in a
  // fixed order, what a range sends the next one: the conv's last Kc − 1
  // inputs (a range shorter than that passes on older ranges' too) and h.
  template <class S, class F>
  static void for_each_view(const State<S>& st, F&& f) {
    f(st.conv);
    f(st.ssm);
  }
  // No range maps (the conv state is no affine map of h): the state goes range
  // to range forward, and per layer backward a reverse wavefront hands the range
  // before every view of the carry its first block leaves (for_each_carry_view:
  // the scatter of ∂L/∂ the conv state onto the range's last inputs, μ and A).
  static constexpr bool range_maps = false;
  // A carry to receive into: every view allocated (the block backward keeps its buffers).
  template <class S>
  static Carry<S> make_range_carry(const ModelDims& d, index_t Bt) {
    Carry<S> c = make_carry<S>(d, Bt);
    c.mu.mu = View3<S>("ash::seqblocks::mamba_carry_mu", Bt, d.inner(), d.state);
    c.mu.A = View3<S>("ash::seqblocks::mamba_carry_A", Bt, d.inner(), d.state);
    return c;
  }
  template <class S, class F>
  static void for_each_carry_view(Carry<S>& c, F&& f) {
    f(c.gconv);
    f(c.mu.mu);
    f(c.mu.A);
  }
  // Whether the carry's views came from a next range (the last range's are zero: μ's carry is then none).
  template <class S>
  static void carry_arrived(Carry<S>& c, bool from_next_range) {
    c.mu.valid = from_next_range;
  }
  // Its block forward run again from a kept state gives the forward's bits, so
  // a range cut inside one of one process's blocks needs that block's replay
  // only when the inputs were rounded to 16 bits (run.storage).
  static constexpr bool replays_cut_block = false;
  // The window T̄ on a token range of a sequence rank (paper mode): the
  // range's own_T tokens per sequence then the next range's first tokens (the
  // halo) in s_ext, y_ext and g_ext (its halo rows are zeroed), from `before`
  // (the state before the range). μ_T̄ of the own tokens reads the halo; only
  // the own tokens add to grad; carry.gconv (for_each_window_carry_view, what
  // goes range to range): in, ∂L/∂ the conv state after the own tokens (the
  // next range's scatter); out, before the range.
  template <class S, class F>
  static void for_each_window_carry_view(Carry<S>& c, F&& f) {
    f(c.gconv);
  }
  template <class S, class P>
  static void backward_window_range(AdjointExactLayer<S>& e3, const P& p, const ModelDims& d,
                                    const SeqShape& s_ext, const View2<S>& y_ext, const View2<S>& g_ext,
                                    const State<S>& before, index_t own_T, Carry<S>& carry, const P& grad);

  // What the kind keeps from layer (and token block) to layer of a pass: the
  // block's cotangents, a token block's activations and the state its forward
  // runs again from.
  template <class S>
  struct Scratch {
    std::unique_ptr<MambaCotangents<S>> cot;
    std::unique_ptr<MambaActivations<S>> act;
    MambaState<S> state;
    // The cotangents of `rows` tokens, allocated on first use (the old ones freed first).
    const MambaCotangents<S>& cotangents(index_t rows, const ModelDims& d, bool scan_partials) {
      if (!cot || index_t(cot->gs.extent(0)) != rows) {
        cot.reset();
        cot = std::make_unique<MambaCotangents<S>>(rows, d, scan_partials);
      }
      return *cot;
    }
    void release() {
      cot.reset();
      act.reset();
      state = MambaState<S>();
    }
  };
  template <class S>
  static LayerShape scan_shape(const SeqShape& s, const ModelDims& d) {
    return LayerShape{s.batch, s.T, d.inner(), d.state, sizeof(S), d.mamba2() ? d.n_groups : 1};
  }
  static constexpr bool window_cotangents = false;  // the scan's are part of MambaCotangents
  template <class S, class P>
  static void backward_window(const P& p, const ModelDims& d, ActivationStore<S>& store, int k,
                              const View2<S>& g, bool detach, const FormMu<S>& form_mu, const View3<S>& mu,
                              const Workspace<S>& work, Scratch<S>& sc, const P& grad, const ExecSpace& exec);
  template <class S, class P>
  static void backward_exact(AdjointExactLayer<S>& e3, const P& p, const ModelDims& d, int k,
                             ActivationStore<S>& store, const View2<S>& g, const P& grad);

  // A layer stack alone (grad/stack_adjoint.hpp): without a memory lever, E3
  // over the whole window block by block; with one, the block-wise engine,
  // which keeps the stack's input y_0 in the storage format.
  static constexpr bool stack_whole_window = true;
  static constexpr bool stack_input_again = false;

  // ---- Workspace specs: what the kind allocates, in scalars of elem bytes (mamba_kind.cpp) ----
  // The allocations above are made from them or checked against them
  // (unit_tests/test_memory_plan.cpp); the memory planner sums them.
  static LayerShape scan_layer_shape(const ModelDims& d, index_t Bt, index_t T, std::size_t elem) {
    return LayerShape{Bt, T, d.inner(), d.state, elem, d.mamba2() ? d.n_groups : 1};
  }
  static WorkspaceSpec state_spec(const ModelDims& d, index_t Bt, std::size_t elem);  // MambaState
  static WorkspaceSpec block_states_spec(const ModelDims& d, index_t Bt, index_t blocks, std::size_t elem);
  // MambaActivations of `rows` tokens: projections only (make_block_acts), or
  // with h^{t-1} and A over E channels (h_and_A: E1's and E2's kept activations).
  static WorkspaceSpec acts_spec(const ModelDims& d, index_t rows, bool h_and_A, std::size_t elem);
  static WorkspaceSpec carry_spec(const ModelDims& d, index_t Bt, std::size_t elem);  // make_carry: the conv's
  // MambaCotangents of `rows` tokens (Scratch::cotangents); without scan_partials the scan's row partials are empty.
  static WorkspaceSpec cotangents_spec(const ModelDims& d, index_t rows, bool scan_partials, std::size_t elem);
  // What backward_block's E3 holds from a layer's first block on (blocks of T
  // tokens, a window's halo included): Scratch's activations, state copy and
  // cotangents, and the scan's wave workspace.
  static PlanRows exact_block_rows(const EngineOptions& o, const ModelDims& d, index_t Bt, index_t T, bool halo,
                                   std::size_t elem);
  static PlanRows exact_window_rows(const EngineOptions& o, const ModelDims& d, index_t Bt, index_t T,
                                    std::size_t elem);  // backward_exact's (beside the kept activations)
  static constexpr PlanStyle plan_style{"block",
                                        true,
                                        "Mamba states at block starts (K x blocks) + running state",
                                        true,
                                        "block activations (one block)",
                                        "block y, next y",
                                        "conv carries (K)",
                                        "conv carry",
                                        "E3 carries (mu, A over E per layer)",
                                        true,
                                        false};
};

}  // namespace ash
