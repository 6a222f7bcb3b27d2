#include "ash/plan/memory_plan.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>

#include <Kokkos_Core.hpp>
#if defined(KOKKOS_ENABLE_CUDA)
#include <cuda_runtime_api.h>
#endif

#include "ash/core/error.hpp"
#include "ash/core/memory.hpp"
#include "ash/core/sizes.hpp"
#include "ash/grad/low_memory_engine.hpp"
#include "ash/kernels/rms_norm.hpp"
#include "ash/model/embedding.hpp"
#include "ash/model/head.hpp"

namespace ash {

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

MemoryPlan plan_memory(const Settings& cfg, Workload w, std::size_t scalar_bytes, std::int64_t valid_windows) {
  // Sizes in double: Config::settings() has already checked every product for overflow.
  const auto& d = cfg.model;
  const double S = double(scalar_bytes), V = double(d.vocab), P = double(d.width), N = double(d.state);
  const std::int64_t R = std::max<std::int64_t>(1, cfg.dist.layer_ranks);
  const std::int64_t Sq = std::max<std::int64_t>(1, cfg.dist.seq_ranks);
  const std::int64_t K = (d.layers + R - 1) / R;  // layers on the busiest rank
  const std::int64_t Ti = (cfg.data.seq_len + Sq - 1) / Sq, Bi = cfg.data.batch;
  const double T = double(Ti), B = double(Bi), M = B * T, cnt = double(checked_parameter_count(d));
  // The engines' own options and size rules, so the plan follows them.
  const EngineOptions& o = cfg.grad;
  const std::string engine = method_name(o.method);
  const Storage storage = o.storage;
  const std::int64_t m = o.layer_checkpoint;
  const bool carry = o.carry_state;
  const double hc = double(head_chunk_rows(o.head_chunk, d.vocab));
  const bool low = o.exact_adjoint() && o.low_memory();

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
    const std::int64_t nkept = K / m;  // y_m, y_2m, ... <= y_K
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
  } else if (o.exact_adjoint()) {
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
    if (o.method == Method::backprop) {  // the chunked reverse scan: carries (and local sums, products) per chunk
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

void check_memory(const Settings& cfg, Workload w, std::size_t scalar_bytes, std::uint64_t limit) {
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
