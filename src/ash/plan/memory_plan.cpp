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
// the code each building block names. Sizes in double: Config::settings() has
// already checked every integer product for overflow.
struct Planner {
  const Settings& cfg;
  const EngineOptions& o;
  LayerRange lr;  // this rank's layers (the whole model on one process)
  bool multi;     // a dist.* layout of several ranks
  double S, V, P, N;
  std::int64_t K, Ti;  // layers on this rank, tokens per window on this rank
  double T, B, M;
  double hc;  // head chunk rows

  Planner(const Settings& c, std::size_t scalar_bytes, const LayerRange& range, std::int64_t Sq, std::int64_t D)
      : cfg(c),
        o(c.grad),
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

  // Parameters of this rank's shard (embedding on the first, final norm and head on the last).
  double shard_parameters() const {
    if (cfg.model.mamba()) {  // the shard's own layout (a tied Mamba's last rank: its embedding copy)
      const auto l = param_layout(cfg.model, lr);
      return l.empty() ? 0.0 : double(l.back().offset + l.back().size());
    }
    const double per_layer = P * P + 3 * P * N + 3 * P;
    return double(K) * per_layer + (lr.embedding ? V * P : 0) + (lr.head ? P + V * P : 0);
  }
  // data.carry_state: every layer's state of the whole batch (ash train keeps it all on every rank):
  // [B·P, N] per layer, a Mamba's [B·E, Kc−1+N].
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

  double proj(double rows) const {  // LayerActivations, projections only
    return WorkspaceSpec().projections(std::int64_t(rows), cfg.model.width, cfg.model.state, std::size_t(S)).bytes();
  }
  double head(double rows, double chunk_rows, bool g) const {  // head_loss: rstd, ŷ, logits (and ∂ŷ) of one chunk
    const double C = std::min(chunk_rows, rows);
    return (C * (1 + P + V + (g ? P : 0)) + (g ? std::ceil(C / double(impl::reduce_rows)) * P + P : 0.0)) * S;
  }
  LayerShape shape(double Bt, std::int64_t Tw) const {
    return LayerShape{std::int64_t(Bt), Tw, cfg.model.width, cfg.model.state, std::size_t(S)};
  }
  // AdjointExactLayer::run on windows of Tw tokens (its workspace spec); halo:
  // a range with a halo after its own tokens
  double e3_scratch(double Bt, std::int64_t Tw, bool halo = false) const {
    return adjoint_exact_workspace(o, shape(Bt, Tw), halo).bytes();
  }
  double emb_partial(double rows) const {  // embedding_backward's private copies of gE (none on a host backend)
    const index_t seg = embedding_backward_segments(index_t(ExecSpace().concurrency()), index_t(rows), cfg.model.vocab,
                                                    cfg.model.width);
    return seg > 1 ? double(seg) * V * P * S : 0.0;
  }

  // The block-wise engine (a memory lever set): returns the plan's engine name.
  std::string blockwise(std::size_t scalar_bytes, Items& persistent, Phases& phases) const {
    const std::int64_t m = o.layer_checkpoint;
    const std::int64_t blen = multi ? pipeline_block_length(o, Ti, std::max<std::int64_t>(1, cfg.dist.layer_ranks),
                                                            cfg.dist.pipeline_blocks)
                                    : blockwise_block_length(o, Ti);
    const double nb = double((Ti + blen - 1) / blen), rb = B * double(blen);
    const BlockwiseWorkspace ws = blockwise_workspace(o, pass(blen));
    persistent.push_back({kept_inputs(ws), ws.kept.bytes()});
    persistent.push_back({"states at block starts (K x blocks)", double(K) * nb * B * P * N * S});
    persistent.push_back({"block projections + running state", ws.block.bytes() + B * P * N * S});
    if (o.carry_state) persistent.push_back({"carried state", carried_state()});
    phases.push_back({"forward", {{"block activations (in, out)", ws.forward.bytes()}}});
    Items back{{"segment inputs + g of a block", ws.backward.bytes()},
               {"E3 block projections", adjoint_exact_block_workspace(shape(B, blen)).bytes()}};
    if (nb > 1) back.push_back({"E3 carries (mu, A per layer)", ws.carries.bytes()});
    // E3's scratch lives through the pass, so from the second block on the
    // head's chunk comes on top of it; with one block the head runs first.
    const double e3 = e3_scratch(B, blen), hd = lr.head ? head(rb, hc, true) : 0.0;
    auto emb = back;  // each block ends with its embedding backward, E3's scratch still held
    emb.push_back({"E3 wave scratch", e3});
    if (lr.embedding) emb.push_back({"embedding backward segments", emb_partial(rb)});
    if (nb > 1 || e3 >= hd) back.push_back({"E3 wave scratch", e3});
    if (lr.head && (nb > 1 || hd > e3)) back.push_back({"head chunk", hd});
    phases.push_back({"backward", back});
    phases.push_back({"embedding backward", emb});
    return "adjoint-exact over token blocks of " + std::to_string(blen) + ", " + storage_name(o.storage) +
           " storage, layer checkpoint " + std::to_string(m);
  }

  // dist::SequenceBlockwise (a lever with S > 1): this rank's token range in whole-range
  // y buffers, token blocks of sequence_block_length inside it, layer by layer.
  std::string sequence_blockwise(std::size_t scalar_bytes, Items& persistent, Phases& phases) const {
    // A window T̄ < T: each range one block, and a halo of T̄ − 1 tokens from the next range.
    const bool window = o.truncate > 0 && o.truncate < cfg.data.seq_len;
    const std::int64_t blen = sequence_block_length(o, Ti, cfg.data.seq_len);
    // The most blocks a range has (one process's blocks cut at the range's ends).
    std::int64_t nblocks = 1;
    const std::int64_t Tall = cfg.data.seq_len, Sr = cfg.dist.seq_ranks;
    for (std::int64_t s = 0; s < Sr; ++s)
      nblocks = std::max<std::int64_t>(nblocks, sequence_blocks(o, Tall, Tall * s / Sr, Tall * (s + 1) / Sr).n);
    const double nb = double(nblocks), rb = B * double(blen), state = B * P * N * S;
    const double H = window ? double(std::min<std::int64_t>(o.truncate - 1, Ti)) : 0.0, Te = T + H;
    const BlockwiseWorkspace ws = sequence_blockwise_workspace<SsmResNetKind>(o, pass(blen), cfg.data.seq_len,
                                                                                  std::int64_t(H));
    persistent.push_back({kept_inputs(ws), ws.kept.bytes()});
    persistent.push_back({"states at block starts (K x blocks) + running state", (double(K) * nb + 1) * state});
    persistent.push_back({"whole-range y and next y (or g)", ws.range.bytes()});
    persistent.push_back({"block projections", ws.block.bytes()});
    if (o.carry_state) persistent.push_back({"carried state", carried_state()});
    phases.push_back({"forward", {{"the state at the range's end (to the next range)", ws.forward.bytes()}}});
    const Items blocks{{"recomputed blocks (in, out), a replay's state", ws.backward.bytes()},
                       {"carry maps (range, block; ones)", ws.carry_maps.bytes()}};
    if (lr.head) {
      Items head_phase(blocks.begin(), blocks.begin() + 1);
      head_phase.push_back({"head chunk", head(rb, hc, true)});
      phases.push_back({"head", head_phase});
    }
    // E3's projections and wave scratch stay allocated from the first block on
    // (released after the pass); a block's carry map adds μ and products at chunk starts.
    if (window) {  // the halo's messages (dist::WindowHalo): H rows sent, H received
      phases.push_back({"backward",
                        {blocks[0],
                         {"range + halo of y and g; g's halo; halo messages", ws.window.bytes() + 2 * H * B * P * S},
                         {"E3 block projections", adjoint_exact_block_workspace(shape(B, std::int64_t(Te))).bytes()},
                         {"E3 wave scratch", e3_scratch(B, std::int64_t(Te), H > 0)}}});
    } else {
      Items back = blocks;
      back.push_back({"E3 block projections", adjoint_exact_block_workspace(shape(B, blen)).bytes()});
      back.push_back({"E3 wave scratch", e3_scratch(B, blen)});
      Items map = back;
      map.push_back({"E3 carry map (open carry, chunk starts)",
                     adjoint_exact_carry_map_workspace(o, shape(B, blen)).bytes()});
      phases.push_back({"backward", back});
      phases.push_back({"backward carry map", map});
    }
    if (lr.embedding) phases.push_back({"embedding backward", {{"embedding backward segments", emb_partial(rb)}}});
    return "adjoint-exact over token blocks of " + std::to_string(blen) + " in each sequence range, " +
           storage_name(o.storage) + " storage, layer checkpoint " + std::to_string(o.layer_checkpoint);
  }

  // A Mamba block's activations (MambaActivations): r, ŷ [D]; x, z, c, s, o, Δ, u [E];
  // δ [R]; β, γ [N]; a [E, N]; with h^{t-1} and A [E, N] per row when E1 keeps them.
  double mamba_acts(double rows, bool h_and_A) const {
    const double E = double(cfg.model.inner()), R = double(cfg.model.rank());
    return (rows * (1 + P + 7 * E + R + 2 * N) + E * N + (h_and_A ? 2 * rows * E * N : 0.0)) * S;
  }
  // A Mamba's block-wise pass (BlockwiseEngine::compute_range: a lever in one
  // process, E3 on every data and layer rank layout), on this rank's layer
  // range: the kept inputs (run.storage; a range after the first keeps the
  // input it received), a MambaState before every (layer, block) and the
  // running one, one block's activations; forward: a block's y and next y;
  // backward: the segment's inputs and g of a block, the conv's carry per layer
  // (and E3's μ/A carries over E channels with several blocks), and
  // the kind's block backward's block activations, state copy,
  // cotangents and scan workspace, held from the first block on; the head's
  // chunk on the range with the head.
  std::string mamba_blockwise(Items& persistent, Phases& phases) const {
    const double E = double(cfg.model.inner()), R = double(cfg.model.rank());
    const double Kc1 = double(cfg.model.conv_kernel - 1), state = B * E * (Kc1 + N) * S;
    const std::int64_t blen = multi ? pipeline_block_length(o, Ti, std::max<std::int64_t>(1, cfg.dist.layer_ranks),
                                                            cfg.dist.pipeline_blocks)
                                    : blockwise_block_length(o, Ti);
    const double nb = double((Ti + blen - 1) / blen), rows = B * double(blen);
    const BlockwiseWorkspace ws = blockwise_workspace(o, pass(blen));
    const LayerShape scan{std::int64_t(B), blen, cfg.model.inner(), cfg.model.state, std::size_t(S)};
    persistent.push_back({kept_inputs(ws), ws.kept.bytes()});
    persistent.push_back({"Mamba states at block starts (K x blocks) + running state", (double(K) * nb + 1) * state});
    persistent.push_back({"block activations (one block)", mamba_acts(rows, false)});
    if (o.carry_state) persistent.push_back({"carried state", carried_state()});
    phases.push_back({"forward", {{"block y, next y", 2 * rows * P * S}}});
    const double cot_e = WorkspaceSpec().cotangents(scan.rows(), scan.P, scan.N, false, scan.scalar_bytes).bytes();
    const double rbk = std::ceil(rows / double(impl::reduce_rows));
    const Items held{{"segment inputs + g of a block", ws.backward.bytes()},
                     {"conv carries (K)", double(K) * B * E * Kc1 * S}};
    Items back = held;
    back.push_back({"E3 block activations + state copy", mamba_acts(rows, false) + state});
    back.push_back({"cotangents (one block)", (rows * (3 * E + R + P) + rbk * P) * S + cot_e});
    back.push_back({"E3 scan workspace", adjoint_exact_scan_workspace(o, scan).bytes()});
    if (nb > 1) back.push_back({"E3 carries (mu, A over E per layer)", double(K) * 2 * B * E * N * S});
    auto emb = back;
    if (lr.k0 == 0) emb.push_back({"embedding backward segments", emb_partial(rows)});  // a tied last range's embedding is its head
    // E3's scratch lives through the pass: from the second block on the head's
    // chunk comes on top of it; with one block the head runs before it exists.
    if (lr.head && nb > 1) back.push_back({"head chunk", head(rows, hc, true)});
    if (lr.head && nb == 1) {
      Items hd = held;
      hd.push_back({"head chunk", head(rows, hc, true)});
      phases.push_back({"head", hd});
    }
    phases.push_back({"backward", back});
    phases.push_back({"embedding backward", emb});
    return "adjoint-exact" + std::string(o.detach_inputs ? ", detached" : "") + " over token blocks of " +
           std::to_string(blen) + ", " + storage_name(o.storage) + " storage, layer checkpoint " +
           std::to_string(o.layer_checkpoint) + " (model.arch=mamba)";
  }

  // A Mamba on sequence ranks (dist::SequenceBlockwise, levers or not): the
  // kept inputs (run.storage), whole-range y and next y, a MambaState before
  // every (layer, block) and the running one, one block's activations; head:
  // a recomputed block's in and out and the head chunk; backward: those, the
  // conv's carry and μ's carry (μ, A over E) passed range to range, and
  // the kind's block backward's block activations, state copy,
  // cotangents and scan workspace, held from the first block on. A window T̄:
  // the range one block, the backward's over the range and a halo of H tokens
  // (their y and g, dist::WindowHalo), only the conv's carry passed.
  std::string mamba_sequence(Items& persistent, Phases& phases) const {
    const double E = double(cfg.model.inner()), R = double(cfg.model.rank());
    const double Kc1 = double(cfg.model.conv_kernel - 1), state = B * E * (Kc1 + N) * S;
    const std::int64_t Tall = cfg.data.seq_len, Sr = cfg.dist.seq_ranks;
    // Without a lever each range is one block; with one, one process's blocks cut at the range's ends.
    const std::int64_t blen = o.blockwise_levers() ? sequence_block_length(o, Ti, Tall) : Ti;
    std::int64_t nblocks = 1;
    if (o.blockwise_levers())
      for (std::int64_t s = 0; s < Sr; ++s)
        nblocks = std::max<std::int64_t>(nblocks, sequence_blocks(o, Tall, Tall * s / Sr, Tall * (s + 1) / Sr).n);
    const bool window = o.truncate > 0 && o.truncate < Tall;
    const std::int64_t H = window ? std::min<std::int64_t>(o.truncate - 1, Ti) : 0;
    const double nb = double(nblocks), rows = B * double(blen), rows_b = B * double(blen + H);
    const BlockwiseWorkspace ws = sequence_blockwise_workspace<MambaKind>(o, pass(blen), Tall, H);
    const LayerShape scan{std::int64_t(B), blen + H, cfg.model.inner(), cfg.model.state, std::size_t(S)};
    persistent.push_back({kept_inputs(ws), ws.kept.bytes()});
    persistent.push_back({"whole-range y and next y (or g)", ws.range.bytes()});
    persistent.push_back({"Mamba states at block starts (K x blocks) + running state",
                          (double(K) * nb + 1) * state + B * P * N * S});
    persistent.push_back({"block activations (one block)", mamba_acts(rows, false)});
    const Items blocks{{"recomputed blocks (in, out)", ws.backward.bytes()}};
    if (lr.head) {
      Items head_phase = blocks;
      head_phase.push_back({"head chunk", head(rows, hc, true)});
      phases.push_back({"head", head_phase});
    }
    const double cot_e = WorkspaceSpec().cotangents(scan.rows(), scan.P, scan.N, false, scan.scalar_bytes).bytes();
    const double rbk = std::ceil(rows_b / double(impl::reduce_rows));
    Items back = blocks;
    if (window)
      back.push_back({"range + halo of y and g; g's halo; halo messages; conv carry",
                      ws.window.bytes() + (2 * double(H) * B * P + B * E * Kc1) * S});
    else
      back.push_back({"conv carry + mu, A carry (from the next range)", B * E * (Kc1 + 2 * N) * S});
    back.push_back({"E3 block activations + state copy", mamba_acts(rows_b, false) + state});
    back.push_back({"cotangents (one block)", (rows_b * (3 * E + R + P) + rbk * P) * S + cot_e});
    back.push_back({"E3 scan workspace", adjoint_exact_scan_workspace(o, scan).bytes()});
    phases.push_back({"backward", back});
    if (lr.embedding) {
      back.push_back({"embedding backward segments", emb_partial(rows)});
      phases.push_back({"embedding backward", back});
    }
    return "adjoint-exact" + std::string(o.detach_inputs ? ", detached" : "") + " over token blocks of " +
           std::to_string(blen) + " in each sequence range, " + storage_name(o.storage) +
           " storage, layer checkpoint " + std::to_string(o.layer_checkpoint) + " (model.arch=mamba)";
  }

  // A Mamba (model.arch = "mamba"): LocalEngine with E1, E2 or E3 over the whole
  // window (the methods' Mamba paths, grad/layer_adjoint.hpp).
  std::string mamba(Items& persistent, Phases& phases) const {
    const double E = double(cfg.model.inner()), R = double(cfg.model.rank()), Kc = double(cfg.model.conv_kernel);
    const std::string layer_inputs = " layer inputs";
    const double rb = std::ceil(M / double(impl::reduce_rows));
    const LayerShape scan{std::int64_t(B), Ti, cfg.model.inner(), cfg.model.state, std::size_t(S)};
    if (o.method == Method::adjoint_exact) {
      // E3 (exact, detached or windowed): the K+1 layer inputs (K in the
      // backward), one block's activations (computed again per block up to the
      // scan's inputs; the waves form s), and in the backward MambaCotangents
      // with the scan's cotangents of every row (no row partials) and E3's scan
      // workspace (its spec, the window's included): waves, never [M, E, N].
      persistent.push_back({"block projections (one block)", mamba_acts(M, false)});
      persistent.push_back({"g (dL/dy)", M * P * S});
      phases.push_back(
          {"head",
           {{std::to_string(K + 1) + layer_inputs, double(K + 1) * M * P * S}, {"head chunk", head(M, hc, true)}}});
      const double cot_e = WorkspaceSpec().cotangents(scan.rows(), scan.P, scan.N, false, scan.scalar_bytes).bytes();
      phases.push_back({"backward of the top block",
                        {{std::to_string(K) + layer_inputs, double(K) * M * P * S},
                         {"cotangents (whole window)", (M * (3 * E + R + P) + rb * (P + E * (Kc + 1))) * S + cot_e},
                         {"E3 scan workspace", adjoint_exact_scan_workspace(o, scan).bytes()}}});
      phases.push_back({"embedding backward", {{"embedding backward segments", emb_partial(M)}}});
      return std::string("adjoint-exact") + (o.detach_inputs ? ", detached" : "") +
             (o.truncate > 0 ? ", T-bar=" + std::to_string(o.truncate) : "") + " (model.arch=mamba)";
    }
    // E1, E2: every block's activations with h^{t-1} and A over E channels.
    persistent.push_back({std::to_string(K) + " blocks' activations (h, A, projections)", double(K) * mamba_acts(M, true)});
    persistent.push_back({"g (dL/dy)", M * P * S});
    phases.push_back(
        {"head",
         {{std::to_string(K + 1) + layer_inputs, double(K + 1) * M * P * S}, {"head chunk", head(M, hc, true)}}});
    // MambaCotangents: ∂s, ∂z, ∂x [E], ∂δ [R], ∂ŷ [D], norm and conv partials; the scan's LayerCotangents over E;
    // the method's workspace spec over E without cotangents: μ [M, E, N] (and E1's scan carries)
    const double cot_e = WorkspaceSpec().cotangents(scan.rows(), scan.P, scan.N, true, scan.scalar_bytes).bytes();
    const WorkspaceSpec ws = o.method == Method::backprop ? backprop_workspace(o, scan, false)
                                                          : adjoint_workspace(o, scan, false);
    const double carries = ws.bytes("ash::e1::chunk_");
    Items back{{std::to_string(K) + layer_inputs, double(K) * M * P * S},
               {"mu + cotangents (whole window)", ws.bytes() - carries + (M * (3 * E + R + P) + rb * (P + E * (Kc + 1))) * S + cot_e}};
    if (o.method == Method::backprop) back.push_back({"E1 chunk carries", carries});
    phases.push_back({"backward of the top block", back});
    phases.push_back({"embedding backward", {{"embedding backward segments", emb_partial(M)}}});
    return method_name(o.method) + " (model.arch=mamba)";
  }

  // Whole windows: E3 keeps the layer inputs; E1 and E2 every layer's activations with h^{t-1} and A.
  std::string whole_window(Items& persistent, Phases& phases) const {
    const std::string layer_inputs = " layer inputs";
    if (o.exact_adjoint()) {
      persistent.push_back({"layer projections (one layer)", proj(M)});
      persistent.push_back({"g (dL/dy)", M * P * S});
      phases.push_back(
          {"head",
           {{std::to_string(K + 1) + layer_inputs, double(K + 1) * M * P * S}, {"head chunk", head(M, hc, true)}}});
      phases.push_back(
          {"backward of the top layer",
           {{std::to_string(K) + layer_inputs, double(K) * M * P * S}, {"E3 wave scratch", e3_scratch(B, Ti)}}});
    } else {
      persistent.push_back(
          {std::to_string(K) + " layers' activations (h, A, projections)", double(K) * (proj(M) + 2 * M * P * N * S)});
      persistent.push_back({"g (dL/dy)", M * P * S});
      phases.push_back(
          {"head",
           {{std::to_string(K + 1) + layer_inputs, double(K + 1) * M * P * S}, {"head chunk", head(M, hc, true)}}});
      // E1, E2's workspace: μ and the cotangents; E1's chunked reverse scan adds carries (and local sums, products)
      const WorkspaceSpec ws = layer_workspace(o, shape(B, Ti));
      const double carries = ws.bytes("ash::e1::chunk_");
      Items back{{std::to_string(K) + layer_inputs, double(K) * M * P * S},
                 {"mu + cotangents (whole window)", ws.bytes() - carries}};
      if (o.method == Method::backprop) back.push_back({"E1 chunk carries", carries});
      phases.push_back({"backward of the top layer", back});
    }
    // after the layers: g and the segment copies of gE
    phases.push_back({"embedding backward", {{"embedding backward segments", emb_partial(M)}}});
    return o.exact_adjoint() ? "adjoint-exact" : method_name(o.method);
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

MemoryPlan plan_rank(const Settings& cfg, Workload w, std::size_t scalar_bytes, std::int64_t valid_windows,
                     const LayerRange& lr) {
  const std::int64_t R = std::max<std::int64_t>(1, cfg.dist.layer_ranks);
  const std::int64_t Sq = std::max<std::int64_t>(1, cfg.dist.seq_ranks);
  const std::int64_t D = std::max<std::int64_t>(1, cfg.dist.data_ranks);
  const Planner pl(cfg, scalar_bytes, lr, Sq, D);
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
  // With a lever on sequence ranks (S > 1) each range runs in token blocks (dist::SequenceBlockwise).
  // A Mamba alike (its E1 and E2 on whole windows); on sequence ranks its own pass (mamba_sequence).
  const bool blockwise = cfg.grad.exact_adjoint() && (cfg.grad.blockwise_levers() || (multi && Sq == 1));
  const bool seq_blocks = blockwise && Sq > 1;
  // A Mamba on sequence ranks runs dist::SequenceBlockwise, levers or not.
  const bool mamba_seq = cfg.model.mamba() && cfg.grad.exact_adjoint() && Sq > 1;
  plan.engine = mamba_seq         ? pl.mamba_sequence(persistent, phases)
                : cfg.model.mamba() ? (blockwise ? pl.mamba_blockwise(persistent, phases) : pl.mamba(persistent, phases))
                : seq_blocks        ? pl.sequence_blockwise(scalar_bytes, persistent, phases)
                : blockwise         ? pl.blockwise(scalar_bytes, persistent, phases)
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
               2 * Mv * P * S + (cfg.model.mamba() ? pl.mamba_acts(Mv, false) : pl.proj(Mv))},
              {"validation head chunk", pl.head(Mv, 1024, false)}};
    if (nv > B) val.push_back({"validation batch token ids", Mv * 4});
    peak.consider("validation forward", keep, val);
  }
  plan.phase = peak.phase;
  plan.items.insert(plan.items.end(), peak.items.begin(), peak.items.end());
  if (multi)
    plan.engine += blockwise || mamba_seq ? " (per rank: the busiest of layers " + std::to_string(lr.k0) + ".." +
                                   std::to_string(lr.k1 - 1) + ")"
                             : " (per rank, approximate for dist.* layouts)";
  return plan;
}

}  // namespace

// One process: the whole model. dist.* layouts: the largest plan of the
// layer ranks that differ (the first and last hold the embedding and the
// head; the first K mod R hold one layer more; where a range starts on the
// checkpoint grid changes its kept inputs), so a plan is the busiest rank's.
MemoryPlan plan_memory(const Settings& cfg, Workload w, std::size_t scalar_bytes, std::int64_t valid_windows) {
  const int R = int(std::max<std::int64_t>(1, cfg.dist.layer_ranks));
  if (R == 1) return plan_rank(cfg, w, scalar_bytes, valid_windows, LayerRange::all(cfg.model));
  MemoryPlan best;
  double best_total = -1;
  // Layer ranks differ in the embedding (rank 0), the head (rank R-1) and the
  // layer count (q + 1 below rank K mod R, q from it on); a range's kept
  // inputs follow from its layer count. One rank of each kind is planned.
  const int more = int(cfg.model.layers % R);
  std::vector<int> ranks{0, 1, more > 0 ? more - 1 : 0, more, R - 2, R - 1};
  ranks.erase(std::remove_if(ranks.begin(), ranks.end(), [&](int r) { return r < 0 || r >= R; }), ranks.end());
  for (const int r : ranks) {
    const auto p = plan_rank(cfg, w, scalar_bytes, valid_windows, LayerRange::block(cfg.model, r, R));
    if (p.total() > best_total) {
      best_total = p.total();
      best = p;
    }
  }
  return best;
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
