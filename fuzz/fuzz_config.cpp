// The configuration parser: any bytes as a config file's text and as a --set
// value. An ash::Error is the expected answer to bad input; anything else (a
// crash, a sanitizer report, another exception) is a finding.
#include <cstddef>
#include <cstdint>
#include <string>

#include "ash/core/config.hpp"
#include "ash/core/error.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  try {
    ash::Config c;
    c.merge(ash::parse_json_strict(text, "fuzz input"), "fuzz input");
    (void)c.settings();
  } catch (const ash::Error&) {
  }
  try {
    ash::Config c;
    c.set("model.width=" + text);
    c.set("grad." + text.substr(0, 16) + "=1");
    (void)c.settings();
  } catch (const ash::Error&) {
  }
  return 0;
}
