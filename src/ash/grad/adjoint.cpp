#include "ash/grad/adjoint.hpp"

#include "ash/core/error.hpp"

namespace ash {

namespace {

// One work item per (sequence b, token i) — a league of teams whose threads
// share the P·N channels. Each item forms λ^{t,i} for the t of its window by
// running products of the stored A (Alg. 2) and sums the cotangents v^{t,i}.
// (The paper indexes work by output token t and scatters to i; gathering by
// i computes the same products and sums with no atomics, so the result is
// deterministic.)
template <class S>
void window_adjoint(const SeqShape& s, const LayerActivations<S>& act, const View2<S>& g, index_t Tbar,
                    const View3<S>& mu, const ExecSpace& exec) {
  const index_t T = s.T, P = act.yhat.extent(1), N = act.beta.extent(1), PN = P * N;
  auto A = act.A;
  auto gamma = act.gamma;
  using Team = Kokkos::TeamPolicy<ExecSpace>;
  using Scratch = Kokkos::View<S*, ExecSpace::scratch_memory_space, Kokkos::MemoryTraits<Kokkos::Unmanaged>>;
  // The running products Π A of the item live in team scratch; the t loop is
  // outermost so every step reads contiguous rows A^t, g^t, γ^t.
  const int level = Scratch::shmem_size(PN) <= 32768 ? 0 : 1;
  Team policy(exec, int(s.rows()), Kokkos::AUTO);
  policy.set_scratch_size(level, Kokkos::PerTeam(Scratch::shmem_size(PN)));
  Kokkos::parallel_for(
      "ash::e2::window_adjoint", policy, KOKKOS_LAMBDA(const typename Team::member_type& team) {
        const index_t m_i = team.league_rank();
        const index_t b = m_i / T, i = m_i % T;
        const index_t t_end = (i + Tbar - 1 < T - 1) ? i + Tbar - 1 : T - 1;
        Scratch prod(team.team_scratch(level), PN);
        for (index_t t = i; t <= t_end; ++t) {
          const index_t m_t = b * T + t;
          Kokkos::parallel_for(Kokkos::TeamThreadRange(team, P), [&](const index_t q) {
            const S gq = g(m_t, q);
            Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, N), [&](const index_t n) {
              const index_t pn = q * N + n;
              const S pr = t > i ? prod(pn) * A(m_t, q, n) : S(1);  // Π_{j=i+1..t} A^j
              prod(pn) = pr;
              const S v = gq * gamma(m_t, n) * pr;  // v^{t,i} = g^t γ^t Π A
              mu(m_i, q, n) = t > i ? mu(m_i, q, n) + v : v;
            });
          });
          team.team_barrier();
        }
      });
}

}  // namespace

template <class S>
AdjointLayer<S>::AdjointLayer(const EngineOptions& opts) : truncate_(opts.truncate) {}

template <class S>
std::string AdjointLayer<S>::name() const {
  return truncate_ > 0 ? "adjoint (T-bar=" + std::to_string(truncate_) + ")" : "adjoint";
}

// Layers are independent given g (paper §4.5): every layer uses the same g and
// leaves it unchanged (inputs detached; the residual stream passes g to the embedding).
template <class S>
void AdjointLayer<S>::backward(const LayerParams<S>& p, int k, ActivationStore<S>& store, const View2<S>& g,
                               const LayerParams<S>& grad) {
  const auto& s = store.shape();
  const index_t Tbar = (truncate_ <= 0 || truncate_ > s.T) ? s.T : truncate_;
  work_.ensure("ash::e2::mu", s.rows(), p.W_delta.extent(0), p.W_B.extent(0));
  const auto& act = store.kept(k);
  window_adjoint(s, act, g, Tbar, work_.mu, this->exec_);
  ssm_layer_backward_rows(p, s, store.input(k), act, g, RowBlock{0, s.T}, work_.mu, act.hprev, act.A, *work_.cot, grad, g,
                          /*detach_input=*/true, this->exec_);
}

template <class S>
void AdjointLayer<S>::release() {
  work_.release();
}

template class AdjointLayer<float>;
template class AdjointLayer<double>;

}  // namespace ash
