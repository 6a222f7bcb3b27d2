// The strict JSON parser (core/config: parse_json_strict) that reads every JSON
// input of the tool: config files, --set values, a folder's config.json, a
// safetensors header or index, a checkpoint's config attribute. Properties:
// - the input parses or is refused with an ash::Error; what parses is what
//   nlohmann's own parser makes of the same text (the strict parser refuses
//   more: duplicate keys, a byte order mark, a NUL byte, deep nesting; never less);
// - time linear in the size: a document that parses is parsed again as the value
//   of every member of one object and of every element of one array of about
//   512 KB. Run with a per-input -timeout (fuzz/run.sh): nlohmann's callback
//   parser, quadratic in the members of one object, took 16 s on `{}` so.
// A crash, a sanitizer report, a timeout or a disagreement is a finding.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include <nlohmann/json.hpp>

#include "ash/core/config.hpp"
#include "ash/core/error.hpp"

namespace {

constexpr std::size_t amplified_bytes = std::size_t(512) << 10;

[[noreturn]] void finding(const char* what) {
  std::fprintf(stderr, "fuzz_json: %s\n", what);
  std::abort();
}

// `text` repeated as the members {"0": text, "1": text, ...} or the elements [text, text, ...].
std::string repeated(const std::string& text, bool object, std::size_t* count) {
  std::string s(1, object ? '{' : '[');
  *count = 0;
  while (s.size() + text.size() + 12 < amplified_bytes || *count == 0) {
    if (*count) s += ',';
    if (object) s += '"' + std::to_string(*count) + "\":";
    s += text;
    ++*count;
  }
  return s + (object ? '}' : ']');
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  nlohmann::json doc;
  try {
    doc = ash::parse_json_strict(text, "fuzz input");
  } catch (const ash::Error&) {
    return 0;
  }
  nlohmann::json plain;
  try {
    plain = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception&) {
    finding("the strict parser accepts what nlohmann's parser refuses");
  }
  if (doc != plain) finding("the strict parser and nlohmann's parser read different documents");
  const bool room = ash::json_depth(text) < ash::max_json_depth;  // one level more still fits
  for (const bool object : {true, false}) {
    std::size_t count = 0;
    const std::string big = repeated(text, object, &count);
    try {
      const nlohmann::json many = ash::parse_json_strict(big, "amplified fuzz input");
      if (many.size() != count || many.begin().value() != doc) finding("the repeated document reads differently");
    } catch (const ash::Error&) {
      if (room) finding("the repeated document, within the depth limit, is refused");
    }
  }
  return 0;
}
