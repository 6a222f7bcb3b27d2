// Reliability (docs/design.md §7) of what a run writes: --out never an input, one
// writer per run directory, and links (at the lock, --out, its temporary file, the
// checkpoint, metrics.jsonl) never written through.
#include <sys/stat.h>

#include "reliability_helpers.hpp"

namespace ash::test {

// ---- 7. --out equal to an input --------------------------------------------

TEST(Reliability, OutputMayNotReplaceAnInput) {
  const auto corpus = corpus_file(), ckpt = tmp_path("m.h5");
  ASSERT_EQ(run("init " + small_model + "--out " + ckpt).code, 0);
  const auto before = slurp(ckpt);
  const auto g = "grad --tokens " + corpus + " --checkpoint " + ckpt;
  EXPECT_CLEAR_ERROR(run(g + " --out " + ckpt), "same file as --checkpoint");
  const auto dot = fs::path(ckpt).parent_path() / "." / fs::path(ckpt).filename();
  EXPECT_CLEAR_ERROR(run(g + " --out " + dot.string()), "same file as --checkpoint");
  const auto link = tmp_path("link.h5");
  fs::remove(link);
  fs::create_hard_link(ckpt, link);
  EXPECT_CLEAR_ERROR(run(g + " --out " + link), "same file as --checkpoint");
  EXPECT_CLEAR_ERROR(run(g + " --out " + corpus), "same file as --tokens");
  const auto cfg = tmp_path("c.json");
  write(cfg, R"({"model": {"width": 8}})");
  EXPECT_CLEAR_ERROR(run("init --config " + cfg + " --out " + cfg), "same file as --config");
  EXPECT_EQ(slurp(ckpt), before);
}

// ---- 5. one writer per run directory ---------------------------------------

TEST(Reliability, SecondRunOnTheSameDirectoryFailsNamingThePid) {
  const auto corpus = corpus_file(), dir = tmp_path("lock");
  fs::remove_all(dir);
  {
    Child a(train_args(dir, corpus, 100000000));
    ASSERT_TRUE(a.wait_for("step      1")) << a.out();
    auto args = train_args(dir, corpus, 3);
    std::string line;
    for (const auto& s : args) line += "'" + s + "' ";
    EXPECT_CLEAR_ERROR(run(line), "is in use by another ash train (PID " + std::to_string(a.pid()) + ")");
    // Every writer of the directory waits for its train: init and grad --out into it are refused.
    const auto before = fs::exists(dir + "/checkpoint.h5") ? fs::last_write_time(dir + "/checkpoint.h5")
                                                           : fs::file_time_type();
    const auto m = tmp_path("lockmodel.h5");
    ASSERT_EQ(run("init " + small_model + "--out " + m).code, 0);
    EXPECT_CLEAR_ERROR(run("init " + small_model + "--out " + dir + "/checkpoint.h5"),
                       "is in use by another ash train (PID " + std::to_string(a.pid()) + ")");
    EXPECT_CLEAR_ERROR(run("grad --checkpoint " + m + " --tokens " + corpus + " --out " + dir + "/grad.h5"),
                       "is in use by another ash train (PID " + std::to_string(a.pid()) + ")");
    EXPECT_FALSE(fs::exists(dir + "/grad.h5"));
    if (fs::exists(dir + "/checkpoint.h5")) EXPECT_EQ(fs::last_write_time(dir + "/checkpoint.h5"), before);
    ::kill(a.pid(), SIGKILL);  // a stale lock: the kernel drops the flock
    a.finish();
  }
  // A killed writer's temp file is cleaned by the next run of the directory:
  // write_atomically's names (six random characters) and older builds' (a PID).
  // A symbolic link of such a name is left alone, its target untouched.
  const auto stale = dir + "/checkpoint.h5.tmp.999999", stale_new = dir + "/checkpoint.h5.tmp.a1B2c3";
  write(stale, "half a file");
  write(stale_new, "half a file");
  const auto target = tmp_path("not_a_temp.txt");
  write(target, "kept");
  fs::remove(dir + "/checkpoint.h5.tmp.777777");
  fs::create_symlink(target, dir + "/checkpoint.h5.tmp.777777");
  auto args = train_args(dir, corpus, 3);
  std::string line;
  for (const auto& s : args) line += "'" + s + "' ";
  const auto r = run(line);
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_FALSE(fs::exists(stale));
  EXPECT_FALSE(fs::exists(stale_new));
  EXPECT_TRUE(fs::is_symlink(dir + "/checkpoint.h5.tmp.777777"));
  EXPECT_EQ(slurp(target), "kept");
  EXPECT_EQ(checkpoint_step(dir + "/checkpoint.h5"), 3);
}

// ---- 8. hostile paths (issue 35): links are never written through ---------

namespace {

// A file whose bytes the test checks afterwards.
std::string victim_file(const std::string& name) {
  const auto p = tmp_path(name);
  write(p, "precious bytes that no ash run may touch\n");
  return p;
}

}  // namespace

// <dir>/.lock is truncated and rewritten with the PID: a symbolic link there
// (dangling or not), a FIFO or a hard link to another file is refused, naming
// the path, and whatever it points at is untouched.
TEST(Reliability, LockFileThatIsALinkIsRefusedNotFollowed) {
  const auto corpus = corpus_file(), victim = victim_file("victim.h5"), model = tmp_path("m.h5");
  const auto before = slurp(victim);
  ASSERT_EQ(run("init " + small_model + "--out " + model).code, 0);
  const auto dir = tmp_path("linked_lock");
  const auto lock = dir + "/.lock";
  auto writers = [&] {
    return std::vector<std::string>{
        "train " + small_model + "--set data.train=" + corpus + " --set optim.steps=2 --set run.out_dir=" + dir,
        "init " + small_model + "--out " + dir + "/x.h5",
        "grad --checkpoint " + model + " --tokens " + corpus + " --out " + dir + "/g.h5"};
  };
  auto fresh_dir = [&] {
    fs::remove_all(dir);
    fs::create_directories(dir);
  };
  auto nothing_written = [&] {
    EXPECT_TRUE(slurp(victim) == before) << "the lock's target was written";
    for (const char* f : {"/x.h5", "/g.h5", "/checkpoint.h5", "/metrics.jsonl"}) EXPECT_FALSE(fs::exists(dir + f)) << f;
  };

  fresh_dir();
  fs::create_symlink(victim, lock);
  for (const auto& w : writers()) EXPECT_CLEAR_ERROR(timed(w), "the lock file '" + lock + "'");
  EXPECT_CLEAR_ERROR(timed(writers()[0]), "is a symbolic link, which ash never follows");
  EXPECT_TRUE(fs::is_symlink(lock));
  nothing_written();

  // A dangling link: following it would create its target.
  const auto nowhere = tmp_path("nowhere.h5");
  fs::remove(nowhere);
  fresh_dir();
  fs::create_symlink(nowhere, lock);
  for (const auto& w : writers()) EXPECT_CLEAR_ERROR(timed(w), "is a symbolic link, which ash never follows");
  EXPECT_FALSE(fs::exists(nowhere));
  nothing_written();

  // A hard link to the victim, and a FIFO.
  fresh_dir();
  fs::create_hard_link(victim, lock);
  for (const auto& w : writers()) EXPECT_CLEAR_ERROR(timed(w), "has 2 hard links");
  nothing_written();
  fresh_dir();
  ASSERT_EQ(::mkfifo(lock.c_str(), 0600), 0);
  for (const auto& w : writers()) EXPECT_CLEAR_ERROR(timed(w), "is not a regular file");
  nothing_written();

  // An ordinary lock file left by an earlier run still works.
  fresh_dir();
  write(lock, "12345\n");
  const auto ok = timed(writers()[1]);
  EXPECT_EQ(ok.code, 0) << ok.out;
  fs::remove_all(dir);
}

// The temporary file of every write is created exclusively under an
// unpredictable name: a link planted at the old name <out>.tmp.<pid> (bash's
// $$ is the PID of the ash it execs) is not written through, and --out ends up
// a regular file. A link at --out itself, at the run's checkpoint or at
// metrics.jsonl (appended to, never renamed) is refused (docs/cli.md, Output
// files). The victim is never touched.
TEST(Reliability, OutputLinksAreRefusedNeverWrittenThrough) {
  const auto corpus = corpus_file(), victim = victim_file("victim.txt"), model = tmp_path("m.h5");
  const auto before = slurp(victim);
  ASSERT_EQ(run("init " + small_model + "--out " + model).code, 0);
  for (const std::string verb : {"init", "grad"}) {
    SCOPED_TRACE(verb);
    const auto out = tmp_path(verb + "_out.h5");
    fs::remove(out);
    const std::string args = verb == "init" ? "init " + small_model + "--out " + out
                                            : "grad --checkpoint " + model + " --tokens " + corpus + " --out " + out;
    const auto r = run_shell("timeout 120 bash -c 'ln -s " + victim + " " + out + ".tmp.$$ && exec " +
                             std::string(cli_path()) + " " + args + "'");
    EXPECT_EQ(r.code, 0) << r.out;
    EXPECT_TRUE(slurp(victim) == before) << "written through the planted link";
    EXPECT_FALSE(fs::is_symlink(out)) << "--out became the planted link";
    EXPECT_TRUE(fs::is_regular_file(out));
    EXPECT_NO_THROW(inspect_checkpoint(out, Verify::all));
    // The planted link is left alone; no temporary file of ash's remains.
    for (const auto& e : fs::directory_iterator(fs::path(out).parent_path())) {
      const auto name = e.path().filename().string();
      if (name.rfind(fs::path(out).filename().string() + ".tmp.", 0) == 0)
        EXPECT_TRUE(fs::is_symlink(e.symlink_status())) << "temp file left: " << e.path();
    }
    // A link at --out: refused (docs/cli.md, Output files), neither replaced nor written through.
    fs::remove(out);
    fs::create_symlink(victim, out);
    EXPECT_CLEAR_ERROR(timed(args), "--out '" + out + "' is a symbolic link (to '" + victim + "')");
    EXPECT_TRUE(fs::is_symlink(out));
    EXPECT_TRUE(slurp(victim) == before);
  }

  const auto dir = tmp_path("linked_outputs");
  const auto train = "train " + small_model + "--set data.train=" + corpus + " --set optim.steps=2 --set run.out_dir=" + dir;
  fs::remove_all(dir);
  fs::create_directories(dir);
  fs::create_symlink(victim, dir + "/checkpoint.h5");
  EXPECT_CLEAR_ERROR(timed(train), "the run's checkpoint '" + dir + "/checkpoint.h5' is a symbolic link");
  EXPECT_TRUE(fs::is_symlink(dir + "/checkpoint.h5"));
  EXPECT_TRUE(slurp(victim) == before);

  fs::remove_all(dir);
  fs::create_directories(dir);
  fs::create_symlink(victim, dir + "/metrics.jsonl");
  EXPECT_CLEAR_ERROR(timed(train), "the metrics file '" + dir + "/metrics.jsonl' is a symbolic link");
  EXPECT_TRUE(slurp(victim) == before) << "metrics appended through the link";
  EXPECT_FALSE(fs::exists(dir + "/checkpoint.h5"));
  fs::remove_all(dir);
  fs::create_directories(dir + "/metrics.jsonl");
  EXPECT_CLEAR_ERROR(timed(train), "the metrics file '" + dir + "/metrics.jsonl' is not a regular file");
  fs::remove_all(dir);
  fs::create_directories(dir);
  ASSERT_EQ(::mkfifo((dir + "/metrics.jsonl").c_str(), 0600), 0);  // never blocks on it
  EXPECT_CLEAR_ERROR(timed(train), "the metrics file '" + dir + "/metrics.jsonl' is not a regular file");
  fs::remove_all(dir);
}

}  // namespace ash::test
