// Reliability (docs/design.md §7) of reading a checkpoint: the strict schema and
// checksums, hostile files (links, FIFOs, edited headers, missing datasets), a fuzz
// test of corruption, declared shapes checked before anything is read, non-finite
// values. Every load gives the same values or a clear error, and never hangs.
#include <sys/stat.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>

#include "reliability_helpers.hpp"

namespace ash::test {

// ---- 3. strict schema and checksums ----------------------------------------

namespace {

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
