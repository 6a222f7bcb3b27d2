#include "ash/core/resources.hpp"

#include <unistd.h>

#include <limits>

#include "ash/core/error.hpp"
#include "ash/core/memory.hpp"

namespace ash {

std::int64_t checked_mul(std::int64_t a, std::int64_t b, const std::string& what) {
  std::int64_t r = 0;
  require(a >= 0 && b >= 0 && !__builtin_mul_overflow(a, b, &r),
          "sizes overflow: " + what + " (" + std::to_string(a) + " x " + std::to_string(b) + ") does not fit in 64 bits");
  return r;
}

std::int64_t checked_add(std::int64_t a, std::int64_t b, const std::string& what) {
  std::int64_t r = 0;
  require(a >= 0 && b >= 0 && !__builtin_add_overflow(a, b, &r),
          "sizes overflow: " + what + " (" + std::to_string(a) + " + " + std::to_string(b) + ") does not fit in 64 bits");
  return r;
}

std::int64_t checked_parameter_count(const ModelDims& d) {
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

MemoryEstimate estimate_memory(const Config& cfg, Workload w, std::size_t scalar_bytes) {
  const auto d = cfg.model();
  const std::int64_t S = std::int64_t(scalar_bytes);
  const std::int64_t P = d.width, N = d.state, V = d.vocab;
  const std::int64_t R = std::max<std::int64_t>(1, cfg.get<std::int64_t>("dist.layer_ranks"));
  const std::int64_t K = (d.layers + R - 1) / R;  // layers on the busiest rank
  const auto params = checked_mul(checked_parameter_count(d), S, "parameter bytes");
  MemoryEstimate e;
  e.params = std::uint64_t(params);
  // init: a host mirror and the file image; grad: the gradient and the image;
  // train: gradient, Adam m and v, and the image of params + m + v.
  const std::int64_t copies = w == Workload::init ? 2 : w == Workload::grad ? 2 : 6;
  e.state = std::uint64_t(checked_mul(params, copies, "optimizer and file bytes"));
  if (w == Workload::init) return e;
  const auto B = cfg.get<std::int64_t>("data.batch");
  // A sequence rank holds T/S tokens of every window (docs/design.md §2, E4).
  const auto Sq = std::max<std::int64_t>(1, cfg.get<std::int64_t>("dist.seq_ranks"));
  const auto T = (cfg.get<std::int64_t>("data.seq_len") + Sq - 1) / Sq;
  const auto BT = checked_mul(B, T, "data.batch x data.seq_len");
  // The head forms logits and their gradient grad.head_chunk tokens at a time; token ids.
  const auto head_chunk = std::max<std::int64_t>(1, cfg.get<std::int64_t>("grad.head_chunk"));
  auto act = checked_mul(checked_mul(std::min<std::int64_t>(BT, head_chunk), V, "head chunk x vocab"), 2 * S,
                         "logit bytes");
  act = checked_add(act, checked_mul(BT, 8, "token bytes"), "activation bytes");
  const auto PN = checked_mul(P, N, "model.width x model.state");
  const auto projections = checked_add(checked_mul(2, P, "2 x width"), 2 * N + 1, "per-token projections");
  const auto per_token_layer = checked_add(checked_mul(2, PN, "2 x width x state"), projections, "per-token state");
  const auto engine = cfg.get<std::string>("grad.engine");
  // Every layer's input and the cotangent g: (K + 2)·B·T·P.
  std::int64_t kept = checked_mul(checked_mul(K + 2, BT, "layers x batch x seq_len"), P, "layer inputs");
  if (engine == "adjoint-exact") {
    // E3: one layer's projections, h and μ at chunk boundaries (3 buffers of
    // B·T/C·P·N), and one wave of h, A and μ (3 buffers of B·min(T, W)·P·N).
    const auto C = std::max<std::int64_t>(1, cfg.get<std::int64_t>("grad.chunk"));
    const auto chunks = checked_mul(B, (T + C - 1) / C, "chunks");
    kept = checked_add(kept, checked_mul(BT, projections, "one layer's projections"), "kept activations");
    kept = checked_add(kept, checked_mul(checked_mul(3, chunks, "boundary states"), PN, "boundary states"),
                       "kept activations");
    kept = checked_add(kept, checked_mul(checked_mul(3 * B, std::min<std::int64_t>(T, std::max<std::int64_t>(C, cfg.get<std::int64_t>("grad.wave"))), "wave"), PN, "wave"),
                       "kept activations");
  } else {
    // E1 / E2 keep A, h and the projections of every layer, and μ of one:
    // K·B·T·(2PN + 2P + 2N + 1) + B·T·P·N.
    kept = checked_add(kept, checked_mul(checked_mul(K, BT, "layers x batch x seq_len"), per_token_layer, "kept"),
                       "kept activations");
    kept = checked_add(kept, checked_mul(BT, PN, "mu"), "kept activations");
  }
  act = checked_add(act, checked_mul(kept, S, "activation bytes"), "activation bytes");
  e.activations = std::uint64_t(act);
  return e;
}

std::uint64_t physical_memory_bytes() {
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page <= 0) return 0;
  return std::uint64_t(pages) * std::uint64_t(page);
}

void check_memory(const Config& cfg, Workload w, std::size_t scalar_bytes, std::uint64_t limit) {
  const auto e = estimate_memory(cfg, w, scalar_bytes);
  const bool from_flag = limit > 0;
  if (!from_flag) limit = physical_memory_bytes();
  if (limit == 0 || e.total() <= limit) return;
  throw Error("this configuration needs about " + format_bytes(e.total()) + " of memory (parameters " +
              format_bytes(e.params) + ", gradient/optimizer/file " + format_bytes(e.state) + ", activations " +
              format_bytes(e.activations) + "), more than " +
              (from_flag ? "--max-memory " : "the machine's physical memory ") + format_bytes(limit) +
              ": reduce data.batch, data.seq_len or the model sizes");
}

}  // namespace ash
