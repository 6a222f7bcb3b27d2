#include "ash/model/params.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>

#include "ash/core/error.hpp"

namespace ash {

std::string layer_prefix(int k) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "layers/%03d/", k);
  return buf;
}

LayerRange LayerRange::block(const ModelDims& d, int r, int R) {
  require(R >= 1 && r >= 0 && r < R, "LayerRange::block: rank " + std::to_string(r) + " of " + std::to_string(R));
  require(R <= d.layers, "cannot split " + std::to_string(d.layers) + " layers over " + std::to_string(R) +
                             " layer ranks (dist.layer_ranks must not exceed model.layers)");
  const int K = int(d.layers), base = K / R, extra = K % R;
  LayerRange lr;
  lr.k0 = r * base + (r < extra ? r : extra);
  lr.k1 = lr.k0 + base + (r < extra ? 1 : 0);
  // A tied head: the last rank's head is the embedding, so it holds a copy
  // (kept equal: E4 sums the two gradient parts on both ranks).
  lr.embedding = r == 0 || (d.tied_head() && r == R - 1);
  lr.head = r == R - 1;
  return lr;
}

index_t parameter_count(const ModelDims& d) {
  const auto l = param_layout(d);
  return l.back().offset + l.back().size();
}

std::vector<TensorInfo> param_layout(const ModelDims& d) { return param_layout(d, LayerRange::all(d)); }

std::vector<TensorInfo> param_layout(const ModelDims& d, const LayerRange& range) {
  const std::int64_t V = d.vocab, P = d.width, N = d.state;
  std::vector<TensorInfo> out;
  index_t off = 0;
  auto add = [&](const std::string& name, std::vector<std::int64_t> shape, bool decay = false) {
    TensorInfo t{name, std::move(shape), off, decay};
    off += t.size();
    out.push_back(t);
  };
  if (d.mamba2()) {
    // docs/file_format.md: transformers' tensors, row-major [out, in].
    const std::int64_t E = d.inner(), C = d.conv_dim(), H = d.head_count(), Kc = d.conv_kernel;
    if (range.embedding) add("embedding", {V, P}, true);
    if (range.head) {
      add("final_norm", {P});
      if (!d.tie_embeddings) add("head", {V, P}, true);
    }
    for (int k = range.k0; k < range.k1; ++k) {
      const auto pre = layer_prefix(k);
      add(pre + "norm", {P});
      add(pre + "in_proj", {E + C + H, P}, true);  // the matrices mamba-ssm decays (not A_log, D, dt_bias, norms)
      add(pre + "conv_weight", {C, Kc}, true);
      add(pre + "conv_bias", {C});
      add(pre + "dt_bias", {H});
      add(pre + "A_log", {H});
      add(pre + "D", {H});
      add(pre + "gated_norm", {E});
      add(pre + "out_proj", {P, E}, true);
    }
    return out;
  }
  if (d.mamba()) {
    // docs/file_format.md: transformers' tensors, row-major [out, in].
    const std::int64_t E = d.inner(), R = d.rank(), Kc = d.conv_kernel;
    if (range.embedding) add("embedding", {V, P}, true);
    if (range.head) {
      add("final_norm", {P});
      if (!d.tie_embeddings) add("head", {V, P}, true);
    }
    for (int k = range.k0; k < range.k1; ++k) {
      const auto pre = layer_prefix(k);
      add(pre + "norm", {P});
      add(pre + "in_proj", {2 * E, P}, true);  // the matrices mamba-ssm decays (not A_log, D, biases, norms)
      add(pre + "conv_weight", {E, Kc}, true);
      add(pre + "conv_bias", {E});
      add(pre + "x_proj", {R + 2 * N, E}, true);
      add(pre + "dt_proj", {E, R}, true);
      add(pre + "dt_bias", {E});
      add(pre + "A_log", {E, N});
      add(pre + "D", {E});
      add(pre + "out_proj", {P, E}, true);
    }
    return out;
  }
  if (range.embedding) add("embedding", {V, P}, true);
  if (range.head) {
    add("final_norm", {P});
    add("head", {V, P}, true);
  }
  for (int k = range.k0; k < range.k1; ++k) {
    const auto pre = layer_prefix(k);
    add(pre + "norm", {P});
    add(pre + "W_delta", {P, P}, true);
    add(pre + "b_delta", {P});
    add(pre + "A_log", {P, N});
    add(pre + "W_B", {N, P}, true);
    add(pre + "W_C", {N, P}, true);
    add(pre + "D", {P});
  }
  return out;
}

template <class S>
ParamSet<S>::ParamSet(const ModelDims& d, const LayerRange& range)
    : dims_(d), range_(range), tensors_(param_layout(d, range)) {
  require(range.k0 >= 0 && range.k0 <= range.k1 && range.k1 <= d.layers, "ParamSet: layer range out of bounds");
  const index_t off = tensors_.empty() ? 0 : tensors_.back().offset + tensors_.back().size();
  data_ = View1<S>("ash::params", off);
  S* base = data_.data();
  auto m = [&](const std::string& n) {
    const auto& t = tensor(n);
    return Unmanaged2<S>(base + t.offset, t.shape[0], t.shape[1]);
  };
  auto v = [&](const std::string& n) { return Unmanaged1<S>(base + tensor(n).offset, tensor(n).shape[0]); };
  if (range.embedding) global_.embedding = m("embedding");
  if (d.mamba()) {
    global_.norm_eps = d.norm_eps;
    // Tied embeddings: the head is the embedding's View, so the head's gradient
    // and the embedding's add into one tensor (both kernels add).
    require(!d.tie_embeddings || range.embedding || !range.head,
            "ParamSet: a Mamba with tied embeddings keeps its head with the embedding");
    if (range.head) {
      global_.final_norm = v("final_norm");
      global_.head = d.tie_embeddings ? global_.embedding : m("head");
    }
    const index_t E = d.inner(), R = d.rank(), N = d.state, C = d.conv_dim(), H = d.head_count();
    for (int k = range.k0; k < range.k1; ++k) {
      const auto pre = layer_prefix(k);
      const auto rows = [&](const std::string& n, index_t r0, index_t r) {
        const auto& t = tensor(n);
        return Unmanaged2<S>(base + t.offset + r0 * t.shape[1], r, t.shape[1]);
      };
      if (d.mamba2()) {
        mamba2_layers_.push_back(Mamba2LayerParams<S>{
            v(pre + "norm"), rows(pre + "in_proj", 0, E), rows(pre + "in_proj", E, C), rows(pre + "in_proj", E + C, H),
            m(pre + "conv_weight"), v(pre + "conv_bias"), v(pre + "dt_bias"), v(pre + "A_log"), v(pre + "D"),
            v(pre + "gated_norm"), m(pre + "out_proj")});
        continue;
      }
      mamba_layers_.push_back(MambaLayerParams<S>{
          v(pre + "norm"), rows(pre + "in_proj", 0, E), rows(pre + "in_proj", E, E), m(pre + "conv_weight"),
          v(pre + "conv_bias"), rows(pre + "x_proj", 0, R), rows(pre + "x_proj", R, N), rows(pre + "x_proj", R + N, N),
          m(pre + "dt_proj"), v(pre + "dt_bias"), m(pre + "A_log"), v(pre + "D"), m(pre + "out_proj")});
    }
    return;
  }
  if (range.head) {
    global_.final_norm = v("final_norm");
    global_.head = m("head");
  }
  for (int k = range.k0; k < range.k1; ++k) {
    const auto pre = layer_prefix(k);
    layers_.push_back(LayerParams<S>{v(pre + "norm"), m(pre + "W_delta"), v(pre + "b_delta"), m(pre + "A_log"),
                                     m(pre + "W_B"), m(pre + "W_C"), v(pre + "D")});
  }
}

template <class S>
Mamba2LayerParams<S> ParamSet<S>::mamba2_layer(int k) const {
  require(dims_.mamba2(), "ParamSet: layer " + std::to_string(k) + " is a model.arch=" + arch_name(dims_.arch) +
                              " layer, not a Mamba-2 block");
  require(range_.owns(k), "ParamSet: layer " + std::to_string(k) + " is not in this shard [" +
                              std::to_string(range_.k0) + ", " + std::to_string(range_.k1) + ")");
  return mamba2_layers_[k - range_.k0];
}

template <class S>
MambaLayerParams<S> ParamSet<S>::mamba_layer(int k) const {
  require(dims_.mamba() && !dims_.mamba2(), "ParamSet: layer " + std::to_string(k) + " is a model.arch=" +
                                                arch_name(dims_.arch) + " layer, not a Mamba-1 block");
  require(range_.owns(k), "ParamSet: layer " + std::to_string(k) + " is not in this shard [" +
                              std::to_string(range_.k0) + ", " + std::to_string(range_.k1) + ")");
  return mamba_layers_[k - range_.k0];
}

template <class S>
LayerParams<S> ParamSet<S>::layer(int k) const {
  // An SSM-ResNet layer's views (SsmResNetKind::layer); a Mamba's are mamba_layer's.
  require(!dims_.mamba(),
          "ParamSet: layer " + std::to_string(k) + " is a Mamba block (model.arch=mamba), not an SSM-ResNet layer");
  require(range_.owns(k), "ParamSet: layer " + std::to_string(k) + " is not in this shard [" +
                              std::to_string(range_.k0) + ", " + std::to_string(range_.k1) + ")");
  return layers_[k - range_.k0];
}

template <class S>
const TensorInfo& ParamSet<S>::tensor(const std::string& name) const {
  for (const auto& t : tensors_)
    if (t.name == name) return t;
  throw Error("no parameter tensor named '" + name + "'");
}

template <class S>
void ParamSet<S>::fill_zero() const {
  Kokkos::deep_copy(data_, S(0));
}

template <class S>
void ParamSet<S>::copy_from(const ParamSet& other) const {
  require(other.size() == size() && other.dims() == dims() && other.range() == range(),
          "ParamSet::copy_from: layouts differ");
  Kokkos::deep_copy(data_, other.data_);
}

template <class S>
ParamSet<S> ParamSet<S>::clone() const {
  ParamSet<S> c(dims_, range_);
  c.copy_from(*this);
  return c;
}

namespace {

// Platform-independent transforms of mt19937_64 output.
struct Rng {
  std::mt19937_64 gen;
  explicit Rng(std::uint64_t seed) : gen(seed) {}
  double uniform() { return double(gen() >> 11) * (1.0 / 9007199254740992.0); }  // [0, 1)
  double uniform(double a, double b) { return a + (b - a) * uniform(); }
  double normal() {  // Box-Muller, one value per call
    double u1 = uniform();
    while (u1 <= 0.0) u1 = uniform();
    const double u2 = uniform();
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }
};

}  // namespace

namespace {

// transformers' MambaConfig defaults (initializer_range, time_step_min / max / floor / scale).
constexpr double mamba_init_std = 0.1, mamba_dt_min = 1e-3, mamba_dt_max = 0.1, mamba_dt_floor = 1e-4;

// One Mamba tensor, drawn from rng (params.hpp: initialize).
template <class S>
void initialize_mamba_tensor(const ModelDims& d, const TensorInfo& t, S* p, Rng& rng) {
  const index_t n = t.size();
  const std::string leaf = t.name.substr(t.name.rfind('/') + 1);
  const auto uniform = [&](double bound) {
    for (index_t i = 0; i < n; ++i) p[i] = S(rng.uniform(-bound, bound));
  };
  if (d.mamba2() && leaf == "A_log") {  // one per head
    for (index_t h = 0; h < n; ++h) p[h] = S(std::log(double(h + 1)));
    return;
  }
  if (leaf == "embedding" || leaf == "head" || leaf == "in_proj" || leaf == "x_proj") {
    for (index_t i = 0; i < n; ++i) p[i] = S(mamba_init_std * rng.normal());
  } else if (leaf == "conv_weight") {
    uniform(1.0 / std::sqrt(double(d.conv_kernel)));  // kaiming_uniform(a = √5): 1/sqrt(fan_in)
  } else if (leaf == "out_proj") {
    uniform(1.0 / std::sqrt(double(d.inner())));
  } else if (leaf == "dt_proj") {
    uniform(1.0 / std::sqrt(double(d.rank())));
  } else if (leaf == "dt_bias") {
    for (index_t i = 0; i < n; ++i) {
      double dt = std::exp(rng.uniform(std::log(mamba_dt_min), std::log(mamba_dt_max)));
      dt = dt > mamba_dt_floor ? dt : mamba_dt_floor;
      p[i] = S(dt + std::log(-std::expm1(-dt)));  // softplus(b) = dt
    }
  } else if (leaf == "A_log") {
    for (index_t e = 0; e < t.shape[0]; ++e)
      for (index_t k = 0; k < t.shape[1]; ++k) p[e * t.shape[1] + k] = S(std::log(double(k + 1)));
  } else if (leaf == "conv_bias") {
    for (index_t i = 0; i < n; ++i) p[i] = S(0);
  } else {  // norm, final_norm, D, gated_norm
    for (index_t i = 0; i < n; ++i) p[i] = S(1);
  }
}

}  // namespace

template <class S>
void initialize(const ParamSet<S>& params, std::uint64_t seed) {
  const auto& d = params.dims();
  auto host = Kokkos::create_mirror_view(params.data());
  Rng rng(seed);
  const double bound = 1.0 / std::sqrt(double(d.width));
  // The random stream runs over the whole model in storage order, so a shard
  // gets exactly the values the full model has for its tensors.
  const auto mine = params.tensors();
  std::vector<S> skipped;
  for (const auto& t : param_layout(d)) {
    const auto it = std::find_if(mine.begin(), mine.end(), [&](const TensorInfo& x) { return x.name == t.name; });
    const index_t n = t.size();
    if (it == mine.end()) skipped.resize(n);
    S* p = it != mine.end() ? host.data() + it->offset : skipped.data();
    if (d.mamba()) {
      initialize_mamba_tensor(d, t, p, rng);
      continue;
    }
    const std::string leaf = t.name.substr(t.name.rfind('/') + 1);
    if (leaf == "embedding") {
      for (index_t i = 0; i < n; ++i) p[i] = S(0.02 * rng.normal());
    } else if (leaf == "head" || leaf == "W_delta" || leaf == "W_B" || leaf == "W_C") {
      for (index_t i = 0; i < n; ++i) p[i] = S(rng.uniform(-bound, bound));
    } else if (leaf == "b_delta") {
      for (index_t i = 0; i < n; ++i) {
        const double dt = std::exp(rng.uniform(std::log(1e-3), std::log(1e-1)));
        p[i] = S(dt + std::log(-std::expm1(-dt)));  // softplus(b) = dt
      }
    } else if (leaf == "A_log") {
      for (index_t pp = 0; pp < t.shape[0]; ++pp)
        for (index_t nn = 0; nn < t.shape[1]; ++nn) p[pp * t.shape[1] + nn] = S(std::log(double(nn + 1)));
    } else {  // norm, final_norm, D
      for (index_t i = 0; i < n; ++i) p[i] = S(1);
    }
  }
  Kokkos::deep_copy(params.data(), host);
}

template class ParamSet<float>;
template class ParamSet<double>;
template void initialize<float>(const ParamSet<float>&, std::uint64_t);
template void initialize<double>(const ParamSet<double>&, std::uint64_t);

}  // namespace ash
