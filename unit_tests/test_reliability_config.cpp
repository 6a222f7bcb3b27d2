// Reliability (docs/design.md §7) of what a user types: every flag and config value
// validated, usage errors, deep JSON and non-regular config files, integer keys at
// 2^31, 2^32 and 2^63 - 1. A clear error (exit 2) or a run, never a crash or a hang.
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include <algorithm>

#include "ash/app/hf_mamba.hpp"
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

namespace {

// {"k0":{},"k1":{},...} of about `bytes` bytes: many object-valued members of one
// object, quadratic in nlohmann's callback parser (a 1 MiB config took 66 s).
std::string many_empty_objects(std::size_t bytes) {
  std::string s = "{";
  for (std::size_t i = 0; s.size() + 16 < bytes; ++i) s += (i ? ",\"k" : "\"k") + std::to_string(i) + "\":{}";
  return s + "}";
}

// A MambaForCausalLM folder of BF16 tensors whose model.safetensors is sparse:
// its header (`extra` more zero-length tensors in it) and a hole of the data's size.
std::string sparse_hf_folder(const std::string& name, const nlohmann::json& hf_config, std::size_t extra = 0) {
  const std::string dir = tmp_path(name);
  fs::remove_all(dir);
  fs::create_directories(dir);
  write(dir + "/config.json", hf_config.dump());
  const MambaDims d = mamba_dims(hf_mamba_config_to_ash(hf_config, "test"), "test");
  std::vector<HfName> names = hf_mamba_global_names(d);
  for (std::int64_t k = 0; k < d.layers; ++k)
    for (const auto& n : hf_mamba_layer_names(d, k)) names.push_back(n);
  std::string header = "{";
  std::uint64_t at = 0;
  for (const auto& n : names) {
    std::uint64_t bytes = 2;
    std::string shape;
    for (const auto s : n.hf_shape) bytes *= std::uint64_t(s), shape += (shape.empty() ? "" : ",") + std::to_string(s);
    header += (header.size() > 1 ? "," : "") + ("\"" + n.hf + "\":{\"dtype\":\"BF16\",\"shape\":[" + shape +
                                                 "],\"data_offsets\":[" + std::to_string(at) + "," +
                                                 std::to_string(at + bytes) + "]}");
    at += bytes;
  }
  for (std::size_t i = 0; i < extra; ++i)
    header += ",\"extra." + std::to_string(i) + "\":{\"dtype\":\"BF16\",\"shape\":[0],\"data_offsets\":[0,0]}";
  header += "}";
  header += std::string((8 - header.size() % 8) % 8, ' ');
  std::string len(8, '\0');
  for (std::size_t i = 0; i < 8; ++i) len[i] = char((header.size() >> (8 * i)) & 0xff);
  const std::string st = dir + "/model.safetensors";
  write(st, len + header);
  fs::resize_file(st, 8 + header.size() + at);  // a hole: no disk, zeros when read
  return dir;
}

nlohmann::json hf_config(std::int64_t vocab, std::int64_t width) {
  return {{"architectures", {"MambaForCausalLM"}}, {"model_type", "mamba"}, {"hidden_size", width},
          {"state_size", 4}, {"num_hidden_layers", 1}, {"vocab_size", vocab}, {"expand", 2},
          {"intermediate_size", 2 * width}, {"tie_word_embeddings", true}};
}

// A command's exit code, output and peak resident memory (its own, through wait4).
struct Measured {
  int code = -1;
  std::string out;
  long maxrss_kb = 0;
};
Measured run_measured(const std::string& args) {
  const std::string log = tmp_path("measured.log");
  const std::string cmd = "exec " + std::string(cli_path()) + " " + args + " > " + log + " 2>&1";
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::execl("/bin/sh", "sh", "-c", cmd.c_str(), static_cast<char*>(nullptr));
    ::_exit(127);
  }
  Measured m;
  int st = 0;
  struct rusage ru {};
  if (pid > 0 && ::wait4(pid, &st, 0, &ru) == pid) {
    m.code = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
    m.maxrss_kb = ru.ru_maxrss;
  }
  std::ifstream in(log);
  m.out.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  return m;
}

}  // namespace

// Every strict JSON input at its size limit is parsed or refused in time linear in
// its size : each run has a timeout far above the linear parser's
// time and far below the quadratic one's (over a minute each).
TEST(Reliability, JsonOfManyObjectsIsReadInLinearTime) {
  const std::string timeout = "timeout 30 " + std::string(cli_path()) + " ";
  const auto cfg = tmp_path("many.json");
  write(cfg, many_empty_objects(std::size_t(1) << 20));
  ASSERT_LE(fs::file_size(cfg), std::uintmax_t(1) << 20);
  EXPECT_CLEAR_ERROR(run_shell(timeout + "plan --config " + cfg), "unknown config key 'k0'");
  // A safetensors header of 200,000 tensors (11 MB): parsed, then the folder refused.
  const auto dir = sparse_hf_folder("many_tensors", hf_config(16, 16), 200000);
  ASSERT_GT(fs::file_size(dir + "/model.safetensors"), 10u << 20);
  EXPECT_CLEAR_ERROR(run_shell(timeout + "import-hf --from " + dir + " --out " + tmp_path("many_import.h5")),
                     "unexpected tensor 'extra.0'");
  // A checkpoint whose config attribute is that 1 MiB document.
  const auto ckpt = tmp_path("many.h5");
  ASSERT_EQ(run("init " + small_model + "--out " + ckpt).code, 0);
  rewrite_attr_str(ckpt, "config", many_empty_objects(std::size_t(1) << 20));
  reseal(ckpt);
  EXPECT_CLEAR_ERROR(run_shell(timeout + "inspect " + ckpt), "unknown config key 'k0'");
}

// import-hf sizes the model from config.json and the headers and refuses it
// before it reads a tensor (a 540 MB BF16 folder grew to 2.1 GB
// resident, converted to double, before the check said it needs 4 GiB).
TEST(Reliability, ImportHfChecksMemoryBeforeReadingTensors) {
  const auto dir = sparse_hf_folder("sparse_hf", hf_config(262144, 1024));
  const auto size = fs::file_size(dir + "/model.safetensors");
  ASSERT_GT(size, 500u << 20);
  const auto r = run_measured("import-hf --from " + dir + " --out " + tmp_path("sparse.h5") + " --max-memory 100000000");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("more than --max-memory"), std::string::npos) << r.out;
  EXPECT_LT(r.maxrss_kb, long(size / 1024 / 4)) << "peak resident KiB, for a " << size << "-byte file:\n" << r.out;
  EXPECT_FALSE(fs::exists(tmp_path("sparse.h5")));
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
