// E4 over MPI, Cabana-style: ctest runs this executable under mpiexec with
// 1, 2, 3 and 4 ranks; each test runs every rank layout R × D that fits the
// world and compares with one process computing the same thing alone.
#include <mpi.h>

#include <sstream>

#include "ash/distributed/collectives.hpp"
#include "ash/distributed/distributed_engine.hpp"
#include "ash/distributed/session.hpp"
#include "ash/distributed/sharded_io.hpp"
#include "ash/grad/blockwise_engine.hpp"
#include "ash/plan/memory_plan.hpp"
#include "test_helpers.hpp"

namespace ash::test {

namespace {

int world_size() {
  int n = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  return n;
}
int world_rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

struct Lay {
  int R = 1, S = 1, D = 1;
};

// Every R × S × D = world with R <= K (S = 1 only unless with_seq: sequence
// ranks run E3 alone).
std::vector<Lay> layouts(int K, bool with_seq = false) {
  std::vector<Lay> out;
  const int n = world_size();
  for (int R = 1; R <= n; ++R)
    for (int S = 1; S <= (with_seq ? n : 1); ++S)
      if (n % (R * S) == 0 && R <= K) out.push_back({R, S, n / (R * S)});
  return out;
}

Config layout_config(const ModelDims& d, int R, int D, index_t batch, int S = 1) {
  Config c = config_for(d);
  c.set("dist.layer_ranks=" + std::to_string(R));
  c.set("dist.data_ranks=" + std::to_string(D));
  c.set("dist.seq_ranks=" + std::to_string(S));
  c.set("data.batch=" + std::to_string(batch));
  return c;
}

// The tensors of one range, copied out of a whole model.
template <class S>
ParamSet<S> shard_of(const ParamSet<S>& full, const LayerRange& r) {
  ParamSet<S> part(full.dims(), r);
  for (const auto& t : part.tensors()) Kokkos::deep_copy(part.flat(t), full.flat(full.tensor(t.name)));
  return part;
}

std::string tag(const Lay& l, const EngineOptions& o, index_t blocks) {
  return "R=" + std::to_string(l.R) + " S=" + std::to_string(l.S) + " D=" + std::to_string(l.D) + " " + method_name(o.method) +
         (o.detach_inputs ? " detached" : "") + " T-bar=" + std::to_string(o.truncate) +
         " blocks=" + std::to_string(blocks);
}

// Loss and gradient of every layout equal one process's, relative 1e-12 in double.
// tokens: the windows (default: random tokens without document starts).
void expect_layouts_match(int K, index_t T, index_t batch, const EngineOptions& o, index_t blocks = 0,
                          bool with_seq = false, const ParamSet<double>* model = nullptr,
                          const TokenView& tokens = TokenView()) {
  const auto d = tiny_dims(K);
  const auto full = model ? model->clone() : random_model<double>(d, 500 + K);
  const auto x = tokens.extent(0) > 0 ? tokens : random_tokens(batch, T, d.vocab, 600 + K);
  double ref_loss = 0;
  const auto ref = grad_of(o, full, x, &ref_loss);
  for (const Lay& l : layouts(K, with_seq)) {
    if (l.D > batch) continue;  // a replica needs a window
    const int R = l.R, D = l.D;
    const dist::Grid grid(layout_config(d, R, D, batch, l.S));
    const auto params = shard_of(full, grid.range(d));
    ParamSet<double> grad(d, grid.range(d));
    dist::DistributedEngine<double> engine(grid, o, d, blocks);
    const double loss = engine.compute(params, x, grad);
    EXPECT_NEAR(loss, ref_loss, 1e-12 * std::abs(ref_loss)) << tag(l, o, blocks);
    const auto whole = dist::gather(grid, grad);
    if (world_rank() == 0) expect_close(to_host(whole), ref, d, 1e-12, tag(l, o, blocks));
  }
}

}  // namespace

TEST(Distributed, LayoutsFollowTheWorld) {
  const auto d = tiny_dims(5);
  const dist::Grid grid(layout_config(d, 1, 0, 4));  // D = 0: world / R
  EXPECT_EQ(grid.layout().D, world_size());
  // Uneven blocks cover every layer once.
  for (int R = 1; R <= 5; ++R) {
    int next = 0;
    for (int r = 0; r < R; ++r) {
      const auto lr = LayerRange::block(d, r, R);
      EXPECT_EQ(lr.k0, next);
      EXPECT_GE(lr.k1 - lr.k0, 5 / R);
      next = lr.k1;
      EXPECT_EQ(lr.embedding, r == 0);
      EXPECT_EQ(lr.head, r == R - 1);
    }
    EXPECT_EQ(next, 5);
  }
  EXPECT_THROW(LayerRange::block(d, 0, 6), Error);
  EXPECT_THROW(dist::Layout::from_config(layout_config(d, 6, 1, 4), 0, 6), Error);  // R > K
  EXPECT_THROW(dist::Layout::from_config(layout_config(d, 2, 0, 4), 0, 3), Error);  // 3 ranks, R = 2
  EXPECT_THROW(dist::Layout::from_config(layout_config(d, 1, 4, 2), 0, 4), Error);  // batch < D
}

TEST(Distributed, ShardInitialisationIsTheWholeModelsSlice) {
  const auto d = tiny_dims(5);
  ParamSet<double> full(d);
  initialize(full, 42);
  for (int R = 1; R <= 5; ++R)
    for (int r = 0; r < R; ++r) {
      ParamSet<double> part(d, LayerRange::block(d, r, R));
      initialize(part, 42);
      EXPECT_EQ(to_host(part), to_host(shard_of(full, part.range()))) << "R=" << R << " r=" << r;
    }
}

// K = 4 and 5 (uneven blocks at R = 2, 3, 4); T = 29 leaves short token blocks.
TEST(Distributed, BackpropMatchesOneProcess) {
  for (int K : {4, 5}) expect_layouts_match(K, 29, 4, engine_options("backprop"));
  expect_layouts_match(4, 29, 4, engine_options("backprop", 0, true));
}

TEST(Distributed, PaperAdjointMatchesOneProcess) {
  for (int K : {4, 5}) {
    expect_layouts_match(K, 29, 4, engine_options("adjoint"));
    expect_layouts_match(K, 29, 4, engine_options("adjoint", 6));
  }
}

TEST(Distributed, ExactAdjointPipelineMatchesOneProcess) {
  for (int K : {4, 5}) {
    auto o = engine_options("adjoint-exact");
    o.chunk = 4;
    o.wave = 8;
    for (index_t blocks : {index_t(0), index_t(1), index_t(3), index_t(8)}) expect_layouts_match(K, 29, 4, o, blocks);
  }
}

TEST(Distributed, DetachedExactAdjointMatchesOneProcess) {
  for (int K : {4, 5}) {
    auto o = engine_options("adjoint-exact", 0, true);
    o.chunk = 4;
    expect_layouts_match(K, 29, 4, o);
    o.truncate = 6;
    expect_layouts_match(K, 29, 4, o);
  }
}

TEST(Distributed, ValidationLossMatchesOneProcess) {
  const auto d = tiny_dims(4);
  const auto full = random_model<double>(d, 77);
  const auto x = random_tokens(4, 33, d.vocab, 78);
  const double ref = forward_loss(full, x);
  for (const Lay& l : layouts(4, true)) {
    const dist::Grid grid(layout_config(d, l.R, l.D, 4, l.S));
    dist::DistributedEngine<double> engine(grid, engine_options("adjoint-exact"), d);
    EXPECT_NEAR(engine.loss(shard_of(full, grid.range(d)), x), ref, 1e-12 * ref) << tag(l, engine_options("adjoint-exact"), 0);
  }
}

// A file written from shards equals, dataset for dataset and bit for bit, the
// one process's file, and reading it back on any layout gives the same bits.
TEST(Distributed, CheckpointsReshardBitwise) {
  const auto d = tiny_dims(5);
  const auto full = random_model<double>(d, 91), m = random_model<double>(d, 92), v = random_model<double>(d, 93);
  const Config cfg = config_for(d);
  const std::string np = "_np" + std::to_string(world_size());  // ctest runs the rank counts concurrently
  const std::string one = tmp_path("one" + np + ".h5"), sharded = tmp_path("sharded" + np + ".h5");
  if (world_rank() == 0) save_checkpoint(one, cfg, full, 3, 11, OptimizerState<double>{&m, &v, 3});
  MPI_Barrier(MPI_COMM_WORLD);
  for (const Lay& l : layouts(5, true)) {
    const int R = l.R;
    const dist::Grid grid(layout_config(d, R, l.D, 4, l.S));
    const auto range = grid.range(d);
    const auto p = load_checkpoint<double>(one, range);
    ParamSet<double> pm(d, range), pv(d, range);
    std::int64_t st = 0;
    ASSERT_TRUE(load_optimizer_state(one, pm, pv, &st));
    EXPECT_EQ(to_host(p), to_host(shard_of(full, range)));
    EXPECT_EQ(to_host(pm), to_host(shard_of(m, range)));
    dist::save_checkpoint(grid, sharded, cfg, p, 3, 11, OptimizerState<double>{&pm, &pv, st});
    if (world_rank() == 0) {
      const auto back = load_checkpoint<double>(sharded);
      ParamSet<double> bm(d), bv(d);
      ASSERT_TRUE(load_optimizer_state(sharded, bm, bv, &st));
      EXPECT_EQ(to_host(back), to_host(full)) << "R=" << R;
      EXPECT_EQ(to_host(bm), to_host(m)) << "R=" << R;
      EXPECT_EQ(to_host(bv), to_host(v)) << "R=" << R;
      EXPECT_EQ(st, 3);
    }
    MPI_Barrier(MPI_COMM_WORLD);
  }
}

TEST(Distributed, ShardedAdamWStepEqualsOneProcess) {
  const auto d = tiny_dims(5);
  const auto full = random_model<double>(d, 55);
  const auto x = random_tokens(4, 21, d.vocab, 56);
  AdamWOptions ao;
  ao.clip = 0.05;  // clipping on: the global norm must cover every shard
  auto ref_p = full.clone();
  AdamW<double> ref_opt(d, ao);
  ParamSet<double> ref_g(d);
  for (int step = 0; step < 3; ++step) {
    make_engine<double>(engine_options("adjoint-exact"))->compute(ref_p, x, ref_g);
    ref_opt.update(ref_p, ref_g);
  }
  for (const Lay& l : layouts(5, true)) {
    const int R = l.R;
    const dist::Grid grid(layout_config(d, R, l.D, 4, l.S));
    auto p = shard_of(full, grid.range(d));
    AdamW<double> opt(d, grid.range(d), ao);
    ParamSet<double> g(d, grid.range(d));
    dist::DistributedEngine<double> engine(grid, engine_options("adjoint-exact"), d);
    for (int step = 0; step < 3; ++step) {
      engine.compute(p, x, g);
      const MPI_Comm lc = grid.layers();
      opt.update(p, g, [lc](double ss) { return dist::allreduce_sum(ss, lc); });
    }
    const auto whole = dist::gather(grid, p);
    if (world_rank() == 0) expect_close(to_host(whole), to_host(ref_p), d, 1e-12, "R=" + std::to_string(R));
  }
}

// Context parallelism: every R × S × D layout with S > 1 (R = 2 × S = 2 and
// S = 2 × D = 2 at 4 ranks); T = 29 leaves uneven ranges (S = 3: 9, 10, 10).
// The backend's E3 form and the other backend's (fused, chunked or
// sequential h): a range takes the later ranges' carry into its last chunk.
TEST(Distributed, SequenceRanksMatchOneProcess) {
  for (const E3Form f : {E3Form::fused_sequential, E3Form::fused_chunked, E3Form::walk_chunked}) {
    SCOPED_TRACE(e3_form_name(f));
    for (int K : {4, 5}) {
      auto o = with_e3_form(engine_options("adjoint-exact"), f);
      o.chunk = 4;
      o.wave = 8;
      expect_layouts_match(K, 29, 4, o, 0, true);
      o.detach_inputs = true;
      expect_layouts_match(K, 29, 4, o, 0, true);
    }
  }
}

// The paper's window T̄ across sequence ranks: each range reads the next
// range's first T̄ - 1 tokens (g and every layer's input) as a halo. T̄ = 2
// (a one-token halo), 6, 8 (= the shortest range at S = 4, plus one) and
// T̄ >= T (the full detached gradient); K = 4 and 5 with R = 2 at 4 ranks.
TEST(Distributed, WindowsAcrossSequenceRanksMatchOneProcess) {
  for (int K : {4, 5}) {
    for (index_t Tbar : {2, 6, 8, 40}) {
      auto o = engine_options("adjoint-exact", Tbar, true);
      o.chunk = 4;
      o.wave = 8;
      expect_layouts_match(K, 29, 4, o, 0, true);
    }
  }
  // Ranges of one token (T = 5 on S = 4: 1, 1, 1, 2) with T-bar = 2: a range and
  // its halo (2 tokens) fit in one window, so E3 runs unwindowed there, and the
  // halo's rows must still add nothing (in every E3 form).
  for (const E3Form f : e3_forms()) {
    SCOPED_TRACE(e3_form_name(f));
    auto o = with_e3_form(engine_options("adjoint-exact", 2, true), f);
    o.chunk = 1;
    expect_layouts_match(4, 5, 4, o, 0, true);
  }
  // A range shorter than T-bar - 1 (with a range after it) is refused on every rank.
  if (world_size() != 4) return;
  const auto d = tiny_dims(2);
  auto o = engine_options("adjoint-exact", 6, true);
  o.chunk = 4;
  const dist::Grid grid(layout_config(d, 1, 1, 4, 4));
  const auto full = random_model<double>(d, 730);
  ParamSet<double> grad(d, grid.range(d));
  dist::DistributedEngine<double> engine(grid, o, d);
  const auto fits = random_tokens(4, 21, d.vocab, 731);  // ranges of 5, 5, 5, 6 tokens
  EXPECT_NO_THROW(engine.compute(shard_of(full, grid.range(d)), fits, grad));
  const auto too_short = random_tokens(4, 13, d.vocab, 732);  // ranges of 3, 3, 3, 4
  expect_error([&] { engine.compute(shard_of(full, grid.range(d)), too_short, grad); }, "each range needs >= T-bar - 1");
}

// Document starts (data.separator) on every layout: for sequence ranks a
// reset is a = 0 in the affine composition of the ranges. With T = 29 the
// ranges start at 14 (S = 2) and 7, 14, 21 (S = 4); starts fall on a range's
// first token, its last, the window's first and its last token.
TEST(Distributed, DocumentStartsMatchOneProcess) {
  const index_t T = 29, B = 4;
  const int K = 4;
  const auto x = random_tokens(B, T, tiny_dims(K).vocab, 640);
  std::vector<index_t> starts;
  const std::vector<std::vector<index_t>> at = {{0, 7, 13, 14, 28}, {3, 21, 22}, {6, 14, 20}, {1, 2, 27, 28}};
  for (index_t b = 0; b < B; ++b)
    for (const index_t t : at[std::size_t(b)]) starts.push_back(b * T + t);
  Kokkos::View<index_t*, MemSpace> sv("starts", starts.size());
  auto h = Kokkos::create_mirror_view(sv);
  for (std::size_t i = 0; i < starts.size(); ++i) h(i) = starts[i];
  Kokkos::deep_copy(sv, h);
  set_document_starts(x, sv);
  ASSERT_EQ(target_count(x), B * (T - 1) - 14);  // every start but t = 0 of window 0
  auto o = engine_options("backprop");
  expect_layouts_match(K, T, B, o, 0, false, nullptr, x);
  o = engine_options("adjoint", 5);
  expect_layouts_match(K, T, B, o, 0, false, nullptr, x);
  o = engine_options("adjoint-exact");
  o.chunk = 4;
  o.wave = 8;
  expect_layouts_match(K, T, B, o, 0, true, nullptr, x);  // pipeline (S > 1) and block-wise (S = 1)
  o.detach_inputs = true;
  expect_layouts_match(K, T, B, o, 0, true, nullptr, x);
  o.truncate = 6;  // halos across sequence ranks
  expect_layouts_match(K, T, B, o, 0, true, nullptr, x);
  auto lev = engine_options("adjoint-exact");
  lev.chunk = 4;
  lev.storage = Storage::full;
  lev.layer_checkpoint = 2;
  lev.token_block = 8;
  expect_layouts_match(K, T, B, lev, 0, false, nullptr, x);  // levers on layer and data ranks
}

// A model whose A is close to 1 (a = -exp(-8)): the state and μ carry across
// the whole window, so a range that started from h = 0 or μ = 0 would be far
// off. The first check shows how far: the same tokens as two separate windows.
TEST(Distributed, SequenceCarryOnALongMemoryModel) {
  const auto d = tiny_dims(3);
  auto m = random_model<double>(d, 808);
  auto v = to_host(m);
  for (const auto& t : m.tensors())
    if (t.name.find("A_log") != std::string::npos)
      for (index_t i = 0; i < t.size(); ++i) v[t.offset + i] = -8.0;
  from_host(m, v);
  const index_t T = 40;
  const auto x = random_tokens(2, T, d.vocab, 809);
  const auto split = make_windows(random_token_ids(2 * T, d.vocab, 809), 4, T / 2, d.vocab);  // the same tokens cut in half
  auto o = engine_options("adjoint-exact");
  o.chunk = 4;
  const auto whole = grad_of(o, m, x), halves = grad_of(o, m, split);
  EXPECT_GT(rel_l2(halves, whole), 1e-2) << "the carry matters on this model";
  expect_layouts_match(3, T, 2, o, 0, true, &m);
}

// The memory levers under every layout: on layer and data ranks the
// block-wise pass of one process on each rank's layer range, y and g blocks
// handed between the ranks; on sequence ranks each range in token blocks,
// layer by layer (distributed/sequence_blockwise.hpp). Equal to one process
// with the same levers: bitwise with one replica and one range (the same
// kernels on the same blocks), else to 1e-12 (the batch's sums split over
// replicas and ranges, μ composed over ranges). A range starts each layer from
// the state the range before it ended with, runs one process's blocks cut at its
// ends and replays a cut block from the state the range before reaches, so it
// stores and recomputes one process's values whenever its cuts do not change a
// scan's arithmetic: ranges on one process's block grid, or blocks scanned token
// by token (forward_scan_is_sequential). Otherwise,
// and with 16-bit storage when a layer range starts off the checkpoint grid (k0
// not a multiple of m, other inputs kept), within twice what 16-bit storage
// costs one process.
namespace {

EngineOptions lever_options(Storage st, index_t m, index_t block, bool detach = false, index_t Tbar = 0) {
  auto o = engine_options("adjoint-exact", Tbar, detach);
  o.chunk = 4;
  o.wave = 8;
  o.storage = st;
  o.layer_checkpoint = m;
  o.token_block = block;
  return o;
}

// Whether every sequence rank's range starts where one process starts a block.
bool ranges_on_blocks(index_t T, int S, index_t block) {
  for (int r = 1; r < S; ++r)
    if ((T * r / S) % block != 0) return false;
  return true;
}

bool ranks_on_grid(const ModelDims& d, int R, index_t m) {
  for (int r = 1; r < R; ++r)
    if (LayerRange::block(d, r, R).k0 % m != 0) return false;
  return true;
}

// Whether the sequence ranks' cuts leave every forward scan's bits as one
// process's: the ranges start on its block grid, or its blocks and the ranges'
// are scanned token by token.
bool cuts_keep_scans(index_t T, int S, index_t Bt, index_t P, const EngineOptions& o) {
  const index_t range = T / S + (T % S != 0);
  return ranges_on_blocks(T, S, blockwise_block_length(o, T)) ||
         (forward_scan_is_sequential(blockwise_block_length(o, T), Bt, P) &&
          forward_scan_is_sequential(sequence_block_length(o, range, T), Bt, P));
}

void expect_levers_match(int K, index_t T, index_t batch, const EngineOptions& o, bool with_seq = true,
                         const ModelDims* dims = nullptr) {
  const auto d = dims ? *dims : tiny_dims(K);
  const auto full = random_model<double>(d, 700 + K);
  const auto x = random_tokens(batch, T, d.vocab, 710 + K);
  ASSERT_TRUE(o.blockwise_levers());
  double ref_loss = 0;
  ParamSet<double> ref_g(d);
  BlockwiseEngine<double>(o).compute(full, x, ref_g);
  ref_loss = BlockwiseEngine<double>(o).compute(full, x, ref_g);
  const auto ref = to_host(ref_g);
  auto full_storage = o;
  full_storage.storage = Storage::full;
  const auto ref_full = grad_of(full_storage, full, x);
  const double rounding = rel_l2(ref, ref_full);  // what 16-bit storage costs one process (0 with float)
  for (const Lay& l : layouts(K, with_seq)) {
    if (l.D > batch) continue;
    const dist::Grid grid(layout_config(d, l.R, l.D, batch, l.S));
    const auto params = shard_of(full, grid.range(d));
    ParamSet<double> grad(d, grid.range(d));
    dist::DistributedEngine<double> engine(grid, o, d);
    const double loss = engine.compute(params, x, grad);
    const auto whole = dist::gather(grid, grad);
    const std::string what = tag(l, o, 0) + " " + storage_name(o.storage) + " m=" + std::to_string(o.layer_checkpoint);
    // 16-bit storage: a block replays from its kept (float) state, so where
    // blocks start matters as much as which inputs are kept.
    const bool on_grid =
        o.storage == Storage::full ||
        (ranks_on_grid(d, l.R, o.layer_checkpoint) && cuts_keep_scans(T, l.S, batch / l.D, d.width, o));
    // A tied Mamba on R > 1: the embedding's parts from the first rank (embedding) and the
    // last (head) are summed after the pass, one process sums them block by block.
    const bool tied_split = d.mamba() && d.tie_embeddings && l.R > 1;
    if (l.D == 1 && l.S == 1 && on_grid && !tied_split) {
      EXPECT_EQ(loss, ref_loss) << what;
      if (world_rank() == 0) EXPECT_EQ(to_host(whole), ref) << what << " (bitwise)";
    } else if (on_grid) {
      EXPECT_NEAR(loss, ref_loss, 1e-12 * std::abs(ref_loss)) << what;
      if (world_rank() == 0) expect_close(to_host(whole), ref, d, 1e-12, what);
    } else {
      EXPECT_NEAR(loss, ref_loss, 1e-2 * std::abs(ref_loss)) << what;
      if (world_rank() == 0) EXPECT_LE(rel_l2(to_host(whole), ref), 2 * rounding) << what;
      EXPECT_GT(rounding, 0.0);
    }
  }
}

}  // namespace

TEST(Distributed, MemoryLeversMatchOneProcess) {
  for (int K : {4, 5}) {
    expect_levers_match(K, 29, 4, lever_options(Storage::full, 1, 8));   // token blocks alone
    expect_levers_match(K, 29, 4, lever_options(Storage::full, 2, 8));   // layer checkpointing
    expect_levers_match(K, 29, 4, lever_options(Storage::bf16, 1, 8));   // 16-bit storage
    expect_levers_match(K, 29, 4, lever_options(Storage::bf16, 2, 12));  // both
    expect_levers_match(K, 29, 4, lever_options(Storage::fp16, 3, 8));
    expect_levers_match(K, 29, 4, lever_options(Storage::full, 9, 8));   // m > K: only y_0
    expect_levers_match(K, 29, 4, lever_options(Storage::bf16, 2, 8, true));     // paper mode
    // A window: one block per process or range; halos of T̄ - 1 tokens on sequence ranks.
    expect_levers_match(K, 29, 4, lever_options(Storage::bf16, 2, 8, true, 6));
    expect_levers_match(K, 29, 4, lever_options(Storage::full, 2, 8, true, 6));
    expect_levers_match(K, 29, 4, lever_options(Storage::full, 3, 8, true, 3));
    expect_levers_match(K, 29, 4, lever_options(Storage::full, 1, 8, true, 8));  // S = 4: a halo of a whole range
    // Ranges of 16 and 8 tokens start on the blocks of one process (S = 2, 4).
    expect_levers_match(K, 32, 4, lever_options(Storage::bf16, 1, 8));
    expect_levers_match(K, 32, 4, lever_options(Storage::bf16, 2, 8, true));
  }
}

// A Mamba's E3 with the memory levers on data and layer ranks (issue 34): the
// block-wise pass of one process (BlockwiseEngine's Mamba form: a MambaState
// before every (layer, block), the conv's and μ's carries across block starts)
// on each rank's layer range, y and g blocks handed between the ranks. Equal to
// one process with the same levers as for the SSM-ResNet: bitwise with one
// replica, untied, ranges on the checkpoint grid; 1e-12 with replicas or a tied
// embedding (its two parts summed after the pass); 16-bit storage with a range
// off the checkpoint grid within twice what 16-bit storage costs one process.
// Token blocks that do not divide T = 29, blocks of one token (chunk 1),
// layer checkpointing m = 1..K+1, bf16 and fp16, exact, detached and windowed.
TEST(Distributed, MambaMemoryLeversMatchOneProcess) {
  for (const bool tied : {true, false})
    for (int K : {4, 5}) {
      const auto d = mamba_tiny_dims(K, tied);
      const auto run = [&](const EngineOptions& o) { expect_levers_match(K, 29, 4, o, false, &d); };
      for (index_t m = 1; m <= K + 1; ++m) run(lever_options(Storage::full, m, 8));  // blocks of 8 and 5
      auto one = lever_options(Storage::full, 2, 1);
      one.chunk = 1;  // blocks of one token
      run(one);
      run(lever_options(Storage::full, 1, 12));
      run(lever_options(Storage::bf16, 1, 8));
      run(lever_options(Storage::bf16, 2, 12));
      run(lever_options(Storage::fp16, 3, 8));
      run(lever_options(Storage::bf16, 2, 8, true));      // detached
      run(lever_options(Storage::full, 2, 8, true, 6));   // a window: one block per window
      run(lever_options(Storage::bf16, 3, 8, true, 6));
    }
}

// Issue 35: 16-bit storage on sequence ranks stores and recomputes exactly one
// process's values (design.md §2, "What the layout changes"), so the gradient
// equals one process's to 1e-12 in double — not bitwise: the
// parameter sums over blocks are split over the ranges and added by the
// allreduce, and μ's carry is composed over ranges. Exact and detached E3,
// bf16 and fp16, token blocks of 8 and 12 with ranges on and off one process's
// block grid (T = 32, 29), layer checkpointing m = 1..3; the rounding that a
// flipped 16-bit value would show is checked to be far above the tolerance.
TEST(Distributed, SixteenBitStorageOnSequenceRanksMatchesOneProcess) {
  const int K = 4;
  const auto d = tiny_dims(K);
  for (const Storage st : {Storage::bf16, Storage::fp16})
    for (const bool detach : {false, true})
      for (const index_t m : {1, 2, 3})
        for (const index_t T : {29, 32}) {
          const auto o = lever_options(st, m, m == 2 ? 12 : 8, detach);
          const auto full = random_model<double>(d, 730 + int(m));
          const auto x = random_tokens(4, T, d.vocab, 740 + int(T));
          ParamSet<double> ref_g(d);
          const double ref_loss = BlockwiseEngine<double>(o).compute(full, x, ref_g);
          const auto ref = to_host(ref_g);
          auto fo = o;
          fo.storage = Storage::full;
          const double rounding = rel_l2(ref, grad_of(fo, full, x));
          ASSERT_GT(rounding, 1e-5) << "16-bit storage must change the gradient";
          for (const Lay& l : layouts(K, true)) {
            if (l.S == 1 || l.R > 1) continue;  // R × S: a layer range off the checkpoint grid keeps other inputs
            const dist::Grid grid(layout_config(d, l.R, l.D, 4, l.S));
            ParamSet<double> grad(d, grid.range(d));
            dist::DistributedEngine<double> engine(grid, o, d);
            const double loss = engine.compute(shard_of(full, grid.range(d)), x, grad);
            const auto whole = dist::gather(grid, grad);
            const std::string what = tag(l, o, 0) + " " + storage_name(st) + " m=" + std::to_string(m) +
                                     " T=" + std::to_string(T);
            EXPECT_NEAR(loss, ref_loss, 1e-12 * std::abs(ref_loss)) << what;
            // Host runs (one thread per rank, Bt·P ≥ 8) scan token by token: every cut keeps the bits.
            if (world_rank() == 0 && cuts_keep_scans(T, l.S, 4 / l.D, d.width, o))
              expect_close(to_host(whole), ref, d, 1e-12, what);
            else if (world_rank() == 0)  // a wide device off the block grid: the bound of design.md §2
              EXPECT_LE(rel_l2(to_host(whole), ref), 2 * rounding) << what;
          }
        }
}

// A wide device with few channels scans a block in chunks of 64 tokens: then a
// range that cuts one of one process's blocks off its block grid carries the
// state across the cut in another form than one process's chunk carry (last
// bits), which can flip a 16-bit rounding — the bound of design.md §2 (within
// twice what 16-bit storage costs one process); on the grid, 1e-12. Bt·P = 4
// makes the host chunk its blocks of 128 tokens too.
TEST(Distributed, ChunkedScansOnSequenceRanksStayWithinTheBound) {
  const auto d = tiny_dims(3, 17, 4, 4);
  const index_t T = 256;
  ASSERT_FALSE(forward_scan_is_sequential(128, 1, d.width));
  expect_levers_match(3, T, 1, lever_options(Storage::bf16, 2, 128), true, &d);
  expect_levers_match(3, T, 1, lever_options(Storage::fp16, 1, 128, true), true, &d);
}

// data.carry_state under every layout: two consecutive windows, the second
// starting from the first's state; the second gradient and the state a
// checkpoint gathers equal one process. On sequence ranks the first range
// starts from the carried state and the last range's end state is every range's.
TEST(Distributed, CarriedStateMatchesOneProcess) {
  const int K = 4;
  const index_t B = 4, T = 21;
  const auto d = tiny_dims(K);
  const auto full = random_model<double>(d, 720);
  const auto x1 = random_tokens(B, T, d.vocab, 721), x2 = random_tokens(B, T, d.vocab, 722);
  auto o = lever_options(Storage::full, 2, 8);  // (bf16 off the checkpoint grid rounds one more input)
  o.carry_state = true;
  auto states = [&] {
    std::vector<View2<double>> h;
    for (int k = 0; k < K; ++k) h.emplace_back("h", B * d.width, d.state);
    return h;
  };
  auto ref_h = states();
  BlockwiseEngine<double> ref_engine(o);
  ref_engine.set_carried_state(&ref_h);
  ParamSet<double> ref_g(d);
  ref_engine.compute(full, x1, ref_g);
  const double ref_loss = ref_engine.compute(full, x2, ref_g);
  const auto ref = to_host(ref_g);
  for (const Lay& l : layouts(K, true)) {
    if (l.D > B) continue;
    Config c = layout_config(d, l.R, l.D, B, l.S);
    const dist::Grid grid(c);
    const auto params = shard_of(full, grid.range(d));
    ParamSet<double> grad(d, grid.range(d));
    auto h = states();
    dist::DistributedEngine<double> engine(grid, o, d);
    engine.set_carried_state(&h);
    engine.compute(params, x1, grad);
    const double loss = engine.compute(params, x2, grad);
    const auto whole = dist::gather(grid, grad);
    const std::string what = tag(l, o, 0) + " carried state";
    EXPECT_NEAR(loss, ref_loss, 1e-12 * std::abs(ref_loss)) << what;
    if (world_rank() == 0) expect_close(to_host(whole), ref, d, 1e-12, what);
    // The checkpoint gathers every rank's rows of every layer onto rank 0.
    const std::string path = tmp_path("dist_carry_" + std::to_string(l.R) + "x" + std::to_string(l.S) + "x" +
                                      std::to_string(l.D) + "_np" +
                                      std::to_string(world_size()) + ".h5");
    dist::save_checkpoint(grid, path, c, params, 2, 0, OptimizerState<double>{nullptr, nullptr, 0, &h});
    if (world_rank() == 0) {
      auto loaded = states();
      ASSERT_TRUE(load_carried_state(path, loaded));
      for (int k = 0; k < K; ++k) {
        const auto a = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), loaded[k]);
        const auto b = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), ref_h[k]);
        for (index_t i = 0; i < index_t(a.extent(0)); ++i)
          for (index_t n = 0; n < index_t(a.extent(1)); ++n)
            ASSERT_NEAR(a(i, n), b(i, n), 1e-12 * (1 + std::abs(b(i, n)))) << what << " layer " << k;
      }
    }
    MPI_Barrier(MPI_COMM_WORLD);
  }
}

// The busiest rank's plan against the largest Kokkos peak measured over the
// ranks for one gradient of a batch of 2 windows of T tokens; printed, and
// held to within `within` of the measured peak.
void expect_plan_is_busiest_peak(const Settings& st, index_t T, const std::string& what, double within) {
  const auto d = st.model;
  const dist::Grid grid(st);
  const std::string sp = MemSpace::name();
  MPI_Barrier(MPI_COMM_WORLD);
  const auto base = MemoryTracker::current(sp);
  MemoryTracker::reset_peak();
  {
    ParamSet<float> params(d, grid.range(d));
    initialize(params, d.seed);
    ParamSet<float> grad(d, grid.range(d));
    const auto x = random_tokens(2, T, d.vocab, 5);
    dist::DistributedEngine<float> engine(grid, st.grad, st.model, st.dist.pipeline_blocks);
    engine.compute(params, x, grad);
    Kokkos::fence();
  }
  const std::uint64_t mine = MemoryTracker::peak(sp) - base;
  std::uint64_t peak = mine;
  MPI_Allreduce(MPI_IN_PLACE, &peak, 1, MPI_UINT64_T, MPI_MAX, MPI_COMM_WORLD);
  const MemoryPlan plan = plan_memory(st, Workload::grad, 4);
  const double planned = plan.total(), measured = double(peak);
  if (world_rank() == 0)
    std::printf("  plan/measured %.3f (%.2f / %.2f MiB): %s\n", planned / measured, planned / 1048576.0,
                measured / 1048576.0, what.c_str());
  const bool miss = std::fabs(planned - measured) > within * measured;
  // On a miss the busiest rank says what its peak was made of beside the plan:
  // a GPU run cannot be repeated at will, so one failure must say why.
  if (miss && mine == peak) {
    std::string labels;
    for (const auto& [label, bytes] : MemoryTracker::peak_breakdown(sp, 16))
      labels += "\n    " + format_bytes(bytes) + "  " + label;
    std::printf("  rank %d at its peak:%s\n  the plan:\n%s", world_rank(), labels.c_str(), plan.table("    ").c_str());
    std::fflush(stdout);
  }
  EXPECT_FALSE(miss) << what << ": planned " << planned << " bytes, measured " << measured;
}

// The planner per rank (docs/design.md §8): the busiest rank's plan within
// 10 % of the largest measured Kokkos peak over the ranks, with the levers, on
// layer, data and sequence ranks.
TEST(Distributed, PlanIsTheBusiestRanksPeak) {
  const std::vector<std::vector<std::string>> configs{
      {"run.storage=bf16", "grad.layer_checkpoint=2", "grad.token_block=256"},
      {"run.storage=float", "grad.layer_checkpoint=1", "grad.token_block=512"},
      {"run.storage=fp16", "grad.layer_checkpoint=3", "grad.token_block=256", "grad.detach_inputs=true"},
      {"run.storage=bf16", "grad.layer_checkpoint=2", "grad.detach_inputs=true", "grad.truncate=100"},  // a window
      {"dist.pipeline_blocks=0"},  // no lever: E3's pipeline over 4 blocks per layer rank
      {"grad.detach_inputs=true", "dist.pipeline_blocks=6"},
  };
  for (const bool chunked_h : {!host_backend, host_backend})  // this backend's h form, then the other's
  for (const auto& levers : configs)
    for (const Lay& l : layouts(4, true)) {
      if (l.D > 2) continue;  // a replica needs a window
      bool lever = false;
      for (const auto& kv : levers) lever = lever || kv.rfind("run.storage", 0) == 0 || kv.rfind("grad.layer", 0) == 0;
      if (l.R * l.D * l.S == 1 && !lever) continue;  // one process without a lever runs the local engine
      if (l.S > 1 && !lever) continue;  // sequence ranks without a lever run whole ranges: not planned exactly
      const auto d = tiny_dims(4, 64, 32, 8);
      Config c = layout_config(d, l.R, l.D, 2, l.S);
      for (const auto& kv : {"grad.engine=adjoint-exact", "data.seq_len=2048", "grad.chunk=32", "grad.wave=256"})
        c.set(kv);
      for (const auto& kv : levers) c.set(kv);
      c.validate();
      auto st = c.settings();
      st.grad.e3_chunked_h = chunked_h;
      std::string what = "R=" + std::to_string(l.R) + " S=" + std::to_string(l.S) + " D=" + std::to_string(l.D);
      for (const auto& kv : levers) what += " " + kv;
      if (chunked_h) what += " (chunk-parallel h)";
      expect_plan_is_busiest_peak(st, 2048, what, 0.05);  // the promise is 10 %
    }
}

// A Mamba on data and layer ranks (tied embeddings: the last layer rank holds
// the embedding's copy): the busiest rank's plan against the largest measured
// Kokkos peak, for E1 and E2 (whole windows) and E3 (the block-wise pipeline),
// E3 with the memory levers too.
TEST(Distributed, MambaPlanIsTheBusiestRanksPeak) {
  for (const std::string engine :
       {"grad.engine=backprop", "grad.engine=adjoint", "grad.engine=adjoint-exact",
        "grad.engine=adjoint-exact grad.token_block=128",
        "grad.engine=adjoint-exact grad.token_block=96 grad.layer_checkpoint=2 run.storage=bf16",
        "grad.engine=adjoint-exact grad.layer_checkpoint=3 run.storage=fp16",
        "grad.engine=adjoint-exact grad.detach_inputs=true grad.token_block=64 grad.layer_checkpoint=2"})
    for (const Lay& l : layouts(4)) {
      if (l.D > 2 || l.R * l.D == 1) continue;  // a replica needs a window; one process is test_mamba_*'s
      Config c = layout_config(tiny_dims(4, 64, 16, 8), l.R, l.D, 2);
      for (const std::string& kv : std::vector<std::string>{"model.arch=mamba", "data.seq_len=512", "grad.chunk=32",
                                                             "grad.wave=64"})
        c.set(kv);
      for (std::size_t a = 0, b; a < engine.size(); a = b + 1) {  // the engine's keys, space-separated
        b = engine.find(' ', a);
        if (b == std::string::npos) b = engine.size();
        c.set(engine.substr(a, b - a));
      }
      c.validate();
      const auto st = c.settings();
      const std::string what = "mamba " + engine + " R=" + std::to_string(l.R) + " D=" + std::to_string(l.D);
      expect_plan_is_busiest_peak(st, 512, what, 0.05);
    }
}

namespace {

// A Mamba on every layout with S > 1 (R × S × D) against one process with the
// same options (the block-wise engine with a lever, the whole window without),
// loss and gradient within 1e-12 relative in double. Returns how many layouts ran.
int expect_mamba_ranges_match(const ModelDims& d, const TokenView& x, const EngineOptions& o,
                              const std::string& what0) {
  const index_t B = x.extent(0), T = x.extent(1);
  const auto full = random_model<double>(d, 910 + d.conv_kernel);
  double ref_loss = 0;
  const auto ref = grad_of(o, full, x, &ref_loss);
  const double ref_forward = forward_loss(full, x);  // the forward alone keeps no 16-bit inputs
  int ran = 0;
  for (const Lay& l : layouts(int(d.layers), true)) {
    if (l.S == 1 || l.D > B) continue;  // S = 1: whole windows (test_distributed_cli)
    // 16-bit storage with m > 1: a layer range off the checkpoint grid keeps other inputs than one process.
    if (o.storage != Storage::full && o.layer_checkpoint > 1 && l.R > 1) continue;
    const dist::Grid grid(layout_config(d, l.R, l.D, B, l.S));
    ParamSet<double> grad(d, grid.range(d));
    dist::DistributedEngine<double> engine(grid, o, d);
    const double loss = engine.compute(shard_of(full, grid.range(d)), x, grad);
    const auto whole = dist::gather(grid, grad);
    const std::string what = what0 + " " + tag(l, o, 0) + " " + storage_name(o.storage) + " m=" +
                             std::to_string(o.layer_checkpoint) + " block=" + std::to_string(o.token_block) +
                             " T=" + std::to_string(T) + " Kc=" + std::to_string(d.conv_kernel) +
                             (d.tie_embeddings ? " tied" : " untied");
    EXPECT_NEAR(loss, ref_loss, 1e-12 * std::abs(ref_loss)) << what;
    if (world_rank() == 0) expect_close(to_host(whole), ref, d, 1e-12, what);
    // The forward-only loss (ash train's validation) passes the same states.
    const double vloss = engine.loss(shard_of(full, grid.range(d)), x);
    EXPECT_NEAR(vloss, ref_forward, 1e-12 * std::abs(ref_forward)) << what << " (validation loss)";
    ++ran;
  }
  return ran;
}

}  // namespace

// Issue 34: a Mamba on sequence ranks. Each range starts every layer from the
// MambaState the range before ended it with (the conv's last Kc − 1 inputs —
// the halo — and h) and hands back the conv state's cotangent with μ's carry.
// T = 29 puts S = 2, 3, 4's range starts inside one process's token blocks of 8;
// T = 10 with Kc = 4 makes ranges of 2 or 3 tokens, shorter than the 3-token halo
// (on S = 4 a range's first taps read two ranges back); documents start inside
// ranges and on a range's first token. Exact and detached, without a lever (each
// range one block) and with each lever, tied and untied embeddings.
TEST(Distributed, MambaOnSequenceRanksMatchesOneProcess) {
  int ran = 0;
  for (const bool tied : {true, false})
    for (const auto& [T, Kc] : {std::pair<index_t, std::int64_t>{29, 3}, std::pair<index_t, std::int64_t>{10, 4}}) {
      const auto d = mamba_tiny_dims(3, tied, Kc);
      const auto x = random_tokens(2, T, d.vocab, 930 + T);
      auto exact = engine_options("adjoint-exact");
      exact.chunk = 4;
      exact.wave = 8;
      auto detached = exact;
      detached.detach_inputs = true;
      for (const auto& o : {exact, detached, lever_options(Storage::full, 1, 8), lever_options(Storage::full, 2, 8),
                            lever_options(Storage::full, 4, 4, true), lever_options(Storage::full, 2, 12)})
        ran += expect_mamba_ranges_match(d, x, o, "plain");
      if (T == 29) {  // documents: inside the second range of S = 2, at a range start of S = 3 (29·2/3 = 19)
        const auto xd = with_document_starts(random_tokens(2, T, d.vocab, 940), {17, 19, T + 5, T + 14});
        ran += expect_mamba_ranges_match(d, xd, exact, "documents");
        ran += expect_mamba_ranges_match(d, xd, lever_options(Storage::full, 2, 8), "documents");
      }
    }
  if (world_size() > 1) EXPECT_GT(ran, 0);
}

// Issue 35 for a Mamba: with bf16 or fp16 storage each range stores exactly
// one process's values (its blocks are one process's, cut at the range's
// ends, each run from the state kept before it), so the gradient equals one
// process's 16-bit run to 1e-12 — a flipped 16-bit rounding would show far
// above that (checked: 16-bit storage changes the gradient by > 1e-5).
TEST(Distributed, MambaSixteenBitStorageOnSequenceRanksMatchesOneProcess) {
  int ran = 0;
  for (const Storage st : {Storage::bf16, Storage::fp16})
    for (const bool detach : {false, true})
      for (const index_t m : {1, 2}) {
        const auto d = mamba_tiny_dims(3, !detach, 4);
        const auto x = random_tokens(2, 29, d.vocab, 950 + int(m));
        const auto o = lever_options(st, m, 8, detach);
        auto fo = o;
        fo.storage = Storage::full;
        const auto full = random_model<double>(d, 910 + d.conv_kernel);
        ASSERT_GT(rel_l2(grad_of(o, full, x), grad_of(fo, full, x)), 1e-5) << "16-bit storage must change the gradient";
        ran += expect_mamba_ranges_match(d, x, o, "16-bit");
      }
  if (world_size() > 1) EXPECT_GT(ran, 0);
}

// data.carry_state on a Mamba under every layout (issue 34): two consecutive
// windows of one stream, the second starting from the first's state ([B·E,
// Kc−1+N] per layer: the conv's last Kc − 1 inputs, then h). Each window's loss
// and gradient and the carried state after it equal the one-process carried
// run's to 1e-12 in double: on every rank its layers' rows of its windows (E per
// window; on sequence ranks the last range's end state is every range's), and
// the whole state a checkpoint gathers. Without a lever and with each: token
// blocks (on T = 10 with Kc = 4, S = 4's ranges of 2 or 3 tokens are shorter than
// the conv's reach), layer checkpointing, detached, bf16 and fp16 storage
// (against one process's 16-bit run; it changes the gradient by > 1e-5), and a
// window T̄ = 3 without and with a lever (on sequence ranks the window's halos).
namespace {

std::vector<View2<double>> mamba_carried(const ModelDims& d, index_t B) {
  std::vector<View2<double>> st;
  for (int k = 0; k < d.layers; ++k) st.emplace_back("carried", B * d.carry_rows(), d.carry_cols());
  return st;
}

// Rows [r0, r1) of layers [k0, k1) of two carried states: max |a − b| and max |b|.
std::pair<double, double> carried_diff(const std::vector<View2<double>>& a, const std::vector<View2<double>>& b,
                                       int k0, int k1, index_t r0, index_t r1) {
  double diff = 0, ref = 0;
  for (int k = k0; k < k1; ++k) {
    const auto ha = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), a[std::size_t(k)]);
    const auto hb = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), b[std::size_t(k)]);
    for (index_t i = r0; i < r1; ++i)
      for (index_t c = 0; c < index_t(ha.extent(1)); ++c) {
        diff = std::max(diff, std::fabs(ha(i, c) - hb(i, c)));
        ref = std::max(ref, std::fabs(hb(i, c)));
      }
  }
  return {diff, ref};
}

// Returns how many layouts with more than one rank ran.
int expect_mamba_carry_matches(const ModelDims& d, index_t T, const EngineOptions& o) {
  const index_t B = 4;
  const int K = int(d.layers);
  const auto full = random_model<double>(d, 960 + d.conv_kernel);
  const auto x = random_tokens(B, 2 * T, d.vocab, 961 + T);
  const TokenView xs[2] = {token_block(x, 0, T), token_block(x, T, T)};
  // One process: make_engine's carried run (the block-wise engine).
  auto ref_state = mamba_carried(d, B);
  auto ref_engine = make_engine<double>(o);
  ref_engine->set_carried_state(&ref_state);
  double ref_loss[2];
  std::vector<double> ref_grad[2];
  std::vector<View2<double>> ref_after[2];
  for (int w = 0; w < 2; ++w) {
    ParamSet<double> g(d);
    ref_loss[w] = ref_engine->compute(full, xs[w], g);
    ref_grad[w] = to_host(g);
    ref_after[w] = mamba_carried(d, B);
    for (int k = 0; k < K; ++k) Kokkos::deep_copy(ref_after[w][std::size_t(k)], ref_state[std::size_t(k)]);
  }
  EXPECT_GT(carried_diff(ref_after[0], ref_after[1], 0, K, 0, B * d.carry_rows()).first, 1e-3)
      << "the second window must move the state";
  int ran = 0;
  for (const Lay& l : layouts(K, true)) {
    if (l.D > B) continue;
    // 16-bit storage with a layer range off the checkpoint grid keeps other inputs than one process.
    if (o.storage != Storage::full && !ranks_on_grid(d, l.R, o.layer_checkpoint)) continue;
    Config c = layout_config(d, l.R, l.D, B, l.S);
    const dist::Grid grid(c);
    const LayerRange range = grid.range(d);
    const auto params = shard_of(full, range);
    ParamSet<double> grad(d, range);
    auto h = mamba_carried(d, B);
    dist::DistributedEngine<double> engine(grid, o, d);
    engine.set_carried_state(&h);
    const auto [b0, b1] = grid.layout().windows(B);  // this replica's windows
    const std::string what = "mamba carried state " + tag(l, o, 0) + " " + storage_name(o.storage) + " m=" +
                             std::to_string(o.layer_checkpoint) + " block=" + std::to_string(o.token_block) +
                             " T=" + std::to_string(T) + " Kc=" + std::to_string(d.conv_kernel);
    for (int w = 0; w < 2; ++w) {
      const std::string ww = what + " window " + std::to_string(w + 1);
      const double loss = engine.compute(params, xs[w], grad);
      EXPECT_NEAR(loss, ref_loss[w], 1e-12 * std::abs(ref_loss[w])) << ww;
      const auto whole = dist::gather(grid, grad);
      if (world_rank() == 0) expect_close(to_host(whole), ref_grad[w], d, 1e-12, ww);
      const auto [diff, ref] = carried_diff(h, ref_after[w], range.k0, range.k1, b0 * d.carry_rows(),
                                            b1 * d.carry_rows());
      EXPECT_GT(ref, 0.0) << ww;
      EXPECT_LE(diff, 1e-12 * ref) << ww << " (this rank's rows of the state after the window)";
    }
    // The checkpoint gathers every rank's rows of every layer onto rank 0.
    const std::string path = tmp_path("dist_mamba_carry_np" + std::to_string(world_size()) + ".h5");
    dist::save_checkpoint(grid, path, c, params, 2, 0, OptimizerState<double>{nullptr, nullptr, 0, &h});
    if (world_rank() == 0) {
      auto loaded = mamba_carried(d, B);
      EXPECT_TRUE(load_carried_state(path, loaded));
      const auto [diff, ref] = carried_diff(loaded, ref_after[1], 0, K, 0, B * d.carry_rows());
      EXPECT_LE(diff, 1e-12 * ref) << what << " (the checkpoint's state)";
    }
    MPI_Barrier(MPI_COMM_WORLD);
    ran += l.R * l.S * l.D > 1;
  }
  return ran;
}

}  // namespace

TEST(Distributed, MambaCarriedStateMatchesOneProcess) {
  int ran = 0;
  for (const auto& [T, Kc] : {std::pair<index_t, std::int64_t>{29, 3}, std::pair<index_t, std::int64_t>{10, 4}}) {
    const auto d = mamba_tiny_dims(4, T == 29, Kc);  // tied on T = 29: the embedding's parts summed on R > 1
    auto exact = engine_options("adjoint-exact");
    exact.chunk = 4;
    exact.wave = 8;
    auto window = exact;  // the paper's window T̄ = 3 (on sequence ranks each range reads a halo)
    window.truncate = 3;
    window.detach_inputs = true;
    for (auto o : {exact, lever_options(Storage::full, 1, 8), lever_options(Storage::full, 2, 4),
                   lever_options(Storage::full, 2, 8, true), lever_options(Storage::bf16, 1, 8),
                   lever_options(Storage::fp16, 2, 4), window, lever_options(Storage::full, 2, 8, true, 3)}) {
      if (o.storage != Storage::full) {
        auto fo = o;
        fo.storage = Storage::full;
        const auto full = random_model<double>(d, 960 + d.conv_kernel);
        const auto x = random_tokens(4, T, d.vocab, 961 + T);
        ASSERT_GT(rel_l2(grad_of(o, full, x), grad_of(fo, full, x)), 1e-5) << "16-bit storage must change the gradient";
      }
      o.carry_state = true;
      ran += expect_mamba_carry_matches(d, T, o);
    }
  }
  if (world_size() > 1) EXPECT_GT(ran, 0);
}

// The paper's window T̄ on a Mamba's sequence ranks: each range reads the next
// range's first T̄ − 1 tokens of y_k and g (the halo μ_T̄ reads), its forward
// conv halo as without a window, and gets the conv cotangent's scatter from the
// next range. T = 29 on S = 2, 3, 4 (ranges of 14/15, 9/10/10, 7/7/7/8): T̄ = 1
// (no halo), 2 (below Kc), 3, 5 and 8 (a halo of a whole 7-token range) for
// conv kernels 2–4, without a lever and with checkpointing; T = 10 with Kc = 4
// makes ranges of 2 tokens, shorter than the conv's 3-token reach (T̄ = 2, 3);
// documents start inside ranges, on a range's first token and inside a halo;
// bf16 and fp16 storage against one process's 16-bit run.
TEST(Distributed, MambaWindowsOnSequenceRanksMatchOneProcess) {
  const auto windowed = [](index_t Tbar) {  // no lever: each range one block
    auto o = engine_options("adjoint-exact", Tbar, true);
    o.chunk = 4;
    o.wave = 8;
    return o;
  };
  int ran = 0;
  for (const std::int64_t Kc : {2, 3, 4}) {
    const auto d = mamba_tiny_dims(3, Kc != 3, Kc);
    const auto x = random_tokens(2, 29, d.vocab, 960 + int(Kc));
    for (const index_t Tbar : {1, 2, 3, 5, 8}) {
      ran += expect_mamba_ranges_match(d, x, windowed(Tbar), "window");
      ran += expect_mamba_ranges_match(d, x, lever_options(Storage::full, 2, 8, true, Tbar), "window");
    }
  }
  const auto d4 = mamba_tiny_dims(3, true, 4);
  for (const index_t Tbar : {2, 3}) {
    const auto x = random_tokens(2, 10, d4.vocab, 970 + int(Tbar));
    ran += expect_mamba_ranges_match(d4, x, windowed(Tbar), "short ranges");
    ran += expect_mamba_ranges_match(d4, x, lever_options(Storage::full, 1, 4, true, Tbar), "short ranges");
  }
  // Starts at 17 (inside S = 2's second range), 19 (S = 3's third range's first
  // token) and 29 + 16 (inside the halo S = 2's first range reads with T̄ = 5).
  const auto xd = with_document_starts(random_tokens(2, 29, d4.vocab, 975), {17, 19, 29 + 5, 29 + 16});
  ran += expect_mamba_ranges_match(d4, xd, windowed(5), "documents");
  ran += expect_mamba_ranges_match(d4, xd, lever_options(Storage::full, 2, 8, true, 3), "documents");
  for (const Storage st : {Storage::bf16, Storage::fp16})
    for (const index_t m : {1, 2}) {
      const auto o = lever_options(st, m, 8, true, 4);
      auto fo = o;
      fo.storage = Storage::full;
      const auto x = random_tokens(2, 29, d4.vocab, 980 + int(m));
      const auto full = random_model<double>(d4, 910 + d4.conv_kernel);
      ASSERT_GT(rel_l2(grad_of(o, full, x), grad_of(fo, full, x)), 1e-5) << "16-bit storage must change the gradient";
      ran += expect_mamba_ranges_match(d4, x, o, "window 16-bit");
    }
  if (world_size() > 1) EXPECT_GT(ran, 0);
}

// A Mamba on sequence ranks refuses a window whose halo (T̄ − 1 tokens) is
// longer than a range after the first, as an SSM-ResNet's, before any work.
TEST(Distributed, MambaOnSequenceRanksRefusesShortRanges) {
  if (world_size() < 3) GTEST_SKIP() << "needs 3 or more ranks (ranges of 3 tokens)";
  const auto d = mamba_tiny_dims(2, true, 4);
  const auto params = random_model<double>(d, 3);
  ParamSet<double> grad(d);
  // S = world: ranges of 3 tokens; T̄ = 4 reads 3 past a range, 5 reads 4
  const int S = world_size();
  const dist::Grid grid(layout_config(d, 1, 1, 2, S));
  const auto x = random_tokens(2, 3 * S, d.vocab, 4);
  dist::DistributedEngine<double> fits(grid, engine_options("adjoint-exact", 4, true), d);
  EXPECT_NO_THROW(fits.compute(params, x, grad));
  dist::DistributedEngine<double> too_long(grid, engine_options("adjoint-exact", 5, true), d);
  expect_error([&] { too_long.compute(params, x, grad); }, "each range needs >= T-bar - 1");
}

// A Mamba on sequence ranks (dist::SequenceBlockwise): the busiest rank's plan
// against the largest measured Kokkos peak, within 10 %, without a lever and
// with token blocks, layer checkpointing and bf16 storage, and with a window T̄.
TEST(Distributed, MambaSequencePlanIsTheBusiestRanksPeak) {
  for (const std::string levers : {"", "grad.token_block=128 grad.layer_checkpoint=2 run.storage=bf16",
                                    "grad.detach_inputs=true grad.token_block=64",
                                    "grad.detach_inputs=true grad.truncate=48",
                                    "grad.detach_inputs=true grad.truncate=100 grad.layer_checkpoint=2"})
    for (const Lay& l : layouts(4, true)) {
      if (l.S == 1 || l.D > 2) continue;
      Config c = layout_config(tiny_dims(4, 64, 16, 8), l.R, l.D, 2, l.S);
      std::istringstream words("model.arch=mamba data.seq_len=512 grad.chunk=32 grad.wave=64 "
                               "grad.engine=adjoint-exact " + levers);
      for (std::string w; words >> w;) c.set(w);
      c.validate();
      const auto st = c.settings();
      const std::string what = "mamba sequence [" + levers + "] R=" + std::to_string(l.R) + " S=" +
                               std::to_string(l.S) + " D=" + std::to_string(l.D);
      expect_plan_is_busiest_peak(st, 512, what, 0.10);
    }
}

TEST(Distributed, SequenceRanksRefuseWhatTheyCannotRun) {
  if (world_size() % 2 != 0) GTEST_SKIP() << "needs an even number of ranks";
  const auto d = tiny_dims(2);
  const dist::Grid grid(layout_config(d, 1, world_size() / 2, 4, 2));
  for (const auto& o : {engine_options("adjoint"), engine_options("backprop"), engine_options("adjoint", 6, true)})
    EXPECT_THROW(dist::DistributedEngine<double>(grid, o, d), Error) << method_name(o.method);
  // The model's layer kind picks the engine's passes: another kind's parameters are refused before any work.
  const auto md = mamba_tiny_dims(2, true);
  dist::DistributedEngine<double> built(grid, engine_options("adjoint-exact"), d);
  const auto mp = shard_of(random_model<double>(md, 5), grid.range(md));
  ParamSet<double> mg(md, grid.range(md));
  expect_error([&] { built.compute(mp, random_tokens(4, 8, md.vocab, 6), mg); }, "built for another model.arch");
  EXPECT_THROW(dist::Layout::from_config(layout_config(d, 1, 1, 4, 3), 0, 2), Error);  // 2 ranks, S = 3
  Config c = layout_config(d, 1, 1, 4, 4);
  c.set("data.seq_len=3");
  EXPECT_THROW(dist::Layout::from_config(c, 0, 4), Error);  // a token range would be empty
}

}  // namespace ash::test

int main(int argc, char* argv[]) {
  ash::dist::Session mpi(&argc, &argv);
  ::testing::InitGoogleTest(&argc, argv);
  Kokkos::ScopeGuard kokkos(argc, argv);
  ash::MemoryTracker::install();
  if (mpi.rank() != 0) {  // one report: the other ranks' failures show in the exit code
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
  }
  int rc = RUN_ALL_TESTS();
  MPI_Allreduce(MPI_IN_PLACE, &rc, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  return rc;
}
