#pragma once
// `ash generate` and Python's generate as one library call (the use-case floor,
// docs/architecture.md): the memory check from the stored model sizes, the
// model in double, the prompt fed in one pass, recurrent sampling.
#include <cstdint>
#include <string>
#include <vector>

#include "ash/app/run_checks.hpp"

namespace ash {

struct GenerateOptions {
  std::int64_t tokens = 200;     // how many to sample (at most max_generate_tokens)
  double temperature = 0.8;      // softmax temperature (0: greedy)
  std::uint64_t seed = 1;        // the sampler's seed
  std::uint64_t max_memory = 0;  // check_memory's limit (0: the machine's)
  // A model trained on documents (data.separator): the prompt's documents each
  // start from h = 0 (a Mamba's conv state too), and the sample ends with the separator (the document's end:
  // what follows one was never a target in training). ash generate; not Python's.
  bool documents = true;
};

struct GeneratedTokens {
  std::vector<std::uint32_t> ids;  // the sampled tokens, after the prompt
  std::int64_t vocab = 0;          // the model's vocabulary (V <= 256: bytes)
};

// The options are checked first; then `read` gives the checkpoint's header (only its
// stored model sizes size the memory check; the load verifies the rest).
GeneratedTokens generate_tokens(const std::string& checkpoint, const std::vector<std::uint32_t>& prompt,
                                const GenerateOptions& opts, const CheckpointReader& read);

}  // namespace ash
