// E4 over MPI, Cabana-style: ctest runs this executable under mpiexec with
// 1, 2, 3 and 4 ranks; each test runs every rank layout R × D that fits the
// world and compares with one process computing the same thing alone.
#include <mpi.h>

#include "ash/dist/distributed_engine.hpp"
#include "ash/dist/sharded_io.hpp"
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

// Every (R, D) with R·D = world and R <= K.
std::vector<std::pair<int, int>> layouts(int K) {
  std::vector<std::pair<int, int>> out;
  const int n = world_size();
  for (int R = 1; R <= n; ++R)
    if (n % R == 0 && R <= K) out.push_back({R, n / R});
  return out;
}

Config model_config(const ModelDims& d) {
  Config c;
  c.set("model.vocab=" + std::to_string(d.vocab));
  c.set("model.width=" + std::to_string(d.width));
  c.set("model.state=" + std::to_string(d.state));
  c.set("model.layers=" + std::to_string(d.layers));
  c.set("model.seed=" + std::to_string(d.seed));
  return c;
}

Config layout_config(const ModelDims& d, int R, int D, index_t batch) {
  Config c = model_config(d);
  c.set("dist.layer_ranks=" + std::to_string(R));
  c.set("dist.data_ranks=" + std::to_string(D));
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

std::string tag(int R, int D, const EngineOptions& o, index_t blocks) {
  return "R=" + std::to_string(R) + " D=" + std::to_string(D) + " " + o.engine + (o.detach_inputs ? " detached" : "") +
         " T-bar=" + std::to_string(o.truncate) + " blocks=" + std::to_string(blocks);
}

// Loss and gradient of every layout equal one process's, relative 1e-12 in double.
void expect_layouts_match(int K, index_t T, index_t batch, const EngineOptions& o, index_t blocks = 0) {
  const auto d = tiny_dims(K);
  const auto full = random_model<double>(d, 500 + K);
  const auto x = random_tokens(batch, T, d.vocab, 600 + K);
  double ref_loss = 0;
  const auto ref = grad_of(o, full, x, &ref_loss);
  for (auto [R, D] : layouts(K)) {
    const dist::Grid grid(layout_config(d, R, D, batch));
    const auto params = shard_of(full, grid.range(d));
    ParamSet<double> grad(d, grid.range(d));
    dist::DistributedEngine<double> engine(grid, o, blocks);
    const double loss = engine.compute(params, x, grad);
    EXPECT_NEAR(loss, ref_loss, 1e-12 * std::abs(ref_loss)) << tag(R, D, o, blocks);
    const auto whole = dist::gather(grid, grad);
    if (world_rank() == 0) expect_close(to_host(whole), ref, d, 1e-12, tag(R, D, o, blocks));
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
  for (auto [R, D] : layouts(4)) {
    const dist::Grid grid(layout_config(d, R, D, 4));
    dist::DistributedEngine<double> engine(grid, engine_options("adjoint-exact"));
    EXPECT_NEAR(engine.loss(shard_of(full, grid.range(d)), x), ref, 1e-12 * ref) << "R=" << R << " D=" << D;
  }
}

// A file written from shards equals, dataset for dataset and bit for bit, the
// one process's file, and reading it back on any layout gives the same bits.
TEST(Distributed, CheckpointsReshardBitwise) {
  const auto d = tiny_dims(5);
  const auto full = random_model<double>(d, 91), m = random_model<double>(d, 92), v = random_model<double>(d, 93);
  const Config cfg = model_config(d);
  const std::string np = "_np" + std::to_string(world_size());  // ctest runs the rank counts concurrently
  const std::string one = tmp_path("one" + np + ".h5"), sharded = tmp_path("sharded" + np + ".h5");
  if (world_rank() == 0) save_checkpoint(one, cfg, full, 3, 11, OptimizerState<double>{&m, &v, 3});
  MPI_Barrier(MPI_COMM_WORLD);
  for (auto [R, D] : layouts(5)) {
    const dist::Grid grid(layout_config(d, R, D, 4));
    const auto range = grid.range(d);
    const auto p = load_checkpoint<double>(one, range);
    ParamSet<double> pm(d, range), pv(d, range);
    std::int64_t st = 0;
    ASSERT_TRUE(load_optimizer_state(one, pm, pv, &st));
    EXPECT_EQ(to_host(p), to_host(shard_of(full, range)));
    EXPECT_EQ(to_host(pm), to_host(shard_of(m, range)));
    dist::save_checkpoint(grid, sharded, cfg, p, 3, 11, &pm, &pv, st);
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
  for (auto [R, D] : layouts(5)) {
    const dist::Grid grid(layout_config(d, R, D, 4));
    auto p = shard_of(full, grid.range(d));
    AdamW<double> opt(d, grid.range(d), ao);
    ParamSet<double> g(d, grid.range(d));
    dist::DistributedEngine<double> engine(grid, engine_options("adjoint-exact"));
    for (int step = 0; step < 3; ++step) {
      engine.compute(p, x, g);
      const MPI_Comm lc = grid.layers();
      opt.update(p, g, [lc](double ss) { return dist::allreduce_sum(ss, lc); });
    }
    const auto whole = dist::gather(grid, p);
    if (world_rank() == 0) expect_close(to_host(whole), to_host(ref_p), d, 1e-12, "R=" + std::to_string(R));
  }
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
