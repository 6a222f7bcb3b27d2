#include "ash/model/ssm_layer.hpp"

#include "ash/core/error.hpp"
#include "ash/kernels/blas.hpp"
#include "ash/kernels/chunked_scan.hpp"
#include "ash/kernels/rms_norm.hpp"

namespace ash {

template <class S>
LayerActivations<S>::LayerActivations(const SeqShape& s, index_t P, index_t N, Store store, index_t groups)
    : rstd("ash::act::rstd", s.rows()),
      yhat("ash::act::yhat", s.rows(), P),
      delta("ash::act::delta", s.rows(), P),
      beta("ash::act::beta", s.rows(), groups * N),
      gamma("ash::act::gamma", s.rows(), groups * N),
      a("ash::act::a", P, N) {
  if (store >= with_hprev) hprev = View3<S>("ash::act::hprev", s.rows(), P, N);
  if (store >= with_hprev_and_A) A = View3<S>("ash::act::A", s.rows(), P, N);
}

template <class S>
LayerCotangents<S>::LayerCotangents(index_t rows, index_t P, index_t N, bool row_partials, index_t groups,
                                    bool gather_rows)
    : gyhat("ash::cot::gyhat", rows, P),
      gz("ash::cot::gz", rows, P),
      gbeta("ash::cot::gbeta", rows, groups * N),
      ggamma("ash::cot::ggamma", rows, groups * N),
      yhat_rows(gather_rows ? View2<S>("ash::cot::yhat_rows", rows, P) : View2<S>()),
      norm_part(Kokkos::view_alloc(std::string("ash::cot::norm_part"), Kokkos::WithoutInitializing),
                impl::row_blocks(rows), P) {
  if (!row_partials) return;
  alog_part = View3<S>("ash::cot::alog_part", impl::row_blocks(rows), P, N);
  d_part = View2<S>("ash::cot::d_part", impl::row_blocks(rows), P);
  bd_part = View2<S>("ash::cot::bd_part", impl::row_blocks(rows), P);
}

namespace {

constexpr index_t forward_chunk = 64;  // tokens per chunk of the forward scan when chunks are needed

using impl::softplus;

// Chunks of the forward scan. Chunks only add parallelism (each costs a
// second pass over its tokens), so a sequence is one chunk when its channels
// alone give every thread of the space enough work (the CPU case), and
// chunks of 64 tokens otherwise (a GPU).
impl::Chunks forward_chunks(index_t T, index_t Bt, index_t P, const ExecSpace& exec) {
  const index_t C = (Bt * P >= 8 * index_t(exec.concurrency()) || T <= forward_chunk) ? T : forward_chunk;
  return impl::Chunks(C, T);
}

// The forward replay: each (sequence, chunk, channel) scans its chunk from
// the state before it (h0/zero for the first chunk, Hb of the chunk before
// otherwise), forming y_out = y_in + D ŷ + Σ_n γ_n h_n and, where allocated,
// storing h^{t-1} and A^t. With one chunk and a carried state, the thread
// also leaves h after the last token in state_io.
template <int NT, class S>
void scan_replay(const impl::ScanView<S>& L, const impl::Chunks ch, index_t Bt, const View3<S>& Hb,
                 const View2<S>& state_io, const Unmanaged1<S>& D, const View2<S>& y_in, const View2<S>& y_out,
                 const View3<S>& Hst, const View3<S>& Ast, const ExecSpace& exec) {
  const index_t P = L.a.extent(0), N = L.a.extent(1), T = L.T, nc = ch.n;
  const bool store_h = Hst.extent(0) > 0, store_A = Ast.extent(0) > 0;
  const bool carry = state_io.extent(0) > 0;
  const bool has_in = y_in.extent(0) > 0;  // a Mamba's scan output has no residual in it
  Kokkos::parallel_for(
      "ash::layer_scan_forward", Range(exec, 0, Bt * nc * P), KOKKOS_LAMBDA(const index_t i) {
        const index_t bc = i / P, q = i % P, b = bc / nc, c = bc % nc, gc = L.gcol(q);
        for (index_t t = ch.start(c); t < ch.end(c); ++t) {
          const index_t m = b * T + t;
          y_out(m, q) = (has_in ? y_in(m, q) : S(0)) + D(q) * L.yhat(m, q);
        }
        for (index_t n0 = 0; n0 < N; n0 += NT) {
          S h[NT], av[NT];
          for (int j = 0; j < NT; ++j) {
            h[j] = c > 0 ? Hb(bc - 1, q, n0 + j) : (carry ? state_io(b * P + q, n0 + j) : S(0));
            av[j] = L.a(q, n0 + j);
          }
          for (index_t t = ch.start(c); t < ch.end(c); ++t) {
            const index_t m = b * T + t;
            const S dq = L.delta(m, q), du = dq * L.yhat(m, q), kp = L.keep(b, t);
            S A[NT], part[NT];
            for (int j = 0; j < NT; ++j) A[j] = kp * impl::exp_fast(dq * av[j]);
            if (store_h)  // E1/E2 keep h^{t-1} and A^t (loop-invariant branches, so the j-loops vectorise)
              for (int j = 0; j < NT; ++j) Hst(m, q, n0 + j) = h[j];
            if (store_A)
              for (int j = 0; j < NT; ++j) Ast(m, q, n0 + j) = A[j];
            for (int j = 0; j < NT; ++j) {
              h[j] = A[j] * h[j] + du * L.beta(m, gc + n0 + j);
              part[j] = L.gamma(m, gc + n0 + j) * h[j];
            }
            S out = 0;
            for (int j = 0; j < NT; ++j) out += part[j];
            y_out(m, q) += out;
          }
          if (carry && nc == 1)
            for (int j = 0; j < NT; ++j) state_io(b * P + q, n0 + j) = h[j];
        }
      });
}

// The per-(token, channel) VJPs of step i of one row block. One thread owns
// rows [blk·reduce_rows, ...) of channel q: per row, gΔ and the ŷ-part through
// u = Δ ŷ β (sums over n, into gz and gyhat), and per block the partial sums
// of the A_log, D and bδ gradients; μ becomes μ Δ ŷ (what ∂L/∂β sums over p).
template <int NT, class S, class Map>
void vjp_channel(const LayerActivations<S>& act, const View2<S>& gy, const Unmanaged1<S>& D, const Map map, index_t R,
                 const View3<S>& mu, const View3<S>& hprev, const View3<S>& Av, const LayerCotangents<S>& cot,
                 const ExecSpace& exec) {
  const index_t P = act.a.extent(0), N = act.a.extent(1), GN = act.beta.extent(1);
  const index_t nblk = impl::row_blocks(R);
  auto yhat = act.yhat;
  auto delta = act.delta;
  auto beta = act.beta;
  auto a = act.a;
  auto gyhat = cot.gyhat;
  auto gz = cot.gz;
  auto alog_part = cot.alog_part;
  auto d_part = cot.d_part;
  auto bd_part = cot.bd_part;
  Kokkos::parallel_for(
      "ash::vjp_channel", Range(exec, 0, nblk * P), KOKKOS_LAMBDA(const index_t i) {
        const index_t blk = i / P, q = i % P, gc = group_col(q, P, N, GN);
        const index_t r0 = blk * impl::reduce_rows, r1 = r0 + impl::reduce_rows < R ? r0 + impl::reduce_rows : R;
        for (index_t r = r0; r < r1; ++r) {
          const index_t m = map(r);
          gz(r, q) = 0;
          gyhat(r, q) = gy(m, q) * D(q);  // output term D_p ŷ_p
        }
        for (index_t n0 = 0; n0 < N; n0 += NT) {
          S av[NT], acc[NT];
          for (int j = 0; j < NT; ++j) {
            av[j] = a(q, n0 + j);
            acc[j] = 0;
          }
          for (index_t r = r0; r < r1; ++r) {
            const index_t m = map(r);
            const S dq = delta(m, q), yq = yhat(m, q), du = dq * yq;
            S gd[NT], gh[NT];
            for (int j = 0; j < NT; ++j) {
              const S mv = mu(r, q, n0 + j), hA = hprev(r, q, n0 + j) * Av(r, q, n0 + j), bn = beta(m, gc + n0 + j);
              gd[j] = mv * (hA * av[j] + bn * yq);
              gh[j] = mv * bn;
              acc[j] += mv * hA * dq;
              mu(r, q, n0 + j) = mv * du;
            }
            S sd = 0, sh = 0;
            for (int j = 0; j < NT; ++j) {
              sd += gd[j];
              sh += gh[j];
            }
            gz(r, q) += sd;  // gΔ for now; turned into ∂L/∂z below
            gyhat(r, q) += sh * dq;
          }
          for (int j = 0; j < NT; ++j) alog_part(blk, q, n0 + j) = acc[j];
        }
        S d = 0, bd = 0;
        for (index_t r = r0; r < r1; ++r) {
          const index_t m = map(r);
          const S gzr = -gz(r, q) * kmath::expm1(-delta(m, q));  // softplus'(z) = sigmoid(z) = 1 - e^{-Δ}
          gz(r, q) = gzr;
          d += gy(m, q) * yhat(m, q);
          bd += gzr;
        }
        d_part(blk, q) = d;
        bd_part(blk, q) = bd;
      });
}

// Per (token, group, state tile): ∂L/∂β^i_n = Σ_p μ Δ ŷ (μ already scaled) and
// ∂L/∂γ^i_n = Σ_p g^i_p h^i_pn, h^i = A^i h^{i-1} + Δ ŷ β, over the group's
// channels (every channel: one group).
template <int NT, class S, class Map>
void vjp_state(const LayerActivations<S>& act, const View2<S>& gy, const Map map, index_t R, const View3<S>& mu,
               const View3<S>& hprev, const View3<S>& Av, const LayerCotangents<S>& cot, const ExecSpace& exec) {
  const index_t P = act.a.extent(0), N = act.a.extent(1), G = act.beta.extent(1) / N, Pg = P / G;
  const index_t ntile = G * (N / NT);  // tiles over the G·N columns, a group's N in order
  auto yhat = act.yhat;
  auto delta = act.delta;
  auto beta = act.beta;
  auto gbeta = cot.gbeta;
  auto ggamma = cot.ggamma;
  Kokkos::parallel_for(
      "ash::vjp_state", Range(exec, 0, R * ntile), KOKKOS_LAMBDA(const index_t i) {
        const index_t r = i / ntile, n0 = (i % ntile) * NT, m = map(r);
        const index_t q0 = (n0 / N) * Pg, nn = n0 % N;  // the group's first channel, the tile's state
        S gb[NT], gg[NT], bv[NT];
        for (int j = 0; j < NT; ++j) {
          gb[j] = 0;
          gg[j] = 0;
          bv[j] = beta(m, n0 + j);
        }
        for (index_t q = q0; q < q0 + Pg; ++q) {
          const S du = delta(m, q) * yhat(m, q), g = gy(m, q);
          for (int j = 0; j < NT; ++j) {
            gb[j] += mu(r, q, nn + j);
            gg[j] += g * (Av(r, q, nn + j) * hprev(r, q, nn + j) + du * bv[j]);
          }
        }
        for (int j = 0; j < NT; ++j) {
          gbeta(r, n0 + j) = gb[j];
          ggamma(r, n0 + j) = gg[j];
        }
      });
}

template <class S>
void dense_vjps(const LayerParams<S>& p, const SeqShape& s, const View2<S>& y_in, const LayerActivations<S>& act,
                const View2<S>& gy, const BlockRows& rb, const LayerCotangents<S>& cot, const LayerParams<S>& grad,
                const View2<S>& gy_in, bool detach_input, const ExecSpace& exec);

}  // namespace

template <class S>
void ssm_layer_project(const LayerParams<S>& p, const View2<S>& y_in, const LayerActivations<S>& act,
                       const ExecSpace& exec) {
  impl::rms_norm_forward<S>(y_in, p.norm, act.rstd, act.yhat, exec);
  impl::gemm<S>(exec, "N", "T", S(1), act.yhat, p.W_delta, S(0), act.delta);
  selective_scan_inputs(p.W_B, p.W_C, p.A_log, p.b_delta, act, exec);
}

template <class S>
void selective_scan_inputs(const Unmanaged2<S>& W_B, const Unmanaged2<S>& W_C, const Unmanaged2<S>& A_log,
                           const Unmanaged1<S>& bias, const LayerActivations<S>& act, const ExecSpace& exec) {
  const index_t M = act.delta.extent(0), P = act.delta.extent(1);
  impl::gemm<S>(exec, "N", "T", S(1), act.yhat, W_B, S(0), act.beta);
  impl::gemm<S>(exec, "N", "T", S(1), act.yhat, W_C, S(0), act.gamma);
  impl::decay_rates(A_log, act.a, exec);
  auto delta = act.delta;
  auto bd = bias;
  // Two-dimensional: no 64-bit division per element (a host's cost here).
  Kokkos::parallel_for(
      "ash::layer_delta", Range2(exec, {0, 0}, {M, P}),
      KOKKOS_LAMBDA(const index_t m, const index_t q) { delta(m, q) = softplus(delta(m, q) + bd(q)); });
}

bool forward_scan_is_sequential(index_t T, index_t Bt, index_t P, const ExecSpace& exec) {
  return forward_chunks(T, Bt, P, exec).n == 1;
}

index_t forward_scan_chunks(index_t T, index_t Bt, index_t P, const ExecSpace& exec) {
  return forward_chunks(T, Bt, P, exec).n;
}

template <class S>
void ssm_layer_forward(const LayerParams<S>& p, const SeqShape& s, const View2<S>& y_in,
                       const LayerActivations<S>& act, const View2<S>& y_out, const View2<S>& state_io,
                       const ExecSpace& exec) {
  ssm_layer_project(p, y_in, act, exec);
  ssm_layer_scan(p, s, y_in, act, y_out, state_io, exec);
}

template <class S>
void ssm_layer_scan(const LayerParams<S>& p, const SeqShape& s, const View2<S>& y_in, const LayerActivations<S>& act,
                    const View2<S>& y_out, const View2<S>& state_io, const ExecSpace& exec) {
  selective_scan_forward(p.D, s, y_in, act, y_out, state_io, exec);
}

template <class S>
void selective_scan_forward(const Unmanaged1<S>& D, const SeqShape& s, const View2<S>& y_in,
                            const LayerActivations<S>& act, const View2<S>& y_out, const View2<S>& state_io,
                            const ExecSpace& exec) {
  const index_t T = s.T, Bt = s.batch, P = act.yhat.extent(1), N = act.a.extent(1);
  // The scan as a chunked parallel scan: h at every chunk end (chunk-local
  // scans, then a carry pass; skipped with one chunk), then every (sequence,
  // chunk, channel) replays its chunk from the boundary state.
  const impl::Chunks ch = forward_chunks(T, Bt, P, exec);
  const index_t nc = ch.n;
  const bool carry = state_io.extent(0) == std::size_t(Bt * P);
  const impl::ScanView<S> L{act.delta, act.yhat, act.beta, act.gamma, View2<S>(), act.a, T, s.docs};
  View3<S> Hb;
  if (nc > 1) {
    Hb = View3<S>(Kokkos::view_alloc(std::string("ash::fwd::h_boundary"), Kokkos::WithoutInitializing), Bt * nc, P, N);
    View3<S> pa(Kokkos::view_alloc(std::string("ash::fwd::chunk_products"), Kokkos::WithoutInitializing), Bt * nc, P,
                N);
    impl::boundary_states(L, ch, Bt, Hb, pa, carry ? state_io : View2<S>(), exec);
  }
  const View2<S> io = carry ? state_io : View2<S>();
  ASH_WITH_STATE_TILE(N, scan_replay<NT>(L, ch, Bt, Hb, io, D, y_in, y_out, act.hprev, act.A, exec));
  if (carry && nc > 1)
    Kokkos::parallel_for(
        "ash::layer_state_out", Range(exec, 0, Bt * P * N), KOKKOS_LAMBDA(const index_t i) {
          const index_t bq = i / N, n = i % N;
          state_io(bq, n) = Hb((bq / P) * nc + nc - 1, bq % P, n);
        });
}

template <class S>
void ssm_layer_state_map(const LayerParams<S>& p, const SeqShape& s, const LayerActivations<S>& act,
                         const View2<S>& prod, const View2<S>& h_local, const ExecSpace& exec) {
  const index_t T = s.T, Bt = s.batch, P = act.yhat.extent(1), N = p.W_B.extent(0);
  const index_t C = forward_chunk < T ? forward_chunk : T;
  const impl::Chunks ch(C, T);
  const index_t nc = ch.n;
  const impl::ScanView<S> L{act.delta, act.yhat, act.beta, act.gamma, View2<S>(), act.a, T, s.docs};
  View3<S> Hb("ash::fwd::h_boundary", Bt * nc, P, N);
  View3<S> PA("ash::fwd::chunk_products", Bt * nc, P, N);
  impl::boundary_states(L, ch, Bt, Hb, PA, View2<S>(), exec);  // PA keeps each chunk's Π A
  Kokkos::parallel_for(
      "ash::layer_state_map", Range(exec, 0, Bt * P * N), KOKKOS_LAMBDA(const index_t i) {
        const index_t bq = i / N, n = i % N, b = bq / P, q = bq % P;
        S pr = 1;
        for (index_t c = 0; c < nc; ++c) pr = PA(b * nc + c, q, n) * pr;
        prod(bq, n) = pr;
        h_local(bq, n) = Hb(b * nc + nc - 1, q, n);
      });
}

template <class S>
void ssm_layer_backward_rows(const LayerParams<S>& p, const SeqShape& s, const View2<S>& y_in,
                             const LayerActivations<S>& act, const View2<S>& gy, const BlockRows& rb,
                             const View3<S>& mu, const View3<S>& hprev, const View3<S>& Av,
                             const LayerCotangents<S>& cot, const LayerParams<S>& grad, const View2<S>& gy_in,
                             bool detach_input, const ExecSpace& exec) {
  // The scan core's VJPs (checks the buffers), then the layer's dense ones.
  selective_scan_backward_rows(p.D, s, act, gy, rb, mu, hprev, Av, cot,
                               ScanParamGrads<S>{grad.A_log, grad.D, grad.b_delta}, exec);
  dense_vjps(p, s, y_in, act, gy, rb, cot, grad, gy_in, detach_input, exec);
}

template <class S>
void selective_scan_backward_rows(const Unmanaged1<S>& D, const SeqShape& s, const LayerActivations<S>& act,
                                  const View2<S>& gy, const BlockRows& rb, const View3<S>& mu, const View3<S>& hprev,
                                  const View3<S>& Av, const LayerCotangents<S>& cot, const ScanParamGrads<S>& grad,
                                  const ExecSpace& exec) {
  const index_t N = act.a.extent(1), R = s.batch * rb.W;
  const index_t nblk = impl::row_blocks(R);
  require(rb.T == s.T, "selective_scan_backward_rows: the row block is of another window length");
  require(index_t(mu.extent(0)) >= R && index_t(hprev.extent(0)) >= R && index_t(Av.extent(0)) >= R &&
              index_t(cot.gyhat.extent(0)) >= R,
          "selective_scan_backward_rows: buffers smaller than the row block");
  const BlockRows map = rb;
  ASH_WITH_STATE_TILE(N, vjp_channel<NT>(act, gy, D, map, R, mu, hprev, Av, cot, exec));
  ASH_WITH_LANE_TILE(N, vjp_state<NT>(act, gy, map, R, mu, hprev, Av, cot, exec));
  selective_scan_param_sums(act, ParamPartials<S>{cot.alog_part, cot.d_part, cot.bd_part, nblk}, grad, exec);
}

template <class S>
void ssm_layer_backward_dense(const LayerParams<S>& p, const SeqShape& s, const View2<S>& y_in,
                              const LayerActivations<S>& act, const View2<S>& gy, const BlockRows& rb,
                              const LayerCotangents<S>& cot, const ParamPartials<S>& parts, const LayerParams<S>& grad,
                              const View2<S>& gy_in, bool detach_input, const ExecSpace& exec) {
  selective_scan_param_sums(act, parts, ScanParamGrads<S>{grad.A_log, grad.D, grad.b_delta}, exec);
  dense_vjps(p, s, y_in, act, gy, rb, cot, grad, gy_in, detach_input, exec);
}

template <class S>
void selective_scan_param_sums(const LayerActivations<S>& act, const ParamPartials<S>& parts,
                               const ScanParamGrads<S>& grad, const ExecSpace& exec) {
  const index_t P = act.a.extent(0), N = act.a.extent(1), nblk = parts.n;
  // Sums over row blocks, in a fixed order.
  auto gAlog = grad.A_log;
  auto gD = grad.D;
  auto gbd = grad.bias;
  auto a = act.a;
  auto alog_part = parts.alog;
  auto d_part = parts.d;
  auto bd_part = parts.bd;
  Kokkos::parallel_for(
      "ash::vjp_param_sums", impl::block_sum_policy(exec, P * N), KOKKOS_LAMBDA(const impl::BlockSumMember& team) {
        const index_t i = team.league_rank(), q = i / N, n = i % N;
        const S al = impl::team_block_sum<S>(team, nblk, [&](const index_t blk) { return alog_part(blk, q, n); });
        Kokkos::single(Kokkos::PerTeam(team), [&]() { gAlog(q, n) += al * a(q, n); });  // ∂a/∂Alog = a
        if (n == 0) {
          const S d = impl::team_block_sum<S>(team, nblk, [&](const index_t blk) { return d_part(blk, q); });
          const S bd = impl::team_block_sum<S>(team, nblk, [&](const index_t blk) { return bd_part(blk, q); });
          Kokkos::single(Kokkos::PerTeam(team), [&]() {
            gD(q) += d;
            gbd(q) += bd;
          });
        }
      });
}

namespace {

// The SSM-ResNet's dense VJPs over a row block (ssm_layer_backward_dense after the scan's parameter sums).
template <class S>
void dense_vjps(const LayerParams<S>& p, const SeqShape& s, const View2<S>& y_in, const LayerActivations<S>& act,
                const View2<S>& gy, const BlockRows& rb, const LayerCotangents<S>& cot, const LayerParams<S>& grad,
                const View2<S>& gy_in, bool detach_input, const ExecSpace& exec) {
  const index_t T = s.T, P = act.yhat.extent(1);
  const index_t W = rb.W, t0 = rb.t0, R = s.batch * W;
  require(rb.T == T, "ssm_layer_backward_dense: the row block is of another window length");
  const BlockRows map = rb;

  // Dense VJPs over the block's rows, one GEMM each: weight gradients over
  // tokens, their input VJPs into ∂L/∂ŷ, then the RMSNorm VJP gives the
  // input's. The rows of ŷ are contiguous for one sequence or a whole window;
  // otherwise they are gathered first. gy was read for the last time above, so
  // gy_in may be gy itself (in place); detached, the input gets gy by identity
  // and only the norm weight uses ∂L/∂ŷ.
  const auto rows = Kokkos::make_pair(index_t(0), R);
  const auto all = Kokkos::ALL();
  View2<S> yh;
  if (s.batch == 1 || W == T) {
    yh = Kokkos::subview(act.yhat, Kokkos::make_pair(t0, t0 + R), all);
  } else {
    auto yhat = act.yhat;
    auto yr = cot.yhat_rows;
    Kokkos::parallel_for(
        "ash::gather_yhat_rows", Range(exec, 0, R * P),
        KOKKOS_LAMBDA(const index_t i) { yr(i / P, i % P) = yhat(map(i / P), i % P); });
    yh = Kokkos::subview(cot.yhat_rows, rows, all);
  }
  auto gz_b = Kokkos::subview(cot.gz, rows, all);
  auto gb_b = Kokkos::subview(cot.gbeta, rows, all);
  auto gg_b = Kokkos::subview(cot.ggamma, rows, all);
  auto gyh_b = Kokkos::subview(cot.gyhat, rows, all);
  impl::gemm<S>(exec, "T", "N", S(1), gz_b, yh, S(1), grad.W_delta);
  impl::gemm<S>(exec, "T", "N", S(1), gb_b, yh, S(1), grad.W_B);
  impl::gemm<S>(exec, "T", "N", S(1), gg_b, yh, S(1), grad.W_C);
  impl::gemm<S>(exec, "N", "N", S(1), gz_b, p.W_delta, S(1), gyh_b);
  impl::gemm<S>(exec, "N", "N", S(1), gb_b, p.W_B, S(1), gyh_b);
  impl::gemm<S>(exec, "N", "N", S(1), gg_b, p.W_C, S(1), gyh_b);
  if (gy_in.data() != gy.data()) {
    Kokkos::parallel_for(
        "ash::copy_gy_rows", Range(exec, 0, R * P),
        KOKKOS_LAMBDA(const index_t i) { gy_in(map(i / P), i % P) = gy(map(i / P), i % P); });
  }
  if (detach_input)
    impl::rms_norm_backward<S>(y_in, p.norm, act.rstd, gyh_b, grad.norm, View2<S>(), true, cot.norm_part, exec, map);
  else
    impl::rms_norm_backward<S>(y_in, p.norm, act.rstd, gyh_b, grad.norm, gy_in, true, cot.norm_part, exec, map);
}

}  // namespace

#define ASH_INSTANTIATE(S)                                                                                            \
  template struct LayerActivations<S>;                                                                                \
  template struct LayerCotangents<S>;                                                                                 \
  template void ssm_layer_project<S>(const LayerParams<S>&, const View2<S>&, const LayerActivations<S>&,              \
                                     const ExecSpace&);                                                               \
  template void ssm_layer_forward<S>(const LayerParams<S>&, const SeqShape&, const View2<S>&,                         \
                                     const LayerActivations<S>&, const View2<S>&, const View2<S>&, const ExecSpace&); \
  template void ssm_layer_scan<S>(const LayerParams<S>&, const SeqShape&, const View2<S>&,                            \
                                  const LayerActivations<S>&, const View2<S>&, const View2<S>&, const ExecSpace&);    \
  template void ssm_layer_state_map<S>(const LayerParams<S>&, const SeqShape&, const LayerActivations<S>&,            \
                                       const View2<S>&, const View2<S>&, const ExecSpace&);                           \
  template void ssm_layer_backward_rows<S>(                                                                           \
      const LayerParams<S>&, const SeqShape&, const View2<S>&, const LayerActivations<S>&, const View2<S>&,           \
      const BlockRows&, const View3<S>&, const View3<S>&, const View3<S>&, const LayerCotangents<S>&,                 \
      const LayerParams<S>&, const View2<S>&, bool, const ExecSpace&);                                                \
  template void ssm_layer_backward_dense<S>(const LayerParams<S>&, const SeqShape&, const View2<S>&,                  \
                                            const LayerActivations<S>&, const View2<S>&, const BlockRows&,            \
                                            const LayerCotangents<S>&, const ParamPartials<S>&,                       \
                                            const LayerParams<S>&, const View2<S>&, bool, const ExecSpace&);          \
  template void selective_scan_inputs<S>(const Unmanaged2<S>&, const Unmanaged2<S>&, const Unmanaged2<S>&,            \
                                         const Unmanaged1<S>&, const LayerActivations<S>&, const ExecSpace&);         \
  template void selective_scan_forward<S>(const Unmanaged1<S>&, const SeqShape&, const View2<S>&,                     \
                                          const LayerActivations<S>&, const View2<S>&, const View2<S>&,               \
                                          const ExecSpace&);                                                          \
  template void selective_scan_backward_rows<S>(const Unmanaged1<S>&, const SeqShape&, const LayerActivations<S>&,    \
                                                const View2<S>&, const BlockRows&, const View3<S>&, const View3<S>&,  \
                                                const View3<S>&, const LayerCotangents<S>&, const ScanParamGrads<S>&, \
                                                const ExecSpace&);                                                    \
  template void selective_scan_param_sums<S>(const LayerActivations<S>&, const ParamPartials<S>&,                     \
                                             const ScanParamGrads<S>&, const ExecSpace&);
ASH_INSTANTIATE(float)
ASH_INSTANTIATE(double)

}  // namespace ash
