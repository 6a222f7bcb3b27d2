#include "ash/grad/backprop.hpp"

#include "ash/core/error.hpp"

namespace ash {

namespace {

// μ^t = gy^t_p γ^t_n + A^{t+1} μ^{t+1}: the adjoint of h, a plain reverse
// loop over t per (sequence, channel, state), A^{t+1} from the stored values.
template <class S>
void reverse_scan(const SeqShape& s, const LayerActivations<S>& act, const View2<S>& gy, const View3<S>& mu,
                  const ExecSpace& exec) {
  const index_t T = s.T, P = act.yhat.extent(1), N = act.beta.extent(1);
  auto A = act.A;
  auto gamma = act.gamma;
  Kokkos::parallel_for(
      "ash::e1::reverse_scan", Range(exec, 0, s.batch * P * N), KOKKOS_LAMBDA(const index_t i) {
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
BackpropLayer<S>::BackpropLayer(const EngineOptions& opts) : detach_(opts.detach_inputs) {
  require(opts.truncate == 0, "engine 'backprop' has no window: --truncate applies to adjoint engines only");
}

template <class S>
void BackpropLayer<S>::backward(const LayerParams<S>& p, int k, ActivationStore<S>& store, const View2<S>& g,
                                const LayerParams<S>& grad) {
  const auto& s = store.shape();
  work_.ensure("ash::e1::mu", s.rows(), p.W_delta.extent(0), p.W_B.extent(0));
  const auto& act = store.kept(k);
  reverse_scan(s, act, g, work_.mu, this->exec_);
  ssm_layer_backward_rows(p, s, store.input(k), act, g, RowBlock{0, s.T}, work_.mu, act.hprev, act.A, *work_.cot, grad, g,
                          detach_, this->exec_);
}

template <class S>
void BackpropLayer<S>::release() {
  work_.release();
}

template class BackpropLayer<float>;
template class BackpropLayer<double>;

}  // namespace ash
