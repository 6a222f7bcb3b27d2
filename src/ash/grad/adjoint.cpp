#include "ash/grad/adjoint.hpp"

#include "ash/core/error.hpp"
#include "ash/kernels/row_sums.hpp"

#include <type_traits>

namespace ash {

namespace {

// Device form (GPUs): one work item per (sequence b, token i) — a league of
// teams whose threads share the P channels and whose vector lanes share the N states. Each lane
// forms λ^{t,i} for the t of its window by a running product of the stored A
// (Alg. 2) kept in a register, and sums the cotangents v^{t,i} in another:
// no scratch and no barrier. At each t a team reads the contiguous rows A^t,
// g^t, γ^t (lanes over n, threads over q). (The paper indexes work by output
// token t and scatters to i; gathering by i computes the same products and
// sums with no atomics, so the result is deterministic.)
template <class S>
void window_adjoint_device(const SeqShape& s, const LayerActivations<S>& act, const View2<S>& g, index_t Tbar,
                    const View3<S>& mu, const ExecSpace& exec) {
  const index_t T = s.T, P = act.yhat.extent(1), N = act.a.extent(1), GN = act.gamma.extent(1);
  auto A = act.A;
  auto gamma = act.gamma;
  using Team = Kokkos::TeamPolicy<ExecSpace>;
  int vl = 1;  // lanes over the state index: a power of two up to N (and the backend's maximum)
  while (vl * 2 <= N && vl * 2 <= Team::vector_length_max()) vl *= 2;
  Kokkos::parallel_for(
      "ash::e2::window_adjoint", Team(exec, impl::league_size(s.rows()), Kokkos::AUTO, vl),
      KOKKOS_LAMBDA(const typename Team::member_type& team) {
        const index_t m_i = team.league_rank();
        const index_t b = m_i / T, i = m_i % T;
        const index_t t_end = (i + Tbar - 1 < T - 1) ? i + Tbar - 1 : T - 1;
        Kokkos::parallel_for(Kokkos::TeamThreadRange(team, P), [&](const index_t q) {
          Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, N), [&](const index_t n) {
            S pr = 1, acc = 0;  // Π_{j=i+1..t} A^j and Σ_t v^{t,i}
            for (index_t t = i; t <= t_end; ++t) {
              const index_t m_t = b * T + t;
              if (t > i) pr *= A(m_t, q, n);
              acc += g(m_t, q) * gamma(m_t, group_col(q, P, N, GN) + n) * pr;  // v^{t,i} = g^t γ^t Π A
            }
            mu(m_i, q, n) = acc;
          });
        });
      });
}

// Host form (CPUs): the same sums with the t loop outermost, so every step
// reads the contiguous rows A^t, g^t, γ^t once and the running products
// stay in the team's scratch (2.8x faster than the device form on one core);
// the per-t barrier costs nothing with one thread per team.
template <class S>
void window_adjoint_host(const SeqShape& s, const LayerActivations<S>& act, const View2<S>& g, index_t Tbar,
                    const View3<S>& mu, const ExecSpace& exec) {
  const index_t T = s.T, P = act.yhat.extent(1), N = act.a.extent(1), GN = act.gamma.extent(1), PN = P * N;
  auto A = act.A;
  auto gamma = act.gamma;
  using Team = Kokkos::TeamPolicy<ExecSpace>;
  using Scratch = Kokkos::View<S*, ExecSpace::scratch_memory_space, Kokkos::MemoryTraits<Kokkos::Unmanaged>>;
  // The running products Π A of the item live in team scratch; the t loop is
  // outermost so every step reads contiguous rows A^t, g^t, γ^t.
  const int level = Scratch::shmem_size(PN) <= 32768 ? 0 : 1;
  Team policy(exec, impl::league_size(s.rows()), Kokkos::AUTO);
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
              const S v = gq * gamma(m_t, group_col(q, P, N, GN) + n) * pr;  // v^{t,i} = g^t γ^t Π A
              mu(m_i, q, n) = t > i ? mu(m_i, q, n) + v : v;
            });
          });
          team.team_barrier();
        }
      });
}

}  // namespace

namespace impl {
template <class S>
void window_adjoint(WindowForm form, const SeqShape& s, const LayerActivations<S>& act, const View2<S>& g,
                    index_t Tbar, const View3<S>& mu, const ExecSpace& exec) {
  if (form == WindowForm::host)
    window_adjoint_host(s, act, g, Tbar, mu, exec);
  else
    window_adjoint_device(s, act, g, Tbar, mu, exec);
}
template <class S>
void e2_mu(const SeqShape& s, const LayerActivations<S>& act, const View2<S>& gy, index_t truncate,
           const View3<S>& mu, const ExecSpace& exec) {
  const index_t Tbar = (truncate <= 0 || truncate > s.T) ? s.T : truncate;
  require(s.rows() <= index_t(2147483647), "adjoint: more than 2^31 - 1 token rows (one kernel team per row)");
  constexpr bool on_host = std::is_same<typename ExecSpace::memory_space, Kokkos::HostSpace>::value;
  window_adjoint(on_host ? WindowForm::host : WindowForm::device, s, act, gy, Tbar, mu, exec);
}
template void window_adjoint<float>(WindowForm, const SeqShape&, const LayerActivations<float>&, const View2<float>&,
                                    index_t, const View3<float>&, const ExecSpace&);
template void window_adjoint<double>(WindowForm, const SeqShape&, const LayerActivations<double>&,
                                     const View2<double>&, index_t, const View3<double>&, const ExecSpace&);
template void e2_mu<float>(const SeqShape&, const LayerActivations<float>&, const View2<float>&, index_t,
                           const View3<float>&, const ExecSpace&);
template void e2_mu<double>(const SeqShape&, const LayerActivations<double>&, const View2<double>&, index_t,
                            const View3<double>&, const ExecSpace&);
}  // namespace impl

WorkspaceSpec adjoint_workspace(const EngineOptions&, const LayerShape& sh, bool cotangents) {
  return window_workspace("ash::e2::mu", sh, cotangents);
}

template <class S>
AdjointLayer<S>::AdjointLayer(const EngineOptions& opts) : truncate_(opts.truncate) {}

template <class S>
std::string AdjointLayer<S>::name() const {
  return truncate_ > 0 ? "adjoint (T-bar=" + std::to_string(truncate_) + ")" : "adjoint";
}

// Layers are independent given g (paper §4.5): every layer uses the same g and
// leaves it unchanged (inputs detached; the residual stream passes g to the embedding).
template <class S>
template <class K>
void AdjointLayer<S>::backward_kind(const typename K::template Params<S>& p, const ModelDims& d, int k,
                                    ActivationStore<S>& store, const View2<S>& g,
                                    const typename K::template Params<S>& grad) {
  const auto& s = store.shape();
  const ExecSpace& exec = this->exec_;
  work_.plan(adjoint_workspace(EngineOptions(), K::template scan_shape<S>(s, d), K::window_cotangents));
  const View3<S> mu = work_.view3("ash::e2::mu");
  const FormMu<S> form_mu = [&](const LayerActivations<S>& scan, const View2<S>& gy) {
    impl::e2_mu(s, scan, gy, truncate_, mu, exec);
  };
  K::backward_window(p, d, store, k, g, /*detach=*/true, form_mu, mu, work_, scratch_.template get<K>(), grad, exec);
}

template <class S>
void AdjointLayer<S>::release() {
  work_.release();
  scratch_.release();
}

template class AdjointLayer<float>;
template class AdjointLayer<double>;

}  // namespace ash
