// ash train: exact resume, checkpoints with optimizer state, non-finite loss,
// bad inputs (docs/design.md §7); recurrent generation.
#include <hdf5.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <fstream>

#include "cli_runner.hpp"
#include "test_helpers.hpp"

namespace ash::test {

namespace {

std::string tmp(const std::string& name) { return tmp_path(name); }

std::string corpus_file() { return word_corpus(tmp("corpus.txt")); }

Config small_config(const std::string& out_dir, const std::string& precision = "float") {
  Config c;
  for (const auto& kv : {"model.width=8", "model.state=4", "model.layers=2", "data.seq_len=32", "data.batch=2",
                         "grad.engine=adjoint-exact", "grad.chunk=8", "optim.steps=6", "optim.warmup=2",
                         "run.log_every=1", "run.eval_every=2", "run.ckpt_every=2"})
    c.set(kv);
  c.set("data.train=" + corpus_file());
  c.set("run.out_dir=" + out_dir);
  c.set("run.precision=" + precision);
  return c;
}

std::vector<double> losses(const std::string& metrics) {
  std::vector<double> out;
  std::ifstream in(metrics);
  for (std::string line; std::getline(in, line);) out.push_back(nlohmann::json::parse(line)["loss"].get<double>());
  return out;
}

}  // namespace

class Resume : public ::testing::TestWithParam<std::tuple<std::string, bool>> {};

// 2n steps straight == n steps, stop, --resume, n more: bitwise.
TEST_P(Resume, IsBitwiseExact) {
  const auto [precision, sequential] = GetParam();
  const std::string tag = precision + (sequential ? "_seq" : "_rand");
  const auto a = tmp("straight_" + tag), b = tmp("split_" + tag);
  std::filesystem::remove_all(a);
  std::filesystem::remove_all(b);
  auto ca = small_config(a, precision), cb = small_config(b, precision);
  ca.set(std::string("data.sequential=") + (sequential ? "true" : "false"));
  cb.set(std::string("data.sequential=") + (sequential ? "true" : "false"));
  train(ca, "", nullptr);
  const auto first = train(cb, "", nullptr, 3);
  EXPECT_EQ(first.last_step, 3);
  const auto second = train(cb, b + "/checkpoint.h5", nullptr);
  EXPECT_EQ(second.first_step, 3);
  EXPECT_EQ(second.last_step, 6);
  const auto la = losses(a + "/metrics.jsonl"), lb = losses(b + "/metrics.jsonl");
  ASSERT_EQ(la.size(), 6u);
  EXPECT_EQ(la, lb);
  CheckpointInfo ia, ib;
  if (precision == "float") {
    EXPECT_EQ(to_host(load_checkpoint<float>(a + "/checkpoint.h5", &ia)),
              to_host(load_checkpoint<float>(b + "/checkpoint.h5", &ib)));
  } else {
    EXPECT_EQ(to_host(load_checkpoint<double>(a + "/checkpoint.h5", &ia)),
              to_host(load_checkpoint<double>(b + "/checkpoint.h5", &ib)));
  }
  EXPECT_EQ(ia.step, 6);
  EXPECT_EQ(ia.data_cursor, ib.data_cursor);
  EXPECT_LT(la.back(), la.front()) << "training should reduce the loss";
}

INSTANTIATE_TEST_SUITE_P(Modes, Resume,
                         ::testing::Values(std::make_tuple(std::string("float"), false),
                                           std::make_tuple(std::string("double"), true)));

TEST(TrainCheckpoint, RoundTripsOptimizerStateAndCursor) {
  const auto d = tiny_dims(2);
  auto p = random_model<double>(d, 1);
  ParamSet<double> m(d), v(d), m2(d), v2(d);
  from_host(m, to_host(random_model<double>(d, 2)));
  from_host(v, to_host(random_model<double>(d, 3)));
  Config c;
  c.set("model.vocab=17");
  c.set("model.width=8");
  c.set("model.state=4");
  c.set("model.layers=2");
  c.set("model.seed=7");
  const auto path = tmp("opt.h5");
  save_checkpoint(path, c, p, 12, 345, OptimizerState<double>{&m, &v, 12});
  std::int64_t step = 0;
  ASSERT_TRUE(load_optimizer_state(path, m2, v2, &step));
  EXPECT_EQ(step, 12);
  EXPECT_EQ(to_host(m2), to_host(m));
  EXPECT_EQ(to_host(v2), to_host(v));
  CheckpointInfo info;
  load_checkpoint<double>(path, &info);
  EXPECT_EQ(info.data_cursor, 345);
  // A fresh model has no optimizer state.
  save_checkpoint(path, c, p);
  EXPECT_FALSE(load_optimizer_state(path, m2, v2, &step));
}

TEST(TrainFailures, NonFiniteLossStopsAndKeepsTheCheckpoint) {
  const auto dir = tmp("nan");
  std::filesystem::remove_all(dir);
  auto cfg = small_config(dir);
  train(cfg, "", nullptr, 2);
  const auto ckpt = dir + "/checkpoint.h5";
  // Poison the stored head with a NaN, as a diverged run would.
  hid_t f = H5Fopen(ckpt.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
  hid_t ds = H5Dopen2(f, "/params/head", H5P_DEFAULT);
  std::vector<float> head(256 * 8);
  H5Dread(ds, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, head.data());
  head[5] = std::nanf("");
  H5Dwrite(ds, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, head.data());
  H5Dclose(ds);
  H5Fclose(f);
  reseal(ckpt);  // consistent digests: the value check, not the digest, must refuse it
  const auto before = slurp(ckpt);
  // A non-finite value is refused when the checkpoint is read (strict schema,
  // docs/file_format.md); the file is left as it was.
  EXPECT_FAILS_WITH(run("train --resume " + ckpt), "holds a non-finite value");
  EXPECT_EQ(slurp(ckpt), before);
}

TEST(TrainFailures, BadInputsNameTheProblemAndTouchNothing) {
  const auto dir = tmp("bad");
  std::filesystem::remove_all(dir);
  const auto corpus = corpus_file();
  const std::string base = "train --set model.width=8 --set model.state=4 --set model.layers=1 "
                           "--set data.seq_len=16 --set optim.steps=2 --set run.out_dir=" + dir +
                           " --set data.train=" + corpus + " ";
  ASSERT_EQ(run(base).code, 0);
  const auto ckpt = dir + "/checkpoint.h5";
  const auto before = slurp(ckpt);
  EXPECT_FAILS_WITH(run(base + "--set optim.colour=1"), "unknown config key 'optim.colour'");
  EXPECT_FAILS_WITH(run(base + "--set data.seq_len=0"), "data.seq_len");
  EXPECT_FAILS_WITH(run(base + "--set model.vocab=50"), ">= model.vocab 50");
  EXPECT_FAILS_WITH(run(base + "--set data.train=" + dir + "/missing.txt"), "cannot open token file");
  EXPECT_FAILS_WITH(run(base + "--set data.train="), "data.train is empty");
  EXPECT_FAILS_WITH(run(base + "--set run.precision=half"), "run.precision");
  EXPECT_FAILS_WITH(run(base + "--resume " + dir + "/nope.h5"), "cannot open checkpoint");
  write(dir + "/junk.h5", "not a checkpoint");
  EXPECT_FAILS_WITH(run(base + "--resume " + dir + "/junk.h5"), "not an HDF5 file");
  write(dir + "/cut.h5", before.substr(0, before.size() / 2));
  EXPECT_NE(run(base + "--resume " + dir + "/cut.h5").code, 0);
  write(dir + "/old.h5", before);
  set_format_version(dir + "/old.h5", 0);
  EXPECT_FAILS_WITH(run(base + "--resume " + dir + "/old.h5"), "format version 0");
  EXPECT_FAILS_WITH(run(base + "--resume " + ckpt + " --set run.precision=double"), "trained in float");
  EXPECT_EQ(slurp(ckpt), before) << "a failed run must not touch the previous checkpoint";
}

TEST(Generate, RecurrentSamplingMatchesTheFullForward) {
  const auto d = tiny_dims(2, 40, 8, 4);
  auto ps = random_model<double>(d, 5);
  Generator<double> gen(ps);
  std::vector<std::uint32_t> seq{3, 1, 4, 1, 5};
  gen.feed(seq);
  std::mt19937_64 rng(1);
  for (int i = 0; i < 6; ++i) {
    // Greedy next token from the full forward over the whole sequence so far.
    const index_t T = index_t(seq.size());
    auto tape = forward_tape<double>(ps, make_windows(seq, 1, T, d.vocab), nullptr,
                                     LayerActivations<double>::projections_only, false);
    auto last = Kokkos::subview(tape.ys[d.layers], Kokkos::make_pair(T - 1, T), Kokkos::ALL());
    View2<double> row("row", 1, d.width), logits("logits", 1, d.vocab);
    Kokkos::deep_copy(row, last);
    head_logits(ps.global(), row, logits);
    auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), logits);
    for (index_t v = 0; v < d.vocab; ++v) EXPECT_NEAR(gen.logits()[v], h(0, v), 1e-12);
    std::uint32_t best = 0;
    for (index_t v = 1; v < d.vocab; ++v)
      if (h(0, v) > h(0, best)) best = std::uint32_t(v);
    EXPECT_EQ(gen.sample(0.0, rng), best);
    seq.push_back(best);
  }
}

TEST(Generate, CliPrintsPromptAndSample) {
  const auto dir = tmp("gen");
  std::filesystem::remove_all(dir);
  ASSERT_EQ(run("init --set model.width=8 --set model.state=4 --out " + dir + "_model.h5").code, 0);
  const auto r = run("generate --checkpoint " + dir + "_model.h5 --prompt Hello --tokens 12 --seed 2");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(r.out.rfind("Hello", 0), 0u);
  EXPECT_EQ(r.out.size(), 5u + 12u + 1u);
  EXPECT_EQ(run("generate --checkpoint " + dir + "_model.h5 --prompt Hello --tokens 12 --seed 2").out, r.out);
}


// ash train on a Mamba with data.carry_state (and the levers): stopped after 3
// steps and resumed from its checkpoint, it is bitwise the uninterrupted run;
// the checkpoint holds the state [K, B·E, Kc−1+N], not zero. A checkpoint whose
// /train/carry_state has another width (an SSM-ResNet's N columns) is refused,
// exit 2, naming the dataset.
TEST(TrainMamba, ResumeWithCarriedStateIsBitwise) {
  const auto corpus = corpus_file();
  auto cfg = [&](const std::string& dir) {
    Config c;
    for (const auto& kv : {"model.arch=mamba", "model.width=8", "model.state=4", "model.layers=3", "model.expand=2",
                           "model.conv_kernel=4", "data.seq_len=32", "data.batch=2", "data.sequential=true",
                           "data.carry_state=true", "run.storage=bf16", "grad.layer_checkpoint=2",
                           "grad.token_block=16", "grad.engine=adjoint-exact", "grad.chunk=8", "optim.steps=6",
                           "optim.warmup=2", "run.log_every=1", "run.eval_every=3", "run.ckpt_every=3"})
      c.set(kv);
    c.set("data.train=" + corpus);
    c.set("run.out_dir=" + dir);
    return c;
  };
  const auto a = tmp("mamba_straight"), b = tmp("mamba_split");
  std::filesystem::remove_all(a);
  std::filesystem::remove_all(b);
  train(cfg(a), "", nullptr);
  train(cfg(b), "", nullptr, 3);
  const index_t E = 16, C = 3 + 4;  // expand·D, Kc−1 + N
  std::vector<View2<float>> st;
  for (int k = 0; k < 3; ++k) st.emplace_back("s", 2 * E, C);
  ASSERT_TRUE(load_carried_state(b + "/checkpoint.h5", st));
  for (const auto& v : st) {  // both parts of every layer's state are non-zero
    auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), v);
    double conv = 0, ssm = 0;
    for (index_t i = 0; i < 2 * E; ++i)
      for (index_t j = 0; j < C; ++j) (j < 3 ? conv : ssm) += std::fabs(h(i, j));
    EXPECT_GT(conv, 0.0);
    EXPECT_GT(ssm, 0.0);
  }
  train(cfg(b), b + "/checkpoint.h5", nullptr);
  const auto la = losses(a + "/metrics.jsonl"), lb = losses(b + "/metrics.jsonl");
  ASSERT_EQ(la.size(), 6u);
  EXPECT_EQ(la, lb);
  EXPECT_EQ(to_host(load_checkpoint<float>(a + "/checkpoint.h5")), to_host(load_checkpoint<float>(b + "/checkpoint.h5")));
  std::vector<View2<float>> sa(st.size(), View2<float>()), sb2;
  for (int k = 0; k < 3; ++k) {
    sa[std::size_t(k)] = View2<float>("a", 2 * E, C);
    sb2.emplace_back("b", 2 * E, C);
  }
  ASSERT_TRUE(load_carried_state(a + "/checkpoint.h5", sa));
  ASSERT_TRUE(load_carried_state(b + "/checkpoint.h5", sb2));
  for (int k = 0; k < 3; ++k) {
    auto ha = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), sa[std::size_t(k)]);
    auto hb = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), sb2[std::size_t(k)]);
    EXPECT_EQ(std::memcmp(ha.data(), hb.data(), ha.size() * sizeof(float)), 0) << "layer " << k << "'s state";
  }
  // The same model with a carried state of the SSM-ResNet's width: refused on resume, exit 2.
  const auto wrong = tmp("mamba_wrong_width.h5");
  const auto params = load_checkpoint<float>(b + "/checkpoint.h5");
  std::vector<View2<float>> narrow;
  for (int k = 0; k < 3; ++k) narrow.emplace_back("n", 2 * 8, 4);
  save_checkpoint(wrong, cfg(b), params, 3, 0, OptimizerState<float>{nullptr, nullptr, 0, &narrow, -1, 0});
  const auto r = run("train --resume " + wrong + " --set run.out_dir=" + tmp("mamba_wrong_run"));
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("/train/carry_state"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("expected [3,B*16,7]"), std::string::npos) << r.out;
}

}  // namespace ash::test
