// The checkpoint loader on mutants of a valid checkpoint ($ASH_FUZZ_CHECKPOINT,
// written by `ash init`; fuzz/make_corpus.sh makes one): the input is a list of
// (offset, byte) pairs XORed into the file's bytes, so every mutant has the
// file's size and layout. The property of docs/file_format.md: a mutant either
// loads the same values as the original or is refused with an ash::Error.
// A load of other values, a crash or a sanitizer report is a finding, and so
// is a timeout: the seeds of fuzz/shape_seed.py declare datasets of 2^40
// elements per dimension in an 11 KB file, which inspect_checkpoint(Verify::all)
// once read for ever (or allocated) before checking their shape.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include <Kokkos_Core.hpp>

#include "ash/core/error.hpp"
#include "ash/io/checkpoint.hpp"

namespace {
std::vector<char> g_original;
std::vector<double> g_values;

std::vector<double> host_values(const ash::ParamSet<double>& p) {
  auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), p.data());
  return std::vector<double>(h.data(), h.data() + h.extent(0));
}
}  // namespace

extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv) {
  Kokkos::initialize(*argc, *argv);
  const char* seed = std::getenv("ASH_FUZZ_CHECKPOINT");
  if (!seed) {
    std::fprintf(stderr, "fuzz_checkpoint: set ASH_FUZZ_CHECKPOINT to a checkpoint written by ash init\n");
    std::abort();
  }
  std::ifstream in(seed, std::ios::binary);
  g_original.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  g_values = host_values(ash::load_checkpoint<double>(seed));
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (g_original.empty()) return 0;
  std::vector<char> bytes = g_original;
  for (std::size_t i = 0; i + 4 < size; i += 5) {  // 4 bytes of offset, 1 byte to XOR
    const std::uint32_t off = std::uint32_t(data[i]) | std::uint32_t(data[i + 1]) << 8 |
                              std::uint32_t(data[i + 2]) << 16 | std::uint32_t(data[i + 3]) << 24;
    bytes[off % bytes.size()] ^= char(data[i + 4]);
  }
  static const std::string path = "/tmp/ash_fuzz_checkpoint." + std::to_string(::getpid()) + ".h5";
  std::ofstream(path, std::ios::binary).write(bytes.data(), std::streamsize(bytes.size()));
  try {
    (void)ash::inspect_checkpoint(path, ash::Verify::all);
    const auto loaded = host_values(ash::load_checkpoint<double>(path));
    if (loaded != g_values) {
      std::fprintf(stderr, "fuzz_checkpoint: a mutant loaded other values without an error\n");
      std::abort();
    }
  } catch (const ash::Error&) {
  }
  ::unlink(path.c_str());
  return 0;
}
