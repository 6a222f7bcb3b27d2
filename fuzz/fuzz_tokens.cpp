// The token reader: any bytes as a text, .u16 or .u32 token file (the first
// byte picks which), then windows of them. ash::Error is the expected answer.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <fstream>
#include <string>

#include <Kokkos_Core.hpp>

#include "ash/core/error.hpp"
#include "ash/io/tokens.hpp"

extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv) {
  Kokkos::initialize(*argc, *argv);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  static const std::string base = "/tmp/ash_fuzz_tokens." + std::to_string(::getpid());
  const std::string path = base + (data[0] % 3 == 0 ? ".txt" : data[0] % 3 == 1 ? ".u16" : ".u32");
  std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(data + 1), std::streamsize(size - 1));
  try {
    const auto ids = ash::load_tokens(path);
    const ash::index_t T = 2 + ash::index_t(data[0] % 7);
    if (ash::index_t(ids.size()) >= T) (void)ash::make_windows(ids, 1, T, 1 << 16, 0);
  } catch (const ash::Error&) {
  }
  ::unlink(path.c_str());
  return 0;
}
