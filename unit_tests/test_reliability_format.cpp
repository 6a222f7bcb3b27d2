// Reliability (docs/design.md §7) across checkpoint format versions: format-1 files
// still load, `ash inspect --upgrade` rewrites them as format 3 with the same values,
// and a lowered format_version is refused while a genuine format-2 file warns.
#include <sys/stat.h>

#include <cmath>
#include <cstdio>
#include <map>

#include "reliability_helpers.hpp"

namespace ash::test {

namespace {

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

// ---- 9. a lowered format_version (issue 35) ---------------------------------

// G2 and the link rule (here for write_version1): every writer refuses a FIFO, a directory or a
// link at its output before any work (a rename would replace a FIFO, or as root
// /dev/null, with a file), exit 2 naming the path and what it is; the node stays.
// `inspect --upgrade --in-place` on a link leaves the link and its target as they were.
TEST(Reliability, OutputsMustBeAbsentOrRegularFiles) {
  const auto corpus = corpus_file(), model = tmp_path("m.h5");
  ASSERT_EQ(run("init " + small_model + "--out " + model).code, 0);
  const auto d = tiny_dims(2);
  const auto v1 = tmp_path("nodes_v1.h5");
  write_version1(v1, config_for(d), random_model<double>(d, 3), 1);
  const auto v1_bytes = slurp(v1);
  const auto dir = tmp_path("nodes");
  fs::remove_all(dir);
  fs::create_directories(dir);
  const auto fifo = dir + "/fifo.h5", folder = dir + "/folder.h5";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  fs::create_directories(folder);
  const std::vector<std::pair<std::string, std::string>> nodes{{fifo, "a FIFO"}, {folder, "a directory"}};
  for (const auto& [out, kind] : nodes) {
    const std::vector<std::string> writers{"init " + small_model + "--out " + out,
                                           "grad --checkpoint " + model + " --tokens " + corpus + " --out " + out,
                                           "inspect " + v1 + " --upgrade --out " + out};
    for (const auto& args : writers) EXPECT_CLEAR_ERROR(timed(args), "--out '" + out + "' is " + kind);
  }
  EXPECT_EQ(fs::symlink_status(fifo).type(), fs::file_type::fifo);
  EXPECT_TRUE(fs::is_directory(folder) && fs::is_empty(folder));

  const auto link = dir + "/link.h5";
  fs::create_symlink(v1, link);
  EXPECT_CLEAR_ERROR(timed("inspect " + link + " --upgrade --in-place"), "'" + link + "' is a symbolic link");
  EXPECT_TRUE(fs::is_symlink(link));
  EXPECT_EQ(slurp(v1), v1_bytes);

  // A run's checkpoint.h5: refused when the run starts, not at its first checkpoint.
  const auto run_dir = dir + "/run";
  fs::create_directories(run_dir);
  ASSERT_EQ(::mkfifo((run_dir + "/checkpoint.h5").c_str(), 0600), 0);
  EXPECT_CLEAR_ERROR(timed("train " + small_model + "--set data.train=" + corpus +
                           " --set optim.steps=2 --set run.out_dir=" + run_dir),
                     "the run's checkpoint '" + run_dir + "/checkpoint.h5' is a FIFO");
  EXPECT_EQ(fs::symlink_status(run_dir + "/checkpoint.h5").type(), fs::file_type::fifo);
  for (const auto& e : fs::recursive_directory_iterator(dir))
    EXPECT_EQ(e.path().filename().string().find(".tmp."), std::string::npos) << "temp file left: " << e.path();
  fs::remove_all(dir);
}

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

}  // namespace ash::test
