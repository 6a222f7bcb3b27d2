#include "ash/grad/mamba_kind.hpp"

#include "ash/grad/falcon_mamba_kind.hpp"

#include "ash/core/error.hpp"
#include "ash/grad/adjoint_exact.hpp"
#include "ash/kernels/row_sums.hpp"

namespace ash {

namespace impl {  // (external linkage: nvcc refuses a KOKKOS_LAMBDA in a function with internal linkage)

// A Mamba's wave: the scan's cotangents of the wave (row b·W + t - t0) into
// the window's (row b·T + t), for the dense VJPs after the scan. (A named
// function: nvcc takes no KOKKOS_LAMBDA inside a lambda.)
template <class S>
void mamba_wave_rows(const SeqShape& s, const BlockRows& rb, const LayerCotangents<S>& wave, const LayerCotangents<S>& all,
               const ExecSpace& exec) {
  const index_t W = rb.W, t0 = rb.t0, T = s.T, E = all.gz.extent(1), N = all.gbeta.extent(1);
  const View2<S> gz = all.gz, gu = all.gyhat, gb = all.gbeta, gc = all.ggamma;
  const View2<S> wz = wave.gz, wu = wave.gyhat, wb = wave.gbeta, wg = wave.ggamma;
  Kokkos::parallel_for(
      "ash::mamba::e3::wave_rows", Range(exec, 0, s.batch * W), KOKKOS_LAMBDA(const index_t r) {
        const index_t m = (r / W) * T + t0 + r % W;
        for (index_t e = 0; e < E; ++e) {
          gz(m, e) = wz(r, e);
          gu(m, e) = wu(r, e);
        }
        for (index_t n = 0; n < N; ++n) {
          gb(m, n) = wb(r, n);
          gc(m, n) = wg(r, n);
        }
      });
}

// Rows t >= own of every sequence of T rows (a window's halo) set to zero.
template <class S>
void zero_halo_rows(const View2<S>& v, index_t T, index_t own, const ExecSpace& exec) {
  const index_t nh = T - own, B = index_t(v.extent(0)) / T, C = v.extent(1);
  Kokkos::parallel_for(
      "ash::e3::zero_halo_rows", Range(exec, 0, B * nh * C), KOKKOS_LAMBDA(const index_t i) {
        const index_t b = i / (nh * C), t = own + (i / C) % nh, c = i % C;
        v(b * T + t, c) = S(0);
      });
}

}  // namespace impl

namespace {

// E3 on a token block or a window's range + halo (own_T > 0: only the first
// own_T tokens of each sequence contribute; the rest is a halo μ_T̄ reads).
// P: the block's parameters (a Mamba-1 or a Mamba-2 block's, by overload).
template <class S, class P>
void exact_block(AdjointExactLayer<S>& e3, const P& p, const ModelDims& d, const SeqShape& sb, const View2<S>& y_blk,
                 const View2<S>& g_blk, const MambaState<S>& before, ExactCarry<S>* carry, const View2<S>& gconv,
                 const P& grad, index_t own_T) {
  const ExecSpace& exec = e3.execution_space();
  const MambaActivations<S>& act = MambaKind::replay_block(e3, p, d, sb, y_blk, before);
  const auto& cot = e3.scratch().template get<MambaKind>().cotangents(sb.rows(), d, false);
  // The gate's VJP split around the scan (∂L/∂s first, which μ reads, also in
  // a halo): with a halo, its rows' g, ∂L/∂o and scan cotangents are zeroed
  // between, so they add nothing to W_out's gradient or the dense VJPs.
  mamba_gate_backward_first(p, act, g_blk, cot, exec);
  const bool halo = own_T > 0 && own_T < sb.T;
  if (!halo && e3_scan_fused_form(e3.options(), sb.T, MambaKind::scan_layer_shape(d, sb.batch, sb.T, sizeof(S)).groups)) {
    // The replay above gave s; the fused form (or the walk) from the block's start state.
    const ScanFusedFn<S> on_rows = [&](const BlockRows& rb, const LayerCotangents<S>& wc, const ParamPartials<S>& parts) {
      selective_scan_param_sums(act.scan, parts, scan_param_grads(grad, cot), exec);
      impl::mamba_wave_rows(sb, rb, wc, cot.scan, exec);
    };
    adjoint_exact_scan_fused(e3.options(), e3.scan_work(), sb, act.scan, cot.gs, scan_core_D(p, act), on_rows, exec,
                             before.ssm, carry);
  } else {
    const ScanWaveFn<S> on_wave = [&](const BlockRows& rb, const View3<S>& mu, const View3<S>& hprev,
                                      const View3<S>& A, const LayerCotangents<S>& wc) {
      selective_scan_backward_rows(scan_core_D(p, act), sb, act.scan, cot.gs, rb, mu, hprev, A, wc,
                                   scan_param_grads(grad, cot), exec);
      impl::mamba_wave_rows(sb, rb, wc, cot.scan, exec);
    };
    adjoint_exact_scan_waves(e3.options(), e3.scan_work(), sb, act.scan, cot.gs, on_wave, exec, before.ssm, carry,
                             own_T);
  }
  if (own_T > 0 && own_T < sb.T) {
    // A named array, not a braced list in the range-for: nvcc's front end refuses that form.
    const View2<S> halo_rows[] = {g_blk, cot.gz, cot.scan.gz, cot.scan.gyhat, cot.scan.gbeta, cot.scan.ggamma, cot.go};
    for (const View2<S>& v : halo_rows)
      if (v.extent(0) > 0) impl::zero_halo_rows(v, sb.T, own_T, exec);
  }
  mamba_gate_backward_second(p, act, g_blk, cot, grad, exec);
  mamba_mixer_backward_block(p, d, sb, y_blk, act, cot, grad, e3.options().detach_inputs ? View2<S>() : g_blk,
                             before.conv, gconv, own_T, exec);
}

}  // namespace

template <class S, class P>
const MambaActivations<S>& MambaKind::replay_block(AdjointExactLayer<S>& e3, const P& p, const ModelDims& d,
                                                   const SeqShape& s, const View2<S>& y, const State<S>& before) {
  const ExecSpace& exec = e3.execution_space();
  auto& sc = e3.scratch().template get<MambaKind>();
  const index_t rows = s.rows();
  if (!sc.act || index_t(sc.act->x.extent(0)) != rows) {
    sc.act.reset();  // the old ones freed first
    sc.act = std::make_unique<MambaActivations<S>>(s, d, LayerActivations<S>::projections_only);
  }
  if (index_t(sc.state.ssm.extent(0)) != index_t(before.ssm.extent(0))) sc.state = MambaState<S>(s.batch, d);
  const auto& cot = sc.cotangents(rows, d, false);
  // From a copy of the state the block started from (the forward advances the state it is given).
  Kokkos::deep_copy(exec, sc.state.conv, before.conv);
  Kokkos::deep_copy(exec, sc.state.ssm, before.ssm);
  mamba_layer_forward(p, d, s, y, *sc.act, cot.gyhat, sc.state, exec);
  return *sc.act;
}

template <class S, class P>
void MambaKind::backward_block(AdjointExactLayer<S>& e3, const P& p, const ModelDims& d, const SeqShape& s,
                               const View2<S>& y, const View2<S>& g, const State<S>& before, bool, Carry<S>& carry,
                               bool carries, const P& grad) {
  exact_block(e3, p, d, s, y, g, before, carries ? &carry.mu : nullptr, carry.gconv, grad, 0);
}

template <class S, class P>
void MambaKind::backward_window_range(AdjointExactLayer<S>& e3, const P& p, const ModelDims& d, const SeqShape& s_ext,
                                      const View2<S>& y_ext, const View2<S>& g_ext, const State<S>& before,
                                      index_t own_T, Carry<S>& carry, const P& grad) {
  require(e3.options().detach_inputs, "adjoint-exact: a window (grad.truncate) needs grad.detach_inputs");
  require(own_T >= 1 && own_T <= s_ext.T, "adjoint-exact: a range's own tokens must lie in its extended block");
  exact_block<S>(e3, p, d, s_ext, y_ext, g_ext, before, nullptr, carry.gconv, grad, own_T);
}

// E1 and E2: the gate's VJP gives ∂L/∂s, the scan's cotangent; the method's
// μ over E channels; the mixer's VJPs (the block's input detached: g passes on).
template <class S, class P>
void MambaKind::backward_window(const P& p, const ModelDims& d, ActivationStore<S>& store, int k, const View2<S>& g,
                                bool detach, const FormMu<S>& form_mu, const View3<S>& mu, const Workspace<S>&,
                                Scratch<S>& sc, const P& grad, const ExecSpace& exec) {
  const auto& s = store.shape();
  const auto& act = store.kept_mamba(k);
  const auto& cot = sc.cotangents(s.rows(), d, true);
  mamba_gate_backward(p, act, g, cot, grad, exec);
  form_mu(act.scan, cot.gs);
  mamba_mixer_backward(p, d, s, store.input(k), act, mu, cot, grad, detach ? View2<S>() : g, exec);
}

// E3 on a whole window: the scan core in the fused form (or the walk), else
// in waves; detached, the input VJP is skipped (g passes on).
template <class S, class P>
void MambaKind::backward_exact(AdjointExactLayer<S>& e3, const P& p, const ModelDims& d, int k,
                               ActivationStore<S>& store, const View2<S>& g, const P& grad) {
  const SeqShape& s = store.shape();
  const ExecSpace& exec = e3.execution_space();
  // For the waves, the block's activations again only up to the scan's
  // inputs: they replay h^{t-1} and A^t, which give the scan's output s
  // without a second forward scan, and the gate's VJP is split around them
  // (∂L/∂s needs no s). A gate that reads s (a Mamba-2's gated norm) and the
  // fused form take the activations through the gate instead.
  const bool reads_s = gate_reads_s(p);
  const bool fused = e3_scan_fused_form(e3.options(), s.T, scan_layer_shape(d, s.batch, s.T, sizeof(S)).groups);
  const bool upto_gate = reads_s || fused;  // the fused kernels replay no h^{t-1} for s: the forward scan gives it
  const auto& act = store.mamba_activations(p, k, exec, upto_gate ? MambaUpTo::gate : MambaUpTo::scan_inputs);
  const auto& cot = e3.scratch().template get<MambaKind>().cotangents(s.rows(), d, false);
  mamba_gate_backward_first(p, act, g, cot, exec);
  if (fused) {
    const ScanFusedFn<S> on_rows = [&](const BlockRows& rb, const LayerCotangents<S>& wc, const ParamPartials<S>& parts) {
      selective_scan_param_sums(act.scan, parts, scan_param_grads(grad, cot), exec);
      impl::mamba_wave_rows(s, rb, wc, cot.scan, exec);
    };
    adjoint_exact_scan_fused(e3.options(), e3.scan_work(), s, act.scan, cot.gs, scan_core_D(p, act), on_rows, exec);
  } else {
    const ScanWaveFn<S> on_wave = [&](const BlockRows& rb, const View3<S>& mu, const View3<S>& hprev,
                                    const View3<S>& A, const LayerCotangents<S>& wc) {
      if (!reads_s) mamba_scan_output_rows(scan_core_D(p, act), s, act, rb, hprev, A, exec);
      selective_scan_backward_rows(scan_core_D(p, act), s, act.scan, cot.gs, rb, mu, hprev, A, wc,
                                   scan_param_grads(grad, cot), exec);
      impl::mamba_wave_rows(s, rb, wc, cot.scan, exec);
    };
    adjoint_exact_scan_waves(e3.options(), e3.scan_work(), s, act.scan, cot.gs, on_wave, exec);
  }
  mamba_gate_backward_second(p, act, g, cot, grad, exec);  // s complete: o, W_out's gradient, ∂L/∂z
  mamba_mixer_backward_dense(p, d, s, store.input(k), act, cot, grad, e3.options().detach_inputs ? View2<S>() : g,
                             exec);
}

// As MambaState's constructor (model/mamba_layer.cpp) allocates it.
WorkspaceSpec MambaKind::state_spec(const ModelDims& d, index_t Bt, std::size_t elem) {
  return WorkspaceSpec()
      .add("ash::mamba::conv_state", elem, {Bt * d.conv_dim(), d.conv_kernel - 1}, true)
      .add("ash::mamba::ssm_state", elem, {Bt * d.inner(), d.state}, true);
}

WorkspaceSpec MambaKind::block_states_spec(const ModelDims& d, index_t Bt, index_t blocks, std::size_t elem) {
  return WorkspaceSpec()
      .add("ash::lowmem::mamba_conv_start", elem, {blocks, Bt * d.conv_dim(), d.conv_kernel - 1}, true)
      .add("ash::lowmem::mamba_ssm_start", elem, {blocks, Bt * d.inner(), d.state}, true);
}

// As MambaActivations' constructor allocates them: its own Views, then the scan's LayerActivations over E.
WorkspaceSpec MambaKind::acts_spec(const ModelDims& d, index_t rows, bool h_and_A, std::size_t elem) {
  const index_t E = d.inner(), C = d.conv_dim();
  WorkspaceSpec w;
  w.add("ash::mamba::rstd", elem, {rows}, true)
      .add("ash::mamba::yhat", elem, {rows, d.width}, true)
      .add("ash::mamba::x", elem, {rows, C}, true)
      .add("ash::mamba::z", elem, {rows, E}, true)
      .add("ash::mamba::conv", elem, {rows, C}, true)
      .add("ash::mamba::dlow", elem, {rows, d.mamba2() ? d.head_count() : d.rank()}, true)
      .add("ash::mamba::scan_out", elem, {rows, E}, true)
      .add("ash::mamba::gated", elem, {rows, E}, true);
  if (d.mixer_norms()) w.add("ash::mamba::mixer_rstd", elem, {rows, 3}, true);  // a FalconMamba's
  if (d.mamba2())  // the gated norm's r, D per channel
    w.add("ash::mamba::mixer_rstd", elem, {rows, d.n_groups}, true).add("ash::mamba::d_channels", elem, {E}, true);
  return w.activations(rows, E, d.state, h_and_A, elem, d.mamba2() ? d.n_groups : 1);
}

WorkspaceSpec MambaKind::carry_spec(const ModelDims& d, index_t Bt, std::size_t elem) {
  return WorkspaceSpec().add("ash::lowmem::mamba_conv_carry", elem, {Bt * d.conv_dim(), d.conv_kernel - 1}, true);
}

// As MambaCotangents' constructor allocates them (the partial sums uninitialized), then the scan's over E.
WorkspaceSpec MambaKind::cotangents_spec(const ModelDims& d, index_t rows, bool scan_partials, std::size_t elem) {
  const index_t E = d.inner(), C = d.conv_dim(), rb = impl::row_blocks(rows);
  WorkspaceSpec w;
  w.add("ash::mamba::cot::gs", elem, {rows, E}, true)
      .add("ash::mamba::cot::gz", elem, {rows, E}, true)
      .add("ash::mamba::cot::gx", elem, {rows, C}, true)
      .add("ash::mamba::cot::gdlow", elem, {rows, d.mamba2() ? d.head_count() : d.rank()}, true)
      .add("ash::mamba::cot::gyhat", elem, {rows, d.width}, true)
      .add("ash::mamba::cot::norm_part", elem, {rb, d.width}, false)
      .add("ash::mamba::cot::conv_part", elem, {rb, C * (d.conv_kernel + 1)}, false);
  w = w.cotangents(rows, E, d.state, scan_partials, elem, d.mamba2() ? d.n_groups : 1, false);
  if (d.mamba2())
    w.add("ash::mamba::cot::go", elem, {rows, E}, true)
        .add("ash::mamba::cot::gc", elem, {rows, C}, true)
        .add("ash::mamba::cot::gate_part", elem, {rb, E}, false)
        .add("ash::mamba::cot::ga_channels", elem, {E, d.state}, true)
        .add("ash::mamba::cot::gd_channels", elem, {E}, true)
        .add("ash::mamba::cot::gb_channels", elem, {E}, true);
  return w;
}

PlanRows MambaKind::exact_block_rows(const EngineOptions& o, const ModelDims& d, index_t Bt, index_t T, bool halo,
                                     std::size_t elem) {
  WorkspaceSpec act = acts_spec(d, Bt * T, false, elem);
  const LayerShape sh = scan_layer_shape(d, Bt, T, elem);
  const bool fused = !halo && e3_scan_fused_form(o, T, sh.groups);
  return {{"E3 block activations + state copy", act.append(state_spec(d, Bt, elem))},
          {"cotangents (one block)", cotangents_spec(d, Bt * T, false, elem)},
          {fused ? "E3 scan workspace (fused)" : "E3 scan workspace",
           fused ? adjoint_exact_scan_fused_workspace(o, sh) : adjoint_exact_scan_workspace(o, sh)}};
}

PlanRows MambaKind::exact_window_rows(const EngineOptions& o, const ModelDims& d, index_t Bt, index_t T,
                                      std::size_t elem) {
  const LayerShape sh = scan_layer_shape(d, Bt, T, elem);
  if (e3_scan_fused_form(o, T, sh.groups)) {
    // The activations to the gate run the forward scan, whose chunk states (a
    // GPU's chunked scan; none in one chunk) live beside the scan workspace.
    const index_t nc = forward_scan_chunks(T, Bt, sh.P);
    WorkspaceSpec fwd;
    if (nc > 1)
      fwd.add("ash::fwd::h_boundary", elem, {Bt * nc, sh.P, sh.N}, false)
          .add("ash::fwd::chunk_products", elem, {Bt * nc, sh.P, sh.N}, false);
    return {{"cotangents (whole window)", cotangents_spec(d, Bt * T, false, elem)},
            {"E3 scan workspace (fused)", adjoint_exact_scan_fused_workspace(o, sh).append(fwd)}};
  }
  return {{"cotangents (whole window)", cotangents_spec(d, Bt * T, false, elem)},
          {"E3 scan workspace", adjoint_exact_scan_workspace(o, sh)}};
}

#define ASH_INSTANTIATE_P(S, P)                                                                                   \
  template const MambaActivations<S>& MambaKind::replay_block<S, P<S>>(                                           \
      AdjointExactLayer<S>&, const P<S>&, const ModelDims&, const SeqShape&, const View2<S>&, const State<S>&);   \
  template void MambaKind::backward_block<S, P<S>>(AdjointExactLayer<S>&, const P<S>&, const ModelDims&,          \
                                                   const SeqShape&, const View2<S>&, const View2<S>&,             \
                                                   const State<S>&, bool, Carry<S>&, bool, const P<S>&);          \
  template void MambaKind::backward_window_range<S, P<S>>(AdjointExactLayer<S>&, const P<S>&, const ModelDims&,   \
                                                          const SeqShape&, const View2<S>&, const View2<S>&,      \
                                                          const State<S>&, index_t, Carry<S>&, const P<S>&);      \
  template void MambaKind::backward_window<S, P<S>>(const P<S>&, const ModelDims&, ActivationStore<S>&, int,       \
                                                    const View2<S>&, bool, const FormMu<S>&, const View3<S>&,     \
                                                    const Workspace<S>&, Scratch<S>&, const P<S>&,                \
                                                    const ExecSpace&);                                            \
  template void MambaKind::backward_exact<S, P<S>>(AdjointExactLayer<S>&, const P<S>&, const ModelDims&, int,      \
                                                   ActivationStore<S>&, const View2<S>&, const P<S>&);
// The blocks' parameter types of the kinds built on MambaKind (FalconMambaKind, Mamba2Kind).
#define ASH_INSTANTIATE(S)                    \
  ASH_INSTANTIATE_P(S, MambaLayerParams)       \
  ASH_INSTANTIATE_P(S, FalconMambaLayerParams) \
  ASH_INSTANTIATE_P(S, Mamba2LayerParams)
ASH_INSTANTIATE(float)
ASH_INSTANTIATE(double)
#undef ASH_INSTANTIATE
#undef ASH_INSTANTIATE_P

}  // namespace ash
