#pragma once
// AdamW with bias correction, global gradient-norm clipping and a warm-up +
// cosine learning-rate schedule. Moments are ParamSets (one slice per
// parameter tensor), so a distributed run can keep each tensor's state on its
// owner.
#include <functional>
#include <vector>

#include "ash/core/config.hpp"
#include "ash/model/params.hpp"

namespace ash {


// lr(step), step = 0, 1, ...: lr·(step+1)/warmup during warm-up, then cosine
// from lr to min_lr_ratio·lr at `steps`, constant after.
double learning_rate(const AdamWOptions& o, std::int64_t step);

// Weight decay applies to the tensors the parameter layout marks
// (TensorInfo::decay: the embedding, the head and each layer's matrices as its
// architecture's reference decays them); not to norms, biases, A_log or D.

template <class S>
class AdamW {
 public:
  AdamW(const ModelDims& dims, const AdamWOptions& opts) : AdamW(dims, LayerRange::all(dims), opts) {}
  // Moments for one layer range only (a rank of a layer-sharded run).
  AdamW(const ModelDims& dims, const LayerRange& range, const AdamWOptions& opts);
  const AdamWOptions& options() const { return opts_; }
  // One update with the gradient of step `step()`; clips grad in place.
  // Returns the gradient norm before clipping. With shards, sum_over_shards
  // turns this shard's sum of squares into the whole model's (an allreduce).
  double update(const ParamSet<S>& params, const ParamSet<S>& grad,
                const std::function<double(double)>& sum_over_shards = {});
  std::int64_t step() const { return step_; }
  void set_step(std::int64_t s) { step_ = s; }
  const ParamSet<S>& m() const { return m_; }
  const ParamSet<S>& v() const { return v_; }

 private:
  AdamWOptions opts_;
  ParamSet<S> m_, v_;
  // Consecutive tensors that all decay or all do not: one update kernel each (a
  // mask per parameter would be a third parameter-sized buffer, 5 GiB at 1.36 B).
  struct DecayRun {
    index_t begin, end;
    bool decay;
  };
  std::vector<DecayRun> runs_;
  std::int64_t step_ = 0;
};

// ||x||_2 over all tensors (deterministic for a fixed build and thread count).
template <class S>
double global_norm(const ParamSet<S>& x);
// Σ x² over all tensors of x.
template <class S>
double sum_of_squares(const ParamSet<S>& x);

}  // namespace ash
