// HDF5 checkpoints: round trip, and every way a file can be bad: the
// digests of format 3, the closed schema (links, names) and format 2 / 1
// files that still load (docs/file_format.md).
#include <hdf5.h>
#include <sys/stat.h>
#include <xxhash.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "test_helpers.hpp"

namespace ash::test {

namespace {

std::string copy_of(const std::string& from, const std::string& name) {
  const auto p = tmp_path(name);
  std::ofstream(p, std::ios::binary) << slurp(from);
  return p;
}

// Runs f on the file opened read-write with the HDF5 API (the test's own edits).
template <class F>
void edit(const std::string& path, F&& f) {
  hid_t file = H5Fopen(path.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
  ASSERT_GE(file, 0) << path;
  f(file);
  ASSERT_GE(H5Fclose(file), 0);
}

std::uint64_t digest_attr_of(hid_t loc, const char* obj) {
  std::uint64_t v = 0;
  hid_t a = H5Aopen_by_name(loc, obj, "digest", H5P_DEFAULT, H5P_DEFAULT);
  EXPECT_GE(a, 0) << obj;
  H5Aread(a, H5T_NATIVE_UINT64, &v);
  H5Aclose(a);
  return v;
}

// Overwrites bytes of a file in place (raw corruption, below HDF5).
void patch(const std::string& path, std::uint64_t at, const std::string& bytes) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekp(std::streamoff(at));
  f.write(bytes.data(), std::streamsize(bytes.size()));
}

void flip_bit(const std::string& path, std::uint64_t at) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(std::streamoff(at));
  char c = 0;
  f.read(&c, 1);
  c = char(c ^ 0x10);
  f.seekp(std::streamoff(at));
  f.write(&c, 1);
}

// File offset of element 0 of a single-chunk dataset.
std::uint64_t chunk_address(const std::string& path, const char* ds_path) {
  hid_t f = H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
  hid_t ds = H5Dopen2(f, ds_path, H5P_DEFAULT);
  hid_t sp = H5Dget_space(ds);
  hsize_t offset[1] = {0}, size = 0;
  unsigned mask = 0;
  haddr_t addr = HADDR_UNDEF;
  EXPECT_GE(H5Dget_chunk_info(ds, sp, 0, offset, &mask, &addr, &size), 0);
  H5Sclose(sp);
  H5Dclose(ds);
  H5Fclose(f);
  return addr;
}

}  // namespace

template <class S>
class Checkpoint : public ::testing::Test {};
TYPED_TEST_SUITE(Checkpoint, Scalars);

TYPED_TEST(Checkpoint, RoundTripIsBitwise) {
  using S = TypeParam;
  const auto d = tiny_dims(3);
  auto ps = random_model<S>(d, 1);
  const auto path = tmp_path("roundtrip.h5");
  auto cfg = config_for(d);
  cfg.set("data.seq_len=77");
  save_checkpoint(path, cfg, ps, 42, 1000);
  CheckpointInfo info;
  auto back = load_checkpoint<S>(path, &info);
  EXPECT_EQ(to_host(back), to_host(ps));
  EXPECT_EQ(info.step, 42);
  EXPECT_EQ(info.data_cursor, 1000);
  EXPECT_EQ(info.precision, sizeof(S) == 8 ? "double" : "float");
  EXPECT_EQ(info.config.settings().data.seq_len, 77);
  EXPECT_TRUE(info.dims == d);
  EXPECT_EQ(info.format_version, 3);
  const auto ins = inspect_checkpoint(path, Verify::all);
  ASSERT_EQ(ins.datasets.size(), ps.tensors().size());
  for (std::size_t i = 0; i < ins.datasets.size(); ++i) {
    EXPECT_EQ(ins.datasets[i].path, "/params/" + ps.tensors()[i].name);
    EXPECT_EQ(ins.datasets[i].shape, ps.tensors()[i].shape);
    EXPECT_EQ(ins.datasets[i].dtype, sizeof(S) == 8 ? "float64" : "float32");
  }
  std::remove(path.c_str());
}

TEST(Checkpoint, FloatFileLoadsAsDouble) {
  const auto d = tiny_dims(1);
  auto ps = random_model<float>(d, 2);
  const auto path = tmp_path("f2d.h5");
  save_checkpoint(path, config_for(d), ps);
  auto back = load_checkpoint<double>(path);
  EXPECT_EQ(to_host(back), to_host(ps));  // float -> double is exact
  std::remove(path.c_str());
}

TEST(Checkpoint, GradientFileRoundTrip) {
  const auto d = tiny_dims(2);
  auto ps = random_model<double>(d, 3);
  ParamSet<double> g(d);
  const double loss = make_engine<double>(EngineOptions{})->compute(ps, random_tokens(2, 9, d.vocab, 1), g);
  const auto path = tmp_path("grad.h5");
  save_gradients(path, config_for(d), loss, g);
  double back_loss = 0;
  auto back = load_gradients(path, d, &back_loss);
  EXPECT_EQ(back_loss, loss);
  EXPECT_EQ(to_host(back), to_host(g));
  std::remove(path.c_str());
}

TEST(Checkpoint, BadFilesGiveClearErrors) {
  const auto d = tiny_dims(1);
  auto ps = random_model<double>(d, 4);
  const auto good = tmp_path("good.h5");
  save_checkpoint(good, config_for(d), ps);

  expect_error([&] { load_checkpoint<double>(tmp_path("does_not_exist.h5")); }, "cannot open");

  const auto junk = tmp_path("junk.h5");
  std::ofstream(junk) << "this is not hdf5";
  expect_error([&] { load_checkpoint<double>(junk); }, "not an HDF5 file");

  // Truncated: the first half of a good file.
  const std::string bytes = slurp(good);
  const auto cut = tmp_path("truncated.h5");
  std::ofstream(cut, std::ios::binary) << bytes.substr(0, bytes.size() / 2);
  EXPECT_THROW(load_checkpoint<double>(cut), Error);

  // Wrong version and a wrong shape, edited in place with the HDF5 API.
  const auto wrongv = tmp_path("wrong_version.h5");
  save_checkpoint(wrongv, config_for(d), ps);
  set_format_version(wrongv, 99);
  expect_error([&] { load_checkpoint<double>(wrongv); }, "format version 99");

  const auto missing = tmp_path("missing.h5");
  save_checkpoint(missing, config_for(d), ps);
  {
    hid_t f = H5Fopen(missing.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
    H5Ldelete(f, "/params/layers/000/W_B", H5P_DEFAULT);
    H5Fclose(f);
  }
  // The object list is part of the header digest; resealed, the schema check names it.
  expect_error([&] { load_checkpoint<double>(missing); }, "checksum mismatch in the header of '" + missing + "'");
  reseal(missing);
  expect_error([&] { load_checkpoint<double>(missing); }, "lacks dataset /params/layers/000/W_B");

  for (const auto& p : {good, junk, cut, wrongv, missing}) std::remove(p.c_str());
}

TEST(Checkpoint, FailedWriteKeepsThePreviousFile) {
  const auto d = tiny_dims(1);
  auto ps = random_model<double>(d, 5);
  const auto path = tmp_path("keep.h5");
  save_checkpoint(path, config_for(d), ps, 1);
  // A config whose sizes disagree with the parameters is refused before writing.
  auto other = config_for(d);
  other.set("model.width=9");
  EXPECT_THROW(save_checkpoint(path, other, ps, 2), Error);
  CheckpointInfo info;
  load_checkpoint<double>(path, &info);
  EXPECT_EQ(info.step, 1);
  // Unwritable target directory: error, no stray file.
  EXPECT_THROW(save_checkpoint("/nonexistent_dir/x.h5", config_for(d), ps), Error);
  std::remove(path.c_str());
}

// ---- format 3: digests ------------------------------------------------------

// The documented digest, computed here with xxHash directly: XXH3-64 of the
// dataset's path, a NUL and its bytes as stored (little-endian IEEE).
TYPED_TEST(Checkpoint, DatasetDigestIsXxh3OfPathAndStoredBytes) {
  using S = TypeParam;
  const auto d = tiny_dims(2);
  const auto ps = random_model<S>(d, 11);
  const auto path = tmp_path("digest.h5");
  save_checkpoint(path, config_for(d), ps);
  hid_t f = H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
  ASSERT_GE(f, 0);
  for (const auto& t : ps.tensors()) {
    const std::string p = "/params/" + t.name;
    std::string bytes = p + '\0';
    std::vector<S> v(std::size_t(t.size()));
    hid_t ds = H5Dopen2(f, p.c_str(), H5P_DEFAULT);
    H5Dread(ds, sizeof(S) == 8 ? H5T_IEEE_F64LE : H5T_IEEE_F32LE, H5S_ALL, H5S_ALL, H5P_DEFAULT, v.data());
    H5Dclose(ds);
    bytes.append(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(S));
    EXPECT_EQ(digest_attr_of(f, p.c_str()), XXH3_64bits(bytes.data(), bytes.size())) << p;
  }
  EXPECT_EQ(H5Aexists(f, "digest"), 1) << "the header digest";
  H5Fclose(f);
  std::remove(path.c_str());
}

// Fletcher-32 sums 16-bit words modulo 65535, so a word 00 00 that becomes
// FF FF passes it: in layer 0's D[0] = 1.0 of a fresh model. Format 2 loads
// the changed value silently; the digest of format 3 refuses it.
TYPED_TEST(Checkpoint, TwoBytesFletcherCannotSeeAreRefused) {
  using S = TypeParam;
  const auto d = tiny_dims(1);
  ParamSet<S> ps(d);
  initialize(ps, 5);
  const auto& D = ps.tensor("layers/000/D");
  ASSERT_EQ(to_host(ps)[std::size_t(D.offset)], 1.0);
  const auto v3 = tmp_path("ffff_v3.h5");
  save_checkpoint(v3, config_for(d), ps);
  const auto v2 = copy_of(v3, "ffff_v2.h5");
  downgrade_to_v2(v2);
  // 1.0 is 00 00 00 00 00 00 F0 3F (double) or 00 00 80 3F (float); FF FF in
  // bytes 4-5 (0-1) adds 65535 units of 2^-20 (2^-23): 1.0624990463256836
  // (1.0078123807907104).
  const std::uint64_t at = sizeof(S) == 8 ? 4 : 0;
  const double changed = sizeof(S) == 8 ? 1.0 + 65535.0 / 1048576.0 : double(1.0f + 65535.0f / 8388608.0f);
  for (const auto& p : {v3, v2}) patch(p, chunk_address(p, "/params/layers/000/D") + at, "\xff\xff");

  CheckpointInfo info;
  const auto got = to_host(load_checkpoint<S>(v2, &info));
  EXPECT_EQ(info.format_version, 2);
  EXPECT_EQ(got[std::size_t(D.offset)], changed) << "the premise: Fletcher-32 does not see this change";

  expect_error([&] { load_checkpoint<S>(v3); },
               "checksum mismatch in dataset /params/layers/000/D of '" + v3 + "' (its digest differs");
  expect_error([&] { inspect_checkpoint(v3, Verify::all); }, "checksum mismatch in dataset /params/layers/000/D");
  EXPECT_NO_THROW(inspect_checkpoint(v3, Verify::none));  // a quick look still works
  for (const auto& p : {v3, v2}) std::remove(p.c_str());
}

// Edits through the HDF5 API (which recomputes HDF5's own checksums) of a
// root attribute, the configuration, /optimizer's step, the object list and
// a dataset: all refused; resealed, each loads (or fails on its own merits).
TYPED_TEST(Checkpoint, EditedHeaderOrDataIsRefused) {
  using S = TypeParam;
  const auto d = tiny_dims(2);
  const auto ps = random_model<S>(d, 12);
  ParamSet<S> m(d), v(d);
  from_host(m, to_host(random_model<S>(d, 13)));
  from_host(v, std::vector<double>(to_host(ps).size(), 0.25));
  const auto good = tmp_path("good.h5");
  save_checkpoint(good, config_for(d), ps, 7, 70, OptimizerState<S>{&m, &v, 7});
  const std::string header = "checksum mismatch in the header of '";

  const auto step = copy_of(good, "step.h5");
  edit(step, [](hid_t f) {
    std::int64_t s = 8;
    hid_t a = H5Aopen(f, "step", H5P_DEFAULT);
    H5Awrite(a, H5T_NATIVE_INT64, &s);
    H5Aclose(a);
  });
  expect_error([&] { load_checkpoint<S>(step); }, header + step + "'");
  expect_error([&] { inspect_checkpoint(step); }, header);
  reseal(step);
  CheckpointInfo info;
  load_checkpoint<S>(step, &info);
  EXPECT_EQ(info.step, 8) << "resealed: the digest is no defence against a deliberate edit";

  // One byte of the stored JSON: "seq_len":256 -> "seq_len":257, still valid.
  const auto cfg = copy_of(good, "config.h5");
  edit(cfg, [](hid_t f) {
    hid_t a = H5Aopen(f, "config", H5P_DEFAULT);
    hid_t t = H5Aget_type(a);
    std::string text(H5Tget_size(t), '\0');
    H5Aread(a, t, &text[0]);
    const auto at = text.find("\"seq_len\":");
    ASSERT_NE(at, std::string::npos) << text;
    text[at + 10] = char(text[at + 10] == '9' ? '8' : text[at + 10] + 1);
    H5Awrite(a, t, text.data());
    H5Tclose(t);
    H5Aclose(a);
  });
  expect_error([&] { load_checkpoint<S>(cfg); }, header + cfg + "'");
  reseal(cfg);
  EXPECT_NO_THROW(load_checkpoint<S>(cfg));

  const auto opt = copy_of(good, "opt.h5");
  edit(opt, [](hid_t f) {
    std::int64_t s = 100;
    hid_t a = H5Aopen_by_name(f, "/optimizer", "step", H5P_DEFAULT, H5P_DEFAULT);
    H5Awrite(a, H5T_NATIVE_INT64, &s);
    H5Aclose(a);
  });
  ParamSet<S> m2(d), v2(d);
  std::int64_t got_step = 0;
  expect_error([&] { load_optimizer_state(opt, m2, v2, &got_step); }, header);

  const auto added = copy_of(good, "added.h5");  // an attribute no reader looks at
  edit(added, [](hid_t f) {
    hid_t sp = H5Screate(H5S_SCALAR);
    hid_t a = H5Acreate2(f, "note", H5T_NATIVE_INT64, sp, H5P_DEFAULT, H5P_DEFAULT);
    std::int64_t x = 1;
    H5Awrite(a, H5T_NATIVE_INT64, &x);
    H5Aclose(a);
    H5Sclose(sp);
  });
  expect_error([&] { load_checkpoint<S>(added); }, header);

  const auto gone = copy_of(good, "gone.h5");  // the moments removed: would restart Adam silently
  edit(gone, [](hid_t f) { H5Ldelete(f, "/optimizer", H5P_DEFAULT); });
  expect_error([&] { load_optimizer_state(gone, m2, v2, &got_step); }, header);

  const auto data = copy_of(good, "data.h5");  // one moment changed in the last bit
  edit(data, [&](hid_t f) {
    std::vector<S> x(std::size_t(ps.tensor("head").size()));
    hid_t ds = H5Dopen2(f, "/optimizer/v/head", H5P_DEFAULT);
    H5Dread(ds, std::is_same<S, double>::value ? H5T_NATIVE_DOUBLE : H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL,
            H5P_DEFAULT, x.data());
    x[3] = std::nextafter(x[3], S(1));
    H5Dwrite(ds, std::is_same<S, double>::value ? H5T_NATIVE_DOUBLE : H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL,
             H5P_DEFAULT, x.data());
    H5Dclose(ds);
  });
  EXPECT_NO_THROW(load_checkpoint<S>(data));  // only what is read is verified
  expect_error([&] { load_optimizer_state(data, m2, v2, &got_step); },
               "checksum mismatch in dataset /optimizer/v/head of '" + data + "'");

  // Swapping two datasets of one shape keeps every byte: the path in the digest sees it.
  const auto swap = copy_of(good, "swap.h5");
  edit(swap, [](hid_t f) {
    H5Lmove(f, "/params/layers/000/W_B", f, "/params/tmp", H5P_DEFAULT, H5P_DEFAULT);
    H5Lmove(f, "/params/layers/000/W_C", f, "/params/layers/000/W_B", H5P_DEFAULT, H5P_DEFAULT);
    H5Lmove(f, "/params/tmp", f, "/params/layers/000/W_C", H5P_DEFAULT, H5P_DEFAULT);
  });
  expect_error([&] { load_checkpoint<S>(swap); }, "checksum mismatch in dataset /params/layers/000/W_B");

  for (const auto& p : {good, step, cfg, opt, added, gone, data, swap}) std::remove(p.c_str());
}

// ---- the closed schema --------------------------------------------------------

// Links other than hard ones, and objects outside the format, are refused in
// format 3 and in format 2 (no digest to catch them there) alike.
TEST(Checkpoint, OnlyHardLinksAndTheFormatsObjects) {
  const auto d = tiny_dims(1);
  const auto ps = random_model<double>(d, 21), other = random_model<double>(d, 22);
  const auto good = tmp_path("good.h5"), donor = tmp_path("donor.h5");
  save_checkpoint(good, config_for(d), ps);
  save_checkpoint(donor, config_for(d), other);
  ASSERT_NE(to_host(ps), to_host(other));
  const std::string nac = "not an ash checkpoint: '";
  for (const bool v2 : {false, true}) {
    auto fresh = [&](const std::string& name) {
      const auto p = copy_of(good, (v2 ? "v2_" : "v3_") + name);
      if (v2) downgrade_to_v2(p);
      return p;
    };
    SCOPED_TRACE(v2 ? "format 2" : "format 3");
    // (a) /params an external link to another checkpoint's parameters.
    const auto ext = fresh("external.h5");
    edit(ext, [&](hid_t f) {
      H5Ldelete(f, "/params", H5P_DEFAULT);
      ASSERT_GE(H5Lcreate_external(donor.c_str(), "/params", f, "/params", H5P_DEFAULT, H5P_DEFAULT), 0);
    });
    expect_error([&] { load_checkpoint<double>(ext); }, nac + ext + "': /params is an external link");
    expect_error([&] { inspect_checkpoint(ext, Verify::none); }, "/params is an external link");
    // (b) /params/head a soft link to /params/embedding (same shape).
    const auto soft = fresh("soft.h5");
    edit(soft, [](hid_t f) {
      H5Ldelete(f, "/params/head", H5P_DEFAULT);
      ASSERT_GE(H5Lcreate_soft("/params/embedding", f, "/params/head", H5P_DEFAULT, H5P_DEFAULT), 0);
    });
    expect_error([&] { load_checkpoint<double>(soft); }, nac + soft + "': /params/head is a soft link");
    // ... or a second hard link to it.
    const auto hard = fresh("hard.h5");
    edit(hard, [](hid_t f) {
      H5Ldelete(f, "/params/head", H5P_DEFAULT);
      ASSERT_GE(H5Lcreate_hard(f, "/params/embedding", f, "/params/head", H5P_DEFAULT, H5P_DEFAULT), 0);
    });
    expect_error([&] { load_checkpoint<double>(hard); }, "is one object under 2 names");
    // Bytes kept outside the file, or behind a filter other than Fletcher-32.
    const auto efl = fresh("efl.h5");
    edit(efl, [&](hid_t f) {
      H5Ldelete(f, "/params/final_norm", H5P_DEFAULT);
      hid_t dcpl = H5Pcreate(H5P_DATASET_CREATE);
      H5Pset_external(dcpl, (good + ".raw").c_str(), 0, 64);
      hsize_t n = 8;
      hid_t sp = H5Screate_simple(1, &n, nullptr);
      hid_t ds = H5Dcreate2(f, "/params/final_norm", H5T_IEEE_F64LE, sp, H5P_DEFAULT, dcpl, H5P_DEFAULT);
      ASSERT_GE(ds, 0);
      H5Dclose(ds);
      H5Sclose(sp);
      H5Pclose(dcpl);
    });
    expect_error([&] { load_checkpoint<double>(efl); }, "dataset /params/final_norm keeps its data in external files");
    const auto vds = fresh("virtual.h5");
    edit(vds, [&](hid_t f) {
      H5Ldelete(f, "/params/final_norm", H5P_DEFAULT);
      hsize_t n = 8;
      hid_t sp = H5Screate_simple(1, &n, nullptr);
      hid_t dcpl = H5Pcreate(H5P_DATASET_CREATE);
      H5Pset_virtual(dcpl, sp, donor.c_str(), "/params/final_norm", sp);
      hid_t ds = H5Dcreate2(f, "/params/final_norm", H5T_IEEE_F64LE, sp, H5P_DEFAULT, dcpl, H5P_DEFAULT);
      ASSERT_GE(ds, 0);
      H5Dclose(ds);
      H5Sclose(sp);
      H5Pclose(dcpl);
    });
    expect_error([&] { load_checkpoint<double>(vds); }, "dataset /params/final_norm is a virtual dataset");
    const auto gz = fresh("deflate.h5");
    edit(gz, [&](hid_t f) {
      H5Ldelete(f, "/params/final_norm", H5P_DEFAULT);
      hid_t dcpl = H5Pcreate(H5P_DATASET_CREATE);
      hsize_t n = 8;
      H5Pset_chunk(dcpl, 1, &n);
      H5Pset_fletcher32(dcpl);
      H5Pset_deflate(dcpl, 1);
      hid_t sp = H5Screate_simple(1, &n, nullptr);
      hid_t ds = H5Dcreate2(f, "/params/final_norm", H5T_IEEE_F64LE, sp, H5P_DEFAULT, dcpl, H5P_DEFAULT);
      ASSERT_GE(ds, 0);
      H5Dclose(ds);
      H5Sclose(sp);
      H5Pclose(dcpl);
    });
    expect_error([&] { load_checkpoint<double>(gz); }, "uses HDF5 filter 1 (only Fletcher-32 is allowed)");
    // Objects the format does not have, resealed so that the schema check, not
    // the digest, is what refuses them.
    const auto extra = fresh("extra.h5");
    edit(extra, [](hid_t f) { H5Gclose(H5Gcreate2(f, "/params/notes", H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT)); });
    if (!v2) reseal(extra);
    expect_error([&] { load_checkpoint<double>(extra); }, nac + extra + "' holds group /params/notes, which is not part");
    const auto kind = fresh("kind.h5");
    edit(kind, [](hid_t f) {
      H5Ldelete(f, "/params/head", H5P_DEFAULT);
      H5Gclose(H5Gcreate2(f, "/params/head", H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT));
    });
    if (!v2) reseal(kind);
    expect_error([&] { load_checkpoint<double>(kind); }, "/params/head is a group, the format has a dataset there");
    for (const auto& p : {ext, soft, hard, efl, vds, gz, extra, kind}) std::remove(p.c_str());
  }
  for (const auto& p : {good, donor}) std::remove(p.c_str());
}

// A FIFO given as the file is refused before anything blocks on it.
TEST(Checkpoint, AFifoIsNotACheckpoint) {
  const auto fifo = tmp_path("fifo.h5");
  std::remove(fifo.c_str());
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  expect_error([&] { load_checkpoint<double>(fifo); }, "checkpoint '" + fifo + "' is not a regular file");
  expect_error([&] { inspect_checkpoint(fifo); }, "is not a regular file");
  expect_error([&] { load_gradients(fifo, tiny_dims(1)); }, "gradient file '" + fifo + "' is not a regular file");
  std::remove(fifo.c_str());
}

// ---- older formats --------------------------------------------------------------

// Every kind of file the format-2 writer made still loads, bitwise: a
// checkpoint with moments and a carried state, and a gradient file.
TYPED_TEST(Checkpoint, Format2FilesStillLoad) {
  using S = TypeParam;
  const auto d = tiny_dims(2);
  const auto ps = random_model<S>(d, 31);
  ParamSet<S> m(d), v(d);
  from_host(m, to_host(random_model<S>(d, 32)));
  from_host(v, std::vector<double>(to_host(ps).size(), 0.5));
  std::vector<View2<S>> carry;
  std::vector<double> carry_host;
  for (int k = 0; k < 2; ++k) {
    carry.push_back(View2<S>("carry", 3 * d.width, d.state));
    auto h = Kokkos::create_mirror_view(carry.back());
    for (std::size_t i = 0; i < h.extent(0); ++i)
      for (std::size_t j = 0; j < h.extent(1); ++j) carry_host.push_back(double(h(i, j) = S(0.01 * (i + 7 * j + k))));
    Kokkos::deep_copy(carry.back(), h);
  }
  const auto path = tmp_path("v2.h5");
  save_checkpoint(path, config_for(d), ps, 5, 50, OptimizerState<S>{&m, &v, 5, &carry});
  downgrade_to_v2(path);
  CheckpointInfo info;
  EXPECT_EQ(to_host(load_checkpoint<S>(path, &info)), to_host(ps));
  EXPECT_EQ(info.format_version, 2);
  EXPECT_EQ(info.step, 5);
  ParamSet<S> m2(d), v2(d);
  std::int64_t step = 0;
  ASSERT_TRUE(load_optimizer_state(path, m2, v2, &step));
  EXPECT_EQ(to_host(m2), to_host(m));
  EXPECT_EQ(to_host(v2), to_host(v));
  EXPECT_EQ(step, 5);
  std::vector<View2<S>> back{View2<S>("b0", 3 * d.width, d.state), View2<S>("b1", 3 * d.width, d.state)};
  ASSERT_TRUE(load_carried_state(path, back));
  std::vector<double> back_host;
  for (const auto& b : back) {
    auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), b);
    for (std::size_t i = 0; i < h.extent(0); ++i)
      for (std::size_t j = 0; j < h.extent(1); ++j) back_host.push_back(double(h(i, j)));
  }
  EXPECT_EQ(back_host, carry_host);
  EXPECT_EQ(inspect_checkpoint(path, Verify::all).format_version, 2);

  ParamSet<S> g(d);
  from_host(g, to_host(random_model<S>(d, 33)));
  const auto gpath = tmp_path("v2_grad.h5");
  save_gradients(gpath, config_for(d), 1.25, g);
  downgrade_to_v2(gpath);
  double loss = 0;
  EXPECT_EQ(to_host(load_gradients(gpath, d, &loss)), to_host(g));
  EXPECT_EQ(loss, 1.25);
  EXPECT_EQ(inspect_checkpoint(gpath, Verify::all).format_version, 2);
  // A format-2 file is still checked against its own Fletcher-32 sums.
  flip_bit(gpath, chunk_address(gpath, "/grad/head") + 1);
  expect_error([&] { load_gradients(gpath, d); }, "checksum mismatch in dataset /grad/head of '" + gpath + "'");
  for (const auto& p : {path, gpath}) std::remove(p.c_str());
}

// format_version lowered from 3 to 2 or 1 (one h5py line) would read the file
// without its digests, so an edit loaded silently. A declared format 1 or 2
// with any digest attribute left (the root's or a dataset's) is refused, in
// every reader and with Verify::none too; a genuine format-2 file loads.
TEST(Checkpoint, LoweredFormatVersionIsRefused) {
  const auto d = tiny_dims(2);
  const auto ps = random_model<double>(d, 8);
  const auto good = tmp_path("good.h5");
  save_checkpoint(good, config_for(d), ps);
  const std::vector<double> twos(std::size_t(d.width), 2.0);
  for (const std::int64_t v : {2, 1}) {
    SCOPED_TRACE("format_version " + std::to_string(v));
    const auto p = copy_of(good, "lowered.h5");
    edit(p, [&](hid_t f) {  // a value changed through HDF5: Fletcher-32 recomputed, the digest not
      hid_t ds = H5Dopen2(f, "/params/final_norm", H5P_DEFAULT);
      EXPECT_GE(H5Dwrite(ds, H5T_NATIVE_DOUBLE, H5S_ALL, H5S_ALL, H5P_DEFAULT, twos.data()), 0);
      H5Dclose(ds);
    });
    set_format_version(p, v);
    const std::string msg = "'" + p + "' declares checkpoint format version " + std::to_string(v) +
                            ", which its contents contradict: the root carries a format-3 digest attribute";
    expect_error([&] { load_checkpoint<double>(p); }, msg);
    expect_error([&] { inspect_checkpoint(p, Verify::none); }, msg);
    expect_error([&] { inspect_checkpoint(p, Verify::all); }, msg);
    // Every digest but one dataset's removed: still a contradiction, naming it.
    downgrade_to_v2(p);
    set_format_version(p, v);
    edit(p, [&](hid_t f) {
      hid_t sp = H5Screate(H5S_SCALAR);
      hid_t a = H5Acreate_by_name(f, "/params/layers/001/D", "digest", H5T_STD_U64LE, sp, H5P_DEFAULT, H5P_DEFAULT,
                                  H5P_DEFAULT);
      const std::uint64_t x = 1;
      H5Awrite(a, H5T_NATIVE_UINT64, &x);
      H5Aclose(a);
      H5Sclose(sp);
    });
    expect_error([&] { load_checkpoint<double>(p); },
                 "contradict: /params/layers/001/D carries a format-3 digest attribute");
    // With none left it is a file of that format, and loads (the edited value included: only its checks).
    edit(p, [&](hid_t f) { EXPECT_GE(H5Adelete_by_name(f, "/params/layers/001/D", "digest", H5P_DEFAULT), 0); });
    CheckpointInfo info;
    EXPECT_NO_THROW(load_checkpoint<double>(p, &info));
    EXPECT_EQ(info.format_version, v);
    std::remove(p.c_str());
  }
  // Gradient files alike.
  const auto gpath = tmp_path("lowered_grad.h5");
  save_gradients(gpath, config_for(d), 0.5, ps);
  set_format_version(gpath, 2);
  expect_error([&] { load_gradients(gpath, d); }, "declares checkpoint format version 2, which its contents contradict");
  for (const auto& p : {good, gpath}) std::remove(p.c_str());
}

namespace {

// Replaces dataset `ds_path` by a float64 one of shape `dims`, chunked
// `chunk` with Fletcher-32; written with `value` when `fill` (maxdims
// unlimited, so a chunk may exceed the extent), else never written.
void replace_dataset(const std::string& path, const char* ds_path, const std::vector<hsize_t>& dims,
                     const std::vector<hsize_t>& chunk, bool fill, double value = 0.5) {
  edit(path, [&](hid_t f) {
    EXPECT_GE(H5Ldelete(f, ds_path, H5P_DEFAULT), 0);
    const std::vector<hsize_t> unlimited(dims.size(), H5S_UNLIMITED);
    hid_t sp = H5Screate_simple(int(dims.size()), dims.data(), fill ? unlimited.data() : nullptr);
    hid_t dcpl = H5Pcreate(H5P_DATASET_CREATE);
    H5Pset_chunk(dcpl, int(chunk.size()), chunk.data());
    H5Pset_fletcher32(dcpl);
    hid_t lcpl = H5Pcreate(H5P_LINK_CREATE);
    H5Pset_create_intermediate_group(lcpl, 1);
    hid_t ds = H5Dcreate2(f, ds_path, H5T_IEEE_F64LE, sp, lcpl, dcpl, H5P_DEFAULT);
    EXPECT_GE(ds, 0) << ds_path;
    if (fill) {
      std::vector<double> v(std::size_t(H5Sget_simple_extent_npoints(sp)), value);
      EXPECT_GE(H5Dwrite(ds, H5T_NATIVE_DOUBLE, H5S_ALL, H5S_ALL, H5P_DEFAULT, v.data()), 0);
    }
    H5Dclose(ds);
    H5Pclose(lcpl);
    H5Pclose(dcpl);
    H5Sclose(sp);
  });
}

}  // namespace

// Every dataset's storage is checked before it is read or anything is sized
// from it (format 2 here: no digest would notice, only these checks): a
// dataset whose chunks were never written (it read as fill values: zeros
// loaded silently), model sizes whose datasets could not fit in the file
// (an 80 KB file declaring a 2^20-token vocabulary allocated and read
// 128 MiB of fill values), and chunks larger than the extent.
TEST(Checkpoint, DatasetStorageIsCheckedBeforeReading) {
  const auto d = tiny_dims(2);
  const auto ps = random_model<double>(d, 21);
  const auto good = tmp_path("good.h5");
  save_checkpoint(good, config_for(d), ps);
  auto refused = [&](const std::string& p, const std::string& msg) {
    expect_error([&] { load_checkpoint<double>(p); }, msg);
    expect_error([&] { inspect_checkpoint(p, Verify::none); }, msg);
    expect_error([&] { inspect_checkpoint(p, Verify::all); }, msg);
  };

  const auto unwritten = copy_of(good, "unwritten.h5");
  downgrade_to_v2(unwritten);
  replace_dataset(unwritten, "/params/final_norm", {hsize_t(d.width)}, {hsize_t(d.width)}, false);
  refused(unwritten, "'" + unwritten + "': dataset /params/final_norm stores 0 bytes of the 64 its shape [8] declares");

  const auto big = copy_of(good, "big_vocab.h5");
  downgrade_to_v2(big);
  const std::int64_t V = std::int64_t(1) << 20;
  edit(big, [&](hid_t f) {
    hid_t a = H5Aopen(f, "vocab", H5P_DEFAULT);
    H5Awrite(a, H5T_NATIVE_INT64, &V);
    H5Aclose(a);
    auto cfg = config_for(d);
    cfg.set("model.vocab=" + std::to_string(V));
    replace_attr_str(f, "config", cfg.json().dump());
  });
  for (const char* p : {"/params/embedding", "/params/head"})
    replace_dataset(big, p, {hsize_t(V), hsize_t(d.width)}, {hsize_t(1) << 14, hsize_t(d.width)}, false);
  ModelDims dv = d;
  dv.vocab = V;
  refused(big, "and its datasets declare " + std::to_string(parameter_count(dv) * 8) +
                   " bytes of values (model sizes V=1048576 P=8 N=4 K=2): the file is truncated or was altered");

  const auto chunky = copy_of(good, "chunky.h5");
  downgrade_to_v2(chunky);
  replace_dataset(chunky, "/params/layers/000/D", {hsize_t(d.width)}, {hsize_t(2 * d.width)}, true);
  refused(chunky, "dataset /params/layers/000/D has chunks of dimension 16 in its shape [8]");
  // The same dataset with chunks within its extent loads (the checks refuse only what the writer never makes).
  replace_dataset(chunky, "/params/layers/000/D", {hsize_t(d.width)}, {hsize_t(d.width / 2)}, true, 0.25);
  const auto back = load_checkpoint<double>(chunky);
  const auto& t = back.tensor("layers/000/D");
  EXPECT_EQ(to_host(back)[std::size_t(t.offset)], 0.25);
  for (const auto& p : {good, unwritten, big, chunky}) std::remove(p.c_str());
}

// What a reader refuses is never written: a non-finite parameter, moment,
// carried state, gradient or loss is an ash::Error naming it, before the
// temporary file exists; the previous file stays. (The trainer checks its
// own state first and names the last good checkpoint.)
TEST(Checkpoint, WritersRefuseNonFiniteValues) {
  const auto d = tiny_dims(2);
  const auto ps = random_model<double>(d, 22);
  const auto path = tmp_path("kept.h5");
  save_checkpoint(path, config_for(d), ps);
  const auto before = slurp(path);
  auto poisoned = [&](const std::string& name, double bad) {
    ParamSet<double> p(d);
    auto v = to_host(ps);
    v[std::size_t(p.tensor(name).offset) + 1] = bad;
    from_host(p, v);
    return p;
  };
  expect_error([&] { save_checkpoint(path, config_for(d), poisoned("layers/001/D", std::nan(""))); },
               "cannot write '" + path + "': /params/layers/001/D holds a non-finite value (nan at index 1)");
  ParamSet<double> m(d), v = poisoned("head", HUGE_VAL);
  expect_error([&] { save_checkpoint(path, config_for(d), ps, 1, 0, OptimizerState<double>{&m, &v, 1}); },
               "/optimizer/v/head holds a non-finite value (inf at index 1)");
  std::vector<View2<double>> carry{View2<double>("c0", d.width, d.state), View2<double>("c1", d.width, d.state)};
  Kokkos::deep_copy(carry[1], -HUGE_VAL);
  expect_error([&] { save_checkpoint(path, config_for(d), ps, 1, 0, OptimizerState<double>{&m, &m, 1, &carry}); },
               "/train/carry_state holds a non-finite value (-inf at index " + std::to_string(d.width * d.state) + ")");
  expect_error([&] { save_gradients(path, config_for(d), 1.0, poisoned("embedding", std::nan(""))); },
               "/grad/embedding holds a non-finite value");
  expect_error([&] { save_gradients(path, config_for(d), std::nan(""), ps); }, "/loss holds a non-finite value");
  EXPECT_EQ(slurp(path), before);
  const auto dir = std::filesystem::path(path).parent_path();
  for (const auto& e : std::filesystem::directory_iterator(dir))
    EXPECT_EQ(e.path().filename().string().find("kept.h5.tmp."), std::string::npos) << e.path();
  std::remove(path.c_str());
}

}  // namespace ash::test
