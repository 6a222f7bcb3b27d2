#pragma once
// Recurrent sampling: the SSM carries a fixed-size state h [K, P, N], so each
// new token costs O(K·(P² + P·N) + V·P), independent of how many came before.
// A Mamba (model.arch = "mamba") carries per block its conv state (the last
// Kc−1 conv inputs, [E, Kc−1]) and its scan state h [E, N] (transformers' and
// mamba-ssm's step): O(K·(D·E + E·(R + N + Kc)) + V·D) per token.
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "ash/model/head.hpp"
#include "ash/model/mamba2_layer.hpp"

namespace ash {

// The most tokens one generate call samples (`ash generate --tokens`, Python's generate).
constexpr std::int64_t max_generate_tokens = std::int64_t(1) << 30;

template <class S>
class Generator {
 public:
  explicit Generator(const ParamSet<S>& params);
  // Feeds tokens (the prompt) through the model in one pass, carrying the state;
  // starts (null, or one flag per token): document starts, where the state
  // restarts from zero as in training (data.separator, docs/design.md §1; a
  // Mamba's conv state too: its conv sees nothing before a start).
  void feed(const std::vector<std::uint32_t>& tokens, const std::vector<std::uint8_t>* starts = nullptr);
  // Samples the next token from softmax(logits / temperature) (argmax when
  // temperature <= 0), feeds it, and returns it.
  std::uint32_t sample(double temperature, std::mt19937_64& rng);
  // Logits after the last fed token (host copy).
  const std::vector<double>& logits() const { return logits_; }

 private:
  const ParamSet<S>& params_;
  std::vector<View2<S>> state_;  // per layer [P, N] (an SSM-ResNet)
  std::vector<MambaState<S>> mamba_state_;  // per block (a Mamba)
  std::vector<double> logits_;
};

}  // namespace ash
