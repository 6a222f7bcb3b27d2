#include "ash/grad/backprop.hpp"

#include <vector>

#include "ash/model/forward.hpp"

namespace ash {

namespace {

// μ^t = gy^t_p γ^t_n + A^{t+1} μ^{t+1}: the adjoint of h, a plain reverse
// loop over t per (sequence, channel, state), A^{t+1} from the stored values.
template <class S>
void reverse_scan(const SeqShape& s, const LayerActivations<S>& act, const View2<S>& gy, const View3<S>& mu) {
  const index_t T = s.T, P = act.yhat.extent(1), N = act.beta.extent(1);
  auto A = act.A;
  auto gamma = act.gamma;
  Kokkos::parallel_for(
      "ash::e1::reverse_scan", Range(0, s.batch * P * N), KOKKOS_LAMBDA(const index_t i) {
        const index_t b = i / (P * N), q = (i / N) % P, n = i % N;
        S carry = 0;
        for (index_t t = T - 1; t >= 0; --t) {
          const index_t m = b * T + t;
          carry = gy(m, q) * gamma(m, n) + carry;
          mu(m, q, n) = carry;
          carry *= A(m, q, n);  // becomes A^{t} μ^{t} for step t-1
        }
      });
}

}  // namespace

template <class S>
double BackpropEngine<S>::compute(const ParamSet<S>& params, const TokenView& x, const ParamSet<S>& grad) {
  const auto& d = params.dims();
  const SeqShape s{index_t(x.extent(0)), index_t(x.extent(1))};
  grad.fill_zero();
  const auto gglobal = grad.global();
  // Forward, storing y_k and every intermediate of every layer.
  auto tape = forward_tape<S>(params, x, &gglobal, LayerActivations<S>::with_hprev_and_A, true, opts_.head_chunk);
  auto& acts = tape.acts;
  const View2<S> g = tape.g;  // g_K, then g_k in place
  View3<S> mu("ash::e1::mu", s.rows(), d.width, d.state);
  const LayerCotangents<S> cot(s.rows(), d);
  for (int k = d.layers - 1; k >= 0; --k) {
    reverse_scan(s, acts[k], g, mu);
    ssm_layer_backward_rows(params.layer(k), s, tape.ys[k], acts[k], g, RowBlock{0, s.T}, mu, acts[k].hprev, cot,
                            grad.layer(k), g, opts_.detach_inputs);
    acts.pop_back();  // free as we go
  }
  embedding_backward(x, g, gglobal.embedding);
  return tape.loss;
}

template class BackpropEngine<float>;
template class BackpropEngine<double>;

}  // namespace ash
