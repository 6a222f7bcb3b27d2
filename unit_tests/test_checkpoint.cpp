// HDF5 checkpoints: round trip, and every way a file can be bad.
#include <hdf5.h>

#include <cstdio>
#include <fstream>

#include "test_helpers.hpp"

namespace ash::test {

namespace {

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
  const auto ins = inspect_checkpoint(path);
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

}  // namespace ash::test
