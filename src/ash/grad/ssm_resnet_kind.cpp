#include "ash/grad/ssm_resnet_kind.hpp"

#include "ash/grad/adjoint_exact.hpp"

namespace ash {

template <class S>
void SsmResNetKind::backward_block(AdjointExactLayer<S>& e3, const Params<S>& p, const ModelDims&, const SeqShape& s,
                                   const View2<S>& y, const View2<S>& g, const State<S>& before, bool zero_before,
                                   Carry<S>& carry, bool carries, const Params<S>& grad) {
  e3.backward_block(p, s, y, g, zero_before ? View2<S>() : before.h, carries ? &carry.mu : nullptr, grad);
}

template <class S>
void SsmResNetKind::block_carry_map(AdjointExactLayer<S>& e3, const Params<S>& p, const SeqShape& s, const View2<S>& y,
                                    const View2<S>& g, const View3<S>& M, const View3<S>& v) {
  e3.block_carry_map(p, s, y, g, M, v);
}

template <class S>
void SsmResNetKind::backward_window_range(AdjointExactLayer<S>& e3, const Params<S>& p, const ModelDims&,
                                          const SeqShape& s_ext, const View2<S>& y_ext, const View2<S>& g_ext,
                                          const State<S>& before, index_t own_T, Carry<S>&, const Params<S>& grad) {
  e3.backward_window_range(p, s_ext, y_ext, g_ext, before.h, own_T, grad);
}

template <class S>
void SsmResNetKind::backward_window(const Params<S>& p, const ModelDims&, ActivationStore<S>& store, int k,
                                    const View2<S>& g, bool detach, const FormMu<S>& form_mu, const View3<S>& mu,
                                    const Workspace<S>& work, Scratch<S>&, const Params<S>& grad,
                                    const ExecSpace& exec) {
  const auto& s = store.shape();
  const auto& act = store.kept(k);
  form_mu(act, g);
  ssm_layer_backward_rows(p, s, store.input(k), act, g, BlockRows{s.T, s.T, 0}, mu, act.hprev, act.A,
                          work.cotangents(), grad, g, detach, exec);
}

template <class S>
void SsmResNetKind::backward_exact(AdjointExactLayer<S>& e3, const Params<S>& p, const ModelDims&, int k,
                                   ActivationStore<S>& store, const View2<S>& g, const Params<S>& grad) {
  const auto& act = store.activations(p, k, e3.execution_space());
  e3.run(p, store.shape(), store.input(k), act, g, View2<S>(), nullptr, grad);
}

WorkspaceSpec SsmResNetKind::state_spec(const ModelDims& d, index_t Bt, std::size_t elem) {
  return WorkspaceSpec().add("ash::blockwise::h_run", elem, {Bt * d.width, d.state}, true);
}

WorkspaceSpec SsmResNetKind::block_states_spec(const ModelDims& d, index_t Bt, index_t blocks, std::size_t elem) {
  return WorkspaceSpec().add("ash::blockwise::h_block_start", elem, {blocks, Bt * d.width, d.state}, true);
}

WorkspaceSpec SsmResNetKind::acts_spec(const ModelDims& d, index_t rows, bool h_and_A, std::size_t elem) {
  return WorkspaceSpec().activations(rows, d.width, d.state, h_and_A, elem);
}

WorkspaceSpec SsmResNetKind::carry_spec(const ModelDims&, index_t, std::size_t) { return WorkspaceSpec(); }

WorkspaceSpec SsmResNetKind::cotangents_spec(const ModelDims&, index_t, bool, std::size_t) { return WorkspaceSpec(); }

PlanRows SsmResNetKind::exact_block_rows(const EngineOptions& o, const ModelDims& d, index_t Bt, index_t T, bool halo,
                                         std::size_t elem) {
  const LayerShape sh = scan_layer_shape(d, Bt, T, elem);
  return {{"E3 block projections", adjoint_exact_block_workspace(sh)},
          {"E3 wave scratch", adjoint_exact_workspace(o, sh, halo), true}};
}

PlanRows SsmResNetKind::exact_window_rows(const EngineOptions& o, const ModelDims& d, index_t Bt, index_t T,
                                          std::size_t elem) {
  return {{"E3 wave scratch", adjoint_exact_workspace(o, scan_layer_shape(d, Bt, T, elem))}};
}

#define ASH_INSTANTIATE(S)                                                                                      \
  template void SsmResNetKind::backward_block<S>(AdjointExactLayer<S>&, const Params<S>&, const ModelDims&,      \
                                                 const SeqShape&, const View2<S>&, const View2<S>&,              \
                                                 const State<S>&, bool, Carry<S>&, bool, const Params<S>&);      \
  template void SsmResNetKind::block_carry_map<S>(AdjointExactLayer<S>&, const Params<S>&, const SeqShape&,       \
                                                  const View2<S>&, const View2<S>&, const View3<S>&,             \
                                                  const View3<S>&);                                              \
  template void SsmResNetKind::backward_window_range<S>(                                                        \
      AdjointExactLayer<S>&, const Params<S>&, const ModelDims&, const SeqShape&, const View2<S>&,               \
      const View2<S>&, const State<S>&, index_t, Carry<S>&, const Params<S>&);                                   \
  template void SsmResNetKind::backward_window<S>(const Params<S>&, const ModelDims&, ActivationStore<S>&, int,  \
                                                  const View2<S>&, bool, const FormMu<S>&, const View3<S>&,      \
                                                  const Workspace<S>&, Scratch<S>&, const Params<S>&,            \
                                                  const ExecSpace&);                                             \
  template void SsmResNetKind::backward_exact<S>(AdjointExactLayer<S>&, const Params<S>&, const ModelDims&, int, \
                                                 ActivationStore<S>&, const View2<S>&, const Params<S>&);
ASH_INSTANTIATE(float)
ASH_INSTANTIATE(double)
#undef ASH_INSTANTIATE

}  // namespace ash
