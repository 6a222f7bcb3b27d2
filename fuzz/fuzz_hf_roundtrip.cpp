// transformers' Mamba folders out and back in (app/hf_mamba, what export-hf and
// import-hf run): the input picks a small MambaForCausalLM configuration (its
// first 8 bytes: vocabulary, width, state, layers, expand, conv kernel, dt rank
// and FalconMamba with its mixer_rms_eps, tied and the file's dtype) and the tensors' values (the rest, two bytes a
// value, cycled). write_hf_mamba writes the folder and read_hf_mamba reads it
// back: the same sizes, every value the written one rounded to the dtype, and a
// second round trip of what was read gives the same bits. An ash::Error for
// this valid model, a crash, a sanitizer report or a changed value is a finding.
#include <unistd.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "ash/app/hf_mamba.hpp"
#include "ash/core/error.hpp"

namespace {

void finding(const std::string& what) {
  std::fprintf(stderr, "fuzz_hf_roundtrip: %s\n", what.c_str());
  __builtin_trap();
}

// The relative rounding of one value written in dtype (half an ulp, with room for a subnormal f16).
bool rounded_from(double got, double want, ash::TensorDtype dtype) {
  const double rel = dtype == ash::TensorDtype::f64 || dtype == ash::TensorDtype::f32 ? 0.0
                     : dtype == ash::TensorDtype::bf16                                 ? 0x1p-8
                                                                                       : 0x1p-11;
  return std::fabs(got - want) <= rel * std::fabs(want) + (dtype == ash::TensorDtype::f16 ? 0x1p-24 : 0.0);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 8) return 0;
  nlohmann::json cfg = {{"model",
                         {{"arch", "mamba"},
                          {"vocab", 2 + data[0] % 17},
                          {"width", 1 + data[1] % 9},
                          {"state", 1 + data[2] % 5},
                          {"layers", 1 + data[3] % 3},
                          {"expand", 1 + data[4] % 3},
                          {"conv_kernel", 1 + data[5] % 4},
                          {"dt_rank", data[6] % 4},
                          {"tie_embeddings", (data[7] & 1) != 0}}}};
  if (data[6] & 4) {  // a FalconMamba: the same tensors, mixer_rms_eps in config.json
    cfg["model"]["arch"] = "falcon_mamba";
    cfg["model"]["mixer_rms_eps"] = (1 + (data[6] >> 3)) * 1e-7;
  }
  const ash::TensorDtype dtypes[] = {ash::TensorDtype::f64, ash::TensorDtype::f32, ash::TensorDtype::bf16,
                                     ash::TensorDtype::f16};
  const ash::TensorDtype dtype = dtypes[(data[7] >> 1) % 4];
  const ash::MambaDims d = ash::mamba_dims(cfg, "fuzz");
  std::vector<ash::HfName> names = ash::hf_mamba_global_names(d);
  for (std::int64_t k = 0; k < d.layers; ++k)
    for (const auto& n : ash::hf_mamba_layer_names(d, k)) names.push_back(n);
  ash::HfTensors tensors;
  std::size_t at = 8;
  for (const auto& n : names) {
    ash::HfTensor t;
    t.shape = n.ash_shape;
    std::size_t count = 1;
    for (const auto s : t.shape) count *= std::size_t(s);
    for (std::size_t i = 0; i < count; ++i, at += 2)  // in [-8, 8), multiples of 2^-12: finite in every dtype
      t.values.push_back((int(data[at % size]) - 128) / 16.0 + data[(at + 1) % size] / 4096.0);
    tensors[n.ash] = t;
  }
  static const std::string dir = "/tmp/ash_fuzz_hf." + std::to_string(::getpid());
  try {
    ash::write_hf_mamba(dir, cfg, tensors, dtype);
    const ash::HfMambaModel a = ash::read_hf_mamba(dir);
    const ash::MambaDims e = ash::mamba_dims(a.config, "fuzz (read back)");
    if (e.width != d.width || e.state != d.state || e.layers != d.layers || e.vocab != d.vocab ||
        e.expand != d.expand || e.conv_kernel != d.conv_kernel || e.rank() != d.rank() ||
        e.tie_embeddings != d.tie_embeddings || e.falcon != d.falcon || e.mixer_rms_eps != d.mixer_rms_eps)
      finding("the configuration read back has other sizes");
    // The keys themselves too (mamba_dims reads both sides, so one of its slips would cancel out).
    const auto& m = a.config.at("model");
    if (m.at("arch") != cfg["model"]["arch"] || m.contains("mixer_rms_eps") != cfg["model"].contains("mixer_rms_eps") ||
        (m.contains("mixer_rms_eps") && m["mixer_rms_eps"] != cfg["model"]["mixer_rms_eps"]))
      finding("model.arch or model.mixer_rms_eps read back differently");
    if (a.tensors.size() != tensors.size()) finding("another number of tensors read back");
    for (const auto& [name, t] : tensors) {
      const auto it = a.tensors.find(name);
      if (it == a.tensors.end() || it->second.shape != t.shape) finding("tensor " + name + " read back differently");
      for (std::size_t i = 0; i < t.values.size(); ++i)
        if (!rounded_from(it->second.values[i], t.values[i], dtype))
          finding("tensor " + name + " element " + std::to_string(i) + " read back as another value");
    }
    ash::write_hf_mamba(dir, a.config, a.tensors, dtype);
    const ash::HfMambaModel b = ash::read_hf_mamba(dir);
    for (const auto& [name, t] : a.tensors) {
      const auto& v = b.tensors.at(name).values;
      for (std::size_t i = 0; i < v.size(); ++i)
        if (std::signbit(v[i]) != std::signbit(t.values[i]) || v[i] != t.values[i])
          finding("tensor " + name + " changed on a second round trip");
    }
  } catch (const ash::Error& err) {
    finding(std::string("a valid model was refused: ") + err.what());
  }
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
  return 0;
}
