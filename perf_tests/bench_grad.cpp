// Time per token and measured peak memory of the gradient engines across T.
//   ash_bench_grad [--engines forward,backprop,adjoint,adjoint:256,adjoint-exact] [--T 256,1024,4096]
//                  [--width 64 --state 16 --layers 2 --vocab 256] [--chunk 64] [--wave 0] [--batch 1]
//                  [--reps 3] [--precision double|float] [--json FILE] [--max-work W] [--profile]
//                  [--e3-form auto|waves|fused|walk] [--matmul fp32|tf32|bf16] [--warmup 0] [--keep-buffers 1]
//                  [--arch ssm-resnet|mamba|mamba2 [--expand 2 --conv-kernel 4 --dt-rank 0]
//                   [--head-dim 64 --n-groups 1]]
// An engine "adjoint:256" is E2 with T̄ = 256; "forward" is the loss alone
// (what `ash eval` runs), the baseline the gradient's cost is measured against.
// --profile prints the time per kernel (KernelProfiler) of the last repetition. Peak bytes are the Kokkos Tools
// high-water mark of the compute call alone (parameters and gradient buffers
// excluded) in the default memory space; "vs E1" is the ratio to backprop's
// peak at the same T in the same run. --e3-form picks E3's per-chunk backward
// (docs/design.md §6): the backend's default, the wave buffers (a host's) or
// the fused kernels (every backend's default) or the reverse walk (the fused
// form's waves, a team per chunk over every channel); rows carry it as "e3_form".
// --matmul is run.matmul (float only; docs/design.md §6) for the forward and
// every engine; rows carry it as "matmul".
// --arch mamba benchmarks a stack of Mamba blocks (model.arch=mamba, width = D;
// backprop and adjoint-exact only), --arch mamba2 one of Mamba-2 blocks (E = expand·D
// in heads of --head-dim, B and C in --n-groups groups); rows carry "arch" (a Mamba-2's
// also "head_dim" and "n_groups"). --warmup runs that many
// untimed repetitions first (module loading, cuBLAS handles). Rows also carry
// "peak_total_bytes": the high-water mark with the parameters, the gradient
// buffers and the token windows included, as a framework's allocator counts it.
// "seconds" is the median of the timed reps, "min_seconds" the fastest, "times"
// every rep in order: each the steady_clock around one compute and the fence after it.
// "allocations" and "allocated_bytes": the Views the last timed rep allocated in the
// default memory space (what a warm engine still pays cudaMalloc and zero-fill for).
// --keep-buffers 1 (the default) lets the engine keep its buffers between calls, as
// a framework's caching allocator does; the peaks count from before the first call
// (warm-ups included). A kept engine's peak is higher by what a call allocates while
// the last call's buffers are held (the head's chunk buffers beside the layer
// workspace, and y_K through the backward). Rows carry "keep_buffers".
#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "ash/ash.hpp"

namespace {

std::vector<long long> parse_list(const std::string& s) {
  std::vector<long long> out;
  std::stringstream ss(s);
  for (std::string x; std::getline(ss, x, ',');) out.push_back(std::stoll(x));
  return out;
}

template <class S>
nlohmann::json run(const ash::ModelDims& d, const ash::EngineOptions& o, bool fwd, long long T, long long batch,
                   int reps, int warmup, bool profile) {
  ash::ParamSet<S> params(d);
  ash::initialize(params, d.seed);
  std::vector<std::uint32_t> ids(std::size_t(batch * T));
  for (std::size_t i = 0; i < ids.size(); ++i) ids[i] = std::uint32_t((i * 2654435761u) % std::uint64_t(d.vocab));
  const auto x = ash::make_windows(ids, batch, T, d.vocab);
  ash::ParamSet<S> grad(d);
  std::unique_ptr<ash::GradientEngine<S>> engine;
  if (!fwd) engine = ash::make_engine<S>(o);
  const std::string space = ash::MemSpace::name();
  const ash::MatmulScope matmul(o.matmul, sizeof(S));  // the engines set it themselves; the forward needs it here
  std::vector<double> times;
  std::uint64_t peak = 0, peak_total = 0;
  double loss = 0;
  std::uint64_t allocs = 0, alloc_bytes = 0;  // the last timed rep's
  // Peaks count from before the first call: with --keep-buffers the engine holds its
  // buffers from call to call, and the first call (a warm-up's too) allocates them.
  const auto base = ash::MemoryTracker::current(space);
  for (int r = -warmup; r < reps; ++r) {
    const auto a0 = ash::MemoryTracker::allocations(space), b0 = ash::MemoryTracker::allocated_bytes(space);
    ash::MemoryTracker::reset_peak();
    if (profile && r + 1 == reps) ash::KernelProfiler::start();
    const auto t0 = std::chrono::steady_clock::now();
    loss = fwd ? ash::forward_loss(params, x, o.head_chunk) : engine->compute(params, x, grad);
    Kokkos::fence();
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (profile && r + 1 == reps) ash::KernelProfiler::stop();
    peak = std::max(peak, ash::MemoryTracker::peak(space) - base);
    peak_total = std::max(peak_total, ash::MemoryTracker::peak(space));
    if (r < 0) continue;  // warm-up: not timed
    allocs = ash::MemoryTracker::allocations(space) - a0;
    alloc_bytes = ash::MemoryTracker::allocated_bytes(space) - b0;
    times.push_back(dt);
  }
  const std::vector<double> in_order = times;  // every timed rep, for a caller's own min and median
  std::sort(times.begin(), times.end());
  const double med = times[times.size() / 2];
  if (profile) std::printf("%s", ash::KernelProfiler::table(times.back()).c_str());
  const bool e3 = !fwd && o.method == ash::Method::adjoint_exact;
  // A Mamba's scan core runs the fused form where e3_scan_fused says; a Mamba-2's "fused" is the SSD's form (no walk).
  const bool fused = e3 && ash::e3_fused_form(o, T) && (d.mamba2() || !d.mamba() || o.e3_scan_fused);
  return {{"engine", fwd ? std::string("forward") : engine->name()}, {"T", T}, {"batch", batch},
          {"e3_form", !e3 ? "-" : !fused ? "waves" : o.e3_walk && !d.mamba2() ? "walk" : "fused"}, {"matmul", ash::matmul_name(o.matmul)},
          {"seconds", med},           {"min_seconds", times.front()}, {"times", in_order},
          {"us_per_token", 1e6 * med / double(batch * T)},
          {"peak_bytes", peak},       {"peak_total_bytes", peak_total},
          {"allocations", allocs},    {"allocated_bytes", alloc_bytes}, {"keep_buffers", o.keep_buffers},
          {"space", space}, {"loss", loss},
          {"width", d.width},         {"state", d.state}, {"layers", d.layers}, {"vocab", d.vocab},
          {"arch", ash::arch_name(d.arch)}, {"head_dim", d.mamba2() ? d.head_dim : 0},
          {"n_groups", d.mamba2() ? d.n_groups : 0}};
}

}  // namespace

int main(int argc, char* argv[]) {
  Kokkos::ScopeGuard kokkos(argc, argv);
  ash::MemoryTracker::install();
  CLI::App app{"AdjointSharding gradient-engine benchmark"};
  std::string engines = "backprop,adjoint,adjoint:256,adjoint:64,adjoint-exact", Ts = "256,1024,4096",
              precision = "double", json_out, e3_form = "auto", matmul = "fp32", arch = "ssm-resnet";
  ash::ModelDims d;
  long long batch = 1, chunk = 64, wave = 0;
  bool profile = false;
  double max_work = 2e10;
  int reps = 3, warmup = 0;
  bool keep_buffers = true;
  app.add_option("--engines", engines, "comma-separated engines");
  app.add_option("--T", Ts, "comma-separated context lengths");
  app.add_option("--vocab", d.vocab);
  app.add_option("--width", d.width);
  app.add_option("--state", d.state);
  app.add_option("--layers", d.layers);
  app.add_option("--batch", batch);
  app.add_option("--chunk", chunk, "E3 chunk length");
  app.add_option("--wave", wave, "E3 wave length (0: auto, as grad.wave)");
  app.add_flag("--profile", profile, "print the time per kernel of the last repetition");
  app.add_option("--max-work", max_work, "skip E2 runs with T*T-bar*P*N*K above this");
  app.add_option("--reps", reps);
  app.add_option("--warmup", warmup, "untimed repetitions before the timed ones")->check(CLI::NonNegativeNumber);
  app.add_option("--keep-buffers", keep_buffers,
                 "1: the engine keeps its buffers between calls (EngineOptions::keep_buffers; a warm call allocates "
                 "almost nothing); 0: every call allocates its own");
  app.add_option("--arch", arch, "model.arch: ssm-resnet, mamba or mamba2")
      ->check(CLI::IsMember({"ssm-resnet", "mamba", "mamba2"}));
  app.add_option("--expand", d.expand, "Mamba: E = expand * width");
  app.add_option("--conv-kernel", d.conv_kernel, "Mamba: the causal conv's taps");
  app.add_option("--dt-rank", d.dt_rank, "Mamba: the rank of the delta projection (0: ceil(width / 16))");
  app.add_option("--head-dim", d.head_dim, "Mamba-2: the channels of a head (E / head_dim heads)");
  app.add_option("--n-groups", d.n_groups, "Mamba-2: the groups of B and C (divides the heads)");
  app.add_option("--precision", precision)->check(CLI::IsMember({"float", "double"}));
  app.add_option("--json", json_out, "also write the rows as JSON lines");
  app.add_option("--e3-form", e3_form, "E3's per-chunk backward: auto (the backend's), waves, fused or walk")
      ->check(CLI::IsMember({"auto", "waves", "fused", "walk"}));
  app.add_option("--matmul", matmul, "run.matmul: fp32, tf32 or bf16 (float only)")
      ->check(CLI::IsMember({"fp32", "tf32", "bf16"}));
  CLI11_PARSE(app, argc, argv);
  d.arch = ash::parse_arch(arch);
  if (d.mamba2() && (d.head_dim < 1 || d.n_groups < 1 || d.inner() % d.head_dim || d.head_count() % d.n_groups)) {
    std::fprintf(stderr, "ash_bench_grad: --head-dim must divide expand * width and --n-groups the heads\n");
    return 2;
  }

  std::string cmd;
  for (int i = 0; i < argc; ++i) cmd += std::string(i ? " " : "") + argv[i];
  std::printf("# %s\n# Kokkos %d, exec space %s, concurrency %d; %s V=%lld P=%lld N=%lld K=%lld batch=%lld %s\n",
              cmd.c_str(), KOKKOS_VERSION, ash::ExecSpace::name(), int(ash::ExecSpace().concurrency()),
              arch.c_str(), (long long)d.vocab, (long long)d.width, (long long)d.state, (long long)d.layers, batch,
              precision.c_str());
  if (const std::string blas = ash::blas_core_note(); !blas.empty()) std::printf("# %s\n", blas.c_str());
  std::printf("%-28s %8s %12s %14s %14s %8s %10s\n", "engine", "T", "seconds", "us/token", "peak", "vs E1",
              "loss");
  std::map<long long, double> e1_peak;
  std::ofstream js;
  if (!json_out.empty()) js.open(json_out);
  std::stringstream es(engines);
  for (std::string e; std::getline(es, e, ',');) {
    ash::EngineOptions o;
    const std::string name = e.substr(0, e.find(':'));
    const bool fwd = name == "forward";  // the forward alone, for the ratio engine / forward
    if (!fwd) o.method = ash::parse_method(name);
    if (e.find(':') != std::string::npos) o.truncate = std::stoll(e.substr(e.find(':') + 1));
    o.chunk = chunk;
    o.wave = wave;
    o.keep_buffers = keep_buffers;
    if (e3_form != "auto") o.e3_fused = o.e3_scan_fused = e3_form != "waves";
    o.e3_walk = e3_form == "walk";
    o.matmul = ash::parse_matmul(matmul);
    for (long long T : parse_list(Ts)) {
      const double work = double(T) * double(o.truncate > 0 && o.truncate < T ? o.truncate : T) *
                          double(d.width * d.state * d.layers * batch);
      if (!fwd && o.method == ash::Method::adjoint && work > max_work) {
        std::printf("%-28s %8lld  skipped: O(T*T-bar) work %.2g > --max-work %.2g\n", e.c_str(), T, work, max_work);
        continue;
      }
      try {
        const auto row = precision == "float" ? run<float>(d, o, fwd, T, batch, reps, warmup, profile)
                                              : run<double>(d, o, fwd, T, batch, reps, warmup, profile);
        const double peak = double(row["peak_bytes"].get<std::uint64_t>());
        if (!fwd && o.method == ash::Method::backprop) e1_peak[T] = peak;
        char ratio[32] = "-";
        if (e1_peak.count(T)) std::snprintf(ratio, sizeof ratio, "%.3f", peak / e1_peak[T]);
        const std::string label =
            row["engine"].get<std::string>() + (row["e3_form"] == "fused" || row["e3_form"] == "walk" ? " " + row["e3_form"].get<std::string>() : "") +
            (matmul != "fp32" ? " " + matmul : "");
        std::printf("%-28s %8lld %12.4f %14.2f %14s %8s %10.4f\n", label.c_str(), T,
                    row["seconds"].get<double>(), row["us_per_token"].get<double>(),
                    ash::format_bytes(row["peak_bytes"].get<std::uint64_t>()).c_str(), ratio,
                    row["loss"].get<double>());
        std::fflush(stdout);
        if (js) js << row.dump() << "\n";
      } catch (const std::exception& ex) {  // e.g. out of memory: report and go on
        std::printf("%-28s %8lld  failed: %s\n", e.c_str(), T, ex.what());
      }
    }
  }
  std::printf("# process HWM %s\n", ash::format_bytes(ash::MemoryTracker::process_hwm_bytes()).c_str());
  return 0;
}
