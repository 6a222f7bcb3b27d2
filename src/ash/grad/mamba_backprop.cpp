#include "ash/grad/mamba_backprop.hpp"

#include <vector>

#include "ash/core/error.hpp"
#include "ash/grad/adjoint_exact.hpp"
#include "ash/grad/backprop.hpp"
#include "ash/kernels/matmul.hpp"
#include "ash/model/embedding.hpp"
#include "ash/model/head.hpp"
#include "ash/model/mamba_layer.hpp"

namespace ash {

namespace impl {

// A wave's scan cotangents (row b·W + t - t0) into the window's (row b·T + t),
// for the dense VJPs after the scan. (A named function: nvcc takes no
// KOKKOS_LAMBDA inside a lambda.)
template <class S>
void mamba_wave_rows(const SeqShape& s, const BlockRows& rb, const LayerCotangents<S>& wave,
                     const LayerCotangents<S>& all, const ExecSpace& exec) {
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

}  // namespace impl

namespace {

// E3 for a Mamba (docs/design.md §2): the forward keeps each block's input
// y_{k-1} only; the reverse pass recomputes one block's activations from it up
// to the scan's inputs (one MambaActivations, projections only, reused by every
// block), and E3's scan machinery forms μ, h^{t-1} and A^t wave by wave for the
// scan's VJP and the scan's output s (so the scan runs forward once per block
// in the reverse pass), and no [M, E, N] buffer of the whole window exists.
template <class S>
double mamba_adjoint_exact(const EngineOptions& opts, const ParamSet<S>& params, const TokenView& x,
                           const ParamSet<S>& grad, const ExecSpace& exec) {
  const auto& d = params.dims();
  const SeqShape s = SeqShape::of(x);
  const int K = int(d.layers);
  grad.fill_zero();
  const auto gglobal = grad.global();
  std::vector<View2<S>> ys;  // y_0 .. y_K
  for (int k = 0; k <= K; ++k) ys.emplace_back(std::string(k == 0 ? "ash::mamba::y_in" : "ash::mamba::y"), s.rows(), d.width);
  const MambaActivations<S> act(s, d, LayerActivations<S>::projections_only);
  embedding_forward(params.global().embedding, x, ys[0], exec);
  for (int k = 0; k < K; ++k) mamba_layer_forward(params.mamba_layer(k), d, s, ys[k], act, ys[k + 1], exec);
  const View2<S> g("ash::g", s.rows(), d.width);
  const double loss = head_loss<S>(params.global(), x, ys[K], g, &gglobal, opts.head_chunk, 0, exec);
  ys[K] = View2<S>();  // the recomputation stops at the gate: no block output again
  {
    const MambaCotangents<S> cot(s.rows(), d, false);
    Workspace<S> work;
    for (int k = K - 1; k >= 0; --k) {
      const auto p = params.mamba_layer(k);
      const auto gk = grad.mamba_layer(k);
      // block k's activations again, up to the scan's inputs: the waves below
      // replay h^{t-1} and A^t, which give s without a second forward scan
      mamba_layer_activations(p, d, s, ys[k], act, MambaUpTo::scan_inputs, exec);
      mamba_gate_backward_first(p, act, g, cot, exec);  // ∂L/∂s needs no s
      const auto& sg = cot.scan;
      const ScanWaveFn<S> on_wave = [&](const BlockRows& rb, const View3<S>& mu, const View3<S>& hprev,
                                        const View3<S>& A, const LayerCotangents<S>& wc) {
        mamba_scan_output_rows(p.D, s, act, rb, hprev, A, exec);
        selective_scan_backward_rows(p.D, s, act.scan, cot.gs, rb, mu, hprev, A, wc,
                                     ScanParamGrads<S>{gk.A_log, gk.D, gk.dt_bias}, exec);
        impl::mamba_wave_rows(s, rb, wc, sg, exec);
      };
      adjoint_exact_scan_waves(opts, work, s, act.scan, cot.gs, on_wave, exec);
      mamba_gate_backward_second(act, g, cot, gk, exec);  // s complete: o, W_out's gradient, ∂L/∂z
      mamba_mixer_backward_dense(p, d, s, ys[k], act, cot, gk, g, exec);
      ys[k] = View2<S>();
    }
  }
  embedding_backward(x, g, gglobal.embedding, exec);
  return loss;
}

}  // namespace

template <class S>
double mamba_backprop(const EngineOptions& opts, const ParamSet<S>& params, const TokenView& x,
                      const ParamSet<S>& grad, const ExecSpace& exec) {
  const auto& d = params.dims();
  require(d.mamba() && grad.dims() == d, "mamba_backprop: needs a Mamba model and a gradient of its layout");
  require(params.range().is_all(d) && grad.range().is_all(d), "mamba_backprop: needs the whole model");
  const auto no = [](const std::string& what) {
    return what + " is not available for model.arch=mamba yet (only grad.engine=backprop or adjoint-exact over "
                  "the whole window in one process)";
  };
  require(opts.method == Method::backprop || opts.method == Method::adjoint_exact,
          no("grad.engine=" + method_name(opts.method)));
  require(!opts.detach_inputs, no("grad.detach_inputs=true"));
  require(opts.truncate == 0, no("grad.truncate"));
  require(!opts.low_memory(), no("run.storage, grad.layer_checkpoint, grad.token_block and data.carry_state"));
  const MatmulScope matmul(opts.matmul, sizeof(S));
  if (opts.method == Method::adjoint_exact) return mamba_adjoint_exact(opts, params, x, grad, exec);
  const SeqShape s = SeqShape::of(x);
  const int K = int(d.layers);
  grad.fill_zero();
  const auto gglobal = grad.global();
  std::vector<View2<S>> ys;
  for (int k = 0; k <= K; ++k) ys.emplace_back(std::string(k == 0 ? "ash::mamba::y_in" : "ash::mamba::y"), s.rows(), d.width);
  std::vector<MambaActivations<S>> acts;
  for (int k = 0; k < K; ++k) acts.emplace_back(s, d, LayerActivations<S>::with_hprev_and_A);
  embedding_forward(params.global().embedding, x, ys[0], exec);
  for (int k = 0; k < K; ++k) mamba_layer_forward(params.mamba_layer(k), d, s, ys[k], acts[k], ys[k + 1], exec);
  // g_K, then g_k in place. With tied embeddings the head's gradient is the
  // embedding's (one View): head_loss adds ∂Ω into it, embedding_backward ∂E.
  const View2<S> g("ash::g", s.rows(), d.width);
  const double loss = head_loss<S>(params.global(), x, ys[K], g, &gglobal, opts.head_chunk, 0, exec);
  ys[K] = View2<S>();
  {
    const MambaCotangents<S> cot(s.rows(), d);
    const View3<S> mu("ash::mamba::mu", s.rows(), d.inner(), d.state);
    for (int k = K - 1; k >= 0; --k) {
      const auto p = params.mamba_layer(k);
      const auto gk = grad.mamba_layer(k);
      mamba_gate_backward(p, acts[k], g, cot, gk, exec);
      impl::e1_reverse_scan(s, acts[k].scan, cot.gs, mu, opts.chunk, exec);
      mamba_mixer_backward(p, d, s, ys[k], acts[k], mu, cot, gk, g, exec);
      acts[k] = MambaActivations<S>();
      ys[k] = View2<S>();
    }
  }
  embedding_backward(x, g, gglobal.embedding, exec);
  return loss;
}

template double mamba_backprop<float>(const EngineOptions&, const ParamSet<float>&, const TokenView&,
                                      const ParamSet<float>&, const ExecSpace&);
template double mamba_backprop<double>(const EngineOptions&, const ParamSet<double>&, const TokenView&,
                                       const ParamSet<double>&, const ExecSpace&);

}  // namespace ash
