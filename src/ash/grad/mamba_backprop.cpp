#include "ash/grad/mamba_backprop.hpp"

#include <vector>

#include "ash/core/error.hpp"
#include "ash/grad/backprop.hpp"
#include "ash/kernels/matmul.hpp"
#include "ash/model/embedding.hpp"
#include "ash/model/head.hpp"
#include "ash/model/mamba_layer.hpp"

namespace ash {

template <class S>
double mamba_backprop(const EngineOptions& opts, const ParamSet<S>& params, const TokenView& x,
                      const ParamSet<S>& grad, const ExecSpace& exec) {
  const auto& d = params.dims();
  require(d.mamba() && grad.dims() == d, "mamba_backprop: needs a Mamba model and a gradient of its layout");
  require(params.range().is_all(d) && grad.range().is_all(d), "mamba_backprop: needs the whole model");
  const auto no = [](const std::string& what) {
    return what + " is not available for model.arch=mamba yet (only grad.engine=backprop over the whole window "
                  "in one process)";
  };
  require(opts.method == Method::backprop, no("grad.engine=" + method_name(opts.method)));
  require(!opts.detach_inputs, no("grad.detach_inputs=true"));
  require(opts.truncate == 0, no("grad.truncate"));
  require(!opts.low_memory(), no("run.storage, grad.layer_checkpoint, grad.token_block and data.carry_state"));
  const MatmulScope matmul(opts.matmul, sizeof(S));
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
