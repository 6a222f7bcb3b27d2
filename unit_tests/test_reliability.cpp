// Reliability (docs/design.md §7): absurd sizes, bad flags and files, full
// disks, diverging runs, two runs on one directory, signals, and a fuzz test
// of checkpoint corruption. Every case ends in a clear error (exit 2) or a
// correct result: never a crash, never a lost or poisoned checkpoint.
#include <fcntl.h>
#include <hdf5.h>
#include <poll.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>

#include "ash/app/hf_mamba.hpp"
#include "cli_runner.hpp"
#include "test_helpers.hpp"

namespace ash::test {

namespace {

namespace fs = std::filesystem;

std::string corpus_file() { return word_corpus(tmp_path("corpus.txt")); }

// Exit 2 (a user error), the message, no crash and no "internal error".
#define EXPECT_CLEAR_ERROR(res, needle)                                             \
  do {                                                                              \
    const auto r2_ = (res);                                                         \
    EXPECT_EQ(r2_.code, 2) << r2_.out;                                              \
    EXPECT_NE(r2_.out.find(needle), std::string::npos) << "output was:\n" << r2_.out; \
    EXPECT_EQ(r2_.out.find("internal error"), std::string::npos) << r2_.out;        \
  } while (0)

const std::string small_model = "--set model.width=8 --set model.state=4 --set model.layers=2 --set data.seq_len=32 ";

// `ash train` as a child process of its own (so signals reach ash itself, not
// a shell), its stdout and stderr on a pipe.
class Child {
 public:
  explicit Child(const std::vector<std::string>& args) {
    int fds[2];
    if (::pipe(fds) != 0) throw std::runtime_error("pipe");
    pid_ = ::fork();
    if (pid_ == 0) {
      ::dup2(fds[1], 1);
      ::dup2(fds[1], 2);
      ::close(fds[0]);
      ::close(fds[1]);
      std::vector<char*> argv{const_cast<char*>(cli_path())};
      for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
      argv.push_back(nullptr);
      ::execv(cli_path(), argv.data());
      ::_exit(127);
    }
    ::close(fds[1]);
    fd_ = fds[0];
  }
  ~Child() {
    if (pid_ > 0 && !waited_) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
    if (fd_ >= 0) ::close(fd_);
  }
  pid_t pid() const { return pid_; }
  // Reads until `needle` appears in the output (true) or EOF / timeout.
  bool wait_for(const std::string& needle, double seconds = 60) {
    const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
    while (out_.find(needle) == std::string::npos) {
      const auto left = std::chrono::duration<double>(end - std::chrono::steady_clock::now()).count();
      if (left <= 0) return false;
      pollfd p{fd_, POLLIN, 0};
      if (::poll(&p, 1, int(left * 1000) + 1) <= 0) return false;
      char buf[4096];
      const ssize_t n = ::read(fd_, buf, sizeof buf);
      if (n <= 0) return out_.find(needle) != std::string::npos;
      out_.append(buf, std::size_t(n));
    }
    return true;
  }
  // Reads to EOF and reaps; the raw wait status.
  int finish() {
    wait_for("\x01never\x01", 120);
    int st = 0;
    ::waitpid(pid_, &st, 0);
    waited_ = true;
    return st;
  }
  const std::string& out() const { return out_; }

 private:
  pid_t pid_ = -1;
  int fd_ = -1;
  bool waited_ = false;
  std::string out_;
};

std::vector<std::string> train_args(const std::string& dir, const std::string& corpus, long long steps) {
  return {"train",       "--set", "model.width=8",         "--set", "model.state=4",
          "--set",       "model.layers=2", "--set", "data.seq_len=64", "--set",
          "data.train=" + corpus, "--set", "optim.steps=" + std::to_string(steps), "--set",
          "run.log_every=1", "--set", "run.ckpt_every=0", "--set", "run.eval_every=0",
          "--set", "run.out_dir=" + dir};
}

// Every verb that reads a checkpoint, on `file` (train resumes from it, with train_sets).
std::vector<std::string> reading_verbs(const std::string& file, const std::string& corpus,
                                       const std::string& train_sets = "") {
  return {"inspect " + file,
          "inspect --no-verify " + file,
          "generate --checkpoint " + file + " --prompt ab --tokens 2",
          "grad --checkpoint " + file + " --tokens " + corpus + " --out " + tmp_path("g.h5"),
          "eval --checkpoint " + file + " --tokens " + corpus,
          "train " + small_model + "--set data.train=" + corpus + " --set run.out_dir=" + tmp_path("run") + " " +
              train_sets + "--resume " + file};
}

std::int64_t checkpoint_step(const std::string& path) {
  CheckpointInfo info;
  load_checkpoint<float>(path, &info);
  return info.step;
}

}  // namespace

// ---- 1. absurd sizes: refused before allocating, exit 2 --------------------

TEST(Reliability, AbsurdSizesAreClearErrors) {
  const auto corpus = corpus_file(), ckpt = tmp_path("m.h5"), out = tmp_path("g.h5");
  ASSERT_EQ(run("init " + small_model + "--out " + ckpt).code, 0);
  const std::string huge = "4611686018427387904";  // 2^62
  const auto g = "grad --checkpoint " + ckpt + " --tokens " + corpus + " --out " + out + " ";
  EXPECT_CLEAR_ERROR(run(g + "--set data.batch=" + huge), "sizes overflow");
  EXPECT_CLEAR_ERROR(run(g + "--set data.seq_len=" + huge), "sizes overflow");
  EXPECT_CLEAR_ERROR(run("init --set model.state=" + huge + " --out " + tmp_path("x.h5")), "sizes overflow");
  EXPECT_CLEAR_ERROR(run("train --set model.state=" + huge + " --set data.train=" + corpus +
                         " --set run.out_dir=" + tmp_path("run")),
                     "sizes overflow");
  // Large but representable: the estimate is quoted, nothing is allocated.
  EXPECT_CLEAR_ERROR(run("init --set model.width=100000 --set model.state=20000 --out " + tmp_path("x.h5")),
                     host_backend ? "physical memory" : "the GPU's memory");
  EXPECT_CLEAR_ERROR(run(g + "--set data.batch=1000000000"), "needs about");
  EXPECT_CLEAR_ERROR(run(g + "--max-memory 100000"), "--max-memory");
  EXPECT_EQ(run(g + "--max-memory 100000000").code, 0);
  // Token files that are not regular files fail at once.
  EXPECT_CLEAR_ERROR(run(g.substr(0, g.find("--tokens")) + "--tokens /dev/zero --out " + out), "not a regular file");
  // ash train with a huge state, depth or batch is refused before allocating,
  // quoting the planned size, by default and under a small --max-memory; so is
  // every verb that allocates a model (grad, eval, generate, init).
  const auto tr = "train " + small_model + "--set data.train=" + corpus + " --set run.out_dir=" + tmp_path("huge") + " ";
  for (const char* big : {"model.state=1000000", "model.layers=1000000", "data.batch=1000000"}) {
    EXPECT_CLEAR_ERROR(run(tr + "--set " + big), "this configuration needs about");
    EXPECT_CLEAR_ERROR(run(tr + "--set " + big + " --max-memory 1000000"), "--max-memory 976.6 KiB");
  }
  EXPECT_CLEAR_ERROR(run(tr + "--max-memory 1000"), "--max-memory");
  EXPECT_CLEAR_ERROR(run("eval --checkpoint " + ckpt + " --tokens " + corpus + " --max-memory 1000"), "--max-memory");
  EXPECT_CLEAR_ERROR(run("generate --checkpoint " + ckpt + " --prompt a --max-memory 1000"), "needs about");
  EXPECT_FALSE(fs::exists(tmp_path("huge") + "/checkpoint.h5"));
  // A read error (EIO) names the file.
  EXPECT_CLEAR_ERROR(run(g.substr(0, g.find("--tokens")) + "--tokens /proc/self/mem --out " + out),
                     "error while reading token file '/proc/self/mem'");
  EXPECT_CLEAR_ERROR(run("plan --config /proc/self/mem"), "error while reading config file '/proc/self/mem'");
  EXPECT_CLEAR_ERROR(run(g.substr(0, g.find("--tokens")) + "--tokens " + fs::temp_directory_path().string() +
                         " --out " + out),
                     "not a regular file");
  // A byte file becomes 4-byte ids, 4x its size (issue 35: a sparse .txt of a fifth of
  // memory passed the check and was read until killed). A sparse file a quarter of
  // memory's size needs all of memory: refused at once, before anything is read.
  if (const std::uint64_t mem = physical_memory_bytes(); mem > 0) {
    const auto sparse = tmp_path("sparse.txt");
    { std::ofstream(sparse, std::ios::binary) << 'a'; }
    fs::resize_file(sparse, mem / 4);
    const auto t0 = std::chrono::steady_clock::now();
    EXPECT_CLEAR_ERROR(run_shell("timeout 60 " + std::string(cli_path()) + " eval --checkpoint " + ckpt +
                                 " --tokens " + sparse),
                       "as 4-byte token ids, more than 80% of memory");
    EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 30.0);
    fs::remove(sparse);
  }
  EXPECT_EQ(checked_mul(3, 5, "x"), 15);
  EXPECT_THROW(checked_mul(std::int64_t(1) << 40, std::int64_t(1) << 30, "x"), Error);
  EXPECT_THROW(checked_mul(-1, 2, "x"), Error);
}

// An allocation that fails despite the estimate is exit 2 with a message, not
// an internal error. Host backends: an address-space limit. A GPU: a model
// larger than the device (P = 160000: 102 GB of W_delta in float) let through by a
// --max-memory above the GPU's memory (a CUDA runtime does not start under
// an address-space limit at all).
TEST(Reliability, AllocationFailureIsAClearError) {
  const std::string init = host_backend
                               ? "PMIX_MCA_gds=hash bash -c 'ulimit -v 1500000; exec " + std::string(cli_path()) +
                                     " init --set model.width=4096 --set model.layers=16 --max-memory 1000000000000 "
                                     "--out " + tmp_path("big.h5") + "'"
                               : std::string(cli_path()) + " init --set model.width=160000 --set model.layers=1 " +
                                     "--max-memory 1000000000000000 --out " + tmp_path("big.h5");
  const auto [code, out] = run_shell(init);
  ASSERT_NE(code, -1) << "killed by a signal: " << out;
  EXPECT_EQ(code, 2) << out;
  EXPECT_NE(out.find("out of memory"), std::string::npos) << out;
  EXPECT_FALSE(fs::exists(tmp_path("big.h5")));
  if (host_backend) {  // without --max-memory the estimate refuses it against the limit's headroom
    const auto [c1, o1] = run_shell("PMIX_MCA_gds=hash bash -c 'ulimit -v 1500000; exec " + std::string(cli_path()) +
                                    " init --set model.width=4096 --set model.layers=16 --out " + tmp_path("big.h5") +
                                    "'");
    EXPECT_EQ(c1, 2) << o1;
    EXPECT_NE(o1.find("needs about 4.08 GiB"), std::string::npos) << o1;
  }
  // An address-space limit too small to start (OpenBLAS's threads would retry forever): one line, exit 2.
  for (const char* kib : {"100000", "150000", "220000"}) {
    const auto [c3, o3] = run_shell("timeout 60 bash -c 'ulimit -v " + std::string(kib) + "; exec " +
                                    std::string(cli_path()) + " plan'");
    EXPECT_EQ(c3, 2) << kib << ": " << o3;
    EXPECT_NE(o3.find("address-space limit (ulimit -v)"), std::string::npos) << o3;
  }
  // Under a limit that starts ash but cannot hold a run and OpenBLAS's buffers, the run is
  // refused by the memory check (issue 35: an eval whose Kokkos allocations fit hung in
  // OpenBLAS's retry loop for its 128 MiB buffer).
  if (host_backend) {
    const auto ckpt = tmp_path("as.h5"), text = tmp_path("as.txt");
    ASSERT_EQ(run("init --out " + ckpt).code, 0);
    std::mt19937_64 gen(7);
    std::string t(200000, ' ');
    for (auto& c : t) c = char('a' + gen() % 26);
    write(text, t);
    const auto [c4, o4] = run_shell("OPENBLAS_NUM_THREADS=1 timeout 60 bash -c 'ulimit -v 400000; exec " +
                                    std::string(cli_path()) + " eval --checkpoint " + ckpt + " --tokens " + text +
                                    " --set data.seq_len=24576'");
    EXPECT_EQ(c4, 2) << o4;
    EXPECT_NE(o4.find("what the address-space limit (ulimit -v) leaves"), std::string::npos) << o4;
  }
  if (!host_backend) {  // the address-space limit stops the backend itself: a clear error too
    const auto [c2, o2] = run_shell("bash -c 'ulimit -v 1500000; exec " + std::string(cli_path()) + " init --out " +
                                    tmp_path("small.h5") + "'");
    EXPECT_EQ(c2, 2) << o2;
    EXPECT_NE(o2.find("cannot start Kokkos"), std::string::npos) << o2;
  }
}

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

// ---- 2. a full disk / file-size limit: clear error, previous file kept ------

TEST(Reliability, FileSizeLimitKeepsThePreviousFile) {
  const auto ckpt = tmp_path("keep.h5");
  ASSERT_EQ(run("init " + small_model + "--out " + ckpt).code, 0);
  const auto before = slurp(ckpt);
  // 50 KiB limit, a ~1 MiB model. PMIX_MCA_gds=hash: Open MPI's singleton
  // start-up would otherwise need shared-memory files above the limit.
  const auto [code, out] = run_shell("PMIX_MCA_gds=hash bash -c 'ulimit -f 50; exec " + std::string(cli_path()) +
                                     " init --set model.width=256 --out " + ckpt + "'");
  ASSERT_NE(code, -1) << "killed by a signal: " << out;
  EXPECT_EQ(code, 2) << out;
  EXPECT_NE(out.find("cannot write '" + ckpt + "'"), std::string::npos) << out;
  EXPECT_NE(out.find("file size limit"), std::string::npos) << out;
  EXPECT_EQ(slurp(ckpt), before) << "the previous file must be kept";
  for (const auto& e : fs::directory_iterator(fs::path(ckpt).parent_path()))
    EXPECT_EQ(e.path().filename().string().find(fs::path(ckpt).filename().string() + ".tmp."), std::string::npos)
        << "temp file left: " << e.path();
}

// ---- 3. strict schema and checksums ----------------------------------------

namespace {

void rewrite_attr_i64(const std::string& path, const char* name, std::int64_t v) {
  hid_t f = H5Fopen(path.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
  H5Adelete(f, name);
  hid_t sp = H5Screate(H5S_SCALAR);
  hid_t a = H5Acreate2(f, name, H5T_STD_I64LE, sp, H5P_DEFAULT, H5P_DEFAULT);
  H5Awrite(a, H5T_NATIVE_INT64, &v);
  H5Aclose(a);
  H5Sclose(sp);
  H5Fclose(f);
}

void rewrite_attr(const std::string& path, const char* name, hid_t file_type, hid_t mem_type, const void* v) {
  hid_t f = H5Fopen(path.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
  H5Adelete(f, name);
  hid_t sp = H5Screate(H5S_SCALAR);
  hid_t a = H5Acreate2(f, name, file_type, sp, H5P_DEFAULT, H5P_DEFAULT);
  H5Awrite(a, mem_type, v);
  H5Aclose(a);
  H5Sclose(sp);
  H5Fclose(f);
}

// Replaces a dataset by one of another file type (and no checksum filter).
void rewrite_dataset(const std::string& path, const std::string& ds_path, hid_t file_type) {
  hid_t f = H5Fopen(path.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
  hid_t ds = H5Dopen2(f, ds_path.c_str(), H5P_DEFAULT);
  hid_t sp = H5Dget_space(ds);
  const auto n = H5Sget_simple_extent_npoints(sp);
  std::vector<double> v(static_cast<std::size_t>(n));
  H5Dread(ds, H5T_NATIVE_DOUBLE, H5S_ALL, H5S_ALL, H5P_DEFAULT, v.data());
  H5Dclose(ds);
  H5Ldelete(f, ds_path.c_str(), H5P_DEFAULT);
  ds = H5Dcreate2(f, ds_path.c_str(), file_type, sp, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
  EXPECT_GE(ds, 0);
  H5Dwrite(ds, H5T_NATIVE_DOUBLE, H5S_ALL, H5S_ALL, H5P_DEFAULT, v.data());
  H5Dclose(ds);
  H5Sclose(sp);
  H5Fclose(f);
}


}  // namespace

namespace {

// Flips one bit inside the stored bytes of layer 1's W_B (its raw little-endian
// doubles appear once in the file); returns the file's new bytes ("" if not found).
std::string flip_bit_in_w_b(const std::string& path, const ParamSet<double>& ps) {
  auto bytes = slurp(path);
  const auto& t = ps.tensor("layers/001/W_B");
  const auto host = to_host(ps);
  std::string raw(std::size_t(t.size()) * 8, '\0');
  std::memcpy(&raw[0], host.data() + t.offset, raw.size());
  const auto at = bytes.find(raw);
  if (at == std::string::npos) return "";
  bytes[at + 13] ^= 0x04;
  write(path, bytes);
  return bytes;
}

// Every dataset of a checkpoint or gradient file, its values as double, and the
// header attributes that are numbers (the optimizer's step too).
std::map<std::string, std::vector<double>> file_values(const std::string& path) {
  std::map<std::string, std::vector<double>> out;
  hid_t f = H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
  for (const auto& p : file_datasets(f)) {
    hid_t ds = H5Dopen2(f, p.c_str(), H5P_DEFAULT), sp = H5Dget_space(ds);
    auto& v = out[p];
    v.resize(std::size_t(H5Sget_simple_extent_npoints(sp)));
    EXPECT_GE(H5Dread(ds, H5T_NATIVE_DOUBLE, H5S_ALL, H5S_ALL, H5P_DEFAULT, v.data()), 0) << p;
    H5Sclose(sp);
    H5Dclose(ds);
  }
  for (const char* a : {"/:step", "/:data_cursor", "/:data_tokens", "/:data_fingerprint", "/optimizer:step"}) {
    const std::string obj(a, std::strchr(a, ':')), name(std::strchr(a, ':') + 1);
    if ((obj != "/" && H5Lexists(f, obj.c_str(), H5P_DEFAULT) <= 0) ||
        H5Aexists_by_name(f, obj.c_str(), name.c_str(), H5P_DEFAULT) <= 0)
      continue;
    std::int64_t v = 0;
    hid_t at = H5Aopen_by_name(f, obj.c_str(), name.c_str(), H5P_DEFAULT, H5P_DEFAULT);
    H5Aread(at, H5T_NATIVE_INT64, &v);
    H5Aclose(at);
    out[a] = {double(v)};
  }
  H5Fclose(f);
  return out;
}

}  // namespace

// A file as builds before format 2 wrote it: HDF5's default (oldest) format,
// contiguous datasets without checksums, format_version 1.
template <class S>
void write_version1(const std::string& path, const Config& cfg, const ParamSet<S>& ps, std::int64_t step) {
  hid_t f = H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
  const auto& d = ps.dims();
  auto i64 = [&](const char* name, std::int64_t v) {
    hid_t sp = H5Screate(H5S_SCALAR);
    hid_t a = H5Acreate2(f, name, H5T_NATIVE_INT64, sp, H5P_DEFAULT, H5P_DEFAULT);
    H5Awrite(a, H5T_NATIVE_INT64, &v);
    H5Aclose(a);
    H5Sclose(sp);
  };
  auto str = [&](const char* name, const std::string& v) { replace_attr_str(f, name, v); };
  i64("format_version", 1);
  i64("vocab", d.vocab);
  i64("width", d.width);
  i64("state", d.state);
  i64("layers", d.layers);
  i64("seed", std::int64_t(d.seed));
  str("precision", sizeof(S) == 8 ? "double" : "float");
  i64("step", step);
  i64("data_cursor", 0);
  str("rng_state", "splitmix64(seed=7, step=0)");
  str("engine", "backprop");
  str("config", cfg.json().dump());
  hid_t lcpl = H5Pcreate(H5P_LINK_CREATE);
  H5Pset_create_intermediate_group(lcpl, 1);
  const auto host = to_host(ps);
  for (const auto& t : ps.tensors()) {
    std::vector<hsize_t> dims(t.shape.begin(), t.shape.end());
    hid_t sp = H5Screate_simple(int(dims.size()), dims.data(), nullptr);
    hid_t ds = H5Dcreate2(f, ("/params/" + t.name).c_str(), sizeof(S) == 8 ? H5T_IEEE_F64LE : H5T_IEEE_F32LE, sp,
                          lcpl, H5P_DEFAULT, H5P_DEFAULT);
    H5Dwrite(ds, H5T_NATIVE_DOUBLE, H5S_ALL, H5S_ALL, H5P_DEFAULT, host.data() + t.offset);
    H5Dclose(ds);
    H5Sclose(sp);
  }
  H5Pclose(lcpl);
  H5Fclose(f);
}

TEST(Reliability, Version1FilesStillLoad) {
  const auto d = tiny_dims(2);
  const auto ps = random_model<double>(d, 6);
  const auto v1 = tmp_path("v1.h5");
  write_version1(v1, config_for(d), ps, 4);
  CheckpointInfo info;
  EXPECT_EQ(to_host(load_checkpoint<double>(v1, &info)), to_host(ps));
  EXPECT_EQ(info.format_version, 1);
  EXPECT_EQ(info.step, 4);
  const auto r = run("inspect " + v1);
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("format_version 1"), std::string::npos) << r.out;
  // The strict checks other than the checksum apply to version 1 too.
  rewrite_attr_i64(v1, "step", -1);
  expect_error([&] { load_checkpoint<double>(v1); }, "negative");
}

// `ash inspect --upgrade` (issue 35): a genuine format-1 or format-2 file is
// checked with what its format has, then rewritten as format 3 with the same
// values (bit for bit, in the stored precision) and digests; a file that fails
// its checks is refused and nothing is written; never in place unless asked.
TEST(Reliability, InspectUpgradeWritesFormat3) {
  const auto d = tiny_dims(2);
  const Config cfg = config_for(d);
  auto has_digest = [](const std::string& path, const char* obj) {
    hid_t f = H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
    const bool yes = H5Aexists_by_name(f, obj, "digest", H5P_DEFAULT) > 0;
    H5Fclose(f);
    return yes;
  };
  // Format 1, double: a new file beside the old one, which stays as it was.
  const auto ps = random_model<double>(d, 6);
  const auto v1 = tmp_path("up_v1.h5"), v1_new = tmp_path("up_v1_new.h5");
  std::remove(v1_new.c_str());
  write_version1(v1, cfg, ps, 4);
  const auto v1_bytes = slurp(v1);
  auto r = run("inspect " + v1 + " --upgrade --out " + v1_new);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("checkpoint format 1: no checksums to check"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("wrote '" + v1_new + "', checkpoint format 3"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("warning"), std::string::npos) << r.out;
  EXPECT_EQ(slurp(v1), v1_bytes);
  CheckpointInfo info;
  EXPECT_EQ(to_host(load_checkpoint<double>(v1_new, &info)), to_host(ps));
  EXPECT_EQ(info.format_version, 3);
  EXPECT_EQ(info.step, 4);
  EXPECT_TRUE(has_digest(v1_new, "/") && has_digest(v1_new, "/params/head"));
  r = run("inspect " + v1_new);
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("verified: the header digest and every dataset's digest"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("warning"), std::string::npos) << r.out;
  // A format-3 file is verified and left alone.
  const auto again = tmp_path("up_again.h5");
  std::remove(again.c_str());
  r = run("inspect " + v1_new + " --upgrade --out " + again);
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("already checkpoint format 3"), std::string::npos) << r.out;
  EXPECT_FALSE(fs::exists(again));

  // Format 2, float, with what training adds (moments, carried state, the token
  // file's size and fingerprint), upgraded in place.
  ParamSet<float> pf(d), m(d), v(d);
  from_host(pf, to_host(random_model<double>(d, 7)));
  from_host(m, to_host(random_model<double>(d, 8)));
  from_host(v, to_host(random_model<double>(d, 9)));
  std::vector<View2<float>> carry;
  for (int k = 0; k < 2; ++k) {
    carry.emplace_back("carry", 3 * d.width, d.state);
    Kokkos::deep_copy(carry.back(), 0.25f * float(k + 1));
  }
  const auto v2 = tmp_path("up_v2.h5");
  save_checkpoint(v2, cfg, pf, 5, 50, OptimizerState<float>{&m, &v, 5, &carry, 1234, 99});
  downgrade_to_v2(v2);
  ASSERT_FALSE(has_digest(v2, "/"));
  const auto v2_values = file_values(v2);
  EXPECT_EQ(v2_values.size(), 3 * param_layout(d).size() + 1 + 5);  // params, m, v, carry; 5 numbers
  r = run("inspect " + v2 + " --upgrade --in-place");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("checkpoint format 2: every dataset's Fletcher-32 checksums"), std::string::npos) << r.out;
  EXPECT_EQ(file_values(v2), v2_values);  // every value, bit for bit
  EXPECT_EQ(to_host(load_checkpoint<float>(v2, &info)), to_host(pf));
  EXPECT_EQ(info.format_version, 3);
  EXPECT_EQ(info.precision, "float");
  EXPECT_TRUE(has_digest(v2, "/") && has_digest(v2, "/optimizer/m/head") && has_digest(v2, "/train/carry_state"));

  // A format-2 gradient file.
  const auto gpath = tmp_path("up_grad.h5"), gnew = tmp_path("up_grad_new.h5");
  save_gradients(gpath, cfg, 1.25, random_model<double>(d, 10));
  downgrade_to_v2(gpath);
  r = run("inspect " + gpath + " --upgrade --out " + gnew);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(file_values(gnew), file_values(gpath));
  EXPECT_EQ(file_values(gnew).count("/loss"), 1u);
  EXPECT_EQ(inspect_checkpoint(gnew, Verify::all).format_version, 3);

  // Refused, nothing written: a format-2 file whose data fails Fletcher-32, a
  // format-1 file holding a NaN, a lowered format_version, and the options.
  const auto bad = tmp_path("up_bad.h5"), bad_new = tmp_path("up_bad_new.h5");
  std::remove(bad_new.c_str());
  save_checkpoint(bad, cfg, ps);
  downgrade_to_v2(bad);
  const auto bytes = flip_bit_in_w_b(bad, ps);
  ASSERT_NE(bytes, "");
  EXPECT_CLEAR_ERROR(run("inspect " + bad + " --upgrade --out " + bad_new),
                     "checksum mismatch in dataset /params/layers/001/W_B");
  EXPECT_FALSE(fs::exists(bad_new));
  EXPECT_CLEAR_ERROR(run("inspect " + bad + " --upgrade --in-place"), "checksum mismatch");
  EXPECT_EQ(slurp(bad), bytes);
  auto nan_model = to_host(ps);
  nan_model[3] = std::nan("");
  ParamSet<double> pn(d);
  from_host(pn, nan_model);
  write_version1(bad, cfg, pn, 0);
  EXPECT_CLEAR_ERROR(run("inspect " + bad + " --upgrade --out " + bad_new), "non-finite");
  EXPECT_FALSE(fs::exists(bad_new));
  const auto lowered = tmp_path("up_lowered.h5");
  save_checkpoint(lowered, cfg, ps);
  set_format_version(lowered, 2);
  EXPECT_CLEAR_ERROR(run("inspect " + lowered + " --upgrade --out " + bad_new), "contradict");
  EXPECT_FALSE(fs::exists(bad_new));
  EXPECT_CLEAR_ERROR(run("inspect " + gpath + " --upgrade"), "give --out NEW.h5");
  EXPECT_CLEAR_ERROR(run("inspect " + gpath + " --upgrade --out " + gpath), "is the same file as the checkpoint");
  EXPECT_EQ(run("inspect " + gpath + " --out " + bad_new).code, 2);
  EXPECT_EQ(run("inspect " + gpath + " --upgrade --no-verify --in-place").code, 2);
  EXPECT_EQ(inspect_checkpoint(gpath, Verify::all).format_version, 2);
  for (const auto& p : {v1, v1_new, v2, gpath, gnew, bad, lowered}) std::remove(p.c_str());
}

TEST(Reliability, StrictSchemaOnRead) {
  const auto d = tiny_dims(2);
  const auto ps = random_model<double>(d, 1);
  const auto good = tmp_path("good.h5");
  save_checkpoint(good, config_for(d), ps, 3, 5);
  const auto bytes = slurp(good);
  auto fresh = [&](const std::string& name) {
    const auto p = tmp_path(name);
    write(p, bytes);
    return p;
  };
  auto load = [](const std::string& p) { return [p] { load_checkpoint<double>(p); }; };

  const auto f16 = fresh("f16.h5");
  hid_t half = H5Tcopy(H5T_IEEE_F32LE);
  H5Tset_fields(half, 15, 10, 5, 0, 10);
  H5Tset_precision(half, 16);
  H5Tset_size(half, 2);
  H5Tset_ebias(half, 15);
  rewrite_dataset(f16, "/params/layers/000/D", half);
  H5Tclose(half);
  expect_error(load(f16), "/params/layers/000/D is float16");
  const auto i32 = fresh("i32.h5");
  rewrite_dataset(i32, "/params/head", H5T_STD_I32LE);
  expect_error(load(i32), "/params/head is int32");

  const auto v15 = fresh("v15.h5");
  const double one_half = 1.5;
  rewrite_attr(v15, "format_version", H5T_IEEE_F64LE, H5T_NATIVE_DOUBLE, &one_half);
  expect_error(load(v15), "'format_version' is not an integer");
  // Edited values: the header digest refuses them; resealed (as a tool that
  // knows the format could), the value checks do.
  const auto neg = fresh("neg.h5");
  rewrite_attr_i64(neg, "step", -5);
  expect_error(load(neg), "checksum mismatch in the header of '" + neg + "'");
  reseal(neg);
  expect_error(load(neg), "step -5 is negative");
  const auto cur = fresh("cursor.h5");
  rewrite_attr_i64(cur, "data_cursor", -1);
  reseal(cur);
  expect_error(load(cur), "data_cursor -1 is negative");
  const auto prec = fresh("half.h5");
  {
    hid_t t = H5Tcopy(H5T_C_S1);
    H5Tset_size(t, 4);
    rewrite_attr(prec, "precision", t, t, "half");
    H5Tclose(t);
  }
  reseal(prec);
  expect_error(load(prec), "precision 'half'");

  // A dataset without the checksum filter: refused in formats 3 and 2,
  // accepted in a version 1 file (written before checksums), with the same values.
  const auto nosum = fresh("nosum.h5");
  rewrite_dataset(nosum, "/params/final_norm", H5T_IEEE_F64LE);
  expect_error(load(nosum), "has no Fletcher-32 checksum (format 3 has one)");
  downgrade_to_v2(nosum);  // a format-2 file: no digest left (a lowered version alone is refused)
  expect_error(load(nosum), "has no Fletcher-32 checksum (format 2 has one)");
  set_format_version(nosum, 1);
  EXPECT_EQ(to_host(load_checkpoint<double>(nosum)), to_host(ps));
  CheckpointInfo info;
  load_checkpoint<double>(good, &info);
  EXPECT_EQ(info.format_version, 3);

  // NaN parameters: refused on load, so `generate` exits 2 instead of
  // printing only the prompt.
  const auto nan = fresh("nan.h5");
  {
    auto v = to_host(ps);
    v[3] = std::nan("");
    auto bad = random_model<double>(d, 1);
    from_host(bad, v);
    hid_t f = H5Fopen(nan.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
    hid_t ds = H5Dopen2(f, "/params/embedding", H5P_DEFAULT);
    H5Dwrite(ds, H5T_NATIVE_DOUBLE, H5S_ALL, H5S_ALL, H5P_DEFAULT, v.data());
    H5Dclose(ds);
    H5Fclose(f);
  }
  expect_error(load(nan), "checksum mismatch in dataset /params/embedding");
  reseal(nan);  // a NaN written by a tool that sealed it
  expect_error(load(nan), "holds a non-finite value");
  EXPECT_CLEAR_ERROR(run("generate --checkpoint " + nan + " --prompt ab --tokens 3"), "non-finite");
}

// A flipped bit in a parameter is found by the checksum and named.
TEST(Reliability, FlippedBitInAParameterIsAChecksumError) {
  const auto d = tiny_dims(2);
  const auto ps = random_model<double>(d, 2);
  const auto path = tmp_path("flip.h5");
  save_checkpoint(path, config_for(d), ps);
  ASSERT_NE(flip_bit_in_w_b(path, ps), "");
  expect_error([&] { load_checkpoint<double>(path); }, "checksum mismatch in dataset /params/layers/001/W_B of '" +
                                                           path + "'");
  // `ash inspect` reads every dataset; --no-verify only the intact header.
  EXPECT_CLEAR_ERROR(run("inspect " + path), "checksum mismatch in dataset /params/layers/001/W_B of '" + path + "'");
  const auto r = run("inspect --no-verify " + path);
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("not verified (--no-verify)"), std::string::npos) << r.out;
}

// Hostile files through the tool (docs/file_format.md, "How files are read
// and checked"): each verb exits 2 with a message, none hangs. `timeout`
// turns a hang into status 124.
TEST(Reliability, HostileCheckpointsAreRefusedWithoutHanging) {
  const auto corpus = corpus_file(), ckpt = tmp_path("m.h5"), donor = tmp_path("donor.h5");
  ASSERT_EQ(run("init " + small_model + "--out " + ckpt).code, 0);
  ASSERT_EQ(run("init " + small_model + "--set model.seed=99 --out " + donor).code, 0);
  const auto fifo = tmp_path("fifo");
  fs::remove(fifo);
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  auto verbs = [&](const std::string& file) { return reading_verbs(file, corpus); };
  auto timed = [](const std::string& args) { return run_shell("timeout 60 " + std::string(cli_path()) + " " + args); };
  for (const auto& v : verbs(fifo)) EXPECT_CLEAR_ERROR(timed(v), "'" + fifo + "' is not a regular file");

  auto linked = [&](const std::string& name, const std::string& target, const char* in_target, bool v2 = false) {
    const auto p = tmp_path(name);
    write(p, slurp(ckpt));
    if (v2) downgrade_to_v2(p);  // no digest to notice the missing /params
    hid_t f = H5Fopen(p.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
    H5Ldelete(f, "/params", H5P_DEFAULT);
    EXPECT_GE(H5Lcreate_external(target.c_str(), in_target, f, "/params", H5P_DEFAULT, H5P_DEFAULT), 0);
    H5Fclose(f);
    return p;
  };
  // (c) /params an external link into a FIFO: HDF5 would block opening it.
  for (const bool v2 : {false, true}) {
    const auto to_fifo = linked(v2 ? "to_fifo_v2.h5" : "to_fifo.h5", fifo, "/", v2);
    for (const auto& v : verbs(to_fifo)) EXPECT_CLEAR_ERROR(timed(v), "/params is an external link");
  }
  // (a) into another checkpoint: its parameters would load silently.
  const auto to_donor = linked("to_donor.h5", donor, "/params");
  EXPECT_CLEAR_ERROR(timed("generate --checkpoint " + to_donor + " --prompt ab --tokens 2"),
                     "not an ash checkpoint: '" + to_donor + "': /params is an external link");
  // (b) a soft link: head read from the embedding.
  const auto soft = tmp_path("soft.h5");
  write(soft, slurp(ckpt));
  {
    hid_t f = H5Fopen(soft.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
    H5Ldelete(f, "/params/head", H5P_DEFAULT);
    EXPECT_GE(H5Lcreate_soft("/params/embedding", f, "/params/head", H5P_DEFAULT, H5P_DEFAULT), 0);
    H5Fclose(f);
  }
  EXPECT_CLEAR_ERROR(timed("inspect --no-verify " + soft), "/params/head is a soft link");
  // (d) an edited step and an edited configuration: the header digest.
  const auto step = tmp_path("step.h5");
  write(step, slurp(ckpt));
  rewrite_attr_i64(step, "step", 3);
  EXPECT_CLEAR_ERROR(timed("inspect " + step), "checksum mismatch in the header of '" + step + "'");
  EXPECT_CLEAR_ERROR(timed("generate --checkpoint " + step + " --prompt ab --tokens 2"), "checksum mismatch");
  const auto r = timed("inspect --no-verify " + step);
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("step 3"), std::string::npos) << r.out;
  // (e) a parameter deleted from a format-2 file (no digest to notice): inspect lists it
  // as missing and does not call the file verified; --no-verify lists it, exit 0.
  const auto holed = tmp_path("holed.h5");
  write(holed, slurp(ckpt));
  downgrade_to_v2(holed);
  {
    hid_t f = H5Fopen(holed.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
    H5Ldelete(f, "/params/layers/001/D", H5P_DEFAULT);
    H5Fclose(f);
  }
  const auto hr = timed("inspect " + holed);
  EXPECT_CLEAR_ERROR(hr, "is incomplete: /params/layers/001/D missing");
  EXPECT_EQ(hr.out.find("verified:"), std::string::npos) << hr.out;
  const auto hn = timed("inspect --no-verify " + holed);
  EXPECT_EQ(hn.code, 0) << hn.out;
  EXPECT_NE(hn.out.find("missing"), std::string::npos) << hn.out;
  EXPECT_CLEAR_ERROR(timed("generate --checkpoint " + holed + " --prompt ab --tokens 2"), "layers/001/D");
  fs::remove(fifo);
}

// Fuzz: seeded byte flips and truncations of a checkpoint with optimizer
// state. Every load ends in identical values or an ash::Error.
TEST(Reliability, FuzzedCheckpointsLoadIdenticallyOrFailCleanly) {
  const auto d = tiny_dims(2);
  const auto ps = random_model<float>(d, 3);
  ParamSet<float> m(d), v(d);
  from_host(m, to_host(random_model<float>(d, 4)));
  auto vh = to_host(random_model<float>(d, 5));
  for (auto& x : vh) x = x * x;
  from_host(v, vh);
  const auto good = tmp_path("fuzz_good.h5");
  save_checkpoint(good, config_for(d), ps, 9, 77, OptimizerState<float>{&m, &v, 9});
  const std::string bytes = slurp(good);
  const auto want_p = to_host(ps), want_m = to_host(m), want_v = to_host(v);
  const auto path = tmp_path("fuzz.h5");
  // ASH_FUZZ_CASES / ASH_FUZZ_SEED run a longer campaign by hand.
  const int cases = std::getenv("ASH_FUZZ_CASES") ? std::atoi(std::getenv("ASH_FUZZ_CASES")) : 400;
  std::mt19937_64 gen(std::getenv("ASH_FUZZ_SEED") ? std::strtoull(std::getenv("ASH_FUZZ_SEED"), nullptr, 10) : 2024);
  int identical = 0, errors = 0;
  for (int i = 0; i < cases; ++i) {
    std::string b = bytes;
    if (i % 8 == 7) {
      b.resize(std::size_t(gen() % b.size()));  // truncation
    } else {
      const std::size_t at = std::size_t(gen() % b.size());
      b[at] = char(b[at] ^ char(1u << (gen() % 8)));
    }
    write(path, b);
    try {
      CheckpointInfo info;
      const auto got = load_checkpoint<float>(path, &info);
      ParamSet<float> gm(d), gv(d);
      std::int64_t step = 0;
      ASSERT_TRUE(load_optimizer_state(path, gm, gv, &step)) << "case " << i;
      EXPECT_EQ(to_host(got), want_p) << "case " << i << ": silently different parameters";
      EXPECT_EQ(to_host(gm), want_m) << "case " << i;
      EXPECT_EQ(to_host(gv), want_v) << "case " << i;
      EXPECT_EQ(info.step, 9) << "case " << i;
      EXPECT_EQ(info.data_cursor, 77) << "case " << i;
      EXPECT_EQ(step, 9) << "case " << i;
      EXPECT_TRUE(info.dims == d) << "case " << i;
      ++identical;
    } catch (const Error&) {
      ++errors;
    }
  }
  // Parameters and moments are most of the file: most flips must be caught.
  EXPECT_GT(errors, cases / 2);
  std::printf("fuzz: %d identical loads, %d clear errors\n", identical, errors);
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
// its size (issue 45, G3): each run has a timeout far above the linear parser's
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
// before it reads a tensor (issue 45, G4: a 540 MB BF16 folder grew to 2.1 GB
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

// ---- 8. hostile paths (issue 35): links are never written through ---------

namespace {

// `ash ARGS` under a timeout (a hang is status 124).
CliResult timed(const std::string& args) { return run_shell("timeout 120 " + std::string(cli_path()) + " " + args); }

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
// a regular file. A link at --out itself, or at the run's checkpoint, is
// replaced by the rename; one at metrics.jsonl (appended to, never renamed)
// is refused. The victim is never touched.
TEST(Reliability, OutputLinksAreReplacedNeverWrittenThrough) {
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
    // A link at --out: replaced by the new file.
    fs::remove(out);
    fs::create_symlink(victim, out);
    const auto r2 = timed(args);
    EXPECT_EQ(r2.code, 0) << r2.out;
    EXPECT_FALSE(fs::is_symlink(out));
    EXPECT_TRUE(slurp(victim) == before);
  }

  const auto dir = tmp_path("linked_outputs");
  const auto train = "train " + small_model + "--set data.train=" + corpus + " --set optim.steps=2 --set run.out_dir=" + dir;
  fs::remove_all(dir);
  fs::create_directories(dir);
  fs::create_symlink(victim, dir + "/checkpoint.h5");
  auto r = timed(train);
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_FALSE(fs::is_symlink(dir + "/checkpoint.h5"));
  EXPECT_EQ(checkpoint_step(dir + "/checkpoint.h5"), 2);
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

// ---- 9. a lowered format_version (issue 35) ---------------------------------

namespace {

// Rewrites every value of a dataset through HDF5 (Fletcher-32 recomputed,
// the digest not).
void set_all_values(const std::string& path, const char* ds_path, double value) {
  hid_t f = H5Fopen(path.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
  hid_t ds = H5Dopen2(f, ds_path, H5P_DEFAULT);
  hid_t sp = H5Dget_space(ds);
  std::vector<double> v(static_cast<std::size_t>(H5Sget_simple_extent_npoints(sp)), value);
  EXPECT_GE(H5Dwrite(ds, H5T_NATIVE_DOUBLE, H5S_ALL, H5S_ALL, H5P_DEFAULT, v.data()), 0);
  H5Sclose(sp);
  H5Dclose(ds);
  H5Fclose(f);
}

}  // namespace

// Setting format_version from 3 to 2 or 1 would switch the digests off and let
// an edit load: every verb refuses a file whose declared version its digests
// contradict. A genuine format-2 file still loads, with one warning on stderr
// naming the weaker check.
TEST(Reliability, LoweredFormatVersionIsRefusedAndFormat2Warns) {
  const auto corpus = corpus_file(), ckpt = tmp_path("m.h5");
  ASSERT_EQ(run("init " + small_model + "--out " + ckpt).code, 0);
  auto verbs = [&](const std::string& file) {
    return reading_verbs(file, corpus, "--set optim.steps=1 --set run.precision=double ");
  };
  for (const int v : {2, 1}) {
    SCOPED_TRACE("format_version " + std::to_string(v));
    const auto lowered = tmp_path("lowered" + std::to_string(v) + ".h5");
    write(lowered, slurp(ckpt));
    set_all_values(lowered, "/params/final_norm", 3.0);
    set_format_version(lowered, v);
    for (const auto& verb : verbs(lowered))
      EXPECT_CLEAR_ERROR(timed(verb), "'" + lowered + "' declares checkpoint format version " + std::to_string(v) +
                                          ", which its contents contradict: the root carries a format-3 digest");
  }
  // Only one dataset's digest left behind is enough.
  const auto one = tmp_path("one_digest.h5");
  write(one, slurp(ckpt));
  downgrade_to_v2(one);
  {
    hid_t f = H5Fopen(one.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
    hid_t ds = H5Dopen2(f, "/params/head", H5P_DEFAULT);
    add_zero_digest(ds);
    H5Dclose(ds);
    H5Fclose(f);
  }
  EXPECT_CLEAR_ERROR(timed("inspect " + one), "contradict: /params/head carries a format-3 digest attribute");

  // A genuine format-2 file: loads, one warning per run naming Fletcher-32.
  const auto v2 = tmp_path("genuine_v2.h5");
  write(v2, slurp(ckpt));
  downgrade_to_v2(v2);
  const std::string warning = "ash: warning: '" + v2 + "' is checkpoint format 2: its data is checked by Fletcher-32 only";
  for (const auto& verb : verbs(v2)) {
    SCOPED_TRACE(verb);
    const auto r = timed(verb);
    EXPECT_EQ(r.code, 0) << r.out;
    const auto at = r.out.find(warning);
    EXPECT_NE(at, std::string::npos) << r.out;
    if (at != std::string::npos) EXPECT_EQ(r.out.find(warning, at + 1), std::string::npos) << "warned twice:\n" << r.out;
  }
  const auto r3 = timed("inspect " + ckpt);
  EXPECT_EQ(r3.code, 0) << r3.out;
  EXPECT_EQ(r3.out.find("warning"), std::string::npos) << r3.out;
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

// ---- 11. declared shapes and non-finite values in `ash inspect` (issue 35) --

namespace {

// Replaces dataset `ds_path` by an empty one of shape `dims`: float32, chunked
// with Fletcher-32 as formats 2 and 3 write (chunks of at most 2^20
// elements), never written, so a few hundred bytes declare any size. With
// `digest` it carries a digest attribute (a wrong one), so that a format-3
// reader gets as far as reading it; the header digest is then recomputed.
void declare_shape(const std::string& path, const char* ds_path, const std::vector<hsize_t>& dims, bool digest) {
  hid_t f = H5Fopen(path.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
  ASSERT_GE(f, 0) << path;
  EXPECT_GE(H5Ldelete(f, ds_path, H5P_DEFAULT), 0);
  hid_t sp = H5Screate_simple(int(dims.size()), dims.data(), nullptr);
  std::vector<hsize_t> chunk(dims.size(), 1);
  chunk.back() = std::min<hsize_t>(dims.back(), hsize_t(1) << 20);
  hid_t dcpl = H5Pcreate(H5P_DATASET_CREATE);
  H5Pset_chunk(dcpl, int(chunk.size()), chunk.data());
  H5Pset_fletcher32(dcpl);
  hid_t ds = H5Dcreate2(f, ds_path, H5T_IEEE_F32LE, sp, H5P_DEFAULT, dcpl, H5P_DEFAULT);
  EXPECT_GE(ds, 0) << ds_path;
  if (digest) add_zero_digest(ds);
  H5Dclose(ds);
  H5Pclose(dcpl);
  H5Sclose(sp);
  if (digest) io::seal_header(f);
  H5Fclose(f);
}

// The tool under a time limit and, on a host backend, a 1 GB address-space
// limit (inspect of a good file needs about 25 MB; a device backend reserves
// more than that to start): a hang is status 124, an allocation of what the
// file declares fails instead of swapping the machine.
CliResult bounded(const std::string& args) {
  const std::string limit = host_backend ? "ulimit -v 1000000; " : "";
  return run_shell("PMIX_MCA_gds=hash bash -c '" + limit + "exec timeout 60 " + std::string(cli_path()) + " " + args +
                   "'");
}

}  // namespace

// A dataset's shape is a number in the file (its dataspace): every one is
// checked against the model sizes, its type and storage too, before anything
// is read or sized from it. `ash inspect` used to read first: an 84 KB file
// declaring /params/final_norm [2^40] hung it (4 TiB of fill values read),
// /params/embedding [2^31, 2^31] made it allocate 8 GiB for one row; now every
// verb, `inspect --no-verify` too, exits 2 naming the shape, in seconds, in
// formats 3 (digest attributes present, header resealed) and 2.
TEST(Reliability, DeclaredShapesAreCheckedBeforeAnythingIsRead) {
  const auto corpus = corpus_file(), ckpt = tmp_path("m.h5");
  ASSERT_EQ(run("init " + small_model + "--out " + ckpt).code, 0);
  const auto d = inspect_checkpoint(ckpt).dims;
  const hsize_t huge = hsize_t(1) << 40, wide = hsize_t(1) << 31;
  struct Case {
    const char* ds;
    std::vector<hsize_t> dims;
    std::string want;
  };
  const std::vector<Case> cases{
      {"/params/final_norm", {huge}, "dataset /params/final_norm has shape [1099511627776], expected [" +
                                         std::to_string(d.width) + "] from the model sizes"},
      {"/params/embedding", {wide, wide}, "dataset /params/embedding has shape [2147483648,2147483648], expected [" +
                                              std::to_string(d.vocab) + "," + std::to_string(d.width) +
                                              "] from the model sizes"}};
  for (const auto& c : cases)
    for (const bool v2 : {false, true}) {
      const auto p = tmp_path(std::string(v2 ? "v2" : "v3") + (c.dims.size() == 1 ? "_norm.h5" : "_embedding.h5"));
      SCOPED_TRACE(p);
      write(p, slurp(ckpt));
      if (v2) downgrade_to_v2(p);
      declare_shape(p, c.ds, c.dims, !v2);
      EXPECT_LT(fs::file_size(p), std::uintmax_t(200000));
      for (const std::string verb : {"inspect ", "inspect --no-verify "}) {
        const auto t0 = std::chrono::steady_clock::now();
        EXPECT_CLEAR_ERROR(bounded(verb + p), "'" + p + "': " + c.want);
        EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 30.0) << verb;
      }
      for (const auto& verb : {"generate --checkpoint " + p + " --prompt ab --tokens 2",
                               "eval --checkpoint " + p + " --tokens " + corpus,
                               "grad --checkpoint " + p + " --tokens " + corpus + " --out " + tmp_path("g.h5")})
        EXPECT_CLEAR_ERROR(timed(verb), c.want);
    }
}

// `ash inspect` reads every value, so it checks them as the other verbs do: a
// NaN or an infinity is exit 2 naming the dataset (it used to print
// "verified" and exit 0 for a file generate, grad and eval refuse), and a
// good file says how many values it found finite.
TEST(Reliability, InspectRefusesNonFiniteValues) {
  const auto ckpt = tmp_path("m.h5");
  ASSERT_EQ(run("init " + small_model + "--out " + ckpt).code, 0);
  const auto good = timed("inspect " + ckpt);
  EXPECT_EQ(good.code, 0) << good.out;
  EXPECT_NE(good.out.find("parameters: 4472\n"), std::string::npos) << good.out;
  EXPECT_NE(good.out.find("all 4472 values finite"), std::string::npos) << good.out;
  EXPECT_EQ(timed("inspect --no-verify " + ckpt).out.find("finite"), std::string::npos);
  for (const bool v2 : {false, true})
    for (const double bad : {std::nan(""), -HUGE_VAL}) {
      const auto p = tmp_path(std::string(v2 ? "v2" : "v3") + (std::isnan(bad) ? "_nan.h5" : "_inf.h5"));
      SCOPED_TRACE(p);
      write(p, slurp(ckpt));
      if (v2) downgrade_to_v2(p);
      set_all_values(p, "/params/layers/001/D", bad);
      if (!v2) reseal(p);  // consistent digests: the value check, not the digest, must refuse it
      EXPECT_CLEAR_ERROR(timed("inspect " + p), "dataset /params/layers/001/D of '" + p + "' holds a non-finite value");
      EXPECT_CLEAR_ERROR(timed("generate --checkpoint " + p + " --prompt ab --tokens 2"), "non-finite");
    }
}

}  // namespace ash::test
