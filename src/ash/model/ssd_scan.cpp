#include "ash/model/ssd_scan.hpp"

#include <map>

#include "ash/core/error.hpp"
#include "ash/kernels/blas.hpp"

namespace ash {

std::vector<SsdBuffer> ssd_buffers(const SsdShape& sh, bool backward) {
  const index_t H = sh.heads, P = sh.head_dim, G = sh.groups, N = sh.state, Q = sh.chunk;
  std::vector<SsdBuffer> b = {
      {"ash::ssd::X", {H, Q, P}},    {"ash::ssd::Y", {H, Q, P}},   {"ash::ssd::Tp", {H, Q, P}},
      {"ash::ssd::B", {G, Q, N}},    {"ash::ssd::C", {G, Q, N}},   {"ash::ssd::Ts", {H, Q, N}},
      {"ash::ssd::CB", {G, Q, Q}},   {"ash::ssd::MD", {H, Q, Q}},  {"ash::ssd::dt", {H, Q}},
      {"ash::ssd::L", {H, Q}},       {"ash::ssd::din", {H, Q}},    {"ash::ssd::dout", {H, Q}},
      {"ash::ssd::seg", {Q}},        {"ash::ssd::H0", {H, P, N}},  {"ash::ssd::Hn", {H, P, N}}};
  if (backward) {
    const std::vector<SsdBuffer> more = {
        {"ash::ssd::G", {H, Q, P}},   {"ash::ssd::dX", {H, Q, P}},  {"ash::ssd::dB", {G, Q, N}},
        {"ash::ssd::dC", {G, Q, N}},  {"ash::ssd::WD", {H, Q, Q}},  {"ash::ssd::GX", {H, Q, Q}},
        {"ash::ssd::XR", {H, Q, N}},  {"ash::ssd::HC", {H, Q, N}},  {"ash::ssd::colk", {H, Q}},
        {"ash::ssd::dl", {H, Q}},     {"ash::ssd::cs", {H, Q}},     {"ash::ssd::R", {H, P, N}},
        {"ash::ssd::acc", {2 * H}},   {"ash::ssd::starts", {sh.batch * sh.chunks() * H, P, N}}};
    b.insert(b.end(), more.begin(), more.end());
  }
  return b;
}

namespace impl {  // (external linkage: nvcc refuses a KOKKOS_LAMBDA in a function with internal linkage)

using SegView = Kokkos::View<index_t*, Kokkos::LayoutRight, MemSpace>;  // SsdScan's seg_

// e^v for a log-decay v ≤ 0, flushed to zero well above the subnormal range
// (e^-60 ≈ 1e-26 in float, e^-600 in double), so that no product of a decay
// with an operand goes subnormal: the GEMMs and state updates slow down many
// times over on subnormal operands, for terms far below S's precision.
template <class S>
KOKKOS_INLINE_FUNCTION S decay(S v) {
  constexpr S lowest = sizeof(S) == 4 ? S(-60.0) : S(-600.0);
  return v < lowest ? S(0) : kmath::exp(v);
}

// The inputs of chunk [t0, t0 + len) of sequence b, zero-padded to Q rows (a
// padded row has Δ = 0, x = B = C = g = 0: it adds nothing and decays nothing),
// its cumulative log-decays and the decays in and out of the chunk. A document
// start at row i puts i in a new segment: paths across it have decay 0.
template <class S>
void ssd_pack(const SsdShape& sh, const typename SsdScan<S>::Chunk& ck, const SegView& seg,
              const LayerActivations<S>& act, const View2<S>& gs, const DocStarts& docs, index_t b, index_t t0,
              const ExecSpace& exec) {
  const index_t H = sh.heads, P = sh.head_dim, G = sh.groups, N = sh.state, Q = sh.chunk, T = sh.T;
  const index_t len = T - t0 < Q ? T - t0 : Q, m0 = b * T + t0;
  auto x = act.yhat;
  auto delta = act.delta;
  auto beta = act.beta;
  auto gamma = act.gamma;
  auto a = act.a;
  auto X = ck.X;
  auto Gv = ck.G;
  auto Bq = ck.Bq;
  auto Cq = ck.Cq;
  auto dt = ck.dt;
  auto L = ck.L;
  auto din = ck.din;
  auto dout = ck.dout;
  const bool with_g = gs.extent(0) > 0;
  Kokkos::parallel_for(
      "ash::ssd::pack_x", Range(exec, 0, H * Q), KOKKOS_LAMBDA(const index_t i) {
        const index_t h = i / Q, r = i % Q;
        const bool valid = r < len;
        for (index_t p = 0; p < P; ++p) {
          X(h, r, p) = valid ? x(m0 + r, h * P + p) : S(0);
          if (with_g) Gv(h, r, p) = valid ? gs(m0 + r, h * P + p) : S(0);
        }
        if (h < G)
          for (index_t n = 0; n < N; ++n) {
            Bq(h, r, n) = valid ? beta(m0 + r, h * N + n) : S(0);
            Cq(h, r, n) = valid ? gamma(m0 + r, h * N + n) : S(0);
          }
      });
  Kokkos::parallel_for(
      "ash::ssd::segments", Range(exec, 0, 1), KOKKOS_LAMBDA(const index_t) {
        index_t sg = 0;
        for (index_t r = 0; r < Q; ++r) {
          if (r < len && docs.at(b, t0 + r)) ++sg;
          seg(r) = sg;
        }
      });
  Kokkos::parallel_for(
      "ash::ssd::decays", Range(exec, 0, H), KOKKOS_LAMBDA(const index_t h) {
        const S ah = a(h * P, 0);
        S cum = 0;
        for (index_t r = 0; r < Q; ++r) {
          const S d = r < len ? delta(m0 + r, h * P) : S(0);
          dt(h, r) = d;
          cum += d * ah;
          L(h, r) = cum;
        }
        const S Lend = L(h, Q - 1);
        const index_t send = seg(Q - 1);
        for (index_t r = 0; r < Q; ++r) {
          din(h, r) = seg(r) == 0 ? decay(L(h, r)) : S(0);
          dout(h, r) = seg(r) == send ? decay(Lend - L(h, r)) : S(0);
        }
      });
}

// The decay mask dec_sj of head h: e^{L_s−L_j} for j ≤ s in one segment, else 0.
template <class S>
KOKKOS_INLINE_FUNCTION S masked_decay(const SegView& seg, const View2<S>& L, index_t h, index_t s, index_t j) {
  return j <= s && seg(j) == seg(s) ? decay(L(h, s) - L(h, j)) : S(0);
}

// MD(h, s, j) = (C_s·B_j) dec_sj Δ_j: s = MD x.
template <class S>
void ssd_intra_matrix(const SsdShape& sh, const typename SsdScan<S>::Chunk& ck, const SegView& seg,
                      const ExecSpace& exec) {
  const index_t H = sh.heads, Q = sh.chunk, Hg = H / sh.groups;
  auto CB = ck.CB;
  auto MD = ck.MD;
  auto dt = ck.dt;
  auto L = ck.L;
  Kokkos::parallel_for(
      "ash::ssd::intra_matrix", Range(exec, 0, H * Q), KOKKOS_LAMBDA(const index_t i) {
        const index_t h = i / Q, s = i % Q, g = h / Hg;
        for (index_t j = 0; j < Q; ++j) MD(h, s, j) = CB(g, s, j) * masked_decay(seg, L, h, s, j) * dt(h, j);
      });
}

// Ts(h, i, ·) = w(h, i) V(g(h), i, ·) for a [G, Q, ·] view V and weights w(h, i) = f(h, i).
template <class S, class F>
void ssd_scale_rows(const char* label, const View3<S>& out, const View3<S>& in, index_t Hg, const F& w,
                    const ExecSpace& exec) {
  const index_t H = out.extent(0), Q = out.extent(1), K = out.extent(2);
  Kokkos::parallel_for(
      label, Range(exec, 0, H * Q), KOKKOS_LAMBDA(const index_t i) {
        const index_t h = i / Q, r = i % Q;
        const S f = w(h, r);
        for (index_t k = 0; k < K; ++k) out(h, r, k) = f * in(h / Hg, r, k);
      });
}

// Hn(h) = din(h, Q−1) H0(h): the start state carried to the chunk's end.
template <class S>
void ssd_carry_state(const View3<S>& out, const View3<S>& in, const View2<S>& din, const ExecSpace& exec) {
  const index_t H = out.extent(0), P = out.extent(1), N = out.extent(2), Q = din.extent(1);
  Kokkos::parallel_for(
      "ash::ssd::carry_state", Range(exec, 0, H * P), KOKKOS_LAMBDA(const index_t i) {
        const index_t h = i / P, p = i % P;
        const S f = din(h, Q - 1);
        for (index_t n = 0; n < N; ++n) out(h, p, n) = f * in(h, p, n);
      });
}

// state [Bt·E, N] (rows b·E + h·P + p) of sequence b to or from H [H, P, N].
template <class S>
void ssd_state_io(const View2<S>& state, const View3<S>& Hv, index_t b, bool to_state, const ExecSpace& exec) {
  const index_t H = Hv.extent(0), P = Hv.extent(1), N = Hv.extent(2), E = H * P;
  Kokkos::parallel_for(
      "ash::ssd::state_io", Range(exec, 0, E), KOKKOS_LAMBDA(const index_t e) {
        for (index_t n = 0; n < N; ++n) {
          if (to_state)
            state(b * E + e, n) = Hv(e / P, e % P, n);
          else
            Hv(e / P, e % P, n) = state(b * E + e, n);
        }
      });
}

// The reverse mode's elementwise Q×Q pass per (head, row s): WD(h, s, j) =
// (g_s·x_j) e^{L_s−L_j} Δ_j (∂L/∂C = WD B, ∂L/∂B = WDᵀ C), and in GX's place
// K'(s, j) = (g_s·x_j)(C_s·B_j) e^{L_s−L_j}; dl(h, s) = Σ_{j<s} K' Δ_j.
template <class S>
void ssd_reverse_matrices(const SsdShape& sh, const typename SsdScan<S>::Chunk& ck, const SegView& seg,
                          const ExecSpace& exec) {
  const index_t H = sh.heads, Q = sh.chunk, Hg = H / sh.groups;
  auto CB = ck.CB;
  auto GX = ck.GX;
  auto MD = ck.MD;
  auto WD = ck.WD;
  auto dt = ck.dt;
  auto L = ck.L;
  auto dl = ck.dl;
  Kokkos::parallel_for(
      "ash::ssd::reverse_matrices", Range(exec, 0, H * Q), KOKKOS_LAMBDA(const index_t i) {
        const index_t h = i / Q, s = i % Q, g = h / Hg;
        S row = 0;
        for (index_t j = 0; j < Q; ++j) {
          const S dec = masked_decay(seg, L, h, s, j), gx = GX(h, s, j) * dec, cb = CB(g, s, j);
          MD(h, s, j) = cb * dec * dt(h, j);
          WD(h, s, j) = gx * dt(h, j);
          const S k = gx * cb;
          GX(h, s, j) = k;
          if (j < s) row += k * dt(h, j);
        }
        dl(h, s) = row;
      });
  auto colk = ck.colk;
  auto cs = ck.cs;
  Kokkos::parallel_for(
      "ash::ssd::reverse_columns", Range(exec, 0, H * Q), KOKKOS_LAMBDA(const index_t i) {
        const index_t h = i / Q, j = i % Q;
        S col = 0;
        for (index_t s = j; s < Q; ++s) col += GX(h, s, j);
        colk(h, j) = col;                         // Σ_{s≥j} K'(s, j): ∂L/∂Δ_j's intra-chunk direct part
        cs(h, j) = dt(h, j) * (col - GX(h, j, j));  // Σ_{s>j} K'(s, j) Δ_j
      });
}

// Per head, serially over the chunk's rows: ∂L/∂Δ and ∂L/∂ℓ, then ∂L/∂Δ_i =
// direct + a_h ∂L/∂ℓ_i into gdelta's rows, and acc(h) += Σ Δ ∂L/∂ℓ, acc(H + h) += Σ g·x.
//   direct_i = Σ_{s≥i} K'(s, i) + dout_i (xᵢᵀ R B_i)
//   ∂L/∂ℓ_t = Σ_{s≥t} Σ_{j<t} K'(s, j) Δ_j + Σ_{s≥t} din_s g_sᵀ H₀ C_s + Σ_{j<t} Δ_j dout_j x_jᵀ R B_j
//             + din_{Q−1} ⟨R, H₀⟩
template <class S>
void ssd_reverse_rows(const SsdShape& sh, const typename SsdScan<S>::Chunk& ck, const LayerActivations<S>& act,
                      const View2<S>& gdelta, index_t b, index_t t0, const ExecSpace& exec) {
  const index_t H = sh.heads, P = sh.head_dim, N = sh.state, Q = sh.chunk, T = sh.T, Hg = H / sh.groups;
  const index_t len = T - t0 < Q ? T - t0 : Q, m0 = b * T + t0;
  auto a = act.a;
  auto X = ck.X;
  auto Gv = ck.G;
  auto Bq = ck.Bq;
  auto Cq = ck.Cq;
  auto XR = ck.XR;
  auto HC = ck.HC;
  auto dt = ck.dt;
  auto din = ck.din;
  auto dout = ck.dout;
  auto colk = ck.colk;
  auto cs = ck.cs;
  auto dl = ck.dl;
  auto R = ck.R;
  auto H0 = ck.H0;
  auto acc = ck.acc;
  Kokkos::parallel_for(
      "ash::ssd::reverse_rows", Range(exec, 0, H), KOKKOS_LAMBDA(const index_t h) {
        const index_t g = h / Hg;
        const S ah = a(h * P, 0);
        S cst = 0;
        for (index_t p = 0; p < P; ++p)
          for (index_t n = 0; n < N; ++n) cst += R(h, p, n) * H0(h, p, n);
        cst *= din(h, Q - 1);
        // Forward: the state terms w_j (prefix sums), direct parts (in colk).
        S wpre = 0;
        for (index_t i = 0; i < Q; ++i) {
          S xrb = 0;
          for (index_t n = 0; n < N; ++n) xrb += XR(h, i, n) * Bq(g, i, n);
          xrb *= dout(h, i);
          const S w = dt(h, i) * xrb;
          colk(h, i) += xrb;  // direct_i
          const S r = dl(h, i);
          dl(h, i) = wpre;  // Σ_{j<i} w_j for now
          wpre += w;
          cs(h, i) = r - cs(h, i);  // S_t − S_{t+1} = r_t − c_t
        }
        // Backward: S_t and the output terms v_s (suffix sums).
        S ssum = 0, vsuf = 0, sa = 0, sd = 0;
        for (index_t i = Q - 1; i >= 0; --i) {
          S v = 0;
          for (index_t n = 0; n < N; ++n) v += Cq(g, i, n) * HC(h, i, n);
          vsuf += din(h, i) * v;
          ssum += cs(h, i);
          const S dli = ssum + vsuf + dl(h, i) + cst;
          dl(h, i) = dli;
          sa += dt(h, i) * dli;
          S gx = 0;
          for (index_t p = 0; p < P; ++p) gx += Gv(h, i, p) * X(h, i, p);
          sd += gx;
          if (i < len) gdelta(m0 + i, h) = colk(h, i) + ah * dli;
        }
        acc(h) += sa;
        acc(H + h) += sd;
      });
}

// ∂L/∂x, ∂L/∂B, ∂L/∂C of the chunk's valid rows into the window's.
template <class S>
void ssd_unpack_grads(const SsdShape& sh, const typename SsdScan<S>::Chunk& ck, const Unmanaged1<S>& D,
                      const SsdGrads<S>& out, index_t b, index_t t0, const ExecSpace& exec) {
  const index_t H = sh.heads, P = sh.head_dim, G = sh.groups, N = sh.state, Q = sh.chunk, T = sh.T;
  const index_t len = T - t0 < Q ? T - t0 : Q, m0 = b * T + t0;
  auto dX = ck.dX;
  auto Gv = ck.G;
  auto dB = ck.dB;
  auto dC = ck.dC;
  auto gx = out.gx;
  auto gb = out.gbeta;
  auto gc = out.ggamma;
  Kokkos::parallel_for(
      "ash::ssd::unpack_grads", Range(exec, 0, H * len), KOKKOS_LAMBDA(const index_t i) {
        const index_t h = i / len, r = i % len;
        const S d = D(h * P);
        for (index_t p = 0; p < P; ++p) gx(m0 + r, h * P + p) = dX(h, r, p) + d * Gv(h, r, p);
        if (h < G)
          for (index_t n = 0; n < N; ++n) {
            gb(m0 + r, h * N + n) = dB(h, r, n);
            gc(m0 + r, h * N + n) = dC(h, r, n);
          }
      });
}

// s = Y + D x of the chunk's valid rows.
template <class S>
void ssd_unpack_output(const SsdShape& sh, const typename SsdScan<S>::Chunk& ck, const Unmanaged1<S>& D,
                       const View2<S>& s, index_t b, index_t t0, const ExecSpace& exec) {
  const index_t H = sh.heads, P = sh.head_dim, Q = sh.chunk, T = sh.T;
  const index_t len = T - t0 < Q ? T - t0 : Q, m0 = b * T + t0;
  auto Y = ck.Y;
  auto X = ck.X;
  Kokkos::parallel_for(
      "ash::ssd::unpack_output", Range(exec, 0, H * len), KOKKOS_LAMBDA(const index_t i) {
        const index_t h = i / len, r = i % len;
        const S d = D(h * P);
        for (index_t p = 0; p < P; ++p) s(m0 + r, h * P + p) = Y(h, r, p) + d * X(h, r, p);
      });
}

template <class S>
void ssd_accumulate_heads(const View1<S>& acc, const SsdGrads<S>& out, index_t H, const ExecSpace& exec) {
  auto ga = out.ga;
  auto gD = out.gD;
  Kokkos::parallel_for(
      "ash::ssd::head_sums", Range(exec, 0, H), KOKKOS_LAMBDA(const index_t h) {
        ga(h) += acc(h);
        gD(h) += acc(H + h);
      });
}

}  // namespace impl

namespace {

// Matrix i of a [n, r, c] view, as a [r, c] view for impl::gemm.
template <class S>
Unmanaged2<S> sub(const View3<S>& v, index_t i) {
  return Unmanaged2<S>(v.data() + i * index_t(v.stride(0)), v.extent(1), v.extent(2));
}

}  // namespace

namespace impl {

// CB(g) = C Bᵀ of every group's chunk.
template <class S>
void ssd_gram(const typename SsdScan<S>::Chunk& ck, index_t G, const ExecSpace& exec) {
  for (index_t g = 0; g < G; ++g) gemm<S>(exec, "N", "T", S(1), sub(ck.Cq, g), sub(ck.Bq, g), S(0), sub(ck.CB, g));
}

// cur ← din_{Q−1} cur + Σ_r w(h, r) V(h, r)ᵀ right(g(h), r) per head: a state carried
// across the chunk (forward: H₀ with V = x, w = dout Δ, right = B; reverse: R with
// V = g, w = din, right = C).
template <class S, class W>
void ssd_next_state(const char* label, const typename SsdScan<S>::Chunk& ck, const View3<S>& cur, const View3<S>& V,
                    const W& w, const View3<S>& right, index_t Hg, const ExecSpace& exec) {
  ssd_scale_rows<S>(label, ck.Tp, V, 1, w, exec);
  ssd_carry_state<S>(ck.Hn, cur, ck.din, exec);
  for (index_t h = 0; h < index_t(cur.extent(0)); ++h)
    gemm<S>(exec, "T", "N", S(1), sub(ck.Tp, h), sub(right, h / Hg), S(1), sub(ck.Hn, h));
  Kokkos::deep_copy(exec, cur, ck.Hn);
}

}  // namespace impl

template <class S>
SsdScan<S>::SsdScan(const SsdShape& sh, bool backward) : sh_(sh) {
  require(sh.heads >= 1 && sh.groups >= 1 && sh.heads % sh.groups == 0 && sh.chunk >= 1 && sh.T >= 1,
          "SsdScan: heads must be a multiple of the groups, chunk and T positive");
  Chunk& c = c_;
  const std::map<std::string, View3<S>*> v3 = {
      {"X", &c.X},   {"Y", &c.Y},   {"Tp", &c.Tp}, {"B", &c.Bq},  {"C", &c.Cq}, {"Ts", &c.Ts}, {"CB", &c.CB},
      {"MD", &c.MD}, {"H0", &c.H0}, {"Hn", &c.Hn}, {"G", &c.G},   {"dX", &c.dX}, {"dB", &c.dB}, {"dC", &c.dC},
      {"WD", &c.WD}, {"GX", &c.GX}, {"XR", &c.XR}, {"HC", &c.HC}, {"R", &c.R},  {"starts", &starts_}};
  const std::map<std::string, View2<S>*> v2 = {{"dt", &c.dt},     {"L", &c.L},   {"din", &c.din}, {"dout", &c.dout},
                                               {"colk", &c.colk}, {"dl", &c.dl}, {"cs", &c.cs}};
  // Allocated as ssd_buffers lists them (zeroed: a GEMM with beta 0 may still read its output).
  for (const SsdBuffer& buf : ssd_buffers(sh, backward)) {
    const auto& e = buf.extents;
    const std::string name = buf.label.substr(std::string("ash::ssd::").size());
    if (name == "seg")
      seg_ = decltype(seg_)(buf.label, e.at(0));
    else if (name == "acc")
      c.acc = View1<S>(buf.label, e.at(0));
    else if (e.size() == 2)
      *v2.at(name) = View2<S>(buf.label, e[0], e[1]);
    else
      *v3.at(name) = View3<S>(buf.label, e.at(0), e.at(1), e.at(2));
  }
}

template <class S>
void SsdScan<S>::forward(const LayerActivations<S>& act, const Unmanaged1<S>& D, const DocStarts& docs,
                         const View2<S>& s, const View2<S>& state_io, const ExecSpace& exec) {
  const SsdShape& sh = sh_;
  const index_t H = sh.heads, G = sh.groups, Hg = H / G, Q = sh.chunk, nc = sh.chunks();
  const bool carry = state_io.extent(0) > 0;
  const Chunk& ck = c_;
  auto dout = ck.dout;
  auto dt = ck.dt;
  auto din = ck.din;
  for (index_t b = 0; b < sh.batch; ++b) {
    if (carry)
      impl::ssd_state_io(state_io, ck.H0, b, false, exec);
    else
      Kokkos::deep_copy(exec, ck.H0, S(0));
    for (index_t c = 0; c < nc; ++c) {
      const index_t t0 = c * Q;
      impl::ssd_pack<S>(sh, ck, seg_, act, View2<S>(), docs, b, t0, exec);
      impl::ssd_gram<S>(ck, G, exec);
      impl::ssd_intra_matrix<S>(sh, ck, seg_, exec);
      impl::ssd_scale_rows<S>("ash::ssd::scale_c", ck.Ts, ck.Cq, Hg,
                              KOKKOS_LAMBDA(index_t h, index_t r) { return din(h, r); }, exec);
      for (index_t h = 0; h < H; ++h) {
        impl::gemm<S>(exec, "N", "N", S(1), sub(ck.MD, h), sub(ck.X, h), S(0), sub(ck.Y, h));
        impl::gemm<S>(exec, "N", "T", S(1), sub(ck.Ts, h), sub(ck.H0, h), S(1), sub(ck.Y, h));
      }
      impl::ssd_unpack_output<S>(sh, ck, D, s, b, t0, exec);
      if (c + 1 == nc && !carry) break;
      // H₀ of the next chunk: din_{Q−1} H₀ + Σ_j dout_j Δ_j x_j B_jᵀ.
      impl::ssd_next_state<S>(
          "ash::ssd::scale_x", ck, ck.H0, ck.X, KOKKOS_LAMBDA(index_t h, index_t r) { return dout(h, r) * dt(h, r); },
          ck.Bq, Hg, exec);
    }
    if (carry) impl::ssd_state_io(state_io, ck.H0, b, true, exec);
  }
}

template <class S>
void SsdScan<S>::backward(const LayerActivations<S>& act, const Unmanaged1<S>& D, const DocStarts& docs,
                          const View2<S>& gs, const SsdGrads<S>& out, const ExecSpace& exec, const View2<S>& h0,
                          const View2<S>& r_io) {
  const SsdShape& sh = sh_;
  const index_t H = sh.heads, G = sh.groups, Hg = H / G, Q = sh.chunk, nc = sh.chunks(), P = sh.head_dim;
  require(starts_.extent(0) == std::size_t(sh.batch * nc * H), "SsdScan::backward: a plan made for the forward only");
  require(index_t(gs.extent(0)) == sh.batch * sh.T && index_t(gs.extent(1)) == H * P &&
              index_t(out.gdelta.extent(1)) == H && out.gx.extent(0) == gs.extent(0),
          "SsdScan::backward: cotangents of another shape");
  const bool from_state = h0.extent(0) > 0, carries = r_io.extent(0) > 0;
  require((!from_state || index_t(h0.extent(0)) == sh.batch * H * P) &&
              (!carries || index_t(r_io.extent(0)) == sh.batch * H * P),
          "SsdScan::backward: a state or state cotangent of another shape");
  const Chunk& ck = c_;
  auto dout = ck.dout;
  auto dt = ck.dt;
  auto din = ck.din;
  auto starts = starts_;
  Kokkos::deep_copy(exec, ck.acc, S(0));
  for (index_t b = 0; b < sh.batch; ++b) {
    // Every chunk's start state, chunk by chunk from h0 (kept: the reverse pass reads them backwards).
    if (from_state)
      impl::ssd_state_io(h0, ck.H0, b, false, exec);
    else
      Kokkos::deep_copy(exec, ck.H0, S(0));
    for (index_t c = 0; c < nc; ++c) {
      const index_t k0 = (b * nc + c) * H;
      Kokkos::deep_copy(exec, Kokkos::subview(starts, Kokkos::make_pair(k0, k0 + H), Kokkos::ALL(), Kokkos::ALL()),
                        ck.H0);
      if (c + 1 == nc) break;
      impl::ssd_pack<S>(sh, ck, seg_, act, View2<S>(), docs, b, c * Q, exec);
      impl::ssd_next_state<S>(
          "ash::ssd::scale_x", ck, ck.H0, ck.X, KOKKOS_LAMBDA(index_t h, index_t r) { return dout(h, r) * dt(h, r); },
          ck.Bq, Hg, exec);
    }
    // The chunks backwards, R = ∂L/∂ the chunk's end state carried.
    if (carries)
      impl::ssd_state_io(r_io, ck.R, b, false, exec);
    else
      Kokkos::deep_copy(exec, ck.R, S(0));
    for (index_t c = nc - 1; c >= 0; --c) {
      const index_t t0 = c * Q, k0 = (b * nc + c) * H;
      impl::ssd_pack<S>(sh, ck, seg_, act, gs, docs, b, t0, exec);
      Kokkos::deep_copy(exec, ck.H0, Kokkos::subview(starts, Kokkos::make_pair(k0, k0 + H), Kokkos::ALL(), Kokkos::ALL()));
      impl::ssd_gram<S>(ck, G, exec);
      for (index_t h = 0; h < H; ++h) impl::gemm<S>(exec, "N", "T", S(1), sub(ck.G, h), sub(ck.X, h), S(0), sub(ck.GX, h));
      impl::ssd_reverse_matrices<S>(sh, ck, seg_, exec);
      impl::ssd_scale_rows<S>("ash::ssd::scale_b", ck.Ts, ck.Bq, Hg,
                              KOKKOS_LAMBDA(index_t h, index_t r) { return dout(h, r) * dt(h, r); }, exec);
      for (index_t h = 0; h < H; ++h) {
        const index_t g = h / Hg;
        const S first = h % Hg == 0 ? S(0) : S(1);  // the group's first head starts its sums
        impl::gemm<S>(exec, "T", "N", S(1), sub(ck.MD, h), sub(ck.G, h), S(0), sub(ck.dX, h));  // MDᵀ g
        impl::gemm<S>(exec, "N", "T", S(1), sub(ck.Ts, h), sub(ck.R, h), S(1), sub(ck.dX, h));  // + dout Δ B Rᵀ
        impl::gemm<S>(exec, "N", "N", S(1), sub(ck.X, h), sub(ck.R, h), S(0), sub(ck.XR, h));   // x R
        impl::gemm<S>(exec, "N", "N", S(1), sub(ck.G, h), sub(ck.H0, h), S(0), sub(ck.HC, h));  // g H₀
        impl::gemm<S>(exec, "N", "N", S(1), sub(ck.WD, h), sub(ck.Bq, g), first, sub(ck.dC, g));
        impl::gemm<S>(exec, "T", "N", S(1), sub(ck.WD, h), sub(ck.Cq, g), first, sub(ck.dB, g));
      }
      impl::ssd_reverse_rows<S>(sh, ck, act, out.gdelta, b, t0, exec);
      {  // the state terms of ∂L/∂B and ∂L/∂C: + Δ_j dout_j Rᵀx_j, + din_s H₀ᵀ g_s, over the group's heads
        auto dB = ck.dB;
        auto dC = ck.dC;
        auto XR = ck.XR;
        auto HC = ck.HC;
        const index_t N = sh.state;
        Kokkos::parallel_for(
            "ash::ssd::state_terms", Range(exec, 0, G * Q), KOKKOS_LAMBDA(const index_t i) {
              const index_t g = i / Q, r = i % Q;
              for (index_t h = g * Hg; h < (g + 1) * Hg; ++h) {
                const S fb = dt(h, r) * dout(h, r), fc = din(h, r);
                for (index_t n = 0; n < N; ++n) {
                  dB(g, r, n) += fb * XR(h, r, n);
                  dC(g, r, n) += fc * HC(h, r, n);
                }
              }
            });
      }
      impl::ssd_unpack_grads<S>(sh, ck, D, out, b, t0, exec);
      if (c == 0 && !carries) break;
      // R of the chunk before: din_{Q−1} R + Σ_s din_s g_s C_sᵀ.
      impl::ssd_next_state<S>(
          "ash::ssd::scale_g", ck, ck.R, ck.G, KOKKOS_LAMBDA(index_t h, index_t r) { return din(h, r); }, ck.Cq, Hg,
          exec);
    }
    if (carries) impl::ssd_state_io(r_io, ck.R, b, true, exec);  // ∂L/∂ h0
  }
  impl::ssd_accumulate_heads<S>(ck.acc, out, H, exec);
}

template class SsdScan<float>;
template class SsdScan<double>;

}  // namespace ash
