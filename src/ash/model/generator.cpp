#include "ash/model/generator.hpp"

#include <cmath>

#include "ash/core/error.hpp"

namespace ash {

template <class S>
Generator<S>::Generator(const ParamSet<S>& params) : params_(params) {
  const auto& d = params.dims();
  for (int k = 0; k < d.layers; ++k) {
    if (d.mamba())
      mamba_state_.emplace_back(1, d);
    else
      state_.emplace_back("ash::gen::state", d.width, d.state);
  }
}

template <class S>
void Generator<S>::feed(const std::vector<std::uint32_t>& tokens, const std::vector<std::uint8_t>* starts) {
  if (tokens.empty()) return;
  const auto& d = params_.dims();
  const index_t T = index_t(tokens.size());
  TokenView x("ash::gen::tokens", 1, T);
  auto h = Kokkos::create_mirror_view(x);
  for (index_t t = 0; t < T; ++t) {
    require(index_t(tokens[t]) < d.vocab, "token id " + std::to_string(tokens[t]) + " is >= vocab");
    h(0, t) = token_t(tokens[t]) | (starts && (*starts)[std::size_t(t)] ? doc_start_bit : token_t(0));
  }
  Kokkos::deep_copy(x, h);
  const SeqShape s = SeqShape::of(x);
  View2<S> y("ash::gen::y", T, d.width), y_next("ash::gen::y_next", T, d.width);
  embedding_forward(params_.global().embedding, x, y);
  if (d.mamba()) {
    const MambaActivations<S> act(s, d, LayerActivations<S>::projections_only);
    for (int k = 0; k < d.layers; ++k) {
      with_mamba_block(params_, k, [&](const auto& p) {
        mamba_layer_forward(p, d, s, y, act, y_next, mamba_state_[std::size_t(k)]);
      });
      std::swap(y, y_next);
    }
  } else {
    const LayerActivations<S> act(s, d, LayerActivations<S>::projections_only);
    for (int k = 0; k < d.layers; ++k) {
      ssm_layer_forward(params_.layer(k), s, y, act, y_next, state_[k]);
      std::swap(y, y_next);
    }
  }
  auto last = Kokkos::subview(y, Kokkos::make_pair(T - 1, T), Kokkos::ALL());
  View2<S> last_row("ash::gen::last", 1, d.width);
  Kokkos::deep_copy(last_row, last);
  View2<S> logits("ash::gen::logits", 1, d.vocab);
  head_logits(params_.global(), last_row, logits);
  auto hl = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), logits);
  logits_.assign(hl.data(), hl.data() + d.vocab);
}

template <class S>
std::uint32_t Generator<S>::sample(double temperature, std::mt19937_64& rng) {
  require(!logits_.empty(), "Generator::sample needs a prompt of at least one token");
  std::size_t pick = 0;
  if (temperature <= 0) {
    for (std::size_t v = 1; v < logits_.size(); ++v)
      if (logits_[v] > logits_[pick]) pick = v;
  } else {
    double mx = logits_[0];
    for (double l : logits_) mx = std::max(mx, l);
    std::vector<double> p(logits_.size());
    double z = 0;
    for (std::size_t v = 0; v < p.size(); ++v) z += p[v] = std::exp((logits_[v] - mx) / temperature);
    double u = double(rng() >> 11) * (1.0 / 9007199254740992.0) * z;
    for (pick = 0; pick + 1 < p.size() && u >= p[pick]; ++pick) u -= p[pick];
  }
  feed({std::uint32_t(pick)});
  return std::uint32_t(pick);
}

template class Generator<float>;
template class Generator<double>;

}  // namespace ash
