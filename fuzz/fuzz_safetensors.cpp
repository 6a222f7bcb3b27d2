// The safetensors reader (io/safetensors) on arbitrary bytes: the input is the
// whole file. The property of docs/file_format.md ("safetensors files"): a file is
// refused with an ash::Error, or every tensor reads, and writing the tensors back
// (write_safetensors) and reading that file again gives the same values (NaN stays
// NaN: float conversions may quiet a signalling one) and the same dtypes and
// shapes. A crash, a sanitizer report, an allocation past -rss_limit_mb (a size
// taken from the header before it was checked) or a changed value is a finding.
#include <unistd.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "ash/core/error.hpp"
#include "ash/io/safetensors.hpp"

namespace {
bool same(double a, double b) { return (std::isnan(a) && std::isnan(b)) || (std::signbit(a) == std::signbit(b) && a == b); }
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static const std::string path = "/tmp/ash_fuzz_safetensors." + std::to_string(::getpid());
  static const std::string again = path + ".again";
  std::ofstream(path, std::ios::binary | std::ios::trunc).write(reinterpret_cast<const char*>(data), std::streamsize(size));
  std::unique_ptr<ash::SafetensorsReader> r;
  try {
    r = std::make_unique<ash::SafetensorsReader>(path);
  } catch (const ash::Error&) {
    return 0;  // refused: the expected answer to most inputs
  }
  // Accepted: every tensor reads, and writing them back cannot fail (an exception
  // from here on is a finding), and what was written reads back the same.
  std::vector<std::vector<double>> values;
  std::vector<ash::TensorToWrite> tensors;
  for (const auto& e : r->tensors()) {
    values.push_back(r->read<double>(e.name));
    if (r->read<float>(e.name).size() != values.back().size()) __builtin_trap();
  }
  for (std::size_t i = 0; i < values.size(); ++i)
    tensors.emplace_back(r->tensors()[i].name, r->tensors()[i].dtype, r->tensors()[i].shape, values[i]);
  ash::write_safetensors(again, tensors, {r->metadata().begin(), r->metadata().end()});
  const ash::SafetensorsReader back(again);
  if (back.tensors().size() != tensors.size()) __builtin_trap();
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const auto& e = back.tensors()[i];
    if (e.name != tensors[i].name || e.dtype != tensors[i].dtype || e.shape != tensors[i].shape) __builtin_trap();
    const auto v = back.read<double>(e.name);
    for (std::size_t j = 0; j < v.size(); ++j)
      if (!same(v[j], values[i][j])) {
        std::fprintf(stderr, "fuzz_safetensors: tensor %s element %zu: %g read back as %g\n", e.name.c_str(), j,
                     values[i][j], v[j]);
        __builtin_trap();
      }
  }
  return 0;
}
