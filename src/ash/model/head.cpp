#include "ash/model/head.hpp"

#include "ash/kernels/blas.hpp"
#include "ash/kernels/rms_norm.hpp"

namespace ash {

index_t head_chunk_rows(index_t requested, index_t V) {
  if (requested > 0) return requested < (index_t(1) << 30) ? requested : (index_t(1) << 30);  // a 32-bit team league
  if (host_backend) return 1024;
  const index_t per = (index_t(1) << 24) / (V > 0 ? V : 1);
  return per > 1024 ? per : 1024;
}

template <class S>
double head_loss(const GlobalParams<S>& p, const TokenView& x, const View2<S>& yK, const View2<S>& g,
                 const GlobalParams<S>* grad, index_t chunk_rows, index_t targets, const ExecSpace& exec) {
  // Rows of yK are (sequence, token) with T tokens per sequence; x may hold one
  // token more per sequence (the target of the last row, from the next token range).
  const index_t Tx = x.extent(1), M = yK.extent(0), P = yK.extent(1), V = p.head.extent(0);
  const index_t T = M / index_t(x.extent(0));
  // A target that starts a document is nobody's (docs/design.md §1).
  const index_t count = targets > 0 ? targets : target_count(x);
  const bool want_g = index_t(g.extent(0)) == M;
  const index_t rows = head_chunk_rows(chunk_rows, V);
  const index_t C = rows < M ? rows : M;
  View1<S> rstd("ash::head::rstd", C);
  View2<S> yhat("ash::head::yhat", C, P);
  View2<S> logits("ash::head::logits", C, V);
  View2<S> gyhat, norm_part;
  View1<S> gw_discard;
  if (want_g) {
    gyhat = View2<S>("ash::head::gyhat", C, P);
    norm_part = View2<S>(Kokkos::view_alloc(std::string("ash::head::norm_part"), Kokkos::WithoutInitializing),
                         impl::row_blocks(C), P);
    if (!grad) gw_discard = View1<S>("ash::head::gw_discard", P);
  }
  const S inv_count = count > 0 ? S(1) / S(count) : S(0);  // no targets: L = 0, g = 0
  // Each chunk's loss sum stays on the device (a reduction into a View does not
  // wait for the kernel); the host adds them in chunk order once, after the last:
  // the same sums in the same order as one host sum per chunk, without a
  // synchronisation per chunk (1,024 a step at 2^20 tokens and 1,024-row chunks).
  const index_t nchunks = (M + C - 1) / C;
  Kokkos::View<double*, MemSpace> chunk_loss("ash::head::chunk_loss", nchunks);
  for (index_t r0 = 0; r0 < M; r0 += C) {
    const index_t r1 = r0 + C < M ? r0 + C : M, c = r1 - r0;
    const auto rows = Kokkos::make_pair(index_t(0), c);
    auto y_c = Kokkos::subview(yK, Kokkos::make_pair(r0, r1), Kokkos::ALL());
    auto rstd_c = Kokkos::subview(rstd, rows);
    auto yhat_c = Kokkos::subview(yhat, rows, Kokkos::ALL());
    auto log_c = Kokkos::subview(logits, rows, Kokkos::ALL());
    impl::rms_norm_forward<S>(y_c, p.final_norm, rstd_c, yhat_c, exec, p.norm_eps);
    impl::gemm<S>(exec, "N", "T", S(1), yhat_c, p.head, S(0), log_c);
    // Per row, one team: log-sum-exp over V, loss, and (in place) go =
    // (softmax - onehot) / count; the team's threads split V.
    using Team = Kokkos::TeamPolicy<ExecSpace>;
    Kokkos::parallel_reduce(
        "ash::head_softmax", Team(exec, c, Kokkos::AUTO),
        KOKKOS_LAMBDA(const typename Team::member_type& team, double& acc) {
          const index_t i = team.league_rank();
          const index_t m = r0 + i, b = m / T, t = m % T;
          S mx = log_c(i, 0);
          Kokkos::parallel_reduce(
              Kokkos::TeamThreadRange(team, V),
              [&](const index_t v, S& best) { best = log_c(i, v) > best ? log_c(i, v) : best; },
              Kokkos::Max<S>(mx));
          S se = 0;
          Kokkos::parallel_reduce(
              Kokkos::TeamThreadRange(team, V), [&](const index_t v, S& sum) { sum += kmath::exp(log_c(i, v) - mx); },
              se);
          const S lse = mx + kmath::log(se);
          const bool has_target = t + 1 < Tx && !starts_document(x(b, t + 1));
          const index_t tgt = has_target ? index_t(token_id(x(b, t + 1))) : -1;
          if (has_target) Kokkos::single(Kokkos::PerTeam(team), [&]() { acc += double(lse - log_c(i, tgt)); });
          team.team_barrier();  // every thread has read the logits it needs
          Kokkos::parallel_for(Kokkos::TeamThreadRange(team, V), [&](const index_t v) {
            const S sm = kmath::exp(log_c(i, v) - lse);
            log_c(i, v) = has_target ? (sm - (v == tgt ? S(1) : S(0))) * inv_count : S(0);
          });
        },
        Kokkos::subview(chunk_loss, r0 / C));
    if (grad) impl::gemm<S>(exec, "T", "N", S(1), log_c, yhat_c, S(1), grad->head);
    if (want_g) {
      auto gyhat_c = Kokkos::subview(gyhat, rows, Kokkos::ALL());
      auto g_c = Kokkos::subview(g, Kokkos::make_pair(r0, r1), Kokkos::ALL());
      impl::gemm<S>(exec, "N", "N", S(1), log_c, p.head, S(0), gyhat_c);
      if (grad)
        impl::rms_norm_backward<S>(y_c, p.final_norm, rstd_c, gyhat_c, grad->final_norm, g_c, false, norm_part, exec);
      else
        impl::rms_norm_backward<S>(y_c, p.final_norm, rstd_c, gyhat_c, gw_discard, g_c, false, norm_part, exec);
    }
  }
  const auto parts = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), chunk_loss);
  double loss_sum = 0;
  for (index_t j = 0; j < nchunks; ++j) loss_sum += parts(j);
  return count > 0 ? loss_sum / double(count) : 0.0;
}

template <class S>
void head_logits(const GlobalParams<S>& p, const View2<S>& y, const View2<S>& logits) {
  View1<S> rstd("ash::head::rstd", y.extent(0));
  View2<S> yhat("ash::head::yhat", y.extent(0), y.extent(1));
  const ExecSpace exec;
  impl::rms_norm_forward<S>(y, p.final_norm, rstd, yhat, exec, p.norm_eps);
  impl::gemm<S>(exec, "N", "T", S(1), yhat, p.head, S(0), logits);
}

template void head_logits<float>(const GlobalParams<float>&, const View2<float>&, const View2<float>&);
template void head_logits<double>(const GlobalParams<double>&, const View2<double>&, const View2<double>&);
template double head_loss<float>(const GlobalParams<float>&, const TokenView&, const View2<float>&,
                                 const View2<float>&, const GlobalParams<float>*, index_t, index_t, const ExecSpace&);
template double head_loss<double>(const GlobalParams<double>&, const TokenView&, const View2<double>&,
                                  const View2<double>&, const GlobalParams<double>*, index_t, index_t, const ExecSpace&);

}  // namespace ash
