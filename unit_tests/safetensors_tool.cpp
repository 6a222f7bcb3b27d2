// The safetensors reader/writer and the Hugging Face Mamba mapping driven from
// Python (unit_tests/test_safetensors_interop.py, ctest safetensors_interop),
// against the `safetensors` package and transformers themselves:
//   safetensors_tool list FILE                 names, dtypes, shapes (one per line)
//   safetensors_tool list-folder DIR           the same for a model folder (file or index)
//   safetensors_tool copy IN OUT               every tensor read and written back in its dtype
//   safetensors_tool convert IN OUT f64|f32    every tensor read as double|float, written F64|F32
//   safetensors_tool hf-read DIR OUT.st OUT.json   a Mamba folder in our names (F64) + config
//   safetensors_tool hf-write IN.st IN.json DIR DTYPE  our names (+ config fragment) as a folder
// An ash::Error prints its message and exits 2 (as the ash tool does for a bad input).
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <iterator>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "ash/app/hf_mamba.hpp"
#include "ash/core/config.hpp"
#include "ash/core/error.hpp"
#include "ash/io/safetensors.hpp"

namespace {

void list(const ash::SafetensorsSet& s) {
  for (const auto& name : s.names()) {
    const auto& e = s.at(name);
    std::cout << name << " " << ash::dtype_name(e.dtype);
    for (const auto d : e.shape) std::cout << " " << d;
    std::cout << "\n";
  }
}

ash::TensorDtype dtype_arg(const std::string& s) {
  if (s == "f64") return ash::TensorDtype::f64;
  if (s == "f32") return ash::TensorDtype::f32;
  if (s == "bf16") return ash::TensorDtype::bf16;
  if (s == "f16") return ash::TensorDtype::f16;
  throw ash::Error("unknown dtype argument '" + s + "'");
}

int run(const std::vector<std::string>& a) {
  const std::string verb = a.empty() ? "" : a[0];
  if (verb == "list" && a.size() == 2) {
    list(ash::SafetensorsSet::single(a[1]));
  } else if (verb == "list-folder" && a.size() == 2) {
    list(ash::SafetensorsSet::folder(a[1]));
  } else if (verb == "copy" && a.size() == 3) {
    const ash::SafetensorsReader in(a[1]);
    std::vector<std::vector<double>> values;
    std::vector<ash::TensorToWrite> out;
    for (const auto& e : in.tensors()) values.push_back(in.read<double>(e.name));
    for (std::size_t i = 0; i < in.tensors().size(); ++i) {
      const auto& e = in.tensors()[i];
      out.emplace_back(e.name, e.dtype, e.shape, values[i]);
    }
    ash::write_safetensors(a[2], out, {in.metadata().begin(), in.metadata().end()});
  } else if (verb == "convert" && a.size() == 4 && (a[3] == "f64" || a[3] == "f32")) {
    const ash::SafetensorsReader in(a[1]);
    std::vector<std::vector<double>> v64;
    std::vector<std::vector<float>> v32;
    std::vector<ash::TensorToWrite> out;
    for (const auto& e : in.tensors()) {
      if (a[3] == "f64")
        v64.push_back(in.read<double>(e.name));
      else
        v32.push_back(in.read<float>(e.name));
    }
    for (std::size_t i = 0; i < in.tensors().size(); ++i) {
      const auto& e = in.tensors()[i];
      if (a[3] == "f64")
        out.emplace_back(e.name, ash::TensorDtype::f64, e.shape, v64[i]);
      else
        out.emplace_back(e.name, ash::TensorDtype::f32, e.shape, v32[i]);
    }
    ash::write_safetensors(a[2], out);
  } else if (verb == "hf-read" && a.size() == 4) {
    const ash::HfMambaModel m = ash::read_hf_mamba(a[1]);
    std::vector<ash::TensorToWrite> out;
    nlohmann::json info = {{"config", m.config}, {"ignored", m.ignored}, {"dtypes", nlohmann::json::object()}};
    for (const auto& t : m.tensors) {
      out.emplace_back(t.first, ash::TensorDtype::f64, t.second.shape, t.second.values);
      info["dtypes"][t.first] = ash::dtype_name(t.second.dtype);
    }
    ash::write_safetensors(a[2], out);
    std::ofstream(a[3]) << info.dump(2) << "\n";
  } else if (verb == "hf-write" && a.size() == 5) {
    const ash::SafetensorsReader in(a[1]);
    ash::HfTensors tensors;
    for (const auto& e : in.tensors()) tensors[e.name] = ash::HfTensor{e.shape, in.read<double>(e.name), e.dtype};
    std::ifstream cf(a[2]);
    const std::string text((std::istreambuf_iterator<char>(cf)), std::istreambuf_iterator<char>());
    ash::write_hf_mamba(a[3], ash::parse_json_strict(text, "'" + a[2] + "'"), tensors, dtype_arg(a[4]));
  } else {
    std::cerr << "usage: safetensors_tool list|list-folder|copy|convert|hf-read|hf-write ... (see the source)\n";
    return 64;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(std::vector<std::string>(argv + 1, argv + argc));
  } catch (const ash::Error& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 2;
  }
}
