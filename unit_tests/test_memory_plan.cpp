// The memory planner (ash plan, docs/design.md §8) against the measured peak
// of the default memory space, within 10 %, for every engine and memory lever.
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <map>
#include <type_traits>

#include "ash/grad/layer_kinds.hpp"
#include "test_helpers.hpp"

namespace ash::test {

namespace {

Config sized(const std::vector<std::string>& sets) {
  Config c;
  for (const auto& s : sets) c.set(s);
  c.validate();
  return c;
}

// The Kokkos peak of one engine call with everything it needs allocated in
// the measured scope: parameters, gradient, token ids.
template <class S>
double measured_grad_peak(const Settings& st) {
  const auto& d = st.model;
  const std::string sp = MemSpace::name();
  const auto base = MemoryTracker::current(sp);
  MemoryTracker::reset_peak();
  {
    ParamSet<S> ps(d);
    initialize(ps, d.seed);
    ParamSet<S> g(d);
    const auto x = random_tokens(st.data.batch, st.data.seq_len, d.vocab, 5);
    make_engine<S>(st.grad)->compute(ps, x, g);
    Kokkos::fence();
  }
  return double(MemoryTracker::peak(sp) - base);
}

// On a miss, what the measured peak was made of (largest labels).
std::string peak_labels() {
  std::string out;
  for (const auto& [label, bytes] : MemoryTracker::peak_breakdown(MemSpace::name(), 12))
    out += "\n    " + format_bytes(bytes) + "  " + label;
  return out;
}

void expect_within(double planned, double measured, const std::string& what) {
  std::printf("  plan/measured %.3f (%.2f / %.2f MiB): %s\n", planned / measured, planned / 1048576.0,
              measured / 1048576.0, what.c_str());
  EXPECT_LE(std::fabs(planned - measured), 0.10 * measured)
      << what << ": planned " << planned << " bytes, measured " << measured << "; at the peak:" << peak_labels();
}

// What make() allocates in the measured space, label by label, equals the
// spec: a kind's specs are what the planner sums for what it allocates.
// (Kokkos allocates whole 8-byte words: a View of an odd number of floats has 4 bytes more.)
template <class F>
void expect_allocates(const WorkspaceSpec& spec, F&& make, const std::string& what) {
  const std::string sp = MemSpace::name();
  std::map<std::string, double> want, got;
  double total = 0;
  for (const auto& b : spec.buffers()) {
    const double one = b.bytes() / double(b.copies), words = 8 * std::ceil(one / 8) * double(b.copies);
    want[b.label] += words;
    total += words;
  }
  const auto base = MemoryTracker::current(sp);
  MemoryTracker::reset_peak();
  {
    const auto held = make();
    Kokkos::fence();
    EXPECT_EQ(double(MemoryTracker::current(sp) - base), total) << what;
    for (const auto& [label, bytes] : MemoryTracker::peak_breakdown(sp, 10000))
      if (want.count(label)) got[label] = double(bytes);
  }
  EXPECT_EQ(got, want) << what;
}

template <class K, class S>
void expect_kind_specs(const ModelDims& d) {
  const std::string what = std::string(K::name) + ", " + std::to_string(sizeof(S)) + "-byte scalars";
  const index_t Bt = 3, T = 101, blocks = 4, rows = Bt * T;  // several row blocks of the partial sums
  const SeqShape s{Bt, T, DocStarts()};
  using Acts = typename K::template BlockActs<S>;
  expect_allocates(
      K::state_spec(d, Bt, sizeof(S)), [&] { return K::template make_state<S>(d, Bt); }, what + " state");
  expect_allocates(
      K::block_states_spec(d, Bt, blocks, sizeof(S)),
      [&] { return typename K::template BlockStates<S>(d, Bt, blocks); }, what + " block states");
  expect_allocates(
      K::acts_spec(d, rows, false, sizeof(S)), [&] { return K::template make_block_acts<S>(s, d); },
      what + " block activations");
  expect_allocates(
      K::acts_spec(d, rows, true, sizeof(S)), [&] { return Acts(s, d, LayerActivations<S>::with_hprev_and_A); },
      what + " kept activations");
  expect_allocates(
      K::carry_spec(d, Bt, sizeof(S)), [&] { return K::template make_carry<S>(d, Bt); }, what + " carry");
  for (const bool partials : {false, true})
    expect_allocates(
        K::cotangents_spec(d, rows, partials, sizeof(S)),
        [&] {
          auto sc = std::make_shared<typename K::template Scratch<S>>();
          if constexpr (std::is_base_of_v<MambaKind, K>) sc->cotangents(rows, d, partials);
          return sc;
        },
        what + " cotangents");
}

}  // namespace

// Each kind's WorkspaceSpecs (grad/*_kind.hpp) against what its constructors allocate.
TEST(MemoryPlan, KindSpecsAreWhatTheKindsAllocate) {
  ModelDims ssm;
  ssm.width = 12;
  ssm.state = 5;
  expect_kind_specs<SsmResNetKind, double>(ssm);
  expect_kind_specs<SsmResNetKind, float>(ssm);
  for (const auto& d : {mamba_tiny_dims(2, false, 4, 3), mamba_tiny_dims(1, true, 2, 0)}) {
    expect_kind_specs<MambaKind, double>(d);
    expect_kind_specs<MambaKind, float>(d);
  }
  const ModelDims falcon = mamba_tiny_dims(2, false, 4, 3, Arch::falcon_mamba);  // the mixer norms' r counted
  expect_kind_specs<FalconMambaKind, double>(falcon);
  expect_kind_specs<FalconMambaKind, float>(falcon);
  const ModelDims m2 = mamba2_tiny_dims(2, false, 4);  // the conv over x, B and C; the gated norm's r
  expect_kind_specs<Mamba2Kind, double>(m2);
  expect_kind_specs<Mamba2Kind, float>(m2);
  expect_kind_specs<Mamba2Kind, double>(mamba2_tiny_dims(2, true, 3, 2));  // B and C in two groups
  EXPECT_GT(FalconMambaKind::acts_spec(falcon, 30, false, 8).bytes(),
            MambaKind::acts_spec(falcon, 30, false, 8).bytes() - 1);
  EXPECT_EQ(MambaKind::acts_spec(falcon, 30, false, 8).bytes() -
                MambaKind::acts_spec(mamba_tiny_dims(2, false, 4, 3), 30, false, 8).bytes(),
            30 * 3 * 8);
}

// The planner's rows of a kind's buffers are its specs' sums (a Mamba's whole
// window and token blocks), so the plan counts what the kind allocates.
TEST(MemoryPlan, KindRowsSumTheKindsSpecs) {
  auto row = [](const MemoryPlan& p, const std::string& label) {
    for (const auto& i : p.items)
      if (i.name == label) return i.bytes;
    ADD_FAILURE() << "no row '" << label << "' in\n" << p.table();
    return -1.0;
  };
  Config c = config_for(mamba_tiny_dims(2, false, 4, 3));
  for (const char* s : {"data.seq_len=96", "data.batch=3", "grad.chunk=8", "grad.engine=adjoint-exact"}) c.set(s);
  const Settings st = c.settings();
  const ModelDims& d = st.model;
  const index_t M = 3 * 96;
  MemoryPlan p = plan_memory(st, Workload::grad, 8);
  EXPECT_EQ(row(p, "block projections (one block)"), MambaKind::acts_spec(d, M, false, 8).bytes());
  EXPECT_EQ(row(p, "cotangents (whole window)"), MambaKind::cotangents_spec(d, M, false, 8).bytes());
  c.set("grad.token_block=32");
  p = plan_memory(c.settings(), Workload::grad, 8);
  EXPECT_EQ(row(p, "block activations (one block)"), MambaKind::acts_spec(d, 3 * 32, false, 8).bytes());
  EXPECT_EQ(row(p, "cotangents (one block)"), MambaKind::cotangents_spec(d, 3 * 32, false, 8).bytes());
  EXPECT_EQ(row(p, "E3 block activations + state copy"),
            MambaKind::acts_spec(d, 3 * 32, false, 8).bytes() + MambaKind::state_spec(d, 3, 8).bytes());
}

TEST(MemoryPlan, GradPeakWithinTenPercentForEveryEngineAndLever) {
  const std::vector<std::string> model{"model.vocab=64", "model.width=32", "model.state=8", "grad.chunk=32",
                                       "grad.wave=256"};
  const std::vector<std::vector<std::string>> configs{
      {"grad.engine=adjoint-exact", "model.layers=3", "data.seq_len=2048", "data.batch=2"},
      {"grad.engine=adjoint-exact", "model.layers=2", "data.seq_len=700", "data.batch=3", "grad.wave=1024"},
      {"grad.engine=backprop", "model.layers=2", "data.seq_len=512", "data.batch=2"},
      {"grad.engine=adjoint", "model.layers=2", "data.seq_len=256", "data.batch=2", "grad.truncate=32"},
      {"grad.engine=adjoint-exact", "model.layers=4", "data.seq_len=4096", "data.batch=1", "run.storage=bf16",
       "grad.layer_checkpoint=2", "grad.token_block=512"},
      {"grad.engine=adjoint-exact", "model.layers=6", "data.seq_len=8192", "data.batch=1", "run.storage=fp16",
       "grad.layer_checkpoint=auto", "grad.token_block=1024"},
      {"grad.engine=adjoint-exact", "model.layers=3", "data.seq_len=2048", "data.batch=2", "run.storage=float",
       "grad.layer_checkpoint=3", "grad.token_block=256", "grad.detach_inputs=true"},
      // the paper's truncated mode in O(T): waves are whole blocks of T-bar
      {"grad.engine=adjoint-exact", "model.layers=2", "data.seq_len=1000", "data.batch=2", "grad.detach_inputs=true",
       "grad.truncate=48"},
      // automatic wave and head chunk (the backend's defaults)
      {"grad.engine=adjoint-exact", "model.layers=2", "data.seq_len=3000", "data.batch=2", "grad.wave=0",
       "grad.head_chunk=0"},
  };
  for (const auto& c : configs) {
    auto sets = model;
    sets.insert(sets.end(), c.begin(), c.end());
    const auto cfg = sized(sets);
    std::string what;
    for (const auto& s : c) what += s + " ";
    Settings st = cfg.settings();
    expect_within(plan_memory(st, Workload::grad, 4).total(), measured_grad_peak<float>(st), "float " + what);
    // E3's wave buffers instead of the fused per-chunk kernels
    if (st.grad.method != Method::adjoint_exact) continue;
    st.grad.e3_fused = !st.grad.e3_fused;
    expect_within(plan_memory(st, Workload::grad, 4).total(), measured_grad_peak<float>(st),
                  "wave buffers float " + what);
  }
  // double, one configuration
  auto sets = model;
  sets.insert(sets.end(), {"grad.engine=adjoint-exact", "model.layers=2", "data.seq_len=1024", "data.batch=2",
                           "run.storage=bf16", "grad.token_block=256"});
  const auto cfg = sized(sets);
  expect_within(plan_memory(cfg, Workload::grad, 8).total(), measured_grad_peak<double>(cfg.settings()), "double");
}

// ash train: optimizer state, validation windows and their forward included.
TEST(MemoryPlan, TrainPeakWithinTenPercent) {
  const auto corpus = word_corpus(tmp_path("corpus.txt"));
  for (const auto& extra : std::vector<std::vector<std::string>>{
           {"data.seq_len=512", "data.batch=4"},
           {"data.seq_len=2048", "data.batch=2", "run.storage=bf16", "grad.layer_checkpoint=2", "grad.token_block=256",
            "data.sequential=true", "data.carry_state=true"}}) {
    std::vector<std::string> sets{"model.vocab=256",
                                  "model.width=32",
                                  "model.state=8",
                                  "model.layers=4",
                                  "grad.engine=adjoint-exact",
                                  "grad.chunk=32",
                                  "grad.wave=256",
                                  "optim.steps=2",
                                  "run.eval_every=1",
                                  "run.ckpt_every=0",
                                  "data.valid_fraction=0.3",
                                  "data.train=" + corpus,
                                  "run.out_dir=" + tmp_path("run")};
    sets.insert(sets.end(), extra.begin(), extra.end());
    const auto cfg = sized(sets);
    std::filesystem::remove_all(tmp_path("run"));
    const std::string sp = MemSpace::name();
    const auto base = MemoryTracker::current(sp);
    MemoryTracker::reset_peak();
    train(cfg, "", nullptr);
    const double measured = double(MemoryTracker::peak(sp) - base);
    const auto data = TokenDataset::from_file(corpus, 256, cfg.settings().data.seq_len, 0.3, 1, false);
    const auto nv = std::min<index_t>(16, data.valid_windows());
    expect_within(plan_memory(cfg, Workload::train, 4, nv).total(), measured, extra.front());
  }
}

}  // namespace ash::test
