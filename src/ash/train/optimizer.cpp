#include "ash/train/optimizer.hpp"

#include <cmath>

#include "ash/core/error.hpp"

namespace ash {


double learning_rate(const AdamWOptions& o, std::int64_t step) {
  if (o.warmup > 0 && step < o.warmup) return o.lr * double(step + 1) / double(o.warmup);
  const double span = double(o.steps - o.warmup);
  const double prog = span > 0 ? std::min(1.0, double(step - o.warmup) / span) : 1.0;
  const double lo = o.min_lr_ratio * o.lr;
  return lo + 0.5 * (o.lr - lo) * (1.0 + std::cos(3.14159265358979323846 * prog));
}

template <class S>
AdamW<S>::AdamW(const ModelDims& dims, const LayerRange& range, const AdamWOptions& opts)
    : opts_(opts), m_(dims, range), v_(dims, range) {
  index_t covered = 0;
  for (const auto& t : m_.tensors()) {
    const bool d = t.decay;
    covered += t.size();
    if (!runs_.empty() && runs_.back().decay == d && runs_.back().end == t.offset)
      runs_.back().end = t.offset + t.size();
    else
      runs_.push_back({t.offset, t.offset + t.size(), d});
  }
  require(covered == m_.size() && (runs_.empty() || (runs_.front().begin == 0 && runs_.back().end == m_.size())),
          "AdamW: the tensors do not tile the parameters");
}

template <class S>
double sum_of_squares(const ParamSet<S>& x) {
  auto d = x.data();
  double ss = 0;
  Kokkos::parallel_reduce(
      "ash::global_norm", Range(0, x.size()),
      KOKKOS_LAMBDA(const index_t i, double& acc) { acc += double(d(i)) * double(d(i)); }, ss);
  return ss;
}

template <class S>
double global_norm(const ParamSet<S>& x) {
  return std::sqrt(sum_of_squares(x));
}

template <class S>
double AdamW<S>::update(const ParamSet<S>& params, const ParamSet<S>& grad,
                        const std::function<double(double)>& sum_over_shards) {
  const double ss = sum_of_squares(grad);
  const double norm = std::sqrt(sum_over_shards ? sum_over_shards(ss) : ss);
  const double scale = (opts_.clip > 0 && norm > opts_.clip) ? opts_.clip / norm : 1.0;
  const double lr = learning_rate(opts_, step_);
  const std::int64_t t = step_ + 1;
  const S b1 = S(opts_.beta1), b2 = S(opts_.beta2), eps = S(opts_.eps);
  const S c1 = S(1.0 / (1.0 - std::pow(opts_.beta1, double(t))));
  const S c2 = S(1.0 / (1.0 - std::pow(opts_.beta2, double(t))));
  const S lr_s = S(lr), wd = S(lr * opts_.weight_decay), sc = S(scale);
  auto p = params.data();
  auto g = grad.data();
  auto m = m_.data();
  auto v = v_.data();
  for (const DecayRun& run : runs_) {
    const S mask = run.decay ? S(1) : S(0);
    Kokkos::parallel_for(
        "ash::adamw", Range(run.begin, run.end), KOKKOS_LAMBDA(const index_t i) {
          const S gi = g(i) * sc;
          g(i) = gi;  // the clipped gradient
          m(i) = b1 * m(i) + (S(1) - b1) * gi;
          v(i) = b2 * v(i) + (S(1) - b2) * gi * gi;
          const S mh = m(i) * c1, vh = v(i) * c2;
          p(i) -= lr_s * mh / (kmath::sqrt(vh) + eps) + wd * mask * p(i);
        });
  }
  ++step_;
  return norm;
}

template class AdamW<float>;
template class AdamW<double>;
template double global_norm<float>(const ParamSet<float>&);
template double global_norm<double>(const ParamSet<double>&);
template double sum_of_squares<float>(const ParamSet<float>&);
template double sum_of_squares<double>(const ParamSet<double>&);

}  // namespace ash
