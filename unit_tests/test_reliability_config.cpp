// Reliability (docs/design.md §7) of what a user types: every flag and config value
// validated, usage errors, deep JSON and non-regular config files, integer keys at
// 2^31, 2^32 and 2^63 - 1. A clear error (exit 2) or a run, never a crash or a hang.
#include <sys/stat.h>

#include <algorithm>

#include "reliability_helpers.hpp"

namespace ash::test {

// ---- 8. every flag and config value validated ------------------------------

TEST(Reliability, BadFlagsAndConfigValuesAreClearErrors) {
  const auto corpus = corpus_file(), ckpt = tmp_path("m.h5"), out = tmp_path("g.h5");
  ASSERT_EQ(run("init " + small_model + "--out " + ckpt).code, 0);
  const auto gen = "generate --checkpoint " + ckpt + " --prompt the ";
  EXPECT_CLEAR_ERROR(run(gen + "--temperature nan"), "--temperature");
  EXPECT_CLEAR_ERROR(run(gen + "--temperature -1"), "--temperature");
  EXPECT_CLEAR_ERROR(run(gen + "--tokens -5"), "--tokens");
  const auto g = "grad --checkpoint " + ckpt + " --tokens " + corpus + " --out " + out + " ";
  EXPECT_CLEAR_ERROR(run(g + "--engine adjoint --truncate -5"), "grad.truncate");
  EXPECT_CLEAR_ERROR(run(g + "--engine adjoint-exact --chunk -1"), "grad.chunk");
  EXPECT_CLEAR_ERROR(run(g + "--engine ''"), "grad.engine");
  const auto i = "init --out " + tmp_path("x.h5") + " ";
  for (const auto& kv : {"run.ckpt_every=-1", "run.log_every=-1", "run.eval_every=-1", "optim.clip=-1",
                         "optim.weight_decay=-0.5"})
    EXPECT_CLEAR_ERROR(run(i + "--set " + kv), std::string(kv).substr(0, std::string(kv).find('=')));
  EXPECT_EQ(run(i + "--set optim.clip=0").code, 0) << "clip 0 means no clipping";
  EXPECT_CLEAR_ERROR(run(i + "--set optim.lr=1e999"), "optim.lr");
  EXPECT_CLEAR_ERROR(run(i + "--set optim.lr=NaN"), "optim.lr");
  const auto cfg = tmp_path("dup.json");
  write(cfg, R"({"model": {"width": 8, "width": 16}})");
  EXPECT_CLEAR_ERROR(run(i + "--config " + cfg), "duplicate key 'width'");
  write(cfg, R"({"optim": {"lr": 0.01}, "optim": {"lr": 0.02}})");
  EXPECT_CLEAR_ERROR(run(i + "--config " + cfg), "duplicate key 'optim'");
  EXPECT_CLEAR_ERROR(run(i + "--set 'model={\"width\": 8, \"width\": 9}'"), "duplicate key 'width'");
  EXPECT_FALSE(fs::exists(out));
}

// Resume compares numbers by value: 0 stored for a float key, 0.05 given.
TEST(Reliability, ResumeAcceptsAnIntegerForAFloatKey) {
  const auto corpus = corpus_file(), dir = tmp_path("run");
  fs::remove_all(dir);
  const auto base = "train " + small_model + "--set data.train=" + corpus + " --set run.out_dir=" + dir + " ";
  auto r = run(base + "--set data.valid_fraction=0 --set optim.lr=1 --set optim.steps=3 --until 2");
  ASSERT_EQ(r.code, 0) << r.out;
  const auto cfg = tmp_path("cfg.json");
  write(cfg, R"({"data": {"valid_fraction": 0.05}, "optim": {"lr": 1.0}})");
  r = run("train --config " + cfg + " --resume " + dir + "/checkpoint.h5");
  EXPECT_EQ(r.code, 0) << r.out;
  // A float for an integer key is still refused.
  EXPECT_CLEAR_ERROR(run("init --set model.layers=2.5 --out " + tmp_path("x.h5")), "model.layers");
  Config c;
  c.set("data.valid_fraction=0");
  EXPECT_TRUE(c.json()["data"]["valid_fraction"].is_number_float());
  EXPECT_NO_THROW(c.set("data.valid_fraction=0.05"));
}

// ---- 9. hostile inputs: usage, nesting, non-regular configs, 64-bit integers -

namespace {

void rewrite_attr_str(const std::string& path, const char* name, const std::string& v) {
  hid_t f = H5Fopen(path.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
  replace_attr_str(f, name, v);
  H5Fclose(f);
}

// Exit 0 or a clear error, within the timeout: never a crash (139, 134), a
// hang (124), an internal error (3) or a parser exit code (100+).
#define EXPECT_RUNS_OR_REFUSES(res, what)                                                          \
  do {                                                                                             \
    const auto r3_ = (res);                                                                        \
    EXPECT_TRUE(r3_.code == 0 || r3_.code == 2) << (what) << " exit " << r3_.code << ":\n" << r3_.out; \
    EXPECT_EQ(r3_.out.find("internal error"), std::string::npos) << (what) << ":\n" << r3_.out;    \
  } while (0)

// `ash plan` answers 0 (fits), 1 (does not fit) or 2 (refused).
#define EXPECT_PLAN_ANSWERS(res, what)                                                                  \
  do {                                                                                                  \
    const auto r4_ = (res);                                                                             \
    EXPECT_TRUE(r4_.code >= 0 && r4_.code <= 2) << (what) << " exit " << r4_.code << ":\n" << r4_.out; \
    EXPECT_EQ(r4_.out.find("internal error"), std::string::npos) << (what) << ":\n" << r4_.out;        \
  } while (0)

}  // namespace

TEST(Reliability, UsageErrorsExitTwoOnOneLine) {
  for (const std::string args : {"", "bogus", "plan --max-memory nan", "plan --max-memory -1", "plan --precision Float",
                                 "plan --set", "train --until abc", "train --until 18446744073709551616",
                                 "generate --checkpoint x --prompt a --temperature inf", "plan --no-such-flag",
                                 "generate --checkpoint x --prompt a --tokens 2147483648",
                                 "generate --checkpoint x --prompt a --seed -3"}) {
    const auto r = run(args);
    EXPECT_EQ(r.code, 2) << "ash " << args << ":\n" << r.out;
    EXPECT_EQ(std::count(r.out.begin(), r.out.end(), '\n'), 1) << "ash " << args << ":\n" << r.out;
    EXPECT_EQ(r.out.rfind("ash: error: ", 0), 0u) << r.out;
    EXPECT_EQ(r.out.find("1.79769"), std::string::npos) << "no absurd bound printed: " << r.out;
  }
  EXPECT_EQ(run("plan --help").code, 0);
}

TEST(Reliability, DeepJsonAndNonRegularConfigsAreClearErrors) {
  const std::string deep = std::string(100000, '[') + std::string(100000, ']');
  const auto cfg = tmp_path("deep.json");
  write(cfg, "{\"model\": {\"width\": " + deep + "}}");
  EXPECT_CLEAR_ERROR(run("plan --config " + cfg), "nested 100002 levels deep");
  EXPECT_CLEAR_ERROR(run("plan --set 'model.width=" + std::string(70, '[') + std::string(70, ']') + "'"),
                     "--set model.width is nested 70 levels deep");
  EXPECT_CLEAR_ERROR(run("plan --set 'model.width=\"" + std::string(70, '[') + "\"'"), "model.width");  // a string
  EXPECT_CLEAR_ERROR(run("plan --config /dev/zero"), "not a regular file");
  const auto fifo = tmp_path("config.fifo");
  fs::remove(fifo);
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  EXPECT_CLEAR_ERROR(run_shell("timeout 30 " + std::string(cli_path()) + " plan --config " + fifo), "not a regular file");
  const auto big = tmp_path("big.json");
  write(big, "{\"model\": {\"width\": 8}}" + std::string(2 << 20, ' '));
  EXPECT_CLEAR_ERROR(run("plan --config " + big), "a configuration is at most");
  // A checkpoint whose /config is nested too deep: every verb that reads it says so.
  const auto ckpt = tmp_path("deep.h5"), corpus = corpus_file();
  ASSERT_EQ(run("init " + small_model + "--out " + ckpt).code, 0);
  rewrite_attr_str(ckpt, "config", "{\"model\": " + deep + "}");
  reseal(ckpt);
  for (const auto& verb : {"inspect " + ckpt, "eval --checkpoint " + ckpt + " --tokens " + corpus,
                           "grad --checkpoint " + ckpt + " --tokens " + corpus + " --out " + tmp_path("g.h5"),
                           "train --resume " + ckpt + " --set data.train=" + corpus + " --set run.out_dir=" +
                               tmp_path("deeprun")})
    EXPECT_CLEAR_ERROR(run_shell("timeout 60 " + std::string(cli_path()) + " " + verb), "levels deep");
}

// Every integer key and option at 2^31, 2^32 and 2^63 - 1: validated into the
// 64-bit type it is used as, so it runs or is refused, never narrowed.
TEST(Reliability, IntegerKeysAtTheEdgesRunOrAreRefused) {
  const auto corpus = corpus_file(), ckpt = tmp_path("m.h5"), out = tmp_path("g.h5");
  ASSERT_EQ(run("init " + small_model + "--set data.batch=2 --out " + ckpt).code, 0);
  const std::string t = "timeout 120 " + std::string(cli_path()) + " ";
  const auto g = t + "grad --checkpoint " + ckpt + " --tokens " + corpus + " --out " + out + " ";
  for (const std::string v : {"2147483648", "4294967296", "9223372036854775807"}) {
    for (const char* k : {"model.vocab", "model.width", "model.state", "model.layers", "model.seed"}) {
      EXPECT_RUNS_OR_REFUSES(run_shell(t + "init --set " + k + "=" + v + " --out " + tmp_path("i.h5")), k);
      EXPECT_PLAN_ANSWERS(run_shell(t + "plan --set " + k + "=" + v), k);
    }
    for (const char* k : {"data.seq_len", "data.batch", "grad.chunk", "grad.wave", "grad.head_chunk",
                          "grad.layer_checkpoint", "grad.token_block", "dist.layer_ranks", "dist.seq_ranks",
                          "dist.data_ranks", "dist.pipeline_blocks"}) {
      EXPECT_RUNS_OR_REFUSES(run_shell(g + "--engine adjoint-exact --set " + k + "=" + v), k);
      EXPECT_PLAN_ANSWERS(run_shell(t + "plan " + small_model + "--set grad.engine=adjoint-exact --set " + k + "=" + v),
                          k);
    }
    EXPECT_RUNS_OR_REFUSES(run_shell(g + "--engine adjoint --truncate " + v), "--truncate");
    EXPECT_RUNS_OR_REFUSES(run_shell(g + "--engine adjoint-exact --chunk " + v), "--chunk");
    EXPECT_RUNS_OR_REFUSES(run_shell(g + "--engine adjoint-exact --detach-inputs --truncate " + v), "--truncate");
    EXPECT_RUNS_OR_REFUSES(run_shell(g + "--max-memory " + v), "--max-memory");
    for (const char* k : {"optim.steps", "optim.warmup", "run.log_every", "run.eval_every", "run.ckpt_every"})
      EXPECT_RUNS_OR_REFUSES(run_shell(t + "train " + small_model + "--set data.train=" + corpus +
                                       " --set run.out_dir=" + tmp_path(std::string("edge_") + k) + " --set " + k +
                                       "=" + v + " --until 1"),
                             k);
    EXPECT_RUNS_OR_REFUSES(run_shell(t + "train " + small_model + "--set data.train=" + corpus + " --set run.out_dir=" +
                                     tmp_path("edge_until") + " --set optim.steps=1 --until " + v),
                           "--until");
    EXPECT_RUNS_OR_REFUSES(run_shell(t + "generate --checkpoint " + ckpt + " --prompt a --tokens 3 --seed " + v),
                           "--seed");
  }
  // The reproducers: a 32-bit layer checkpoint ran into int and crashed or looped.
  for (const std::string v : {"2147483648", "4294967296"}) {
    const auto r = run_shell(g + "--engine adjoint-exact --set grad.layer_checkpoint=" + v);
    EXPECT_EQ(r.code, 0) << r.out;
  }
  EXPECT_CLEAR_ERROR(run("init --set model.layers=4294967298 --max-memory 18446744073709551615 --out " +
                         tmp_path("k.h5")),
                     "model.layers must be <= 1073741824");
  EXPECT_CLEAR_ERROR(run("plan --set dist.seq_ranks=9223372036854775807"), "dist.seq_ranks must be at most");
}

}  // namespace ash::test
