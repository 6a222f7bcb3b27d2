// A Mamba's parameter layout (tied and untied head), its checkpoint round trip and
// its configuration keys (model.arch = "mamba", docs/design.md §1).
#include <sstream>

#include "test_helpers.hpp"

namespace ash::test {

TEST(Mamba, LayoutAndTiedHead) {
  for (bool tied : {true, false}) {
    const auto d = mamba_tiny_dims(2, tied, 4, 0);
    ParamSet<float> ps(d);
    EXPECT_EQ(ps.size(), checked_parameter_count(d));
    EXPECT_EQ(d.rank(), 1);  // ceil(4 / 16)
    EXPECT_EQ(ps.tensor("layers/001/in_proj").shape, (std::vector<std::int64_t>{16, 4}));
    EXPECT_EQ(ps.tensor("layers/001/x_proj").shape, (std::vector<std::int64_t>{1 + 6, 8}));
    EXPECT_EQ(ps.tensor("layers/001/conv_weight").shape, (std::vector<std::int64_t>{8, 4}));
    EXPECT_EQ(ps.tensor("layers/000/out_proj").shape, (std::vector<std::int64_t>{4, 8}));
    const auto g = ps.global();
    EXPECT_EQ(g.head.data() == g.embedding.data(), tied);
    EXPECT_EQ(g.norm_eps, d.norm_eps);
    const auto l = ps.mamba_layer(1);  // in_proj's z rows follow its x rows; x_proj's B after Δ, C after B
    EXPECT_EQ(l.in_z.data(), l.in_x.data() + 8 * 4);
    EXPECT_EQ(l.x_B.data(), l.x_dt.data() + 1 * 8);
    EXPECT_EQ(l.x_C.data(), l.x_B.data() + 3 * 8);
    expect_error([&] { (void)ps.layer(0); }, "model.arch=mamba");
  }
}

TEST(Mamba, CheckpointRoundTrip) {
  for (bool tied : {true, false}) {
    const auto d = mamba_tiny_dims(2, tied);
    auto ps = random_model<double>(d, 9);
    const auto path = tmp_path(tied ? "tied.h5" : "untied.h5");
    save_checkpoint(path, config_for(d), ps);
    CheckpointInfo info;
    const auto back = load_checkpoint<double>(path, &info);
    EXPECT_TRUE(info.dims == d);
    EXPECT_EQ(to_host(back), to_host(ps));
    const auto in = inspect_checkpoint(path, Verify::all);
    EXPECT_TRUE(in.dims.mamba());
    bool has_head = false;
    for (const auto& ds : in.datasets) has_head = has_head || ds.path == "/params/head";
    EXPECT_EQ(has_head, !tied);
  }
}

TEST(Mamba, Configuration) {
  Config ssm;
  EXPECT_FALSE(ssm.stored_json()["model"].contains("arch"));  // an SSM-ResNet's files are as before
  EXPECT_FALSE(ssm.stored_json()["model"].contains("expand"));
  EXPECT_TRUE(ssm.json()["model"].contains("arch"));
  Config m;
  m.set("model.arch=mamba");
  EXPECT_EQ(m.stored_json()["model"]["arch"], "mamba");
  EXPECT_TRUE(m.stored_json()["model"].contains("norm_eps"));
  EXPECT_TRUE(m.settings().model.mamba());
  for (const char* k : {"model.expand=3", "model.conv_kernel=2", "model.dt_rank=1", "model.tie_embeddings=false",
                        "model.norm_eps=1e-6"}) {
    Config c;
    c.set(k);
    expect_error([&] { c.validate(); }, "apply to model.arch=mamba, falcon_mamba or mamba2 only");
  }
  // FalconMamba's key: stored for a FalconMamba only, refused for the others, > 0.
  EXPECT_FALSE(m.stored_json()["model"].contains("mixer_rms_eps"));  // a Mamba's files are as before
  Config f;
  f.set("model.arch=falcon_mamba");
  f.set("model.mixer_rms_eps=1e-5");
  EXPECT_EQ(f.stored_json()["model"]["arch"], "falcon_mamba");
  EXPECT_EQ(f.stored_json()["model"]["mixer_rms_eps"], 1e-5);
  EXPECT_TRUE(f.settings().model.mamba() && f.settings().model.mixer_norms());
  EXPECT_FALSE(m.settings().model.mixer_norms());
  for (const char* arch : {"mamba", "ssm-resnet"}) {
    Config c;
    c.set(std::string("model.arch=") + arch);
    c.set("model.mixer_rms_eps=1e-5");
    expect_error([&] { c.validate(); }, "model.mixer_rms_eps applies to model.arch=falcon_mamba only");
  }
  for (const char* v : {"0", "-1e-6"}) {
    Config c = f;
    c.set(std::string("model.mixer_rms_eps=") + v);
    expect_error([&] { c.validate(); }, "model.mixer_rms_eps must be a finite number > 0");
  }
  Config bad;
  bad.set("model.arch=transformer");
  expect_error([&] { bad.validate(); }, "model.arch must be ssm-resnet, mamba, falcon_mamba or mamba2");
  for (const char* k : {"model.expand=0", "model.conv_kernel=0", "model.dt_rank=-1", "model.norm_eps=0"}) {
    Config c = m;
    c.set(k);
    expect_error([&] { c.validate(); }, std::string(k).substr(0, std::string(k).find('=')));
  }
  // E2 and E3's detached and windowed modes run, on data and layer ranks too, E3's
  // levers and the carried state in one process and on every layout, a window
  // on sequence ranks too: every setting builds (nothing is refused for a Mamba).
  for (const std::string set :
       {"grad.engine=adjoint", "grad.detach_inputs=true", "grad.truncate=4", "run.storage=bf16", "run.storage=fp16",
        "grad.layer_checkpoint=2", "grad.token_block=8", "dist.layer_ranks=2", "dist.data_ranks=2",
        "data.carry_state=true", "dist.seq_ranks=2",
        "dist.seq_ranks=2 grad.detach_inputs=true run.storage=bf16 grad.token_block=8",
        "dist.seq_ranks=2 dist.layer_ranks=2 grad.layer_checkpoint=2",
        "dist.layer_ranks=2 data.sequential=true data.carry_state=true",
        "dist.data_ranks=2 data.sequential=true data.carry_state=true run.storage=bf16",
        "dist.seq_ranks=2 data.sequential=true data.carry_state=true grad.token_block=8",
        "dist.seq_ranks=2 grad.detach_inputs=true grad.truncate=4",
        "dist.seq_ranks=2 grad.detach_inputs=true grad.truncate=4 run.storage=bf16",
        "dist.seq_ranks=2 grad.detach_inputs=true grad.truncate=4 data.sequential=true "
        "data.carry_state=true"}) {
    Config c = m;
    std::istringstream words(set);
    for (std::string w; words >> w;) c.set(w);
    if (set == "grad.truncate=4") c.set("grad.engine=adjoint");
    if (set.find("dist.") != std::string::npos) c.set("model.layers=2");
    if (set == "data.carry_state=true") c.set("data.sequential=true");
    EXPECT_NO_THROW(c.settings()) << set;
    if (std::string(set).rfind("dist", 0) == 0 || std::string(set).rfind("data", 0) == 0) continue;
    for (const char* ranks : {"dist.layer_ranks=2", "dist.data_ranks=2"}) {  // the same on several ranks
      Config r = c;
      r.set("model.layers=2");
      r.set(ranks);
      EXPECT_NO_THROW(r.settings()) << set << " " << ranks;
    }
  }
}

}  // namespace ash::test
