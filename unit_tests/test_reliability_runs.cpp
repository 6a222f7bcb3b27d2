// Reliability (docs/design.md §7) of a run over time: a resumed data cursor checked
// against its token file, a diverging run keeps the last good checkpoint, signals
// stop training with a checkpoint, data without targets is refused.
#include <cmath>
#include <fstream>
#include <regex>

#include "reliability_helpers.hpp"

namespace ash::test {

// ---- 10. a resumed data cursor indexes the file it was written with -------

TEST(Reliability, ResumedCursorsAreCheckedAgainstTheTokenFile) {
  const auto corpus = corpus_file(), shorter = tmp_path("short.txt");
  {  // the first 3000 bytes of the corpus: enough for windows, fewer tokens
    std::ifstream in(corpus, std::ios::binary);
    std::string text(3000, '\0');
    in.read(&text[0], 3000);
    write(shorter, text);
  }
  const std::string t = "timeout 120 " + std::string(cli_path()) + " ";
  for (const std::string mode : {"--set data.sequential=true --set data.carry_state=true ",
                                 "--set data.sequential=true "}) {
    const auto dir = tmp_path("cursor");
    fs::remove_all(dir);
    const auto base = "train " + small_model + "--set data.batch=2 --set grad.engine=adjoint-exact " + mode +
                      "--set optim.steps=6 --set run.log_every=100 --set run.out_dir=" + dir + " ";
    auto r = run_shell(t + base + "--set data.train=" + corpus + " --until 3");
    ASSERT_EQ(r.code, 0) << r.out;
    const auto ckpt = dir + "/checkpoint.h5";
    // Another file: refused, naming both.
    r = run_shell(t + "train --resume " + ckpt + " --set data.train=" + shorter);
    EXPECT_EQ(r.code, 2) << r.out;
    EXPECT_NE(r.out.find("belongs to the other file"), std::string::npos) << r.out;
    EXPECT_NE(r.out.find(shorter), std::string::npos) << r.out;
    // A cursor past the data (the identity removed, as in a file from an older writer): refused.
    for (const std::int64_t cursor : {std::int64_t(100000), std::int64_t(1) << 40, std::int64_t(9223372036854775807)}) {
      const auto edited = tmp_path("cursor_edit.h5");
      fs::copy_file(ckpt, edited, fs::copy_options::overwrite_existing);
      rewrite_attr_i64(edited, "data_cursor", cursor);
      {
        hid_t f = H5Fopen(edited.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
        H5Adelete(f, "data_tokens");
        H5Adelete(f, "data_fingerprint");
        H5Fclose(f);
      }
      reseal(edited);
      r = run_shell(t + "train --resume " + edited + " --set data.train=" + corpus + " --set run.out_dir=" +
                    tmp_path("cursor_run"));
      EXPECT_EQ(r.code, 2) << mode << cursor << ":\n" << r.out;
      EXPECT_NE(r.out.find("data cursor " + std::to_string(cursor)), std::string::npos) << r.out;
      EXPECT_NE(r.out.find(corpus), std::string::npos) << r.out;
      fs::remove_all(tmp_path("cursor_run"));
    }
    // The same file: the run continues.
    r = run_shell(t + "train --resume " + ckpt + " --set data.train=" + corpus);
    EXPECT_EQ(r.code, 0) << r.out;
  }
  // A packed run resumed without packing (or the reverse) is named as such, not as
  // another file (issue 35: the packed count was quoted as the file's).
  {
    const auto docs = tmp_path("packdocs.txt"), dir = tmp_path("packed");
    std::string text;
    for (int i = 0; i < 300; ++i) text += std::string(5 + i % 40, char('a' + i % 26)) + "\n%\n";
    write(docs, text);
    fs::remove_all(dir);
    const auto base = "train " + small_model + "--set data.batch=2 --set data.sequential=true " +
                      "--set 'data.separator=\\n%\\n' --set data.train=" + docs +
                      " --set optim.steps=6 --set run.log_every=100 --set run.out_dir=" + dir + " ";
    auto r = run_shell(t + base + "--set data.pack=true --until 2");
    ASSERT_EQ(r.code, 0) << r.out;
    r = run_shell(t + "train --resume " + dir + "/checkpoint.h5 --set data.pack=false");
    EXPECT_EQ(r.code, 2) << r.out;
    EXPECT_NE(r.out.find("was written by a run with data.pack=true, this one has data.pack=false"), std::string::npos)
        << r.out;
    EXPECT_EQ(r.out.find("the other file"), std::string::npos) << r.out;
    r = run_shell(t + "train --resume " + dir + "/checkpoint.h5");
    EXPECT_EQ(r.code, 0) << r.out;
  }
}

// ---- 4. never a bad state over a good one ----------------------------------

TEST(Reliability, DivergingRunKeepsTheLastGoodCheckpoint) {
  const auto corpus = corpus_file(), dir = tmp_path("div");
  fs::remove_all(dir);
  const auto base = "train " + small_model + "--set data.train=" + corpus + " --set run.out_dir=" + dir + " ";
  ASSERT_EQ(run(base + "--set optim.steps=2").code, 0);
  const auto ckpt = dir + "/checkpoint.h5";
  const auto before = slurp(ckpt);
  const auto r = run(base + "--resume " + ckpt +
                     " --set optim.lr=100 --set run.ckpt_every=1 --set optim.warmup=0 --set optim.steps=200");
  EXPECT_CLEAR_ERROR(r, "the last good checkpoint is kept: " + ckpt + " (step ");
  // Whatever step the message names is the step in the file, and its
  // parameters give a finite loss.
  std::smatch m;
  ASSERT_TRUE(std::regex_search(r.out, m, std::regex("\\(step ([0-9]+)\\)"))) << r.out;
  CheckpointInfo info;
  const auto params = load_checkpoint<float>(ckpt, &info);
  EXPECT_EQ(info.step, std::stoll(m[1].str()));
  const double loss = forward_loss(params, make_windows(load_tokens(corpus), 2, 32, info.dims.vocab));
  EXPECT_TRUE(std::isfinite(loss)) << loss;
  if (info.step == 2) {
    EXPECT_EQ(slurp(ckpt), before);
  }
}

// ---- 6. signals -------------------------------------------------------------

TEST(Reliability, SigtermFinishesTheStepWritesACheckpointAndExits143) {
  const auto corpus = corpus_file();
  for (const int sig : {SIGTERM, SIGINT, SIGUSR1}) {
    const auto dir = tmp_path("sig" + std::to_string(sig));
    fs::remove_all(dir);
    Child a(train_args(dir, corpus, 100000000));
    ASSERT_TRUE(a.wait_for("step      1")) << a.out();
    ::kill(a.pid(), sig);
    const int st = a.finish();
    ASSERT_TRUE(WIFEXITED(st)) << "killed by signal " << (WIFSIGNALED(st) ? WTERMSIG(st) : 0) << "\n" << a.out();
    EXPECT_EQ(WEXITSTATUS(st), 128 + sig) << a.out();
    std::smatch m;
    const std::string out = a.out();
    ASSERT_TRUE(std::regex_search(out, m, std::regex("interrupted by SIG(TERM|INT|USR1) after step ([0-9]+): checkpoint (\\S+)")))
        << out;
    EXPECT_EQ(m[3].str(), dir + "/checkpoint.h5");
    EXPECT_EQ(checkpoint_step(dir + "/checkpoint.h5"), std::stoll(m[2].str()));
    EXPECT_GE(std::stoll(m[2].str()), 1);
    // The last metrics line is the step in the checkpoint: nothing lost.
    std::ifstream in(dir + "/metrics.jsonl");
    std::string row, last;
    while (std::getline(in, row)) last = row;
    EXPECT_EQ(nlohmann::json::parse(last)["step"].get<std::int64_t>(), std::stoll(m[2].str()));
  }
}

// The first signal asks for a clean stop; a second one ends the process at
// once (default action), e.g. when the step is long. The same SIGTERM again
// within a second is one signal delivered twice (Slurm does so at the time
// limit: from slurmstepd and through srun) and still stops cleanly.
TEST(Reliability, SecondSignalEndsTrainingAtOnce) {
  // Seconds per step on the CI machine; a GPU finishes a step of 2 x 16K
  // tokens before the second signal, so a run that is already gone by then
  // proves nothing and is repeated with 4x longer windows.
  for (index_t T = 16384;; T *= 4) {
    const auto corpus = tmp_path("long.txt");
    write(corpus, std::string(std::size_t(3 * T), 'a'));
    const auto dir = tmp_path("twice");
    fs::remove_all(dir);
    Child a({"train", "--set", "model.width=64", "--set", "model.state=16", "--set",
             "data.seq_len=" + std::to_string(T), "--set", "data.batch=2", "--set", "grad.engine=adjoint-exact",
             "--set", "data.valid_fraction=0", "--set", "data.train=" + corpus, "--set", "optim.steps=100000", "--set",
             "run.log_every=1", "--set", "run.ckpt_every=0", "--set", "run.out_dir=" + dir});
    ASSERT_TRUE(a.wait_for("step      1")) << a.out();
    ::kill(a.pid(), SIGTERM);
    ::usleep(20000);  // the first signal is handled (two pending SIGTERMs would merge into one)
    ::kill(a.pid(), SIGTERM);  // the same signal again, at once: ignored
    ::usleep(1200000);         // past the repeat window
    siginfo_t info{};
    const bool running = ::waitid(P_PID, id_t(a.pid()), &info, WEXITED | WNOHANG | WNOWAIT) == 0 && info.si_pid == 0;
    if (running || T >= (index_t(1) << 22)) {
      ::kill(a.pid(), SIGTERM);
      const int st = a.finish();
      ASSERT_TRUE(WIFSIGNALED(st)) << "exited with " << WEXITSTATUS(st) << " (T = " << T << "):\n" << a.out();
      EXPECT_EQ(WTERMSIG(st), SIGTERM);
      return;
    }
    const int st = a.finish();  // the step ended within the window: a clean stop despite the repeat
    ASSERT_TRUE(WIFEXITED(st)) << a.out();
    EXPECT_EQ(WEXITSTATUS(st), 143) << a.out();
  }
}

// Slurm's double SIGTERM during a long step: one clean stop with a checkpoint.
TEST(Reliability, SameSigtermTwiceWithinASecondStopsOnceWithACheckpoint) {
  const auto corpus = tmp_path("long2.txt");
  write(corpus, std::string(std::size_t(3 * 16384), 'a'));
  const auto dir = tmp_path("repeat");
  fs::remove_all(dir);
  Child a({"train", "--set", "model.width=64", "--set", "model.state=16", "--set", "data.seq_len=16384", "--set",
           "data.batch=2", "--set", "grad.engine=adjoint-exact", "--set", "data.valid_fraction=0", "--set",
           "data.train=" + corpus, "--set", "optim.steps=100000", "--set", "run.log_every=1", "--set",
           "run.ckpt_every=0", "--set", "run.out_dir=" + dir});
  ASSERT_TRUE(a.wait_for("step      1")) << a.out();
  ::kill(a.pid(), SIGTERM);
  ::usleep(20000);
  ::kill(a.pid(), SIGTERM);
  const int st = a.finish();
  ASSERT_TRUE(WIFEXITED(st)) << "killed by signal " << (WIFSIGNALED(st) ? WTERMSIG(st) : 0) << "\n" << a.out();
  EXPECT_EQ(WEXITSTATUS(st), 143) << a.out();
  std::smatch m;
  const std::string out = a.out();
  ASSERT_TRUE(std::regex_search(out, m, std::regex("interrupted by SIGTERM after step ([0-9]+)"))) << out;
  EXPECT_EQ(checkpoint_step(dir + "/checkpoint.h5"), std::stoll(m[1].str()));
}

// ---- 10. runs with no targets (issue 35) ------------------------------------

// With data.separator a token that starts a document is nobody's target; a
// file where every token after a window's first starts one would give a loss
// of 0 (train, grad: zero gradients) or NaN (eval) over 0 targets. Each verb
// refuses it, naming why.
TEST(Reliability, RunsWithoutTargetsAreRefused) {
  const auto ckpt = tmp_path("m.h5"), nl = tmp_path("newlines.txt"), g = tmp_path("g.h5");
  ASSERT_EQ(run("init " + small_model + "--out " + ckpt).code, 0);
  write(nl, std::string(300, '\n'));  // with the separator "\n", tokens 1.. all start documents
  const std::string sep = " --set 'data.separator=\\n'";
  const std::string why = "hold no target: every token after the first of a window starts a document (data.separator)";
  EXPECT_CLEAR_ERROR(timed("eval --checkpoint " + ckpt + " --tokens " + nl + sep), why);
  EXPECT_CLEAR_ERROR(timed("eval --carry-state --checkpoint " + ckpt + " --tokens " + nl + sep), why);
  fs::remove(g);
  EXPECT_CLEAR_ERROR(timed("grad --checkpoint " + ckpt + " --tokens " + nl + sep + " --out " + g), why);
  EXPECT_FALSE(fs::exists(g));
  const auto dir = tmp_path("no_targets");
  fs::remove_all(dir);
  const auto train = "train " + small_model + "--set data.train=" + nl + " --set optim.steps=2 --set run.out_dir=" + dir + sep;
  EXPECT_CLEAR_ERROR(timed(train), "has no target in its");
  EXPECT_CLEAR_ERROR(timed(train + " --set data.pack=true"), "has no target in its");
  EXPECT_CLEAR_ERROR(timed(train + " --set data.sequential=true --set data.carry_state=true --set grad.engine=adjoint-exact"),
                     "has no target in its");
  EXPECT_FALSE(fs::exists(dir + "/checkpoint.h5"));
  // Text to train on, and a validation tail of newlines only: its loss would read 0.
  const auto tail = tmp_path("newline_tail.txt");
  write(tail, slurp(corpus_file()) + std::string(2000, '\n'));
  fs::remove_all(dir);
  EXPECT_CLEAR_ERROR(timed("train " + small_model + "--set data.train=" + tail +
                           " --set optim.steps=2 --set run.out_dir=" + dir + sep),
                     "the validation windows of token file '" + tail + "' hold no target");
  EXPECT_FALSE(fs::exists(dir + "/checkpoint.h5"));
  // One scored token is enough: token 6 ('x') starts a document, token 7
  // follows 'x', not a separator: the only target (T = 32: not a window's first).
  std::string one(300, '\n');
  one[6] = 'x';
  write(nl, one);
  const auto e = timed("eval --checkpoint " + ckpt + " --tokens " + nl + sep);
  EXPECT_EQ(e.code, 0) << e.out;
  EXPECT_NE(e.out.find("over 1 targets"), std::string::npos) << e.out;
}

}  // namespace ash::test
