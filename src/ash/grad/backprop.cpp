#include "ash/grad/backprop.hpp"

#include "ash/core/error.hpp"
#include "ash/kernels/blocks.hpp"

namespace ash {

namespace {

// μ^t = gy^t_p γ^t_n + A^{t+1} μ^{t+1}: the adjoint of h, a reverse scan over
// t per (sequence, channel, state) with A^{t+1} from the stored values, as a
// chunked scan (chunks of C = grad.chunk tokens) so a GPU gets Bt·(T/C)·P·N
// threads, not Bt·P·N: each chunk's local carry-out and product of A in
// parallel, a short pass over chunks for the carry into each, then every chunk
// again from its carry. C >= T is the plain loop.
// The chunks of the reverse scan over windows of T tokens.
TokenBlocks scan_chunks(index_t chunk, index_t T) { return TokenBlocks(chunk < T ? chunk : T, T); }

// cin: the carry into each chunk, [Bt·nc, P, N]; out and prod (nc > 1): each
// chunk's local carry-out and product of A.
template <class S>
void reverse_scan(const SeqShape& s, const LayerActivations<S>& act, const View2<S>& gy, const View3<S>& mu,
                  index_t chunk, const View3<S>& cin, const View3<S>& out, const View3<S>& prod,
                  const ExecSpace& exec) {
  const index_t T = s.T, Bt = s.batch, P = act.yhat.extent(1), N = act.a.extent(1), GN = act.gamma.extent(1);
  const TokenBlocks ch = scan_chunks(chunk, T);
  const index_t nc = ch.n;
  auto A = act.A;
  auto gamma = act.gamma;
  // cin: carry in at the end of chunk c (A^{t1} μ^{t1}; 0 for the last chunk)
  if (nc > 1) {
    Kokkos::parallel_for(
        "ash::e1::chunk_local", Range(exec, 0, Bt * nc * P * N), KOKKOS_LAMBDA(const index_t i) {
          const index_t bc = i / (P * N), q = (i / N) % P, n = i % N, b = bc / nc, c = bc % nc;
          const index_t t0 = ch.start(c), t1 = ch.end(c), gn = group_col(q, P, N, GN) + n;
          S carry = 0, pr = 1;
          for (index_t t = t1 - 1; t >= t0; --t) {
            const index_t m = b * T + t;
            carry = (gy(m, q) * gamma(m, gn) + carry) * A(m, q, n);
            pr *= A(m, q, n);
          }
          out(bc, q, n) = carry;
          prod(bc, q, n) = pr;
        });
    Kokkos::parallel_for(
        "ash::e1::chunk_carries", Range(exec, 0, Bt * P * N), KOKKOS_LAMBDA(const index_t i) {
          const index_t b = i / (P * N), q = (i / N) % P, n = i % N;
          S c_in = 0;
          for (index_t c = nc - 1; c >= 0; --c) {
            cin(b * nc + c, q, n) = c_in;
            c_in = out(b * nc + c, q, n) + prod(b * nc + c, q, n) * c_in;
          }
        });
  } else {
    Kokkos::deep_copy(exec, cin, S(0));
  }
  Kokkos::parallel_for(
      "ash::e1::reverse_scan", Range(exec, 0, Bt * nc * P * N), KOKKOS_LAMBDA(const index_t i) {
        const index_t bc = i / (P * N), q = (i / N) % P, n = i % N, b = bc / nc, c = bc % nc;
        const index_t t0 = ch.start(c), t1 = ch.end(c), gn = group_col(q, P, N, GN) + n;
        S carry = cin(bc, q, n);
        for (index_t t = t1 - 1; t >= t0; --t) {
          const index_t m = b * T + t;
          carry = gy(m, q) * gamma(m, gn) + carry;
          mu(m, q, n) = carry;
          carry *= A(m, q, n);  // becomes A^{t} μ^{t} for step t-1
        }
      });
}

// reverse_scan with its carries from ws (e1_scan_workspace's buffers).
template <class S>
void reverse_scan(const SeqShape& s, const LayerActivations<S>& act, const View2<S>& gy, const View3<S>& mu,
                  index_t chunk, const Workspace<S>& ws, const ExecSpace& exec) {
  const bool chunks = scan_chunks(chunk, s.T).n > 1;
  reverse_scan(s, act, gy, mu, chunk, ws.view3("ash::e1::chunk_carry"),
               chunks ? ws.view3("ash::e1::chunk_out") : View3<S>(),
               chunks ? ws.view3("ash::e1::chunk_prod") : View3<S>(), exec);
}

}  // namespace

WorkspaceSpec e1_scan_workspace(index_t chunk, const LayerShape& sh) {
  const index_t nc = scan_chunks(chunk, sh.T).n, rows = sh.batch * nc;
  WorkspaceSpec w;
  w.add("ash::e1::chunk_carry", sh.scalar_bytes, {rows, sh.P, sh.N}, false);
  if (nc > 1) {
    w.add("ash::e1::chunk_out", sh.scalar_bytes, {rows, sh.P, sh.N}, false);
    w.add("ash::e1::chunk_prod", sh.scalar_bytes, {rows, sh.P, sh.N}, false);
  }
  return w;
}

WorkspaceSpec backprop_workspace(const EngineOptions& opts, const LayerShape& sh, bool cotangents) {
  return window_workspace("ash::e1::mu", sh, cotangents).append(e1_scan_workspace(opts.chunk, sh));
}

template <class S>
BackpropLayer<S>::BackpropLayer(const EngineOptions& opts) : opts_(opts) {
  require(opts.truncate == 0, "engine 'backprop' has no window: grad.truncate applies to adjoint engines only");
}

template <class S>
template <class K>
void BackpropLayer<S>::backward_kind(const typename K::template Params<S>& p, const ModelDims& d, int k,
                                     ActivationStore<S>& store, const View2<S>& g,
                                     const typename K::template Params<S>& grad) {
  const auto& s = store.shape();
  const ExecSpace& exec = this->exec_;
  work_.plan(backprop_workspace(opts_, K::template scan_shape<S>(s, d), K::window_cotangents));
  const View3<S> mu = work_.view3("ash::e1::mu");
  const FormMu<S> form_mu = [&](const LayerActivations<S>& scan, const View2<S>& gy) {
    reverse_scan(s, scan, gy, mu, opts_.chunk, work_, exec);
  };
  K::backward_window(p, d, store, k, g, opts_.detach_inputs, form_mu, mu, work_, scratch_.template get<K>(), grad,
                     exec);
}

template <class S>
void BackpropLayer<S>::release() {
  work_.release();
  scratch_.release();
}

template class BackpropLayer<float>;
template class BackpropLayer<double>;

}  // namespace ash
