#include "ash/core/sizes.hpp"

#include <cmath>

#include "ash/core/documents.hpp"
#include "ash/core/error.hpp"

namespace ash {

std::int64_t checked_mul(std::int64_t a, std::int64_t b, const std::string& what) {
  std::int64_t r = 0;
  require(
      a >= 0 && b >= 0 && !__builtin_mul_overflow(a, b, &r),
      "sizes overflow: " + what + " (" + std::to_string(a) + " x " + std::to_string(b) + ") does not fit in 64 bits");
  return r;
}

std::int64_t checked_add(std::int64_t a, std::int64_t b, const std::string& what) {
  std::int64_t r = 0;
  require(
      a >= 0 && b >= 0 && !__builtin_add_overflow(a, b, &r),
      "sizes overflow: " + what + " (" + std::to_string(a) + " + " + std::to_string(b) + ") does not fit in 64 bits");
  return r;
}

namespace {
// The Mamba layout of param_layout(): embedding [V,D], final_norm [D], head
// [V,D] when untied; per layer norm [D], in_proj [2E,D], conv_weight [E,Kc],
// conv_bias, dt_bias, D [E], x_proj [R+2N,E], dt_proj [E,R], A_log [E,N],
// out_proj [D,E].
std::int64_t mamba_parameter_count(const ModelDims& d) {
  const std::int64_t V = d.vocab, Dm = d.width, N = d.state, K = d.layers;
  const auto E = checked_mul(d.expand, Dm, "model.expand x model.width");
  const auto R = d.rank();
  const auto VD = checked_mul(V, Dm, "model.vocab x model.width");
  auto layer = checked_add(Dm, checked_mul(3, checked_mul(E, Dm, "inner x width"), "in_proj and out_proj"),
                           "parameters per layer");
  layer = checked_add(layer, checked_mul(E, checked_add(d.conv_kernel, 3, "conv taps"), "conv and vectors"),
                      "parameters per layer");
  const auto xr = checked_add(R, checked_mul(2, N, "2 x model.state"), "x_proj rows");
  layer = checked_add(layer, checked_mul(checked_add(xr, R, "x_proj and dt_proj"), E, "x_proj and dt_proj"),
                      "parameters per layer");
  layer = checked_add(layer, checked_mul(E, N, "inner x model.state"), "parameters per layer");
  const auto layers = checked_mul(K, layer, "model.layers x parameters per layer");
  const auto global = checked_add(checked_mul(d.tie_embeddings ? 1 : 2, VD, "vocab x width"), Dm, "parameters");
  return checked_add(global, layers, "parameters");
}
}  // namespace

namespace {
// A Mamba-2 (params.cpp, param_layout): embedding [V,D], head [V,D] unless tied,
// final_norm [D]; per block norm [D], in_proj [E+C+H, D], conv [C, Kc], conv_bias
// [C], dt_bias, A_log, D [H], gated_norm [E], out_proj [D,E] (C = E + 2·G·N).
std::int64_t mamba2_parameter_count(const ModelDims& d) {
  const std::int64_t V = d.vocab, Dm = d.width, K = d.layers;
  const auto E = checked_mul(d.expand, Dm, "model.expand x model.width");
  const auto C = checked_add(E, checked_mul(2, checked_mul(d.n_groups, d.state, "groups x state"), "B and C"),
                             "conv channels");
  const auto H = d.head_count();
  const auto rows = checked_add(checked_add(E, C, "in_proj rows"), H, "in_proj rows");
  auto layer = checked_add(Dm, checked_mul(rows, Dm, "in_proj"), "parameters per layer");
  layer = checked_add(layer, checked_mul(C, checked_add(d.conv_kernel, 1, "conv taps"), "conv"), "parameters per layer");
  layer = checked_add(layer, checked_add(checked_mul(3, H, "head vectors"), E, "gated norm"), "parameters per layer");
  layer = checked_add(layer, checked_mul(Dm, E, "out_proj"), "parameters per layer");
  const auto layers = checked_mul(K, layer, "model.layers x parameters per layer");
  const auto VD = checked_mul(V, Dm, "model.vocab x model.width");
  const auto global = checked_add(checked_mul(d.tie_embeddings ? 1 : 2, VD, "vocab x width"), Dm, "parameters");
  return checked_add(global, layers, "parameters");
}
}  // namespace

std::int64_t checked_parameter_count(const ModelDims& d) {
  if (d.mamba2()) return mamba2_parameter_count(d);
  if (d.mamba()) return mamba_parameter_count(d);
  const std::int64_t V = d.vocab, P = d.width, N = d.state, K = d.layers;
  // Same tensors as param_layout(): embedding, head [V,P], final_norm [P];
  // per layer norm, b_delta, D [P], W_delta [P,P], A_log [P,N], W_B, W_C [N,P].
  const auto VP = checked_mul(V, P, "model.vocab x model.width");
  const auto PP = checked_mul(P, P, "model.width x model.width");
  const auto PN = checked_mul(P, N, "model.width x model.state");
  auto layer = checked_add(PP, checked_mul(3, PN, "3 x width x state"), "parameters per layer");
  layer = checked_add(layer, checked_mul(3, P, "3 x model.width"), "parameters per layer");
  const auto layers = checked_mul(K, layer, "model.layers x parameters per layer");
  return checked_add(checked_add(checked_mul(2, VP, "2 x vocab x width"), P, "parameters"), layers, "parameters");
}

void check_model_dims(const ModelDims& d) {
  require(d.vocab >= 2, "model.vocab must be >= 2 (got " + std::to_string(d.vocab) + ")");
  // Token ids keep bit 30 for document starts (core/documents.hpp).
  require(d.vocab <= max_vocab, "model.vocab must be at most 2^30 = 1073741824 (got " +
                                                  std::to_string(d.vocab) + ")");
  require(d.width >= 1, "model.width must be >= 1 (got " + std::to_string(d.width) + ")");
  require(d.state >= 1, "model.state must be >= 1 (got " + std::to_string(d.state) + ")");
  require(d.layers >= 1, "model.layers must be >= 1 (got " + std::to_string(d.layers) + ")");
  require(d.layers <= max_layers, "model.layers must be <= " + std::to_string(max_layers) + " (got " +
                                      std::to_string(d.layers) + ")");
  // One kernel team per (channel, state) sums the A_log gradient: a 32-bit league.
  require(checked_mul(d.width, d.state, "model.width x model.state") <= (std::int64_t(1) << 31) - 1,
          "sizes overflow: model.width x model.state (" + std::to_string(d.width) + " x " + std::to_string(d.state) +
              ") must be below 2^31");
  require(d.mixer_norms() || d.mixer_rms_eps == ModelDims().mixer_rms_eps,
          "model.mixer_rms_eps applies to model.arch=falcon_mamba only; leave it at its default for model.arch=" +
              arch_name(d.arch));
  if (d.mixer_norms())
    require(d.mixer_rms_eps > 0 && std::isfinite(d.mixer_rms_eps), "model.mixer_rms_eps must be a finite number > 0");
  {
    const ModelDims def;
    require(d.mamba2() || (d.head_dim == def.head_dim && d.heads == def.heads && d.n_groups == def.n_groups &&
                           d.time_step_limit_min == def.time_step_limit_min &&
                           d.time_step_limit_max == def.time_step_limit_max),
            "model.head_dim, model.heads, model.n_groups and model.time_step_limit_min/max apply to "
            "model.arch=mamba2 only; leave them at their defaults for model.arch=" + arch_name(d.arch));
    require(!d.mamba2() || d.dt_rank == def.dt_rank,
            "model.dt_rank applies to model.arch=mamba or falcon_mamba only (a Mamba-2 projects one Δ per head)");
  }
  if (d.mamba2()) {
    require(d.head_dim >= 1, "model.head_dim must be >= 1 (got " + std::to_string(d.head_dim) + ")");
    require(d.heads >= 0, "model.heads must be >= 1, or 0 for model.expand x model.width / model.head_dim (got " +
                              std::to_string(d.heads) + ")");
    const auto E = checked_mul(d.expand, d.width, "model.expand x model.width");
    require(checked_mul(d.head_count(), d.head_dim, "model.heads x model.head_dim") == E,
            "model.heads x model.head_dim must equal model.expand x model.width (" + std::to_string(E) +
                "): the block's heads cover its inner width exactly");
    require(d.n_groups >= 1 && d.head_count() % d.n_groups == 0,
            "model.n_groups must be >= 1 and divide the heads (" + std::to_string(d.head_count()) + "; got " +
                std::to_string(d.n_groups) + ")");
    require(std::isfinite(d.time_step_limit_min) && d.time_step_limit_min >= 0 &&
                std::isfinite(d.time_step_limit_max) &&
                (d.time_step_limit_max == 0 || d.time_step_limit_max > d.time_step_limit_min),
            "model.time_step_limit_min must be >= 0 and model.time_step_limit_max 0 (no limit) or above it");
  }
  if (!d.mamba()) {
    // The Mamba keys mean nothing here: a value other than the default is refused
    // rather than ignored (so a stored SSM-ResNet configuration never carries one).
    const ModelDims def;
    require(d.expand == def.expand && d.conv_kernel == def.conv_kernel && d.dt_rank == def.dt_rank &&
                d.tie_embeddings == def.tie_embeddings && d.norm_eps == def.norm_eps,
            "model.expand, model.conv_kernel, model.dt_rank, model.tie_embeddings and model.norm_eps apply to "
            "model.arch=mamba, falcon_mamba or mamba2 only; leave them at their defaults for model.arch=ssm-resnet");
  } else {
    require(d.expand >= 1, "model.expand must be >= 1 (got " + std::to_string(d.expand) + ")");
    require(d.conv_kernel >= 1 && d.conv_kernel <= 1024,
            "model.conv_kernel must be in [1, 1024] (got " + std::to_string(d.conv_kernel) + ")");
    require(d.dt_rank >= 0, "model.dt_rank must be >= 1, or 0 for ceil(model.width / 16) (got " +
                                std::to_string(d.dt_rank) + ")");
    require(d.norm_eps > 0 && std::isfinite(d.norm_eps), "model.norm_eps must be a finite number > 0");
    // The scan runs over E = expand·D channels: the same 32-bit bound on E·N.
    const auto E = checked_mul(d.expand, d.width, "model.expand x model.width");
    require(checked_mul(E, d.state, "inner width x model.state") <= (std::int64_t(1) << 31) - 1,
            "sizes overflow: model.expand x model.width x model.state must be below 2^31");
  }
  checked_parameter_count(d);
}

void check_size_products(const ModelDims& d, std::int64_t batch, std::int64_t seq_len) {
  // A Mamba's scan and its E1 activations run over E = expand·D channels.
  const std::int64_t P = d.mamba() ? checked_mul(d.expand, d.width, "model.expand x model.width") : d.width;
  const std::int64_t N = d.state, K = d.layers;
  // Parameters, gradient, Adam m and v, and the file image of all three, in double.
  checked_mul(checked_mul(checked_parameter_count(d), 8, "parameter bytes"), 6, "optimizer and file bytes");
  const auto BT = checked_mul(batch, seq_len, "data.batch x data.seq_len");
  const auto rows = checked_mul(BT, P, "layer input");
  checked_mul(checked_mul(checked_add(K, 2, "layers"), rows, "layers x batch x seq_len"), 8, "layer input bytes");
  const auto PN = checked_mul(P, N, "model.width x model.state");
  const auto kept =
      checked_mul(checked_mul(K, BT, "layers x batch x seq_len"), checked_mul(2, PN, "h and A"), "kept h and A");
  checked_mul(kept, 8, "activation bytes");
}

void check_grad_numbers(const EngineOptions& g) {
  require(g.truncate >= 0, "grad.truncate must be >= 0 (0 means the full window T)");
  require(g.chunk >= 1, "grad.chunk must be >= 1");
  require(g.wave >= 0, "grad.wave must be >= 1, or 0 / \"auto\" for the backend's default");
  require(g.head_chunk >= 0, "grad.head_chunk must be >= 1, or 0 / \"auto\" for the backend's default");
}

std::int64_t resolve_layer_checkpoint(std::int64_t m, std::int64_t layers) {
  require(m >= 0, "grad.layer_checkpoint must be >= 1, or 0 / \"auto\" for about sqrt(model.layers)");
  if (m > 0) return m;
  const auto r = std::int64_t(std::lround(std::sqrt(double(layers))));
  return r > 1 ? r : 1;
}

}  // namespace ash
