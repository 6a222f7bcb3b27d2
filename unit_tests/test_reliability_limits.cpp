// Reliability (docs/design.md §7) at the machine's limits: absurd sizes refused
// before allocating, an allocation that fails anyway, a file-size limit that keeps
// the previous file. Every case ends in a clear error (exit 2), never a crash.
#include <fstream>

#include "reliability_helpers.hpp"

namespace ash::test {

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

}  // namespace ash::test
