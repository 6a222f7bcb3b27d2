#include "ash/train/evaluate.hpp"

#include <chrono>
#include <cmath>
#include <string>

#include "ash/core/error.hpp"
#include "ash/io/tokens.hpp"
#include "ash/model/forward.hpp"

namespace ash {

namespace {
using Clock = std::chrono::steady_clock;
double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }
}  // namespace

double EvalTotals::bits_per_token() const { return nats / double(targets) / std::log(2.0); }

template <class S>
EvalTotals evaluate_windows(const ParamSet<S>& params, const std::vector<std::uint32_t>& ids, index_t T, index_t B,
                            index_t head_chunk, const std::function<void(const EvalTotals&)>& progress,
                            const std::vector<std::uint8_t>* starts) {
  const auto n = index_t(ids.size());
  const index_t full = n / T, rest = n % T;
  EvalTotals tot;
  auto last_note = Clock::now();
  auto run_windows = [&](index_t count, index_t len, index_t first) {
    const auto x = make_windows(ids, count, len, params.dims().vocab, first, starts);
    const index_t targets = target_count(x);  // count·(len-1) less document starts
    const auto t0 = Clock::now();
    const double loss = forward_loss(params, x, head_chunk);
    Kokkos::fence();
    tot.seconds += since(t0);
    require(std::isfinite(loss), "the loss is not finite at tokens " + std::to_string(first) + "..");
    tot.nats += loss * double(targets);
    tot.targets += targets;
    tot.tokens += count * len;
    if (progress && Clock::now() - last_note > std::chrono::seconds(10)) {
      progress(tot);
      last_note = Clock::now();
    }
  };
  for (index_t w = 0; w < full; w += B) run_windows(std::min(B, full - w), T, w * T);
  if (rest >= 2) run_windows(1, rest, full * T);
  return tot;
}

template <class S>
EvalTotals evaluate_stream(const ParamSet<S>& params, const std::vector<std::uint32_t>& ids, index_t T,
                           index_t head_chunk, bool carry, const std::vector<std::uint8_t>* starts) {
  const auto& d = params.dims();
  const auto n = index_t(ids.size());
  std::vector<View2<S>> state;
  for (index_t k = 0; k < d.layers; ++k) state.emplace_back("ash::eval::state", d.carry_rows(), d.carry_cols());
  EvalTotals tot;
  const auto t0 = Clock::now();
  for (index_t first = 0; first + 1 < n; first += T) {
    const index_t len = std::min(T, n - first), hl = std::min(len + 1, n - first);
    if (!carry)
      for (auto& h : state) Kokkos::deep_copy(h, S(0));
    const auto x = make_windows(ids, 1, len, d.vocab, first, starts);
    const auto xh = make_windows(ids, 1, hl, d.vocab, first, starts);
    const index_t targets = target_count(xh);  // hl - 1 less document starts
    const double loss = forward_loss(params, x, head_chunk, state, xh, targets);  // (0 targets: L = 0, h advances)
    require(std::isfinite(loss), "the loss is not finite at tokens " + std::to_string(first) + "..");
    tot.nats += loss * double(targets);
    tot.targets += targets;
  }
  Kokkos::fence();
  tot.seconds = since(t0);
  tot.tokens = n;
  return tot;
}

#define ASH_INSTANTIATE(S)                                                                                         \
  template EvalTotals evaluate_windows<S>(const ParamSet<S>&, const std::vector<std::uint32_t>&, index_t, index_t, \
                                          index_t, const std::function<void(const EvalTotals&)>&,                  \
                                          const std::vector<std::uint8_t>*);                                       \
  template EvalTotals evaluate_stream<S>(const ParamSet<S>&, const std::vector<std::uint32_t>&, index_t, index_t,  \
                                         bool, const std::vector<std::uint8_t>*);
ASH_INSTANTIATE(float)
ASH_INSTANTIATE(double)

}  // namespace ash
