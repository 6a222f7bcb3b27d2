#include "ash/grad/mamba2_kind.hpp"

#include "ash/grad/adjoint_exact.hpp"

namespace ash {

namespace {

// A Mamba-2's SSD plan's buffers (SsdScan's) as a WorkspaceSpec (rank 1 extents as [1, n]).
WorkspaceSpec ssd_spec(const ModelDims& d, index_t Bt, index_t T, std::size_t elem) {
  WorkspaceSpec ssd;
  const SsdShape sh{Bt, T, d.head_count(), d.head_dim, d.n_groups, d.state, ssd_chunk(T)};
  for (const SsdBuffer& b : ssd_buffers(sh, true)) {
    std::vector<index_t> e = b.extents;
    if (e.size() == 1) e.insert(e.begin(), 1);  // WorkspaceSpec's buffers are of rank 2 or 3
    ssd.add(b.label, b.label == "ash::ssd::seg" ? sizeof(index_t) : elem, e, true);
  }
  ssd.add("ash::mamba2::head_grads", elem, {1, 2 * d.head_count()}, true);
  return ssd;
}

}  // namespace

template <class S, class P>
void Mamba2Kind::backward_exact(AdjointExactLayer<S>& e3, const P& p, const ModelDims& d, int k,
                                ActivationStore<S>& store, const View2<S>& g, const P& grad) {
  const SeqShape& s = store.shape();
  const EngineOptions& o = e3.options();
  // A window T̄ < T (μ summed over T̄ tokens, not a chunk recurrence) and
  // e3_fused = false (the tests' reference form) take MambaKind's wave form.
  if (!o.e3_fused || (o.truncate > 0 && o.truncate < s.T)) {
    MambaKind::backward_exact(e3, p, d, k, store, g, grad);
    return;
  }
  const ExecSpace& exec = e3.execution_space();
  const auto& act = store.mamba_activations(p, k, exec, MambaUpTo::gate);
  const auto& cot = e3.scratch().template get<MambaKind>().cotangents(s.rows(), d, false);
  mamba_gate_backward_first(p, act, g, cot, exec);
  mamba2_scan_backward_chunked(p, d, s, act, cot, grad, exec);
  mamba_gate_backward_second(p, act, g, cot, grad, exec);
  mamba2_mixer_backward_dense_chunked(p, d, s, store.input(k), act, cot, grad, o.detach_inputs ? View2<S>() : g,
                                      exec);
}

template <class S, class P>
void Mamba2Kind::backward_block(AdjointExactLayer<S>& e3, const P& p, const ModelDims& d, const SeqShape& s,
                                const View2<S>& y, const View2<S>& g, const State<S>& before, bool, Carry<S>& carry,
                                bool carries, const P& grad) {
  const EngineOptions& o = e3.options();
  if (!o.e3_fused || o.truncate > 0) {  // the wave form (its μ carry in the base)
    MambaKind::backward_block(e3, p, d, s, y, g, before, false, static_cast<MambaKind::Carry<S>&>(carry), carries,
                              grad);
    return;
  }
  const ExecSpace& exec = e3.execution_space();
  const MambaActivations<S>& act = replay_block(e3, p, d, s, y, before);
  const auto& cot = e3.scratch().template get<MambaKind>().cotangents(s.rows(), d, false);
  mamba_gate_backward_first(p, act, g, cot, exec);
  mamba2_scan_backward_chunked(p, d, s, act, cot, grad, exec, before.ssm, carries ? carry.R : View2<S>());
  mamba_gate_backward_second(p, act, g, cot, grad, exec);
  mamba2_mixer_backward_block_chunked(p, d, s, y, act, cot, grad, o.detach_inputs ? View2<S>() : g, before.conv,
                                      carry.gconv, exec);
}

template <class S, class P>
void Mamba2Kind::backward_window_range(AdjointExactLayer<S>& e3, const P& p, const ModelDims& d,
                                       const SeqShape& s_ext, const View2<S>& y_ext, const View2<S>& g_ext,
                                       const State<S>& before, index_t own_T, Carry<S>& carry, const P& grad) {
  MambaKind::backward_window_range(e3, p, d, s_ext, y_ext, g_ext, before, own_T,
                                   static_cast<MambaKind::Carry<S>&>(carry), grad);
}

WorkspaceSpec Mamba2Kind::carry_spec(const ModelDims& d, index_t Bt, std::size_t elem) {
  return MambaKind::carry_spec(d, Bt, elem).add("ash::ssd::state_carry", elem, {Bt * d.inner(), d.state}, true);
}

PlanRows Mamba2Kind::exact_block_rows(const EngineOptions& o, const ModelDims& d, index_t Bt, index_t T, bool halo,
                                      std::size_t elem) {
  if (halo || !o.e3_fused || o.truncate > 0) return MambaKind::exact_block_rows(o, d, Bt, T, halo, elem);  // waves
  WorkspaceSpec act = acts_spec(d, Bt * T, false, elem);
  return {{"E3 block activations + state copy", act.append(state_spec(d, Bt, elem))},
          {"cotangents (one block)", cotangents_spec(d, Bt * T, false, elem)},
          {"E3 SSD chunk states and operands (one block)", ssd_spec(d, Bt, T, elem)}};
}

PlanRows Mamba2Kind::exact_window_rows(const EngineOptions& o, const ModelDims& d, index_t Bt, index_t T,
                                       std::size_t elem) {
  if (!o.e3_fused || (o.truncate > 0 && o.truncate < T)) return MambaKind::exact_window_rows(o, d, Bt, T, elem);
  return {{"cotangents (whole window)", cotangents_spec(d, Bt * T, false, elem)},
          {"E3 SSD chunk states and operands", ssd_spec(d, Bt, T, elem)}};
}

#define ASH_INSTANTIATE(S)                                                                                      \
  template void Mamba2Kind::backward_exact<S, Mamba2LayerParams<S>>(                                            \
      AdjointExactLayer<S>&, const Mamba2LayerParams<S>&, const ModelDims&, int, ActivationStore<S>&,           \
      const View2<S>&, const Mamba2LayerParams<S>&);                                                            \
  template void Mamba2Kind::backward_block<S, Mamba2LayerParams<S>>(                                            \
      AdjointExactLayer<S>&, const Mamba2LayerParams<S>&, const ModelDims&, const SeqShape&, const View2<S>&,   \
      const View2<S>&, const State<S>&, bool, Carry<S>&, bool, const Mamba2LayerParams<S>&);                    \
  template void Mamba2Kind::backward_window_range<S, Mamba2LayerParams<S>>(                                     \
      AdjointExactLayer<S>&, const Mamba2LayerParams<S>&, const ModelDims&, const SeqShape&, const View2<S>&,   \
      const View2<S>&, const State<S>&, index_t, Carry<S>&, const Mamba2LayerParams<S>&);
ASH_INSTANTIATE(float)
ASH_INSTANTIATE(double)
#undef ASH_INSTANTIATE

}  // namespace ash
