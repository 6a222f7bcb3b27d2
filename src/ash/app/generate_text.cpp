#include "ash/app/generate_text.hpp"

#include <algorithm>
#include <cmath>
#include <random>

#include <nlohmann/json.hpp>

#include "ash/app/token_windows.hpp"
#include "ash/core/documents.hpp"
#include "ash/core/error.hpp"
#include "ash/model/generator.hpp"
#include "ash/plan/memory_plan.hpp"

namespace ash {

GeneratedTokens generate_tokens(const std::string& checkpoint, const std::vector<std::uint32_t>& prompt,
                                const GenerateOptions& opts, const CheckpointReader& read) {
  require(!prompt.empty(), "--prompt must not be empty");
  require(opts.tokens >= 0, "--tokens must be >= 0");
  require(std::isfinite(opts.temperature) && opts.temperature >= 0,
          "--temperature must be a finite number >= 0 (0: greedy), got " + std::to_string(opts.temperature));
  // The model in double and its file image, checked before either is allocated
  // (only the stored model sizes: the rest of the stored configuration is not used).
  Config sizes;
  sizes.merge(nlohmann::json{{"model", read(checkpoint).config.json()["model"]}}, "'" + checkpoint + "': config attribute");
  check_memory(sizes, Workload::init, 8, opts.max_memory);
  CheckpointInfo info;
  const auto params = load_checkpoint<double>(checkpoint, &info);
  for (const auto v : prompt)
    require(std::int64_t(v) < info.dims.vocab,
            "prompt token " + std::to_string(v) + " >= vocab " + std::to_string(info.dims.vocab));
  const std::string separator = opts.documents ? info.config.settings().data.separator : std::string();
  const auto sep = separator_tokens(separator);  // bytes: \u00XX is the byte XX
  const auto document = document_starts(prompt, separator);
  Generator<double> gen(params);
  gen.feed(prompt, document.documents());
  std::mt19937_64 rng(opts.seed);
  GeneratedTokens out;
  out.vocab = info.dims.vocab;
  for (std::int64_t i = 0; i < opts.tokens; ++i) {
    out.ids.push_back(gen.sample(opts.temperature, rng));
    if (!sep.empty() && out.ids.size() >= sep.size() && std::equal(sep.begin(), sep.end(), out.ids.end() - sep.size()))
      break;
  }
  return out;
}

}  // namespace ash
