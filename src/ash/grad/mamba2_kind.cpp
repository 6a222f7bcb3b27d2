#include "ash/grad/mamba2_kind.hpp"

#include "ash/grad/adjoint_exact.hpp"

namespace ash {

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
  mamba2_mixer_backward_dense_chunked(p, d, s, store.input(k), act, cot, grad,
                                      e3.options().detach_inputs ? View2<S>() : g, exec);
}

PlanRows Mamba2Kind::exact_window_rows(const EngineOptions& o, const ModelDims& d, index_t Bt, index_t T,
                                       std::size_t elem) {
  if (!o.e3_fused || (o.truncate > 0 && o.truncate < T)) return MambaKind::exact_window_rows(o, d, Bt, T, elem);
  WorkspaceSpec ssd;
  const SsdShape sh{Bt, T, d.head_count(), d.head_dim, d.n_groups, d.state, ssd_chunk(T)};
  for (const SsdBuffer& b : ssd_buffers(sh, true)) {
    std::vector<index_t> e = b.extents;
    if (e.size() == 1) e.insert(e.begin(), 1);  // WorkspaceSpec's buffers are of rank 2 or 3
    ssd.add(b.label, b.label == "ash::ssd::seg" ? sizeof(index_t) : elem, e, true);
  }
  ssd.add("ash::mamba2::head_grads", elem, {1, 2 * d.head_count()}, true);
  return {{"cotangents (whole window)", cotangents_spec(d, Bt * T, false, elem)}, {"E3 SSD chunk states and operands", ssd}};
}

#define ASH_INSTANTIATE(S)                                                                                      \
  template void Mamba2Kind::backward_exact<S, Mamba2LayerParams<S>>(                                            \
      AdjointExactLayer<S>&, const Mamba2LayerParams<S>&, const ModelDims&, int, ActivationStore<S>&,           \
      const View2<S>&, const Mamba2LayerParams<S>&);
ASH_INSTANTIATE(float)
ASH_INSTANTIATE(double)
#undef ASH_INSTANTIATE

}  // namespace ash
