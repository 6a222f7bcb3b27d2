#pragma once
// An independent plain-C++ host implementation of docs/design.md §1 (loss only):
// straight loops in double, written from the equations, sharing no numerics
// with the library (only the tensor names/offsets of the checkpoint layout).
#include <cmath>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "ash/model/params.hpp"

namespace ash::test {

inline double reference_loss(const ModelDims& d, const std::vector<double>& theta,
                             const std::vector<std::uint32_t>& tokens, int batch, int T) {
  const int V = int(d.vocab), P = int(d.width), N = int(d.state), K = int(d.layers);
  std::map<std::string, const double*> at;
  for (const auto& t : param_layout(d)) at[t.name] = theta.data() + t.offset;
  auto rmsnorm = [&](const std::vector<double>& y, const double* w) {
    double ss = 0;
    for (int p = 0; p < P; ++p) ss += y[p] * y[p];
    const double r = 1.0 / std::sqrt(ss / P + 1e-5);
    std::vector<double> o(P);
    for (int p = 0; p < P; ++p) o[p] = w[p] * y[p] * r;
    return o;
  };
  double total = 0;
  int count = 0;
  for (int b = 0; b < batch; ++b) {
    // y[t][p] for the current layer
    std::vector<std::vector<double>> y(T, std::vector<double>(P));
    for (int t = 0; t < T; ++t)
      for (int p = 0; p < P; ++p) y[t][p] = at["embedding"][tokens[b * T + t] * P + p];
    for (int k = 0; k < K; ++k) {
      const std::string pre = layer_prefix(k);
      const double *w = at[pre + "norm"], *Wd = at[pre + "W_delta"], *bd = at[pre + "b_delta"],
                   *Alog = at[pre + "A_log"], *WB = at[pre + "W_B"], *WC = at[pre + "W_C"], *D = at[pre + "D"];
      std::vector<double> h(P * N, 0.0);
      std::vector<std::vector<double>> ynext(T, std::vector<double>(P));
      for (int t = 0; t < T; ++t) {
        const auto yh = rmsnorm(y[t], w);
        std::vector<double> delta(P), beta(N, 0.0), gamma(N, 0.0);
        for (int p = 0; p < P; ++p) {
          double z = bd[p];
          for (int q = 0; q < P; ++q) z += Wd[p * P + q] * yh[q];
          delta[p] = std::log(1.0 + std::exp(z));
        }
        for (int n = 0; n < N; ++n)
          for (int q = 0; q < P; ++q) {
            beta[n] += WB[n * P + q] * yh[q];
            gamma[n] += WC[n * P + q] * yh[q];
          }
        for (int p = 0; p < P; ++p) {
          double out = D[p] * yh[p];
          for (int n = 0; n < N; ++n) {
            const double A = std::exp(delta[p] * -std::exp(Alog[p * N + n]));
            h[p * N + n] = A * h[p * N + n] + delta[p] * beta[n] * yh[p];
            out += gamma[n] * h[p * N + n];
          }
          ynext[t][p] = y[t][p] + out;
        }
      }
      y.swap(ynext);
    }
    for (int t = 0; t + 1 < T; ++t) {
      const auto yh = rmsnorm(y[t], at["final_norm"]);
      std::vector<double> o(V, 0.0);
      double mx = -1e300;
      for (int v = 0; v < V; ++v) {
        for (int p = 0; p < P; ++p) o[v] += at["head"][v * P + p] * yh[p];
        mx = std::max(mx, o[v]);
      }
      double se = 0;
      for (int v = 0; v < V; ++v) se += std::exp(o[v] - mx);
      total += mx + std::log(se) - o[tokens[b * T + t + 1]];
      ++count;
    }
  }
  return total / count;
}

}  // namespace ash::test
