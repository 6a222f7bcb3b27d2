// Training from C++ with the library API, the way an HPC code embeds it:
// data, engine, optimizer and checkpoint without the ash tool.
//   ash_example_train TOKEN_FILE [steps] [T]
#include <cmath>
#include <cstdio>
#include <string>

#include <ash/ash.hpp>

int main(int argc, char* argv[]) {
  Kokkos::ScopeGuard kokkos(argc, argv);
  ash::MemoryTracker::install();
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s TOKEN_FILE [steps] [T]\n", argv[0]);
    return 2;
  }
  const int steps = argc > 2 ? std::stoi(argv[2]) : 20;
  const ash::index_t T = argc > 3 ? std::stoll(argv[3]) : 512;
  try {
    ash::Config cfg;
    cfg.set("model.width=32");
    cfg.set("model.state=8");
    cfg.set("optim.steps=" + std::to_string(steps));
    cfg.set("optim.warmup=" + std::to_string(steps / 10));
    cfg.validate();
    const auto d = cfg.model();
    const auto data = ash::TokenDataset::from_file(argv[1], d.vocab, T, 0.05, d.seed, false);

    ash::ParamSet<float> params(d), grad(d);
    ash::initialize(params, d.seed);
    ash::EngineOptions eo;
    eo.method = ash::Method::adjoint_exact;  // exact gradient in O(T) memory
    auto engine = ash::make_engine<float>(eo);
    ash::AdamW<float> opt(d, ash::AdamWOptions::from_config(cfg));
    const auto valid = data.valid_batch(4);

    const double before = ash::forward_loss(params, valid);
    for (int step = 0; step < steps; ++step) {
      const double loss = engine->compute(params, data.train_batch(step, 4, nullptr), grad);
      opt.update(params, grad);
      if (step % 5 == 0 || step + 1 == steps) std::printf("step %3d  loss %.4f\n", step + 1, loss);
    }
    const double after = ash::forward_loss(params, valid);
    std::printf("validation loss %.4f -> %.4f nats/token; %s\n", before, after, ash::MemoryTracker::summary().c_str());
    ash::save_checkpoint("example_train.h5", cfg, params, steps, 0,
                         ash::OptimizerState<float>{&opt.m(), &opt.v(), opt.step()});
    if (!(after < before)) {
      std::fprintf(stderr, "expected the validation loss to decrease\n");
      return 1;
    }
  } catch (const ash::Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 2;
  }
  return 0;
}
