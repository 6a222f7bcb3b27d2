#pragma once
// The SSM-ResNet layer kind (model.arch = "ssm-resnet", docs/design.md §1): what
// the kind-generic engines ask of a layer (kind_interface.hpp lists the
// members; this file is their reference). Its recurrent state is h [Bt·P, N];
// its scan core is the layer itself (the cotangent of the scan's output is g);
// E3's backward is AdjointExactLayer's own (run: the fused or wave form).
#include "ash/grad/kind_interface.hpp"
#include "ash/grad/workspace.hpp"
#include "ash/model/forward.hpp"

namespace ash {

struct SsmResNetKind {
  static constexpr const char* name = "ssm-resnet";
  template <class S>
  using Params = LayerParams<S>;
  template <class S>
  static Params<S> layer(const ParamSet<S>& ps, int k) {
    return ps.layer(k);
  }
  // f(name, view, rows, cols) for every view of a layer's parameters with the
  // extents a layer of d has (cols -1: a vector).
  template <class S, class F>
  static void for_each_tensor(const Params<S>& p, const ModelDims& d, F&& f) {
    const index_t P = d.width, N = d.state;
    f("norm", p.norm, P, index_t(-1));
    f("W_delta", p.W_delta, P, P);
    f("b_delta", p.b_delta, P, index_t(-1));
    f("A_log", p.A_log, P, N);
    f("W_B", p.W_B, N, P);
    f("W_C", p.W_C, N, P);
    f("D", p.D, P, index_t(-1));
  }

  // A layer's recurrent state over a batch: what a token block runs from.
  template <class S>
  struct State {
    View2<S> h;  // [Bt·P, N]
  };
  template <class S>
  static State<S> make_state(const ModelDims& d, index_t Bt) {
    return {make_view2<S>(state_spec(d, Bt, sizeof(S)).buffers().at(0))};
  }
  // The states of one layer before each of `blocks` token blocks.
  template <class S>
  struct BlockStates {
    View3<S> h;  // [blocks, Bt·P, N]
    BlockStates(const ModelDims& d, index_t Bt, index_t blocks)
        : h(make_view3<S>(block_states_spec(d, Bt, blocks, sizeof(S)).buffers().at(0))) {}
    State<S> at(index_t j) const { return {Kokkos::subview(h, j, Kokkos::ALL(), Kokkos::ALL())}; }
  };
  template <class S>
  static void copy(const ExecSpace& exec, const State<S>& to, const State<S>& from) {
    Kokkos::deep_copy(exec, to.h, from.h);
  }
  // data.carry_state's view of the layer ([Bt·P, N], check_carried_state's) and the state.
  template <class S>
  static void from_carried(const View2<S>& carried, const State<S>& st, const ExecSpace& exec) {
    Kokkos::deep_copy(exec, st.h, carried);
  }
  template <class S>
  static void to_carried(const State<S>& st, const View2<S>& carried, const ExecSpace& exec) {
    Kokkos::deep_copy(exec, carried, st.h);
  }

  // One token block's activations, the forward's scratch (projections only).
  template <class S>
  using BlockActs = LayerActivations<S>;
  template <class S>
  static BlockActs<S> make_block_acts(const SeqShape& s, const ModelDims& d) {
    return BlockActs<S>(s, d, LayerActivations<S>::projections_only);
  }
  // The forward of one token block from st, which then holds the state after it.
  template <class S>
  static void forward_block(const Params<S>& p, const ModelDims&, const SeqShape& s, const View2<S>& y,
                            const BlockActs<S>& act, const View2<S>& yo, const State<S>& st, const ExecSpace& exec) {
    ssm_layer_forward(p, s, y, first_rows(act, s.rows()), yo, st.h, exec);
  }

  // A whole window's forward from h = 0 (nothing kept but act's projections).
  template <class S>
  static void forward_window(const Params<S>& p, const ModelDims&, const SeqShape& s, const View2<S>& y,
                             const BlockActs<S>& act, const View2<S>& yo, const ExecSpace& exec) {
    ssm_layer_forward(p, s, y, act, yo, View2<S>(), exec);
  }

  // What a token block's backward hands to the block before it.
  template <class S>
  struct Carry {
    ExactCarry<S> mu;  // μ and A at the block's first token (E3 allocates it at a layer's first block)
  };
  template <class S>
  static Carry<S> make_carry(const ModelDims&, index_t) {
    return {};
  }
  // E3 on one token block (blocks last to first): g is g_k in, g_{k-1} out.
  // zero_before: the block starts the window from h = 0 (before unread);
  // carries: the window has several blocks (else no μ carry is formed).
  template <class S>
  static void backward_block(AdjointExactLayer<S>& e3, const Params<S>& p, const ModelDims& d, const SeqShape& s,
                             const View2<S>& y, const View2<S>& g, const State<S>& before, bool zero_before,
                             Carry<S>& carry, bool carries, const Params<S>& grad);

  // A sequence rank's pass (dist::SequenceBlockwise): the state's views in a
  // fixed order, what a range sends the next one (one message each).
  template <class S, class F>
  static void for_each_view(const State<S>& st, F&& f) {
    f(st.h);
  }
  // The state a token range ends with is an affine map of the state before it,
  // and μ's carry it hands back one of the carry after it (c_before = M ⊙
  // c_after + v, block_carry_map): the ranges of a sequence scan their maps at
  // once (exscan_affine), forward without a lever and backward, so no carry goes
  // range to range.
  static constexpr bool range_maps = true;
  // μ's carry map of one token block (layer input y, cotangent g) into M and v [Bt, P, N].
  template <class S>
  static void block_carry_map(AdjointExactLayer<S>& e3, const Params<S>& p, const SeqShape& s, const View2<S>& y,
                              const View2<S>& g, const View3<S>& M, const View3<S>& v);
  // A range that starts inside one of one process's token blocks backpropagates
  // from the state one process's replay of that block reaches at its first
  // token (sent by the range before), whatever run.storage.
  static constexpr bool replays_cut_block = true;
  // The window T̄ on a range + halo: nothing but the halo
  // crosses ranges, so no carry view goes range to range.
  template <class S, class F>
  static void for_each_window_carry_view(Carry<S>&, F&&) {}
  template <class S>
  static void backward_window_range(AdjointExactLayer<S>& e3, const Params<S>& p, const ModelDims& d,
                                    const SeqShape& s_ext, const View2<S>& y_ext, const View2<S>& g_ext,
                                    const State<S>& before, index_t own_T, Carry<S>& carry, const Params<S>& grad);

  // What the kind keeps from layer to layer of a pass (nothing: the methods' workspaces hold it all).
  template <class S>
  struct Scratch {
    void release() {}
  };
  // The shape of the scan core's buffers (a method's workspace): P channels of N states.
  template <class S>
  static LayerShape scan_shape(const SeqShape& s, const ModelDims& d) {
    return LayerShape{s.batch, s.T, d.width, d.state, sizeof(S)};
  }
  // Whether a whole-window method's workspace holds the cotangents of the scan's rows.
  static constexpr bool window_cotangents = true;
  // E1 and E2 on layer k over the whole window from the kept activations:
  // form_mu fills mu from the scan's activations and g, then the per-token and
  // dense VJPs (g → g_{k-1} unless detach).
  template <class S>
  static void backward_window(const Params<S>& p, const ModelDims& d, ActivationStore<S>& store, int k,
                              const View2<S>& g, bool detach, const FormMu<S>& form_mu, const View3<S>& mu,
                              const Workspace<S>& work, Scratch<S>& sc, const Params<S>& grad, const ExecSpace& exec);
  // E3 on layer k over the whole window (exact, detached or windowed, the method's options).
  template <class S>
  static void backward_exact(AdjointExactLayer<S>& e3, const Params<S>& p, const ModelDims& d, int k,
                             ActivationStore<S>& store, const View2<S>& g, const Params<S>& grad);

  // How a layer stack alone (grad/stack_adjoint.hpp) runs its backward: the
  // block-wise engine always (token blocks, levers or not), reading the
  // caller's y_0 again rather than keeping it in the storage format.
  static constexpr bool stack_whole_window = false;
  static constexpr bool stack_input_again = true;

  // ---- Workspace specs: what the kind allocates, in scalars of elem bytes (ssm_resnet_kind.cpp) ----
  // The allocations above are made from them or checked against them
  // (unit_tests/test_memory_plan.cpp); the memory planner sums them.
  static LayerShape scan_layer_shape(const ModelDims& d, index_t Bt, index_t T, std::size_t elem) {
    return LayerShape{Bt, T, d.width, d.state, elem};
  }
  static WorkspaceSpec state_spec(const ModelDims& d, index_t Bt, std::size_t elem);  // make_state
  static WorkspaceSpec block_states_spec(const ModelDims& d, index_t Bt, index_t blocks, std::size_t elem);
  // make_block_acts of `rows` tokens; h_and_A: a whole window's kept activations (E1, E2: with h^{t-1} and A).
  static WorkspaceSpec acts_spec(const ModelDims& d, index_t rows, bool h_and_A, std::size_t elem);
  static WorkspaceSpec carry_spec(const ModelDims& d, index_t Bt, std::size_t elem);  // make_carry: none
  // Scratch's cotangents of `rows` tokens: none (the methods' workspaces hold the layer's).
  static WorkspaceSpec cotangents_spec(const ModelDims& d, index_t rows, bool scan_partials, std::size_t elem);
  // What backward_block's E3 holds from a layer's first block on (blocks of T
  // tokens; halo: a window's range with a halo after its own tokens): the
  // block's projections and the wave scratch of AdjointExactLayer::run.
  static PlanRows exact_block_rows(const EngineOptions& o, const ModelDims& d, index_t Bt, index_t T, bool halo,
                                   std::size_t elem);
  static PlanRows exact_window_rows(const EngineOptions& o, const ModelDims& d, index_t Bt, index_t T,
                                    std::size_t elem);  // backward_exact's (beside the kept projections)
  static constexpr PlanStyle plan_style{"layer",
                                        false,
                                        "states at block starts (K x blocks)",
                                        false,
                                        "block projections + running state",
                                        "block activations (in, out)",
                                        "",
                                        "",
                                        "E3 carries (mu, A per layer)",
                                        false,
                                        true};
};

}  // namespace ash
