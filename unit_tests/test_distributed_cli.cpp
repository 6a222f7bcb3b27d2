// `mpiexec -n N ash ...` end to end (docs/cli.md, MPI): gradients and training
// on several rank layouts equal one process; checkpoints reshard between
// layouts; bad layouts and a failing rank end every rank with one clear message.
#include <signal.h>

#include <chrono>
#include <filesystem>
#include <thread>

#include "cli_runner.hpp"
#include "test_helpers.hpp"

#ifndef ASH_MPIEXEC
#error "ASH_MPIEXEC must be the mpiexec command line (with its flags)"
#endif

namespace ash::test {

namespace {

// $ASH_MPIEXEC where set (a moved build: the GPU bundle's own Open MPI), else the line
// this test was built with.
std::string mpiexec_line() {
  const char* e = std::getenv("ASH_MPIEXEC");
  return e && *e ? e : ASH_MPIEXEC;
}

// A hang fails instead of stalling: `timeout` ends mpiexec after 120 s (exit 124).
CliResult mpirun(int n, const std::string& args, const std::string& env = "") {
  return run_shell(env + " timeout 120 " + mpiexec_line() + " -n " + std::to_string(n) + " " +
                   std::string(cli_path()) + " " + args);
}

std::size_t count(const std::string& hay, const std::string& needle) {
  std::size_t n = 0;
  for (auto at = hay.find(needle); at != std::string::npos; at = hay.find(needle, at + 1)) ++n;
  return n;
}

std::vector<double> losses(const std::string& run_dir) {
  std::ifstream in(run_dir + "/metrics.jsonl");
  std::vector<double> out;
  for (std::string line; std::getline(in, line);) out.push_back(nlohmann::json::parse(line).at("loss").get<double>());
  return out;
}

std::vector<double> grad_norms(const std::string& run_dir) {
  std::ifstream in(run_dir + "/metrics.jsonl");
  std::vector<double> out;
  for (std::string line; std::getline(in, line);)
    out.push_back(nlohmann::json::parse(line).at("grad_norm").get<double>());
  return out;
}

// The gradient file `path` (`ash grad --out`) against the reference gradient
// `ref` and its L2 norm `l_ref`, both to 1e-12.
void expect_gradients(const std::string& path, const ModelDims& d, const std::vector<double>& ref, double l_ref,
                      const std::string& what) {
  double l = 0;
  expect_close(to_host(load_gradients(path, d, &l)), ref, d, 1e-12, what);
  EXPECT_NEAR(l, l_ref, 1e-12 * l_ref) << what;
}

void expect_same_losses(const std::vector<double>& got, const std::vector<double>& ref, const std::string& what) {
  ASSERT_EQ(got.size(), ref.size()) << what;
  for (std::size_t i = 0; i < ref.size(); ++i)
    EXPECT_NEAR(got[i], ref[i], 1e-12 * std::abs(ref[i])) << what << " step " << i + 1;
}

class DistributedCli : public ::testing::Test {
 protected:
  void SetUp() override {
    text = tmp_path("corpus.txt");
    std::string s;
    for (int i = 0; i < 60; ++i) s += "a stitch in time saves nine; many hands make light work. ";
    write(text, s);
    train = "train --set data.train=" + text +
            " --set model.width=8 --set model.state=4 --set model.layers=5 --set data.seq_len=24 --set data.batch=4"
            " --set optim.steps=6 --set optim.warmup=2 --set run.log_every=1 --set run.eval_every=3"
            " --set run.precision=double --set grad.engine=adjoint-exact --set grad.chunk=4";
  }
  // " --set run.out_dir=<tmp>/name", the folder removed first.
  static std::string out_dir(const std::string& name) {
    std::filesystem::remove_all(tmp_path(name));
    return " --set run.out_dir=" + tmp_path(name);
  }
  // `ash train args` in one process into the folder `name`: its losses, one per step.
  std::vector<double> one_process_losses(const std::string& args, const std::string& name) {
    const auto r = run(args + out_dir(name));
    EXPECT_EQ(r.code, 0) << r.out;
    return losses(tmp_path(name));
  }
  void expect_kind_on_every_layout(const std::string& arch, const std::string& tag);
  std::string text, train;
};

}  // namespace

TEST_F(DistributedCli, GradMatchesOneProcessAndReportsEveryRank) {
  const auto ckpt = tmp_path("m.h5"), one = tmp_path("one.h5"), two = tmp_path("two.h5");
  ASSERT_EQ(run("init --set model.width=8 --set model.state=4 --set model.layers=3 --set data.seq_len=40 "
                "--set data.batch=2 --out " +
                ckpt)
                .code,
            0);
  const auto g = "grad --checkpoint " + ckpt + " --tokens " + text + " --engine adjoint-exact --chunk 4 ";
  ASSERT_EQ(run(g + "--out " + one).code, 0);
  const auto r = mpirun(2, g + "--set dist.layer_ranks=2 --out " + two);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("on 2 layer rank(s) x 1 data rank(s), exact mode"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("rank 0 (layers 0..1, embedding"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("rank 1 (layers 2..2, head"), std::string::npos) << r.out;
  EXPECT_EQ(count(r.out, "loss "), 1u) << "only rank 0 prints:\n" << r.out;
  double l1 = 0, l2 = 0;
  const auto d = inspect_checkpoint(ckpt).dims;
  const auto a = to_host(load_gradients(one, d, &l1)), b = to_host(load_gradients(two, d, &l2));
  EXPECT_NEAR(l2, l1, 1e-12 * l1);
  expect_close(b, a, d, 1e-12, "R=2");
  // Context parallelism: each rank one half of every window.
  const auto seq = tmp_path("seq.h5");
  const auto rs = mpirun(2, g + "--set dist.seq_ranks=2 --out " + seq);
  ASSERT_EQ(rs.code, 0) << rs.out;
  EXPECT_NE(rs.out.find("rank 1 (layers 0..2, embedding, head, tokens 20..39"), std::string::npos) << rs.out;
  double ls = 0;
  expect_close(to_host(load_gradients(seq, d, &ls)), a, d, 1e-12, "S=2");
  EXPECT_NEAR(ls, l1, 1e-12 * l1);
  // The paper's window across the two ranges (a halo of T-bar - 1 tokens), alone and with layer
  // checkpointing (each range in one block), and bf16 + layer checkpointing on R = 2.
  for (const std::string extra : {std::string("--detach-inputs --truncate 7 "),
                                  std::string("--detach-inputs --truncate 7 --set grad.layer_checkpoint=2 "),
                                  std::string("--set run.storage=bf16 --set grad.layer_checkpoint=2 "
                                              "--set grad.token_block=8 ")}) {
    const bool window = extra.find("truncate") != std::string::npos;
    const auto ref = tmp_path("ref_x.h5"), got = tmp_path("got_x.h5");
    ASSERT_EQ(run(g + extra + "--out " + ref).code, 0);
    const auto rx =
        mpirun(2, g + extra + (window ? "--set dist.seq_ranks=2" : "--set dist.layer_ranks=2") + " --out " + got);
    ASSERT_EQ(rx.code, 0) << rx.out;
    double lr = 0;
    const auto want = to_host(load_gradients(ref, d, &lr));
    expect_gradients(got, d, want, lr, extra);
  }
}

// Six steps: the same losses on every layout (sequence ranks included),
// resharded resumes (1 -> 3, 2x2 -> 1, 4 -> 2), and a same-layout resume bit for bit.
TEST_F(DistributedCli, TrainingMatchesOneProcessAcrossLayoutsAndReshards) {
  ASSERT_EQ(run(train + out_dir("one")).code, 0);
  const auto ref = losses(tmp_path("one"));
  ASSERT_EQ(ref.size(), 6u);
  struct Run {
    int n, R, S;
  };
  for (const auto& [n, R, S] : {Run{2, 2, 1}, Run{4, 2, 1}, Run{3, 3, 1}, Run{2, 1, 2}, Run{4, 2, 2}}) {
    const auto name = "n" + std::to_string(n) + "R" + std::to_string(R) + (S > 1 ? "S" + std::to_string(S) : "");
    const auto r = mpirun(n, train + out_dir(name) + " --set dist.layer_ranks=" + std::to_string(R) +
                                 " --set dist.seq_ranks=" + std::to_string(S));
    ASSERT_EQ(r.code, 0) << r.out;
    expect_same_losses(losses(tmp_path(name)), ref, name);
  }
  struct Hop {
    int n_a, R_a, n_b, R_b;
  };
  for (const auto& h : {Hop{1, 1, 3, 3}, Hop{4, 2, 1, 1}, Hop{4, 4, 2, 2}, Hop{2, 2, 2, 2}}) {
    const auto a =
        "a" + std::to_string(h.n_a) + std::to_string(h.R_a) + "_" + std::to_string(h.n_b) + std::to_string(h.R_b);
    const auto b = "b" + a.substr(1);
    const auto ra = mpirun(h.n_a, train + out_dir(a) + " --until 3 --set dist.layer_ranks=" + std::to_string(h.R_a));
    ASSERT_EQ(ra.code, 0) << ra.out;
    const auto rb = mpirun(h.n_b, train + out_dir(b) + " --resume " + tmp_path(a) +
                                      "/checkpoint.h5 --set dist.layer_ranks=" + std::to_string(h.R_b));
    ASSERT_EQ(rb.code, 0) << rb.out;
    auto both = losses(tmp_path(a));
    for (double l : losses(tmp_path(b))) both.push_back(l);
    expect_same_losses(both, ref, a + " then " + b);
    if (h.n_a == h.n_b && h.R_a == h.R_b) {
      EXPECT_EQ(both, losses(tmp_path("n2R2"))) << "same-layout resume is bitwise";
    }
  }
}

// A Mamba on data and layer ranks: `ash grad` for E1, E2 (truncated too; whole windows) and
// E3 (exact, detached, windowed; the block-wise pipeline, with the memory levers too), tied
// and untied embeddings, equals one process; training on 2 and 4 ranks gives one process's
// losses and resumes across layouts, with levers too.
TEST_F(DistributedCli, MambaOnDataAndLayerRanksMatchesOneProcess) {
  const std::string dims =
      "--set model.arch=mamba --set model.width=8 --set model.state=4 --set model.layers=3 "
      "--set data.seq_len=24 --set data.batch=4 ";
  for (const bool tied : {true, false}) {
    const std::string tie = std::string("--set model.tie_embeddings=") + (tied ? "true " : "false ");
    const auto ckpt = tmp_path(tied ? "mt.h5" : "mu.h5");
    ASSERT_EQ(run("init " + dims + tie + "--out " + ckpt).code, 0);
    const auto d = inspect_checkpoint(ckpt).dims;
    ASSERT_TRUE(d.mamba() && d.tie_embeddings == tied);
    const auto g = "grad --checkpoint " + ckpt + " --tokens " + text + " --set data.batch=4 --chunk 4 ";
    for (const std::string engine :
         {std::string("--engine backprop "), std::string("--engine adjoint "),
          std::string("--engine adjoint --truncate 7 "), std::string("--engine adjoint-exact "),
          std::string("--engine adjoint-exact --detach-inputs "),
          std::string("--engine adjoint-exact --detach-inputs --truncate 7 ")}) {
      const auto one = tmp_path("m_one.h5");
      ASSERT_EQ(run(g + engine + "--out " + one).code, 0) << engine;
      double l1 = 0;
      const auto a = to_host(load_gradients(one, d, &l1));
      struct Lay {
        int n, R, D;
      };
      for (const auto& [n, R, D] : {Lay{2, 2, 1}, Lay{2, 1, 2}, Lay{4, 2, 2}, Lay{3, 3, 1}}) {
        if (!tied && n != 2) continue;  // untied: the two np 2 layouts suffice
        const auto what = engine + (tied ? "tied" : "untied") + " n" + std::to_string(n) + " R" + std::to_string(R);
        const auto got = tmp_path("m_got.h5");
        const auto r = mpirun(n, g + engine + "--set dist.layer_ranks=" + std::to_string(R) + " --out " + got);
        ASSERT_EQ(r.code, 0) << what << "\n" << r.out;
        EXPECT_NE(r.out.find("on " + std::to_string(R) + " layer rank(s) x " + std::to_string(D) + " data rank(s)"),
                  std::string::npos)
            << r.out;
        expect_gradients(got, d, a, l1, what);
      }
    }
    // E3's memory levers (the block-wise pipeline on each rank's layers) equal one process
    // with the same levers; bf16 with layer checkpointing on R = 2 only (R = 3 starts
    // ranges off the checkpoint grid: within the 16-bit bound, test_distributed's).
    for (const std::string lever : {std::string("--set grad.token_block=5 --set grad.layer_checkpoint=2 "),
                                    std::string("--set run.storage=bf16 --set grad.token_block=8 "),
                                    std::string("--set run.storage=bf16 --set grad.layer_checkpoint=2 "
                                                "--set grad.token_block=8 --detach-inputs ")}) {
      const auto one = tmp_path("m_lev_one.h5");
      const auto e3 = g + "--engine adjoint-exact " + lever;
      ASSERT_EQ(run(e3 + "--out " + one).code, 0) << lever;
      double l1 = 0;
      const auto a = to_host(load_gradients(one, d, &l1));
      for (const auto& [n, R] : {std::pair{2, 2}, std::pair{4, 2}, std::pair{3, 3}}) {
        if (R == 3 && lever.find("layer_checkpoint=2 --set grad.token_block=8") != std::string::npos) continue;
        if (!tied && n != 2) continue;
        const auto what = lever + (tied ? "tied" : "untied") + " n" + std::to_string(n) + " R" + std::to_string(R);
        const auto got = tmp_path("m_lev_got.h5");
        const auto r = mpirun(n, e3 + "--set dist.layer_ranks=" + std::to_string(R) + " --out " + got);
        ASSERT_EQ(r.code, 0) << what << "\n" << r.out;
        EXPECT_NE(r.out.find("storage, layer checkpoint"), std::string::npos) << r.out;
        expect_gradients(got, d, a, l1, what);
      }
    }
  }
  // Training: one process, then 2 layer ranks, 2 data ranks and 2 x 2; a resume from 2 layer
  // ranks on 4 ranks (2 x 2) continues one process's losses.
  const std::string mtrain = train + " --set model.arch=mamba --set model.layers=3";
  ASSERT_EQ(run(mtrain + out_dir("mamba1")).code, 0);
  const auto ref = losses(tmp_path("mamba1"));
  ASSERT_EQ(ref.size(), 6u);
  for (const auto& [n, R] : {std::pair{2, 2}, std::pair{2, 1}, std::pair{4, 2}}) {
    const auto name = "mamba_n" + std::to_string(n) + "R" + std::to_string(R);
    const auto r = mpirun(n, mtrain + out_dir(name) + " --set dist.layer_ranks=" + std::to_string(R));
    ASSERT_EQ(r.code, 0) << r.out;
    expect_same_losses(losses(tmp_path(name)), ref, name);
    // The norm under the clip: a tied embedding's copy on the last layer rank counts once.
    expect_same_losses(grad_norms(tmp_path(name)), grad_norms(tmp_path("mamba1")), name + " grad_norm");
  }
  const auto ra = mpirun(2, mtrain + out_dir("mamba_a") + " --until 3 --set dist.layer_ranks=2");
  ASSERT_EQ(ra.code, 0) << ra.out;
  const auto rb = mpirun(
      4, mtrain + out_dir("mamba_b") + " --resume " + tmp_path("mamba_a") + "/checkpoint.h5 --set dist.layer_ranks=2");
  ASSERT_EQ(rb.code, 0) << rb.out;
  auto both = losses(tmp_path("mamba_a"));
  for (double l : losses(tmp_path("mamba_b"))) both.push_back(l);
  expect_same_losses(both, ref, "mamba R=2 then 2 x 2");
  // With the memory levers: 2 layer ranks equal one process; stopped on 2 layer ranks,
  // resumed on 2 data ranks, the losses continue one process's.
  const std::string mlev = mtrain + " --set run.storage=bf16 --set grad.layer_checkpoint=2 --set grad.token_block=8";
  ASSERT_EQ(run(mlev + out_dir("mamba_lev1")).code, 0);
  const auto lref = losses(tmp_path("mamba_lev1"));
  ASSERT_EQ(lref.size(), 6u);
  const auto rl = mpirun(2, mlev + out_dir("mamba_lev2") + " --set dist.layer_ranks=2");
  ASSERT_EQ(rl.code, 0) << rl.out;
  EXPECT_NE(rl.out.find("bf16 storage, layer checkpoint 2"), std::string::npos) << rl.out;
  expect_same_losses(losses(tmp_path("mamba_lev2")), lref, "mamba levers R=2");
  ASSERT_EQ(mpirun(2, mlev + out_dir("mamba_lev_a") + " --until 3 --set dist.layer_ranks=2").code, 0);
  const auto rlb = mpirun(2, mlev + out_dir("mamba_lev_b") + " --resume " + tmp_path("mamba_lev_a") +
                                 "/checkpoint.h5 --set dist.layer_ranks=1");
  ASSERT_EQ(rlb.code, 0) << rlb.out;
  auto lboth = losses(tmp_path("mamba_lev_a"));
  for (double l : losses(tmp_path("mamba_lev_b"))) lboth.push_back(l);
  expect_same_losses(lboth, lref, "mamba levers R=2 then D=2");
}

// A Mamba on sequence ranks (issue 34): `ash grad` with S = 2, 3, 4 (with layer
// and data ranks too), exact and detached, without a lever and with each,
// tied and untied, equals one process with the same options; training with
// S = 2 and S = 2 x R = 2 gives one process's losses and norms and resumes
// across layouts; a window T̄ (S = 2, 3, 4 in grad; S = 2 in train) too.
TEST_F(DistributedCli, MambaOnSequenceRanksMatchesOneProcess) {
  const std::string dims =
      "--set model.arch=mamba --set model.width=8 --set model.state=4 --set model.layers=3 "
      "--set data.seq_len=24 --set data.batch=4 --set model.conv_kernel=4 ";
  for (const bool tied : {true, false}) {
    const std::string tie = std::string("--set model.tie_embeddings=") + (tied ? "true " : "false ");
    const auto ckpt = tmp_path(tied ? "mst.h5" : "msu.h5");
    ASSERT_EQ(run("init " + dims + tie + "--out " + ckpt).code, 0);
    const auto d = inspect_checkpoint(ckpt).dims;
    const auto g = "grad --checkpoint " + ckpt + " --tokens " + text + " --set data.batch=4 --chunk 4 ";
    for (const std::string opts :
         {std::string("--engine adjoint-exact "), std::string("--engine adjoint-exact --detach-inputs "),
          std::string("--engine adjoint-exact --set grad.token_block=8 --set grad.layer_checkpoint=2 "),
          std::string("--engine adjoint-exact --set run.storage=bf16 --set grad.token_block=4 "),
          std::string("--engine adjoint-exact --detach-inputs --set grad.truncate=5 ")}) {
      const auto one = tmp_path("ms_one.h5");
      ASSERT_EQ(run(g + opts + "--out " + one).code, 0) << opts;
      double l1 = 0;
      const auto a = to_host(load_gradients(one, d, &l1));
      struct Lay {
        int n, R, S, D;
      };
      for (const auto& [n, R, S, D] :
           {Lay{2, 1, 2, 1}, Lay{3, 1, 3, 1}, Lay{4, 2, 2, 1}, Lay{4, 1, 4, 1}, Lay{4, 1, 2, 2}}) {
        if (!tied && n != 4) continue;  // untied: the layouts of 4 ranks suffice
        const auto what = opts + (tied ? "tied" : "untied") + " n" + std::to_string(n) + " R" + std::to_string(R) +
                          " S" + std::to_string(S);
        const auto got = tmp_path("ms_got.h5");
        const auto r = mpirun(n, g + opts + "--set dist.layer_ranks=" + std::to_string(R) +
                                     " --set dist.seq_ranks=" + std::to_string(S) + " --out " + got);
        ASSERT_EQ(r.code, 0) << what << "\n" << r.out;
        EXPECT_NE(r.out.find("on " + std::to_string(R) + " layer rank(s) x " + std::to_string(S) +
                             " sequence rank(s) x " + std::to_string(D) + " data rank(s)"),
                  std::string::npos)
            << r.out;
        expect_gradients(got, d, a, l1, what);
      }
    }
  }
  for (const std::string levers : {std::string(), std::string(" --set run.storage=bf16 --set grad.token_block=8")}) {
    const std::string mtrain = train + " --set model.arch=mamba --set model.layers=3" + levers;
    const std::string tag = levers.empty() ? "mseq" : "mseq_lev";
    ASSERT_EQ(run(mtrain + out_dir(tag + "1")).code, 0);
    const auto ref = losses(tmp_path(tag + "1"));
    ASSERT_EQ(ref.size(), 6u);
    for (const auto& [n, R] : {std::pair{2, 1}, std::pair{4, 2}}) {
      const auto name = tag + "_n" + std::to_string(n) + "R" + std::to_string(R);
      const auto r =
          mpirun(n, mtrain + out_dir(name) + " --set dist.seq_ranks=2 --set dist.layer_ranks=" + std::to_string(R));
      ASSERT_EQ(r.code, 0) << r.out;
      expect_same_losses(losses(tmp_path(name)), ref, name);
      // The norm under the clip: a tied embedding's copy on the last layer rank counts once.
      expect_same_losses(grad_norms(tmp_path(name)), grad_norms(tmp_path(tag + "1")), name + " grad_norm");
    }
    // Three steps on S = 2, then a resume on S = 2 x R = 2 continues one process's losses.
    const auto ra = mpirun(2, mtrain + out_dir(tag + "_a") + " --until 3 --set dist.seq_ranks=2");
    ASSERT_EQ(ra.code, 0) << ra.out;
    const auto rb = mpirun(4, mtrain + out_dir(tag + "_b") + " --resume " + tmp_path(tag + "_a") +
                                  "/checkpoint.h5 --set dist.seq_ranks=2 --set dist.layer_ranks=2");
    ASSERT_EQ(rb.code, 0) << rb.out;
    auto both = losses(tmp_path(tag + "_a"));
    for (double l : losses(tmp_path(tag + "_b"))) both.push_back(l);
    expect_same_losses(both, ref, tag + " S=2 then S=2 x R=2");
  }
  // A window T̄ on sequence ranks (halos of y, g and the conv) trains as one process does.
  const std::string wtrain = train +
                             " --set model.arch=mamba --set model.layers=3 --set grad.detach_inputs=true "
                             "--set grad.truncate=6";
  ASSERT_EQ(run(wtrain + out_dir("mamba_w1")).code, 0);
  const auto rs = mpirun(2, wtrain + " --set dist.seq_ranks=2" + out_dir("mamba_seq_w"));
  ASSERT_EQ(rs.code, 0) << rs.out;
  expect_same_losses(losses(tmp_path("mamba_seq_w")), losses(tmp_path("mamba_w1")), "mamba window S=2");
}

// A Mamba with data.carry_state (issue 34: the conv state and h of every block,
// [Bt·E, Kc−1+N] per layer) trains on 2 sequence ranks, 2 data ranks and 2 × 2
// with one process's losses and norms, without and with levers; a run stopped
// on one layout resumes on another from its checkpoint's /train/carry_state
// (gathered from the ranks' rows, read back by every rank) and continues one
// process's losses.
TEST_F(DistributedCli, MambaCarriedStateTrainsAndResumesAcrossLayouts) {
  const std::string mamba = train +
                            " --set model.arch=mamba --set model.layers=3 --set model.conv_kernel=4"
                            " --set data.sequential=true --set data.carry_state=true";
  for (const std::string levers : {std::string(), std::string(" --set run.storage=bf16 --set grad.token_block=8")}) {
    const std::string mtrain = mamba + levers, tag = levers.empty() ? "mcarry" : "mcarry_lev";
    const auto ref = one_process_losses(mtrain, tag + "1");
    ASSERT_EQ(ref.size(), 6u);
    struct Lay {
      int n, R, S;
    };
    for (const auto& [n, R, S] : {Lay{2, 1, 2}, Lay{2, 1, 1}, Lay{4, 2, 2}}) {
      const auto name = tag + "_n" + std::to_string(n) + "R" + std::to_string(R) + "S" + std::to_string(S);
      const auto r = mpirun(n, mtrain + out_dir(name) + " --set dist.layer_ranks=" + std::to_string(R) +
                                   " --set dist.seq_ranks=" + std::to_string(S));
      ASSERT_EQ(r.code, 0) << r.out;
      EXPECT_NE(r.out.find("carried state) on " + std::to_string(R) + " layer rank(s)"), std::string::npos) << r.out;
      expect_same_losses(losses(tmp_path(name)), ref, name);
      expect_same_losses(grad_norms(tmp_path(name)), grad_norms(tmp_path(tag + "1")), name + " grad_norm");
    }
    // Three steps on 2 sequence ranks, resumed on 2 data ranks (and the other way round).
    for (const auto& [from, to] : {std::pair<std::string, std::string>{" --set dist.seq_ranks=2", ""},
                                   std::pair<std::string, std::string>{"", " --set dist.seq_ranks=2"}}) {
      const std::string a = tag + (from.empty() ? "_da" : "_sa"), b = tag + (from.empty() ? "_db" : "_sb");
      const auto ra = mpirun(2, mtrain + out_dir(a) + " --until 3" + from);
      ASSERT_EQ(ra.code, 0) << ra.out;
      const auto rb = mpirun(2, mtrain + out_dir(b) + " --resume " + tmp_path(a) + "/checkpoint.h5" + to);
      ASSERT_EQ(rb.code, 0) << rb.out;
      auto both = losses(tmp_path(a));
      for (double l : losses(tmp_path(b))) both.push_back(l);
      expect_same_losses(both, ref, tag + (from.empty() ? " D=2 then S=2" : " S=2 then D=2"));
    }
  }
}

// A kind built on the Mamba kind's members (FalconMamba: the mixer's norms;
// Mamba-2: the SSD block) on every kind of layout: `ash grad` for E1, E2
// truncated, E3 exact, detached-windowed and with the levers on layer, data and
// sequence ranks equals one process; training with a carried state on 2
// sequence ranks and on 2 layer x 2 sequence ranks gives one process's losses
// and norms. arch: the model's --set keys; tag: the files' prefix.
void DistributedCli::expect_kind_on_every_layout(const std::string& arch, const std::string& tag) {
  const std::string dims = arch +
                           " --set model.width=8 --set model.state=4 --set model.layers=3 "
                           "--set data.seq_len=24 --set data.batch=4 --set model.conv_kernel=4 ";
  const auto ckpt = tmp_path(tag + ".h5");
  ASSERT_EQ(run("init " + dims + "--out " + ckpt).code, 0);
  const auto d = inspect_checkpoint(ckpt).dims;
  ASSERT_TRUE(d.mamba());
  const auto g = "grad --checkpoint " + ckpt + " --tokens " + text + " --set data.batch=4 --chunk 4 ";
  struct Lay {
    int n, R, S, D;
  };
  struct Case {
    std::string opts;
    std::vector<Lay> layouts;
  };
  const std::vector<Lay> all{Lay{2, 2, 1, 1}, Lay{2, 1, 1, 2}, Lay{2, 1, 2, 1}, Lay{4, 2, 2, 1}};
  const std::vector<Lay> layer_data{Lay{2, 2, 1, 1}, Lay{4, 2, 1, 2}};
  for (const auto& c :
       {Case{"--engine backprop ", layer_data}, Case{"--engine adjoint --truncate 7 ", layer_data},
        Case{"--engine adjoint-exact ", all}, Case{"--engine adjoint-exact --detach-inputs --truncate 5 ", all},
        Case{"--engine adjoint-exact --set grad.token_block=5 --set grad.layer_checkpoint=2 ", all}}) {
    const auto one = tmp_path(tag + "_one.h5");
    ASSERT_EQ(run(g + c.opts + "--out " + one).code, 0) << c.opts;
    double l1 = 0;
    const auto a = to_host(load_gradients(one, d, &l1));
    for (const auto& [n, R, S, D] : c.layouts) {
      const auto what =
          tag + " " + c.opts + "n" + std::to_string(n) + " R" + std::to_string(R) + " S" + std::to_string(S);
      const auto got = tmp_path(tag + "_got.h5");
      const auto r = mpirun(n, g + c.opts + "--set dist.layer_ranks=" + std::to_string(R) +
                                   " --set dist.seq_ranks=" + std::to_string(S) + " --out " + got);
      ASSERT_EQ(r.code, 0) << what << "\n" << r.out;
      EXPECT_NE(r.out.find(std::to_string(D) + " data rank(s)"), std::string::npos) << r.out;
      expect_gradients(got, d, a, l1, what);
    }
  }
  const std::string ktrain = train + " " + arch +
                             " --set model.layers=3 --set model.conv_kernel=4"
                             " --set data.sequential=true --set data.carry_state=true";
  const auto ref = one_process_losses(ktrain, tag + "carry1");
  ASSERT_EQ(ref.size(), 6u);
  for (const auto& [n, R] : {std::pair{2, 1}, std::pair{4, 2}}) {
    const auto name = tag + "carry_n" + std::to_string(n) + "R" + std::to_string(R);
    const auto r =
        mpirun(n, ktrain + out_dir(name) + " --set dist.seq_ranks=2 --set dist.layer_ranks=" + std::to_string(R));
    ASSERT_EQ(r.code, 0) << r.out;
    expect_same_losses(losses(tmp_path(name)), ref, name);
    expect_same_losses(grad_norms(tmp_path(name)), grad_norms(tmp_path(tag + "carry1")), name + " grad_norm");
  }
}

TEST_F(DistributedCli, FalconMambaOnLayerDataAndSequenceRanksMatchesOneProcess) {
  expect_kind_on_every_layout("--set model.arch=falcon_mamba", "fm");
}

TEST_F(DistributedCli, Mamba2OnLayerDataAndSequenceRanksMatchesOneProcess) {
  expect_kind_on_every_layout("--set model.arch=mamba2 --set model.head_dim=4", "m2");
}

// The memory levers under rank layouts (bf16 storage, layer checkpointing,
// token blocks, a carried state): training equals one process, and a
// checkpoint with a carried state resumes on another layout.
TEST_F(DistributedCli, MemoryLeversTrainAndResumeAcrossLayouts) {
  const std::string levers = train +
                             " --set run.storage=bf16 --set grad.layer_checkpoint=3 --set grad.token_block=8"
                             " --set data.sequential=true --set data.carry_state=true";
  ASSERT_EQ(run(levers + out_dir("lev1")).code, 0);
  const auto ref = losses(tmp_path("lev1"));
  ASSERT_EQ(ref.size(), 6u);
  struct Run {
    int n, R;
  };
  for (const auto& [n, R] : {Run{2, 2}, Run{2, 1}, Run{4, 2}}) {
    const auto name = "lev_n" + std::to_string(n) + "R" + std::to_string(R);
    const auto r = mpirun(n, levers + out_dir(name) + " --set dist.layer_ranks=" + std::to_string(R));
    ASSERT_EQ(r.code, 0) << r.out;
    EXPECT_NE(r.out.find("bf16 storage, layer checkpoint 3, carried state"), std::string::npos) << r.out;
    expect_same_losses(losses(tmp_path(name)), ref, name);
  }
  // Stop after 3 steps on 2 layer ranks, resume on 2 data ranks: the carried state crosses layouts.
  ASSERT_EQ(mpirun(2, levers + out_dir("lev_a") + " --until 3 --set dist.layer_ranks=2").code, 0);
  const auto rb = mpirun(
      2, levers + out_dir("lev_b") + " --resume " + tmp_path("lev_a") + "/checkpoint.h5 --set dist.layer_ranks=1");
  ASSERT_EQ(rb.code, 0) << rb.out;
  auto both = losses(tmp_path("lev_a"));
  for (double l : losses(tmp_path("lev_b"))) both.push_back(l);
  expect_same_losses(both, ref, "R=2 then D=2 with a carried state");
}

TEST_F(DistributedCli, BadLayoutsAndAFailingRankEndEveryRankWithOneMessage) {
  const auto ckpt = tmp_path("m.h5");
  ASSERT_EQ(run("init --set model.width=8 --set model.state=4 --set model.layers=2 --set data.seq_len=32 "
                "--set data.batch=2 --out " +
                ckpt)
                .code,
            0);
  const auto g =
      "grad --checkpoint " + ckpt + " --tokens " + text + " --engine adjoint-exact --out " + tmp_path("g.h5");
  struct Case {
    int n;
    std::string args, env, needle;
  };
  for (const auto& c : {Case{3, " --set dist.layer_ranks=2", "", "not a multiple of dist.layer_ranks"},
                        Case{2, " --set dist.layer_ranks=2 --set dist.data_ranks=2", "", "the world has 2 ranks"},
                        Case{3, " --set dist.layer_ranks=3", "", "must not exceed model.layers"},
                        Case{3, " --set dist.seq_ranks=3 --set run.storage=bf16 --detach-inputs --truncate 20", "",
                             "each range needs >= T-bar - 1 tokens"},
                        Case{3, " --set dist.seq_ranks=3 --set data.seq_len=2", "", "would leave a token range empty"},
                        Case{2, " --set dist.layer_ranks=2", "ASH_DEBUG_FAIL_RANK=1", "injected failure on rank 1"},
                        Case{2, " --set dist.layer_ranks=2", "ASH_DEBUG_FAIL_RANK=0", "injected failure on rank 0"}}) {
    const auto t0 = std::chrono::steady_clock::now();
    const auto r = mpirun(c.n, g + c.args, c.env);
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_NE(r.code, 0) << r.out;
    EXPECT_NE(r.code, 124) << "hung:\n" << r.out;
    EXPECT_LT(secs, 60.0) << r.out;
    EXPECT_EQ(count(r.out, c.needle), 1u) << "printed once:\n" << r.out;
    EXPECT_EQ(r.out.find("internal error"), std::string::npos) << r.out;
  }
}

// docs/design.md §7 under MPI: a second run on a locked directory ends every
// rank with one error; SIGTERM to mpiexec (forwarded to every rank) stops all
// ranks after the same step with a checkpoint of that step.
// The run-directory lock holds across ranks: a second `mpiexec ... ash train`
// on the same directory fails at once, naming the holder. (A SIGTERM to
// mpiexec is not checked here: Open MPI forwards it and may kill the ranks
// before they finish the step, so the graceful stop of docs/design.md §7 is
// tested on one process, in test_reliability_runs.)
TEST_F(DistributedCli, LockIsHeldByTheWholeRun) {
  const auto dir = tmp_path("lock");
  std::filesystem::remove_all(dir);
  const auto args = "train --set data.train=" + text +
                    " --set model.width=8 --set model.state=4 --set model.layers=2 --set data.seq_len=24"
                    " --set optim.steps=100000000 --set run.log_every=100000000 --set run.ckpt_every=0"
                    " --set run.eval_every=0 --set dist.layer_ranks=2 --set run.out_dir=" +
                    dir;
  // `exec` keeps the shell's PID for the job, so $$ names it. Progress is read
  // from metrics.jsonl, not stdout (an unread pipe full of progress lines would
  // block the job); `timeout` bounds the run whatever happens.
  const std::string cmd =
      "echo $$; exec timeout -k 10 240 " + mpiexec_line() + " -n 2 " + std::string(cli_path()) + " " + args + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  ASSERT_NE(p, nullptr);
  char buf[4096];
  ASSERT_NE(fgets(buf, sizeof buf, p), nullptr);
  const pid_t pid = pid_t(std::stol(buf));
  auto steps_logged = [&] {
    std::ifstream in(dir + "/metrics.jsonl");
    std::size_t n = 0;
    for (std::string row; std::getline(in, row);) ++n;
    return n;
  };
  for (int i = 0; i < 600 && steps_logged() < 1; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_GE(steps_logged(), 1u) << "the first run logged no step in 60 s";
  const auto second = mpirun(2, args);
  EXPECT_EQ(second.code, 2) << second.out;
  EXPECT_EQ(count(second.out, "is in use by another ash train (PID"), 1u) << second.out;
  ::kill(pid, SIGTERM);  // timeout passes it to mpiexec, which ends the job
  while (fgets(buf, sizeof buf, p)) {
  }
  pclose(p);
}

// A batch system's warning before the time limit (Slurm's --signal=USR1@N
// reaches every rank; here mpiexec forwards it): every rank finishes the same
// step, rank 0 writes that step's checkpoint once, the job exits 138 and the
// checkpoint resumes.
TEST_F(DistributedCli, Sigusr1StopsEveryRankAfterTheSameStepWithACheckpoint) {
  const auto dir = tmp_path("usr1");
  std::filesystem::remove_all(dir);
  const auto args = "train --set data.train=" + text +
                    " --set model.width=8 --set model.state=4 --set model.layers=2 --set data.seq_len=24"
                    " --set optim.steps=100000000 --set run.log_every=100000000 --set run.ckpt_every=0"
                    " --set run.eval_every=0 --set dist.layer_ranks=2 --set run.out_dir=" +
                    dir;
  const std::string cmd =
      "echo $$; exec timeout -k 10 240 " + mpiexec_line() + " -n 2 " + std::string(cli_path()) + " " + args + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  ASSERT_NE(p, nullptr);
  char buf[4096];
  ASSERT_NE(fgets(buf, sizeof buf, p), nullptr);
  const pid_t timeout_pid = pid_t(std::stol(buf));
  auto steps_logged = [&] {
    std::ifstream in(dir + "/metrics.jsonl");
    std::size_t n = 0;
    for (std::string row; std::getline(in, row);) ++n;
    return n;
  };
  for (int i = 0; i < 600 && steps_logged() < 3; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  ASSERT_GE(steps_logged(), 3u) << "no steps logged in 60 s";
  // mpiexec is timeout's child; it forwards SIGUSR1 to every rank.
  const auto child = run_shell("pgrep -P " + std::to_string(timeout_pid));
  ASSERT_EQ(child.code, 0) << child.out;
  ::kill(pid_t(std::stol(child.out)), SIGUSR1);
  std::string out;
  while (fgets(buf, sizeof buf, p)) out += buf;
  const int st = pclose(p);
  ASSERT_TRUE(WIFEXITED(st)) << out;
  EXPECT_EQ(WEXITSTATUS(st), 138) << out;
  EXPECT_EQ(count(out, "interrupted by SIGUSR1 after step"), 1u) << out;
  CheckpointInfo info;
  ash::load_checkpoint<float>(dir + "/checkpoint.h5", &info);
  EXPECT_EQ(std::int64_t(steps_logged()), info.step) << "the checkpoint is the last step logged";
  const auto resumed =
      mpirun(2, "train --resume " + dir +
                    "/checkpoint.h5 --set dist.layer_ranks=2 --set optim.steps=" + std::to_string(info.step + 2));
  EXPECT_EQ(resumed.code, 0) << resumed.out;
}

}  // namespace ash::test
