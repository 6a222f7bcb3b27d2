// Using AdjointSharding from C++: build a model, compute loss and gradient,
// take one plain gradient step, and check the loss went down.
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include <ash/ash.hpp>

int main(int argc, char* argv[]) {
  Kokkos::ScopeGuard kokkos(argc, argv);
  ash::MemoryTracker::install();
  try {
    ash::Config cfg;
    cfg.set("model.vocab=256");
    cfg.set("model.width=32");
    cfg.set("model.state=8");
    cfg.set("model.layers=2");
    cfg.validate();

    ash::ParamSet<double> params(cfg.model());
    ash::initialize(params, cfg.model().seed);

    // Byte tokens of a short text: 4 windows of 64 tokens.
    std::string text;
    while (text.size() < 4 * 64) text += "Adjoint sharding splits the gradient into independent VJPs. ";
    const std::vector<std::uint32_t> ids(text.begin(), text.end());
    const auto x = ash::make_windows(ids, 4, 64, cfg.model().vocab);

    ash::EngineOptions opts;  // backprop (E1)
    auto engine = ash::make_engine<double>(opts);
    ash::ParamSet<double> grad(params.dims());
    const double loss0 = engine->compute(params, x, grad);

    // θ <- θ - lr ∇L, flat over every tensor.
    auto p = params.data();
    auto g = grad.data();
    Kokkos::parallel_for(
        "sgd", Kokkos::RangePolicy<ash::ExecSpace>(0, p.extent(0)), KOKKOS_LAMBDA(const int i) { p(i) -= 0.5 * g(i); });
    const double loss1 = ash::forward_loss(params, x);
    std::printf("engine %s: loss %.6f -> %.6f after one step; %s\n", engine->name().c_str(), loss0, loss1,
                ash::MemoryTracker::summary().c_str());
    if (!(std::isfinite(loss0) && loss1 < loss0)) {
      std::fprintf(stderr, "expected the loss to decrease\n");
      return 1;
    }
  } catch (const ash::Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 2;
  }
  return 0;
}
