#include "ash/plan/memory_plan.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include <Kokkos_Core.hpp>
#if defined(KOKKOS_ENABLE_CUDA)
#include <cuda_runtime_api.h>
#endif

#include "ash/core/error.hpp"
#include "ash/core/memory.hpp"
#include "ash/core/sizes.hpp"
#include "ash/grad/adjoint.hpp"
#include "ash/grad/adjoint_exact.hpp"
#include "ash/grad/backprop.hpp"
#include "ash/grad/blockwise_engine.hpp"
#include "ash/grad/engine.hpp"
#include "ash/grad/layer_kinds.hpp"
#include "ash/kernels/row_sums.hpp"
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

namespace {

using Items = std::vector<MemoryPlan::Item>;
using Phases = std::vector<std::pair<std::string, Items>>;

// The sizes of one rank's share of a configuration, and the allocations of
// the code each building block names, for a layer kind Kind: the kind's own
// buffers are its WorkspaceSpecs and PlanRows, worded and grouped as its
// PlanStyle says (grad/*_kind.hpp). Sizes in double: Config::settings() has
// already checked every integer product for overflow.
template <class Kind>
struct Planner {
  const Settings& cfg;
  const ModelDims& d;
  const EngineOptions& o;
  const PlanStyle& style;
  LayerRange lr;  // this rank's layers (the whole model on one process)
  bool multi;     // a dist.* layout of several ranks
  double S, V, P, N;
  std::int64_t K, Ti;  // layers on this rank, tokens per window on this rank
  double T, B, M;
  double hc;  // head chunk rows

  Planner(const Settings& c, std::size_t scalar_bytes, const LayerRange& range, std::int64_t Sq, std::int64_t D)
      : cfg(c),
        d(c.model),
        o(c.grad),
        style(Kind::plan_style),
        lr(range),
        multi(c.dist.layer_ranks > 1 || c.dist.seq_ranks > 1 || c.dist.data_ranks > 1),
        S(double(scalar_bytes)),
        V(double(c.model.vocab)),
        P(double(c.model.width)),
        N(double(c.model.state)),
        K(range.k1 - range.k0),
        Ti((c.data.seq_len + Sq - 1) / Sq),
        T(double(Ti)),
        B(double((c.data.batch + D - 1) / D)),  // this replica's windows
        M(B * T),
        hc(double(head_chunk_rows(c.grad.head_chunk, c.model.vocab))) {}

  std::size_t elem() const { return std::size_t(S); }
  index_t batch() const { return index_t(B); }
  // Parameters of this rank's shard, its own layout (embedding on the first,
  // final norm and head on the last; where the tied head is the embedding, the
  // last rank's copy of it).
  double shard_parameters() const {
    const auto l = param_layout(cfg.model, lr);
    return l.empty() ? 0.0 : double(l.back().offset + l.back().size());
  }
  // data.carry_state: every layer's state of the whole batch (ash train keeps it all on every rank),
  // [B·carry_rows, carry_cols] per layer.
  double carried_state() const {
    return double(cfg.model.layers) * double(cfg.data.batch) * double(cfg.model.carry_rows()) *
           double(cfg.model.carry_cols()) * S;
  }
  // A block-wise pass on this range in blocks of blen (not reading its input again: a pipeline or one process).
  BlockwiseShape pass(std::int64_t blen) const {
    return BlockwiseShape{lr.k0, lr.k1, int(cfg.model.layers), lr.embedding, lr.head, false, std::int64_t(B),
                          Ti, blen, cfg.model.width, cfg.model.state, std::size_t(S)};
  }
  std::string kept_inputs(const BlockwiseWorkspace& ws) const {
    return std::to_string(ws.kept.buffers().at(0).copies) + " kept layer input(s), " + storage_name(o.storage);
  }

  // The kind's activations of `rows` tokens (projections; with h_and_A E1's and E2's kept ones), its state.
  double acts(double rows, bool h_and_A) const { return Kind::acts_spec(d, index_t(rows), h_and_A, elem()).bytes(); }
  double state() const { return Kind::state_spec(d, batch(), elem()).bytes(); }
  double block_states(std::int64_t blocks) const {
    return double(K) * Kind::block_states_spec(d, batch(), blocks, elem()).bytes();
  }
  // E3's μ and A carried between token blocks over the kind's scan channels, one per layer.
  double mu_carries(std::int64_t blen) const {
    return adjoint_exact_carry_workspace(Kind::scan_layer_shape(d, batch(), blen, elem())).bytes();
  }
  static void add(Items& to, const PlanRows& rows) {
    for (const auto& r : rows) to.push_back({r.label, r.spec.bytes()});
  }
  double head(double rows, double chunk_rows, bool g) const {  // head_loss: rstd, ŷ, logits (and ∂ŷ) of one chunk
    const double C = std::min(chunk_rows, rows);
    return (C * (1 + P + V + (g ? P : 0)) + (g ? std::ceil(C / double(impl::reduce_rows)) * P + P : 0.0)) * S;
  }
  double emb_partial(double rows) const {  // embedding_backward's private copies of gE (none on a host backend)
    const index_t seg = embedding_backward_segments(index_t(ExecSpace().concurrency()), index_t(rows), cfg.model.vocab,
                                                    cfg.model.width);
    return seg > 1 ? double(seg) * V * P * S : 0.0;
  }
  // The plan's engine name: method and rest, and where the kind's style names
  // it, E3's options (tbar: the window too) and the kind.
  std::string named(const std::string& method, const std::string& rest, bool e3, bool tbar = false) const {
    if (!style.names_kind) return method + rest;
    return method + (e3 && o.detach_inputs ? ", detached" : "") +
           (tbar && o.truncate > 0 ? ", T-bar=" + std::to_string(o.truncate) : "") + rest + " (model.arch=" +
           Kind::name + ")";
  }
  std::string levers(const std::string& blocks) const {
    return " over token blocks of " + blocks + ", " + storage_name(o.storage) + " storage, layer checkpoint " +
           std::to_string(o.layer_checkpoint);
  }

  // The block-wise engine (a memory lever set, or E3 on layer and data ranks),
  // BlockwiseEngine's KindPass on this rank's layer range: the kept inputs
  // (run.storage; a range after the first keeps the input it received), the
  // kind's state before every (layer, block) and the running one, one block's
  // activations; forward: a block's y and next y; backward: the segment's
  // inputs and g of a block, the kind's carries (and E3's μ/A carries with
  // several blocks), the scratch of the kind's block backward, held from the
  // first block on; the head's chunk on the range with the head.
  std::string blockwise(Items& persistent, Phases& phases) const {
    const std::int64_t blen = multi ? pipeline_block_length(o, Ti, std::max<std::int64_t>(1, cfg.dist.layer_ranks),
                                                            cfg.dist.pipeline_blocks)
                                    : blockwise_block_length(o, Ti);
    const std::int64_t nblocks = (Ti + blen - 1) / blen;
    const double nb = double(nblocks), rb = B * double(blen), run = state();
    const BlockwiseWorkspace ws = blockwise_workspace(o, pass(blen));
    persistent.push_back({kept_inputs(ws), ws.kept.bytes()});
    persistent.push_back({style.states, block_states(nblocks) + (style.states_hold_run ? run : 0.0)});
    persistent.push_back({style.block_acts, acts(rb, false) + (style.states_hold_run ? 0.0 : run)});
    if (o.carry_state) persistent.push_back({"carried state", carried_state()});
    phases.push_back({"forward", {{style.block_io, ws.forward.bytes()}}});
    Items held{{"segment inputs + g of a block", ws.backward.bytes()}};
    const WorkspaceSpec carry = Kind::carry_spec(d, batch(), elem());
    if (!carry.buffers().empty()) held.push_back({style.carries, double(K) * carry.bytes()});
    // E3's scratch lives through the pass: from the second block on the head's
    // chunk comes on top of it; with one block the head runs before it exists
    // (the weighed rows: the larger of them and the head counts).
    Items back = held, weighed;
    double e3 = 0;
    for (const auto& r : Kind::exact_block_rows(o, d, batch(), blen, false, elem())) {
      (r.weighed ? weighed : back).push_back({r.label, r.spec.bytes()});
      if (r.weighed) e3 += r.spec.bytes();
    }
    if (nb > 1) back.push_back({style.mu_carries, double(K) * mu_carries(blen)});
    const double hd = lr.head ? head(rb, hc, true) : 0.0;
    auto emb = back;  // each block ends with its embedding backward, E3's scratch still held
    emb.insert(emb.end(), weighed.begin(), weighed.end());
    if (lr.k0 == 0) emb.push_back({"embedding backward segments", emb_partial(rb)});  // (a last range's tied embedding is its head)
    if (nb > 1 || e3 >= hd || style.head_own_phase) back.insert(back.end(), weighed.begin(), weighed.end());
    if (lr.head && (nb > 1 || (hd > e3 && !style.head_own_phase))) back.push_back({"head chunk", hd});
    if (lr.head && nb == 1 && style.head_own_phase) {
      Items hp = held;
      hp.push_back({"head chunk", hd});
      phases.push_back({"head", hp});
    }
    phases.push_back({"backward", back});
    phases.push_back({"embedding backward", emb});
    return named("adjoint-exact", levers(std::to_string(blen)), true);
  }

  // dist::SequenceBlockwise on sequence ranks: this rank's token range in
  // whole-range y buffers, token blocks of sequence_block_length inside it
  // (with a lever; the range one block without), layer by layer. A window T̄ <
  // T: each range one block, and a halo of T̄ − 1 tokens from the next range.
  std::string sequence_blockwise(Items& persistent, Phases& phases) const {
    const bool window = o.truncate > 0 && o.truncate < cfg.data.seq_len;
    const std::int64_t Tall = cfg.data.seq_len, Sr = cfg.dist.seq_ranks;
    const std::int64_t blen = o.blockwise_levers() ? sequence_block_length(o, Ti, Tall) : Ti;
    // The most blocks a range has (one process's blocks cut at the range's ends).
    std::int64_t nblocks = 1;
    if (o.blockwise_levers())
      for (std::int64_t s = 0; s < Sr; ++s)
        nblocks = std::max<std::int64_t>(nblocks, sequence_blocks(o, Tall, Tall * s / Sr, Tall * (s + 1) / Sr).n);
    const std::int64_t H = window ? std::min<std::int64_t>(o.truncate - 1, Ti) : 0, Te = Ti + H;
    const double rb = B * double(blen), run = state();
    const BlockwiseWorkspace ws =
        sequence_blockwise_workspace<Kind>(o, pass(blen), Tall, H);
    const std::string states = style.states + std::string(style.states_hold_run ? "" : " + running state");
    const std::string halo = "range + halo of y and g; g's halo; halo messages";
    const double messages = 2 * double(H) * B * P * S;  // the halo's (dist::WindowHalo): H rows sent, H received
    persistent.push_back({kept_inputs(ws), ws.kept.bytes()});
    if (style.sequence_carry_maps) {
      // The states through the block-wise forward, the state at the range's
      // end passed on; backward: μ's carry maps over the range and a block.
      persistent.push_back({states, block_states(nblocks) + run});
      persistent.push_back({"whole-range y and next y (or g)", ws.range.bytes()});
      persistent.push_back({"block projections", ws.block.bytes()});
      if (o.carry_state) persistent.push_back({"carried state", carried_state()});
      phases.push_back({"forward", {{"the state at the range's end (to the next range)", ws.forward.bytes()}}});
      const Items blocks{{"recomputed blocks (in, out), a replay's state", ws.backward.bytes()},
                         {"carry maps (range, block; ones)", ws.carry_maps.bytes()}};
      if (lr.head) phases.push_back({"head", {blocks[0], {"head chunk", head(rb, hc, true)}}});
      // E3's scratch stays allocated from the first block on (released after
      // the pass); a block's carry map adds μ and products at chunk starts.
      if (window) {
        Items back{blocks[0], {halo, ws.window.bytes() + messages}};
        add(back, Kind::exact_block_rows(o, d, batch(), Te, H > 0, elem()));
        phases.push_back({"backward", back});
      } else {
        Items back = blocks;
        add(back, Kind::exact_block_rows(o, d, batch(), blen, false, elem()));
        Items map = back;
        map.push_back({"E3 carry map (open carry, chunk starts)",
                       adjoint_exact_carry_map_workspace(o, Kind::scan_layer_shape(d, batch(), blen, elem())).bytes()});
        phases.push_back({"backward", back});
        phases.push_back({"backward carry map", map});
      }
      if (lr.embedding) phases.push_back({"embedding backward", {{"embedding backward segments", emb_partial(rb)}}});
    } else {
      // The kind's states before every (layer, block), the running one and the
      // block-wise forward's h, one block's activations; backward: the kind's
      // carry and μ's (μ, A) passed range to range (a window: the carry only)
      // and its block backward's scratch, held from the first block on.
      persistent.push_back({"whole-range y and next y (or g)", ws.range.bytes()});
      persistent.push_back({states, block_states(nblocks) + run + B * P * N * S});
      persistent.push_back({style.block_acts, acts(rb, false)});
      const Items blocks{{"recomputed blocks (in, out)", ws.backward.bytes()}};
      if (lr.head) phases.push_back({"head", {blocks[0], {"head chunk", head(rb, hc, true)}}});
      const double carry = Kind::carry_spec(d, batch(), elem()).bytes();
      Items back = blocks;
      if (window)
        back.push_back({halo + "; " + style.carry, ws.window.bytes() + messages + carry});
      else
        back.push_back({style.carry + std::string(" + mu, A carry (from the next range)"), carry + mu_carries(blen)});
      add(back, Kind::exact_block_rows(o, d, batch(), blen + H, H > 0, elem()));
      phases.push_back({"backward", back});
      if (lr.embedding) {
        back.push_back({"embedding backward segments", emb_partial(rb)});
        phases.push_back({"embedding backward", back});
      }
    }
    return named("adjoint-exact", levers(std::to_string(blen) + " in each sequence range"), true);
  }

  // Whole windows (LocalEngine): E3 keeps the layer inputs and one layer's
  // activations; E1 and E2 every layer's activations with h^{t-1} and A.
  std::string whole_window(Items& persistent, Phases& phases) const {
    const std::string unit = style.unit, layer_inputs = " layer inputs";
    const Items head_phase{{std::to_string(K + 1) + layer_inputs, double(K + 1) * M * P * S},
                           {"head chunk", head(M, hc, true)}};
    Items back{{std::to_string(K) + layer_inputs, double(K) * M * P * S}};
    if (o.exact_adjoint()) {
      persistent.push_back({unit + " projections (one " + unit + ")", acts(M, false)});
      persistent.push_back({"g (dL/dy)", M * P * S});
      add(back, Kind::exact_window_rows(o, d, batch(), Ti, elem()));
    } else {
      persistent.push_back(
          {std::to_string(K) + " " + unit + "s' activations (h, A, projections)", double(K) * acts(M, true)});
      persistent.push_back({"g (dL/dy)", M * P * S});
      // E1, E2's workspace over the kind's scan: μ (and the scan's cotangents,
      // unless the kind's own hold them); E1's chunked reverse scan adds carries
      // (and local sums, products).
      const LayerShape scan = Kind::scan_layer_shape(d, batch(), Ti, elem());
      const WorkspaceSpec ws = o.method == Method::backprop ? backprop_workspace(o, scan, Kind::window_cotangents)
                                                            : adjoint_workspace(o, scan, Kind::window_cotangents);
      const double carries = ws.bytes("ash::e1::chunk_");
      back.push_back({"mu + cotangents (whole window)",
                      ws.bytes() - carries + Kind::cotangents_spec(d, index_t(M), true, elem()).bytes()});
      if (o.method == Method::backprop) back.push_back({"E1 chunk carries", carries});
    }
    phases.push_back({"head", head_phase});
    phases.push_back({"backward of the top " + unit, back});
    // after the layers: g and the segment copies of gE
    phases.push_back({"embedding backward", {{"embedding backward segments", emb_partial(M)}}});
    return o.exact_adjoint() ? named("adjoint-exact", "", true, true) : named(method_name(o.method), "", false);
  }
};

// The phase whose items sum highest.
struct Peak {
  double bytes = -1;
  std::string phase;
  Items items;
  void consider(const std::string& name, const Items& base, const Items& extra) {
    double t = 0;
    for (const auto& i : base) t += i.bytes;
    for (const auto& i : extra) t += i.bytes;
    if (t > bytes) {
      bytes = t;
      phase = name;
      items = base;
      items.insert(items.end(), extra.begin(), extra.end());
    }
  }
};

}  // namespace

namespace {

template <class Kind>
MemoryPlan plan_rank(const Settings& cfg, Workload w, std::size_t scalar_bytes, std::int64_t valid_windows,
                     const LayerRange& lr) {
  const std::int64_t R = std::max<std::int64_t>(1, cfg.dist.layer_ranks);
  const std::int64_t Sq = std::max<std::int64_t>(1, cfg.dist.seq_ranks);
  const std::int64_t D = std::max<std::int64_t>(1, cfg.dist.data_ranks);
  const Planner<Kind> pl(cfg, scalar_bytes, lr, Sq, D);
  const bool multi = pl.multi;
  const double S = pl.S, cnt = multi ? pl.shard_parameters() : double(checked_parameter_count(cfg.model));
  MemoryPlan plan;
  // What every phase holds.
  plan.items.push_back({"parameters", cnt * S});
  if (w == Workload::init) {
    plan.items.push_back({"host copy for the file", cnt * S});
    plan.engine = "init";
    plan.phase = "writing the file";
    return plan;
  }
  plan.items.push_back({"gradient", cnt * S});
  if (w == Workload::train) plan.items.push_back({"optimizer (Adam m, v)", 2 * cnt * S});
  plan.items.push_back({"token ids", double(cfg.data.batch) * double(cfg.data.seq_len) * 4});
  if (D > 1) plan.items.push_back({"this replica's token ids", pl.M * 4});

  Phases phases;
  Items persistent;  // engine memory held across the phases below
  // E3 runs block-wise with a lever, and on every layer or data rank layout (S = 1).
  const bool blockwise = cfg.grad.exact_adjoint() && (cfg.grad.blockwise_levers() || (multi && Sq == 1));
  // With S > 1 each range runs in token blocks (dist::SequenceBlockwise): with a
  // lever, or levers or not where the kind passes its carries range to range.
  const bool seq_blocks = cfg.grad.exact_adjoint() && Sq > 1 &&
                          (cfg.grad.blockwise_levers() || !Kind::plan_style.sequence_carry_maps);
  plan.engine = seq_blocks  ? pl.sequence_blockwise(persistent, phases)
                : blockwise ? pl.blockwise(persistent, phases)
                            : pl.whole_window(persistent, phases);
  Peak peak;
  for (const auto& ph : phases) peak.consider(ph.first, persistent, ph.second);
  if (w == Workload::train) {
    // ash train also holds the validation windows and scores them, data.batch
    // at a time, with a forward of its own (one layer at a time, head chunks of 1024 rows).
    const double nv = double(std::max<std::int64_t>(0, valid_windows)), T = pl.T, B = pl.B, P = pl.P;
    plan.items.push_back({"validation token ids", nv * T * 4});
    const double Mv = std::min(nv, B) * T;  // rows of one scored batch
    Items keep;
    if (cfg.grad.carry_state) keep.push_back({"carried state", pl.carried_state()});
    Items val{{"validation activations (y, next y, projections)",
               2 * Mv * P * S + pl.acts(Mv, false)},
              {"validation head chunk", pl.head(Mv, 1024, false)}};
    if (nv > B) val.push_back({"validation batch token ids", Mv * 4});
    peak.consider("validation forward", keep, val);
  }
  plan.phase = peak.phase;
  plan.items.insert(plan.items.end(), peak.items.begin(), peak.items.end());
  if (multi)
    plan.engine += blockwise || seq_blocks ? " (per rank: the busiest of layers " + std::to_string(lr.k0) + ".." +
                                   std::to_string(lr.k1 - 1) + ")"
                             : " (per rank, approximate for dist.* layouts)";
  return plan;
}

}  // namespace

// One process: the whole model. dist.* layouts: the largest plan of the
// layer ranks that differ (the first and last hold the embedding and the
// head; the first K mod R hold one layer more; where a range starts on the
// checkpoint grid changes its kept inputs), so a plan is the busiest rank's.
// The model's layer kind is chosen once, here.
MemoryPlan plan_memory(const Settings& cfg, Workload w, std::size_t scalar_bytes, std::int64_t valid_windows) {
  return with_layer_kind(cfg.model, [&](auto kind) {
    using Kind = decltype(kind);
    const int R = int(std::max<std::int64_t>(1, cfg.dist.layer_ranks));
    if (R == 1) return plan_rank<Kind>(cfg, w, scalar_bytes, valid_windows, LayerRange::all(cfg.model));
    MemoryPlan best;
    double best_total = -1;
    // Layer ranks differ in the embedding (rank 0), the head (rank R-1) and the
    // layer count (q + 1 below rank K mod R, q from it on); a range's kept
    // inputs follow from its layer count. One rank of each kind is planned.
    const int more = int(cfg.model.layers % R);
    std::vector<int> ranks{0, 1, more > 0 ? more - 1 : 0, more, R - 2, R - 1};
    ranks.erase(std::remove_if(ranks.begin(), ranks.end(), [&](int r) { return r < 0 || r >= R; }), ranks.end());
    for (const int r : ranks) {
      const auto p = plan_rank<Kind>(cfg, w, scalar_bytes, valid_windows, LayerRange::block(cfg.model, r, R));
      if (p.total() > best_total) {
        best_total = p.total();
        best = p;
      }
    }
    return best;
  });
}

MemoryCapacity memory_space_capacity() {
#if defined(KOKKOS_ENABLE_CUDA)
  if (!host_backend) {
    std::size_t free_b = 0, total_b = 0;
    if (cudaMemGetInfo(&free_b, &total_b) != cudaSuccess) return {0, "the GPU's memory"};
    return {std::uint64_t(usable_memory_fraction * double(total_b)), "90% of the GPU's memory"};
  }
#endif
  const MemoryCapacity ram{std::uint64_t(usable_memory_fraction * double(physical_memory_bytes())),
                          "90% of the machine's physical memory"};
  // Under ulimit -v the limit binds first; 90% of its headroom, as of the RAM.
  const std::uint64_t as = address_space_headroom();
  if (as == ~std::uint64_t(0) || double(as) * usable_memory_fraction >= double(ram.bytes)) return ram;
  return {std::uint64_t(usable_memory_fraction * double(as)),
          "90% of what the address-space limit (ulimit -v) leaves after the mapped libraries and the BLAS "
          "threads' buffers (128 MiB each; OPENBLAS_NUM_THREADS sets their number)"};
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
              "grad.layer_checkpoint, grad.token_block)\n" +
              plan.table("  "));
}

}  // namespace ash
