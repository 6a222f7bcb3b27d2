// JSON configuration: canonical keys, --set overrides, errors that name the key.
#include <fstream>

#include "test_helpers.hpp"

namespace ash::test {

namespace {
std::string what_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}
}  // namespace

TEST(Config, DefaultsAreValid) {
  Config c;
  EXPECT_NO_THROW(c.validate());
  EXPECT_EQ(c.model().vocab, 256);
  EXPECT_EQ(c.settings().grad.method, Method::backprop);
}

TEST(Config, SetParsesValues) {
  Config c;
  c.set("model.width=32");
  c.set("grad.engine=adjoint-exact");
  c.set("grad.detach_inputs=true");
  c.set("optim.lr=1e-4");
  c.set("optim.lr=1");  // an integer is fine for a float key
  EXPECT_EQ(c.model().width, 32);
  EXPECT_EQ(c.settings().grad.method, Method::adjoint_exact);
  EXPECT_TRUE(c.settings().grad.detach_inputs);
  EXPECT_EQ(c.settings().optim.lr, 1.0);
}

TEST(Config, UnknownKeysAndWrongTypesNameTheKey) {
  Config c;
  EXPECT_NE(what_of([&] { c.set("model.widht=3"); }).find("unknown config key 'model.widht'"), std::string::npos);
  EXPECT_NE(what_of([&] { c.set("nothing=3"); }).find("unknown config key 'nothing'"), std::string::npos);
  EXPECT_NE(what_of([&] { c.set("model.layers=2.5"); }).find("'model.layers'"), std::string::npos);
  EXPECT_NE(what_of([&] { c.set("model=3"); }).find("'model'"), std::string::npos);
  EXPECT_NE(what_of([&] { c.set("noequals"); }).find("key=value"), std::string::npos);
  EXPECT_NE(what_of([&] { c.merge(nlohmann::json::parse(R"({"data": {"seq_len": 8, "bogus": 1}})"), "f.json"); })
                .find("unknown config key 'data.bogus'"),
            std::string::npos);
  // All-or-nothing: the failed merge did not apply seq_len.
  EXPECT_EQ(c.settings().data.seq_len, Config().settings().data.seq_len);
}

// Found by fuzz/fuzz_config: a value that is not valid UTF-8 made the error
// message itself throw (nlohmann's dump), an internal error instead of exit 2.
TEST(Config, InvalidUtf8IsAClearError) {
  Config c;
  EXPECT_NE(what_of([&] { c.set("data.train=a\xc2" "b"); }).find("is not valid UTF-8"), std::string::npos);
  EXPECT_NE(what_of([&] { c.set("model.width=2\xc2"); }).find("'model.width' expects a number"), std::string::npos);
  EXPECT_NE(what_of([&] { c.merge(nlohmann::json{{"run", {{"out_dir", "r\xff"}}}}, "f.json"); }).find("UTF-8"),
            std::string::npos);
  EXPECT_EQ(c.json().dump(), Config().json().dump()) << "nothing applied";
}

TEST(Config, ValidateRejectsInconsistentSizes) {
  for (const char* bad : {"model.vocab=1", "model.width=0", "model.layers=0", "model.state=0", "data.seq_len=0",
                          "data.seq_len=1", "data.batch=0", "grad.chunk=0", "dist.layer_ranks=5", "dist.data_ranks=-1",
                          "dist.seq_ranks=0", "dist.pipeline_blocks=-1",
                          "grad.engine=sgd"}) {
    Config c;
    c.set(bad);
    EXPECT_THROW(c.validate(), Error) << bad;
  }
}

TEST(Config, FileErrors) {
  Config c;
  EXPECT_NE(what_of([&] { c.merge_file("/nonexistent/cfg.json"); }).find("cannot open"), std::string::npos);
  const auto p = tmp_path("bad.json");
  std::ofstream(p) << "{ not json";
  EXPECT_NE(what_of([&] { c.merge_file(p); }).find("not valid JSON"), std::string::npos);
}

}  // namespace ash::test
