// How far is the paper's gradient (E2) from the true one? docs/design.md §2.
//
//   ash_fidelity [--layers 1,2,4,8] [--tokens FILE] [--T 256] [--batch 2]
//                [--width 64 --state 16] [--truncate 0] [--checkpoint CKPT] [--seed S]
//
// For each depth K: a seeded model (or --checkpoint), real text windows, the
// exact gradient (E3, checked against E1 and JAX in the tests) and E2
// (T̄ = --truncate, 0 = full). Prints cosine similarity and relative L2 error
// ||E2 - exact|| / ||exact|| per parameter group, as a Markdown table.
#include <CLI/CLI.hpp>
#include <cmath>
#include <cstdio>
#include <map>
#include <sstream>

#include "ash/ash.hpp"

namespace {

struct Acc {
  double dot = 0, aa = 0, bb = 0, dd = 0;
  void add(double a, double b) {
    dot += a * b;
    aa += a * a;
    bb += b * b;
    dd += (a - b) * (a - b);
  }
  double cosine() const { return dot / std::sqrt(aa * bb); }
  double rel() const { return std::sqrt(dd / bb); }
};

std::string group_of(const std::string& name) {
  const auto slash = name.rfind('/');
  return slash == std::string::npos ? name : "layers/*/" + name.substr(slash + 1);
}

}  // namespace

int main(int argc, char* argv[]) {
  Kokkos::ScopeGuard kokkos(argc, argv);
  CLI::App app{"E2 (paper) vs exact gradient, per parameter group"};
  std::string layers = "1,2,4,8", tokens = "/usr/share/common-licenses/GPL-3", checkpoint;
  long long T = 256, batch = 2, width = 64, state = 16, truncate = 0;
  unsigned long long seed = 1234;
  app.add_option("--layers", layers, "comma-separated depths K");
  app.add_option("--tokens", tokens, "token file (text bytes, .u16, .u32)");
  app.add_option("--T", T);
  app.add_option("--batch", batch);
  app.add_option("--width", width);
  app.add_option("--state", state);
  app.add_option("--truncate", truncate, "E2 window T-bar (0 = full)");
  app.add_option("--checkpoint", checkpoint, "use this model instead of seeded ones (its K)");
  app.add_option("--seed", seed);
  CLI11_PARSE(app, argc, argv);

  std::string cmd;
  for (int i = 0; i < argc; ++i) cmd += std::string(i ? " " : "") + argv[i];
  std::printf("<!-- %s -->\n", cmd.c_str());
  std::printf("| K | group | cosine(E2, exact) | ‖E2−exact‖/‖exact‖ |\n|---|---|---|---|\n");
  try {
    std::vector<long long> Ks;
    std::stringstream ss(layers);
    for (std::string k; std::getline(ss, k, ',');) Ks.push_back(std::stoll(k));
    if (!checkpoint.empty()) Ks = {0};
    const auto ids = ash::load_tokens(tokens);
    for (long long K : Ks) {
      ash::ParamSet<double> params;
      if (checkpoint.empty()) {
        ash::ModelDims d;
        d.vocab = 256;
        d.width = width;
        d.state = state;
        d.layers = K;
        d.seed = seed;
        params = ash::ParamSet<double>(d);
        ash::initialize(params, seed);
      } else {
        params = ash::load_checkpoint<double>(checkpoint);
        K = params.dims().layers;
      }
      const auto x = ash::make_windows(ids, batch, T, params.dims().vocab);
      ash::EngineOptions exact, paper;
      exact.method = ash::Method::adjoint_exact;
      paper.method = ash::Method::adjoint;
      paper.truncate = truncate;
      ash::ParamSet<double> ge(params.dims()), gp(params.dims());
      ash::make_engine<double>(exact)->compute(params, x, ge);
      ash::make_engine<double>(paper)->compute(params, x, gp);
      auto he = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), ge.data());
      auto hp = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), gp.data());
      std::map<std::string, Acc> groups;
      std::vector<Acc> per_layer(K);
      Acc all, no_emb;
      for (const auto& t : ge.tensors()) {
        for (ash::index_t i = t.offset; i < t.offset + t.size(); ++i) {
          groups[group_of(t.name)].add(hp(i), he(i));
          all.add(hp(i), he(i));
          if (t.name != "embedding") no_emb.add(hp(i), he(i));
          if (t.name.rfind("layers/", 0) == 0) per_layer[std::stoi(t.name.substr(7, 3))].add(hp(i), he(i));
        }
      }
      auto row = [&](const std::string& g, const Acc& a) {
        std::printf("| %lld | %s | %.4f | %.3e |\n", K, g.c_str(), a.cosine(), a.rel());
      };
      for (const auto& kv : groups) row(kv.first, kv.second);
      for (long long k = 0; k < K; ++k) row("layer " + std::to_string(k) + " (all of θ_k)", per_layer[k]);
      row("all but the embedding", no_emb);
      row("**all parameters**", all);
      std::fflush(stdout);
    }
  } catch (const ash::Error& e) {
    std::fprintf(stderr, "ash_fidelity: error: %s\n", e.what());
    return 2;
  }
  return 0;
}
