#include "ash/core/resources.hpp"
#include "ash/kernels/rms_norm.hpp"
#include "ash/model/embedding.hpp"
#include "ash/model/head.hpp"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <string>

#include <Kokkos_Core.hpp>
#if defined(KOKKOS_ENABLE_CUDA)
#include <cuda_runtime_api.h>
#endif

#include "ash/core/error.hpp"
#include "ash/core/half.hpp"
#include "ash/grad/low_memory_engine.hpp"
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
  const auto head_chunk = std::int64_t(head_chunk_rows(cfg.get<std::int64_t>("grad.head_chunk"), V));
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
    kept = checked_add(kept, checked_mul(checked_mul(3 * B, std::min<std::int64_t>(T, std::max<std::int64_t>(C, cfg.get<std::int64_t>("grad.wave") > 0 ? cfg.get<std::int64_t>("grad.wave") : T)), "wave"), PN, "wave"),
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

std::int64_t resolve_layer_checkpoint(std::int64_t m, std::int64_t layers) {
  require(m >= 0, "grad.layer_checkpoint must be >= 0 (0 or \"auto\": about sqrt(model.layers))");
  if (m > 0) return m;
  const auto r = std::int64_t(std::lround(std::sqrt(double(layers))));
  return r > 1 ? r : 1;
}

double MemoryPlan::total() const {
  double t = 0;
  for (const auto& i : items) t += i.bytes;
  return t;
}

std::string MemoryPlan::table(const std::string& indent) const {
  std::string out;
  char line[256];
  for (const auto& i : items) {
    std::snprintf(line, sizeof line, "%s%-44s %12s\n", indent.c_str(), i.name.c_str(),
                  format_bytes(std::uint64_t(i.bytes)).c_str());
    out += line;
  }
  std::snprintf(line, sizeof line, "%s%-44s %12s\n", indent.c_str(), "total (predicted peak)",
                format_bytes(std::uint64_t(total())).c_str());
  return out + line;
}

MemoryPlan plan_memory(const Config& cfg, Workload w, std::size_t scalar_bytes, std::int64_t valid_windows) {
  // Sizes in double: validate() has already checked every product for overflow.
  const auto d = cfg.model();
  const double S = double(scalar_bytes), V = double(d.vocab), P = double(d.width), N = double(d.state);
  const std::int64_t R = std::max<std::int64_t>(1, cfg.get<std::int64_t>("dist.layer_ranks"));
  const std::int64_t Sq = std::max<std::int64_t>(1, cfg.get<std::int64_t>("dist.seq_ranks"));
  const std::int64_t K = (d.layers + R - 1) / R;  // layers on the busiest rank
  const std::int64_t Ti = (cfg.get<std::int64_t>("data.seq_len") + Sq - 1) / Sq, Bi = cfg.get<std::int64_t>("data.batch");
  const double T = double(Ti), B = double(Bi), M = B * T, cnt = double(checked_parameter_count(d));
  // The engines' own options and size rules, so the plan follows them.
  const EngineOptions o = EngineOptions::from_config(cfg);
  const std::string& engine = o.engine;
  const Storage storage = o.storage;
  const std::int64_t m = o.layer_checkpoint;
  const bool carry = o.carry_state;
  const double hc = double(head_chunk_rows(o.head_chunk, d.vocab));
  const bool low = engine == "adjoint-exact" && o.low_memory();

  MemoryPlan plan;
  auto add = [](std::vector<MemoryPlan::Item>& v, const std::string& n, double b) { v.push_back({n, b}); };
  // What every phase holds.
  add(plan.items, "parameters", cnt * S);
  if (w == Workload::init) {
    add(plan.items, "host copy for the file", cnt * S);
    plan.engine = "init";
    plan.phase = "writing the file";
    return plan;
  }
  add(plan.items, "gradient", cnt * S);
  if (w == Workload::train) add(plan.items, "optimizer (Adam m, v)", 2 * cnt * S);
  add(plan.items, "token ids", M * 4);

  // Building blocks (the allocations of the code they name).
  auto proj = [&](double rows) { return (rows * (2 * P + 2 * N + 1) + P * N) * S; };  // LayerActivations, projections
  auto head = [&](double rows, double chunk_rows, bool g) {  // head_loss: rstd, ŷ, logits (and ∂ŷ) of one chunk
    const double C = std::min(chunk_rows, rows);
    return C * (1 + P + V + (g ? P : 0)) * S;
  };
  auto cot = [&](double rows) {  // LayerCotangents: 3 [R,P], 2 [R,N], two-level partial sums per reduce_rows rows
    return (rows * (3 * P + 2 * N) + std::ceil(rows / double(impl::reduce_rows)) * (P * N + 2 * P)) * S;
  };
  auto e3_scratch = [&](double Bt, std::int64_t Tw) {  // AdjointExactLayer::run on windows of Tw tokens
    const bool window = o.truncate > 0 && o.truncate < Tw;
    const std::int64_t C = std::min(o.chunk, Tw), nc = (Tw + C - 1) / C;
    const double Wb = double(std::min(e3_wave_length(o, Tw, std::int64_t(Bt) * P * N), Tw));
    // h, products (and μ) at chunk starts; the sequential h form keeps no h or
    // products for h, only μ and its products in exact mode, plus a running h
    const double nchunk_bufs = o.e3_chunked_h ? (window ? 2 : 3) : (window ? 0 : 2);
    const double bound = nchunk_bufs * Bt * double(nc) * P * N * S + (o.e3_chunked_h ? 0.0 : Bt * P * N * S);
    return bound + 3 * Bt * Wb * P * N * S + cot(Bt * Wb);                // one wave of h, A, μ; cotangents
  };

  auto emb_partial = [&](double rows) {  // embedding_backward's private copies of gE (none on a host backend)
    const index_t seg = embedding_backward_segments(index_t(ExecSpace().concurrency()), index_t(rows), d.vocab, d.width);
    return seg > 1 ? double(seg) * V * P * S : 0.0;
  };
  std::vector<std::pair<std::string, std::vector<MemoryPlan::Item>>> phases;
  std::vector<MemoryPlan::Item> persistent;  // engine memory held across the phases below
  if (low) {
    const std::int64_t blen = low_memory_block_length(o, Ti);
    const double nb = double((Ti + blen - 1) / blen), rb = B * double(blen);
    std::int64_t nkept = 0;
    for (std::int64_t k = m; k <= K; k += m) ++nkept;
    const std::int64_t nseg = std::min<std::int64_t>(m, K + 1);
    plan.engine = "adjoint-exact over token blocks of " + std::to_string(blen) + ", " + storage_name(storage) +
                  " storage, layer checkpoint " + std::to_string(m);
    add(persistent, std::to_string(nkept) + " kept layer input(s), " + storage_name(storage),
        double(nkept) * M * P * double(storage_bytes(storage, scalar_bytes)));
    add(persistent, "states at block starts (K x blocks)", double(K) * nb * B * P * N * S);
    add(persistent, "block projections + running state", proj(rb) + B * P * N * S);
    if (carry) add(persistent, "carried state", double(K) * B * P * N * S);
    phases.push_back({"forward", {{"block activations (in, out)", 2 * rb * P * S}}});
    std::vector<MemoryPlan::Item> back{{"segment inputs + g of a block", double(nseg + 1) * rb * P * S},
                                       {"E3 block projections", proj(rb)}};
    if (nb > 1) back.push_back({"E3 carries (mu, A per layer)", 2 * double(K) * B * P * N * S});
    // E3's scratch lives through the pass, so from the second block on the
    // head's chunk comes on top of it; with one block the head runs first.
    const double e3 = e3_scratch(B, blen), hd = head(rb, hc, true);
    auto emb = back;  // each block ends with its embedding backward, E3's scratch still held
    emb.push_back({"E3 wave scratch", e3});
    emb.push_back({"embedding backward segments", emb_partial(rb)});
    if (nb > 1 || e3 >= hd) back.push_back({"E3 wave scratch", e3});
    if (nb > 1 || hd > e3) back.push_back({"head chunk", hd});
    phases.push_back({"backward", back});
    phases.push_back({"embedding backward", emb});
  } else if (engine == "adjoint-exact") {
    plan.engine = "adjoint-exact";
    add(persistent, "layer projections (one layer)", proj(M));
    add(persistent, "g (dL/dy)", M * P * S);
    phases.push_back({"head", {{std::to_string(K + 1) + " layer inputs", double(K + 1) * M * P * S},
                               {"head chunk", head(M, hc, true)}}});
    phases.push_back({"backward of the top layer", {{std::to_string(K) + " layer inputs", double(K) * M * P * S},
                                                    {"E3 wave scratch", e3_scratch(B, Ti)}}});
  } else {  // E1, E2: every layer's activations with h^{t-1} and A
    plan.engine = engine;
    add(persistent, std::to_string(K) + " layers' activations (h, A, projections)",
        double(K) * (proj(M) + 2 * M * P * N * S));
    add(persistent, "g (dL/dy)", M * P * S);
    phases.push_back({"head", {{std::to_string(K + 1) + " layer inputs", double(K + 1) * M * P * S},
                               {"head chunk", head(M, hc, true)}}});
    std::vector<MemoryPlan::Item> back{{std::to_string(K) + " layer inputs", double(K) * M * P * S},
                                       {"mu + cotangents (whole window)", M * P * N * S + cot(M)}};
    if (engine == "backprop") {  // the chunked reverse scan: carries (and local sums, products) per chunk
      const std::int64_t C = std::min(o.chunk, Ti), nc = (Ti + C - 1) / C;
      back.push_back({"E1 chunk carries", (nc > 1 ? 3 : 1) * B * double(nc) * P * N * S});
    }
    phases.push_back({"backward of the top layer", back});
  }
  if (!low)  // after the layers: g and the segment copies of gE
    phases.push_back({"embedding backward", {{"embedding backward segments", emb_partial(M)}}});
  std::vector<MemoryPlan::Item> step_items = persistent;
  double best = -1;
  std::string best_phase;
  std::vector<MemoryPlan::Item> best_items;
  auto consider = [&](const std::string& name, const std::vector<MemoryPlan::Item>& base,
                      const std::vector<MemoryPlan::Item>& extra) {
    double t = 0;
    for (const auto& i : base) t += i.bytes;
    for (const auto& i : extra) t += i.bytes;
    if (t > best) {
      best = t;
      best_phase = name;
      best_items = base;
      best_items.insert(best_items.end(), extra.begin(), extra.end());
    }
  };
  for (const auto& ph : phases) consider(ph.first, step_items, ph.second);
  if (w == Workload::train) {
    // ash train also holds the validation windows and scores them, data.batch
    // at a time, with a forward of its own (one layer at a time, head chunks of 1024 rows).
    const double nv = double(std::max<std::int64_t>(0, valid_windows));
    add(plan.items, "validation token ids", nv * T * 4);
    const double Mv = std::min(nv, B) * T;  // rows of one scored batch
    std::vector<MemoryPlan::Item> keep;
    if (carry) keep.push_back({"carried state", double(K) * B * P * N * S});
    std::vector<MemoryPlan::Item> val{{"validation activations (y, next y, projections)", 2 * Mv * P * S + proj(Mv)},
                                      {"validation head chunk", head(Mv, 1024, false)}};
    if (nv > B) val.push_back({"validation batch token ids", Mv * 4});
    consider("validation forward", keep, val);
  }
  plan.phase = best_phase;
  plan.items.insert(plan.items.end(), best_items.begin(), best_items.end());
  if (R > 1 || Sq > 1) plan.engine += " (per rank, approximate for dist.* layouts)";
  return plan;
}

std::uint64_t physical_memory_bytes() {
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page <= 0) return 0;
  return std::uint64_t(pages) * std::uint64_t(page);
}

MemoryCapacity memory_space_capacity() {
#if defined(KOKKOS_ENABLE_CUDA)
  if (!host_backend) {
    std::size_t free_b = 0, total_b = 0;
    if (cudaMemGetInfo(&free_b, &total_b) != cudaSuccess) return {0, "the GPU's memory"};
    return {std::uint64_t(total_b), "the GPU's memory"};
  }
#endif
  return {physical_memory_bytes(), "the machine's physical memory"};
}

void check_memory(const Config& cfg, Workload w, std::size_t scalar_bytes, std::uint64_t limit) {
  estimate_memory(cfg, w, scalar_bytes);  // overflow checks of every size product
  const auto plan = plan_memory(cfg, w, scalar_bytes);
  const bool from_flag = limit > 0;
  const auto cap = memory_space_capacity();
  if (!from_flag) limit = cap.bytes;
  if (limit == 0 || plan.total() <= double(limit)) return;
  throw Error("this configuration needs about " + format_bytes(std::uint64_t(plan.total())) + " of memory (" +
              plan.engine + ", peak at the " + plan.phase + "), more than " +
              (from_flag ? std::string("--max-memory ") : cap.what + " ") + format_bytes(limit) +
              ": reduce data.batch, data.seq_len or the model sizes, or see `ash plan` (run.storage, "
              "grad.layer_checkpoint, grad.token_block)\n" + plan.table("  "));
}

}  // namespace ash
