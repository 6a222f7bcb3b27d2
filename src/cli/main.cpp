// The `ash` command-line tool (docs/design.md §4): init, train, grad, eval, plan, generate, inspect,
// import-hf, export-hf.
// It parses, starts MPI and Kokkos, calls the verbs' library forms (src/ash/app/) and prints.
#include <CLI/CLI.hpp>
#include <sys/resource.h>

#include <cmath>
#include <cerrno>
#include <cstdlib>
#include <limits>
#include <csignal>
#include <memory>
#include <cstdio>
#include <iostream>
#include <new>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "ash/app/eval_file.hpp"
#include "ash/app/generate_text.hpp"
#include "ash/app/grad_file.hpp"
#include "ash/app/hf_convert.hpp"
#include "ash/app/init_model.hpp"
#include "ash/app/plan_run.hpp"
#include "ash/app/run_checks.hpp"
#include "ash/app/train_run.hpp"
#include "ash/app/upgrade_file.hpp"
#include "ash/ash.hpp"
#include "ash/distributed/run_context.hpp"
#ifdef ASH_HAVE_MPI
#include "ash/distributed/collectives.hpp"
#include "ash/distributed/session.hpp"
#endif

namespace {

struct Common {
  std::string config_file;
  std::vector<std::string> sets;
  std::uint64_t max_memory = 0;  // --max-memory; 0: the machine's physical memory
};

// Warnings go to stderr from the only process, or world rank 0 of an MPI run.
bool g_print_warnings = true;

// ash::inspect_checkpoint, and once per file a warning on stderr when the file
// is of a format with weaker checks than format 3 (ash::format_warning): every
// verb that reads a checkpoint starts here.
ash::CheckpointInfo inspect(const std::string& path, ash::Verify verify = ash::Verify::header) {
  auto info = ash::inspect_checkpoint(path, verify);
  static std::set<std::string> warned;
  const std::string warning = ash::format_warning(path, info);
  if (!warning.empty() && g_print_warnings && warned.insert(path).second) {
    std::fprintf(stderr, "ash: warning: %s\n", warning.c_str());
    std::fflush(stderr);
  }
  return info;
}

ash::Config load_config(const Common& c) { return ash::train_config(nullptr, c.config_file, "", c.sets); }

// A Mamba's own sizes, one line (nothing for an SSM-ResNet, whose output is as before).
std::string mamba_line(const ash::ModelDims& d) {
  if (!d.mamba()) return "";
  char extra[160] = "";  // what the architecture adds to a Mamba's sizes
  if (d.mixer_norms()) std::snprintf(extra, sizeof extra, ", mixer_rms_eps %g", d.mixer_rms_eps);
  if (d.mamba2()) {
    char hi[32] = "inf";
    if (d.time_step_limit_max > 0) std::snprintf(hi, sizeof hi, "%g", d.time_step_limit_max);
    std::snprintf(extra, sizeof extra, ", %lld heads of %lld, n_groups %lld, time_step_limit [%g, %s]",
                  (long long)d.head_count(), (long long)d.head_dim, (long long)d.n_groups, d.time_step_limit_min, hi);
  }
  char rank[48] = "";
  if (!d.mamba2()) std::snprintf(rank, sizeof rank, " dt_rank=%lld", (long long)d.rank());
  char buf[400];
  std::snprintf(buf, sizeof buf, "arch %s: D=%lld E=%lld conv_kernel=%lld%s %s embeddings, norm_eps %g%s\n",
                ash::arch_name(d.arch).c_str(), (long long)d.width, (long long)d.inner(), (long long)d.conv_kernel,
                rank, d.tie_embeddings ? "tied" : "untied", d.norm_eps, extra);
  return buf;
}

template <class S>
void run_init(const ash::Config& cfg, const Common& c, const std::string& out) {
  const auto params = ash::init_file<S>(cfg, c.config_file, out, c.max_memory);
  std::printf("wrote %s: V=%lld P=%lld N=%lld K=%lld, %lld parameters (%s), seed %llu\n", out.c_str(),
              (long long)cfg.model().vocab, (long long)cfg.model().width, (long long)cfg.model().state,
              (long long)cfg.model().layers, (long long)params.size(), sizeof(S) == 8 ? "double" : "float",
              (unsigned long long)cfg.model().seed);
  std::printf("%s", mamba_line(cfg.model()).c_str());
}

struct GradArgs {
  std::string checkpoint, tokens, out, precision;
  ash::RunOverrides run;  // --engine, --truncate, --chunk, --set (unset: the checkpoint's)
  bool detach = false;
  Common common;
};

template <class S>
void run_grad(const GradArgs& a, const ash::CheckpointInfo& info) {
  ash::RunOverrides run = a.run;
  run.sets = a.common.sets;
  if (a.detach) run.detach_inputs = true;  // the flag can only turn it on
  const ash::Config cfg = ash::checkpoint_run_config(info.config, run);
  ash::GradFileOptions opts;
  opts.out = a.out;
  opts.max_memory = a.common.max_memory;
  // Tests: ASH_DEBUG_FAIL_RANK=r makes world rank r fail before the backward,
  // while its neighbours wait in MPI (docs/cli.md: one error, every rank ends).
  if (const char* f = std::getenv("ASH_DEBUG_FAIL_RANK")) opts.fail_rank = std::atoi(f);
  ash::TokenSource tokens;
  tokens.path = a.tokens;
  const auto r = ash::grad_file<S>(a.checkpoint, cfg, tokens, opts);
  const ash::Settings st = cfg.settings();
  const auto T = st.data.seq_len, B = st.data.batch;
  const std::string matmul = st.grad.matmul == ash::Matmul::fp32 ? "" : ", " + ash::matmul_name(st.grad.matmul) + " matmul";
  std::printf("engine %s (%s%s), %lld window(s) of T=%lld\n", r.engine.c_str(), sizeof(S) == 8 ? "double" : "float",
              matmul.c_str(), (long long)B, (long long)T);
  std::printf("loss %.10f\n", r.loss);
  std::printf("time %.3f s (%.2f us/token)\n", r.seconds, 1e6 * r.seconds / double(B * T));
  if (!r.distributed) {
    std::printf("memory: %s; planned peak %s (ash plan)\n", r.memory.c_str(),
                ash::format_bytes(std::uint64_t(r.planned_peak)).c_str());
  } else {
    std::printf("pipeline: %lld token block(s), ranks busy %.0f%% of the time (sum of compute / (R x wall))\n",
                (long long)r.pipeline->blocks, 100.0 * r.pipeline->busy_fraction);
    for (const auto& p : r.places) {
      const std::size_t w = std::size_t(p.world_rank);
      const std::string toks = p.t_end - p.t_begin < T ? ", tokens " + std::to_string(p.t_begin) + ".." +
                                                             std::to_string(p.t_end - 1)
                                                       : std::string();
      std::printf("rank %d (layers %d..%d%s%s%s, replica %d): %s peak %s, process HWM %s, sent %s\n", p.world_rank,
                  p.layers.k0, p.layers.k1 - 1, p.layers.embedding ? ", embedding" : "", p.layers.head ? ", head" : "",
                  toks.c_str(), p.replica, ash::MemSpace::name(), ash::format_bytes(r.usage[3 * w]).c_str(),
                  ash::format_bytes(r.usage[3 * w + 1]).c_str(), ash::format_bytes(r.usage[3 * w + 2]).c_str());
    }
  }
  std::printf("wrote %s\n", a.out.c_str());
}

// The memory planner: predicted peak bytes per component, for `ash train`
// (or `ash grad`) with this configuration, against the machine's memory.
int run_plan(const Common& c, const std::string& workload, const std::string& precision) {
  const auto r = ash::plan_run(load_config(c), workload, precision, c.max_memory);
  const auto& d = r.settings.model;
  std::printf("plan for ash %s: V=%lld P=%lld N=%lld K=%lld, T=%lld, batch %lld, %s\n", workload.c_str(),
              (long long)d.vocab, (long long)d.width, (long long)d.state, (long long)d.layers,
              (long long)r.settings.data.seq_len, (long long)r.settings.data.batch, r.precision.c_str());
  std::printf("engine: %s; peak at the %s\n", r.plan.engine.c_str(), r.plan.phase.c_str());
  std::printf("%s", r.plan.table("  ").c_str());
  std::printf("%.0f bytes per token (total / batch·T); %s %s: %s\n", r.per_token,
              c.max_memory > 0 ? "--max-memory" : r.capacity.what.c_str(), ash::format_bytes(r.budget).c_str(),
              r.budget == 0 ? "unknown" : r.fits ? "fits" : "does NOT fit");
  return r.fits ? 0 : 1;
}

// Forward only over a whole token file (ash::eval_file): prints the loss and
// bits per token over every target, and the forward's time per token.
template <class S>
void run_eval(const std::string& ckpt, const ash::CheckpointInfo& info, const std::string& tokens,
              const Common& common, bool carry) {
  ash::RunOverrides run;
  run.sets = common.sets;
  const ash::Config cfg = ash::checkpoint_run_config(info.config, run);
  ash::EvalFileOptions opts;
  opts.max_memory = common.max_memory;
  opts.carry = carry;
  ash::EvalFileStart start;  // the file's sizes, for the lines printed later
  opts.on_start = [&](const ash::EvalFileStart& s) {
    start = s;
    std::printf("eval %s (%s) on %s: %lld tokens, %lld window(s) of T=%lld%s\n", ckpt.c_str(),
                sizeof(S) == 8 ? "double" : "float", tokens.c_str(), (long long)s.tokens, (long long)s.full,
                (long long)s.seq_len, s.rest >= 2 ? (" and one of " + std::to_string(s.rest)).c_str() : "");
    // data.separator (the checkpoint's, or --set): each document scored on its own.
    if (s.documents > 0)
      std::printf("%lld documents (data.separator): each from h = 0, the first token of each not scored\n",
                  s.documents);
    std::fflush(stdout);
  };
  opts.progress = [&](const ash::EvalTotals& t) {
    std::fprintf(stderr, "eval: %lld of %lld tokens, bits/token so far %.4f\n", (long long)t.tokens,
                 (long long)start.tokens, t.bits_per_token());
  };
  opts.on_pass = [&](int pass, const ash::EvalTotals& tot) {
    std::printf("%s: %.4f bits/token over %lld targets (windows of T=%lld, %.2f us/token)\n",
                pass == 0 ? "carried state" : "each window from h = 0", tot.bits_per_token(), (long long)tot.targets,
                (long long)start.seq_len, 1e6 * tot.seconds / double(start.tokens));
  };
  ash::TokenSource source;
  source.path = tokens;
  const auto r = ash::eval_file<S>(ckpt, cfg, source, opts);
  if (!carry) {
    std::printf("loss %.6f nats/token, %.4f bits/token over %lld targets\n", r.totals.nats / double(r.totals.targets),
                r.totals.bits_per_token(), (long long)r.totals.targets);
    std::printf("forward time %.3f s (%.2f us/token)\n", r.totals.seconds,
                1e6 * r.totals.seconds / double(r.totals.tokens));
    return;
  }
  // --carry-state: the file as one stream, scored once with every layer's
  // state carried from the window before and once from h = 0.
  std::printf("carried state saves %.4f bits/token\n", r.passes[1].bits_per_token() - r.passes[0].bits_per_token());
}

int run_train(const Common& c, const std::string& resume, long long until) {
  ash::TrainRequest req;
  req.config_file = c.config_file;
  req.sets = c.sets;
  req.resume = resume;
  req.until = until;
  req.max_memory = c.max_memory;
  const auto s = ash::train_run(req, stdout, [](const std::string& path) { return inspect(path); });
  if (s.signal != 0) {
    // §7: interrupted, checkpoint written; 128 + signal like a shell.
    std::printf("interrupted by %s after step %lld: checkpoint %s (step %lld); continue with --resume %s\n",
                s.signal == SIGINT ? "SIGINT" : s.signal == SIGUSR1 ? "SIGUSR1" : "SIGTERM", (long long)s.last_step, s.checkpoint.c_str(),
                (long long)s.last_step, s.checkpoint.c_str());
    std::fflush(stdout);
    return 128 + s.signal;
  }
  std::printf("done: steps %lld..%lld, last loss %.4f, checkpoint %s\n", (long long)s.first_step,
              (long long)s.last_step, s.last_loss, s.checkpoint.c_str());
  if (std::isfinite(s.val_loss))
    std::printf("validation: %.3f bits/token; baselines: uniform %.3f, unigram %.3f bits/token\n", s.val_bits,
                s.uniform_bits, s.unigram_bits);
  std::printf("memory: %s\n", ash::MemoryTracker::summary().c_str());
  if (s.rank_peak_bytes.size() > 1) {
    std::printf("memory per rank (%s peak):", ash::MemSpace::name());
    for (std::size_t r = 0; r < s.rank_peak_bytes.size(); ++r)
      std::printf("%s rank %zu %s", r ? "," : "", r, ash::format_bytes(s.rank_peak_bytes[r]).c_str());
    std::printf("\n");
  }
  return 0;
}

void run_generate(const std::string& ckpt, const std::string& prompt, long long n, double temperature,
                  unsigned long long seed, std::uint64_t max_memory) {
  std::vector<std::uint32_t> ids(prompt.begin(), prompt.end());
  for (auto& v : ids) v &= 0xff;
  ash::GenerateOptions opts;
  opts.tokens = n;
  opts.temperature = temperature;
  opts.seed = seed;
  opts.max_memory = max_memory;
  const auto drawn = ash::generate_tokens(ckpt, ids, opts, [](const std::string& path) { return inspect(path); });
  std::string out = prompt;
  for (const auto v : drawn.ids) {
    if (drawn.vocab <= 256)
      out.push_back(char(v));
    else
      out += " " + std::to_string(v);
  }
  std::printf("%s\n", out.c_str());
}

void run_inspect(const std::string& path, bool verify) {
  const auto info = inspect(path, verify ? ash::Verify::all : ash::Verify::none);
  std::printf("checkpoint %s\n", path.c_str());
  std::printf("format_version %d, precision %s, step %lld, data_cursor %lld\n", info.format_version,
              info.precision.c_str(), (long long)info.step, (long long)info.data_cursor);
  std::printf("model: vocab V=%lld width P=%lld state N=%lld layers K=%lld seed %llu\n", (long long)info.dims.vocab,
              (long long)info.dims.width, (long long)info.dims.state, (long long)info.dims.layers,
              (unsigned long long)info.dims.seed);
  std::printf("%s", mamba_line(info.dims).c_str());
  std::printf("config:\n%s\n", info.config.dump().c_str());
  long long total = 0;
  for (const auto& d : info.datasets) {
    std::string shape = "[";
    long long n = 1;
    for (std::size_t i = 0; i < d.shape.size(); ++i) {
      shape += (i ? ", " : "") + std::to_string(d.shape[i]);
      n *= d.shape[i];
    }
    shape += "]";
    if (d.dtype != "missing") total += n;
    std::printf("  %-28s %-12s %s\n", d.path.c_str(), shape.c_str(), d.dtype.c_str());
  }
  std::printf("parameters: %lld\n", total);
  // Some parameters without the others is no verified checkpoint: grad, eval, generate
  // and train refuse it (a gradient file has none; --no-verify lists what is there).
  if (verify) ash::require_complete(path, info);
  if (!verify)
    std::printf("not verified (--no-verify)\n");
  else if (info.format_version >= 3)
    std::printf("verified: the header digest and every dataset's digest and Fletcher-32 checksums\n");
  else if (info.format_version == 2)
    std::printf("verified: every dataset's Fletcher-32 checksums (format 2 has no digests)\n");
  else
    std::printf("not verifiable: format 1 has no checksums (every dataset was read)\n");
  if (info.finite_values >= 0) std::printf("all %lld values finite\n", (long long)info.finite_values);
}

// ash inspect --upgrade: an old format's file rewritten as format 3 (ash::upgrade_file).
void run_upgrade(const std::string& path, const std::string& out, bool in_place) {
  const auto r = ash::upgrade_file(path, out, in_place);
  const int v = r.before.format_version;
  if (r.written.empty()) {
    std::printf("'%s' is already checkpoint format %d (verified: every digest, all %lld values finite); nothing "
                "written\n",
                path.c_str(), v, (long long)r.before.finite_values);
    return;
  }
  std::printf("verified '%s', checkpoint format %d: %s, all %lld values finite\n", path.c_str(), v,
              v == 2 ? "every dataset's Fletcher-32 checksums" : "no checksums to check (format 1)",
              (long long)r.before.finite_values);
  std::printf("wrote '%s', checkpoint format %d: the same values with digests (read back and verified)\n",
              r.written.c_str(), ash::checkpoint_format_version);
}

// transformers' class of a Mamba model (import-hf and export-hf print it).
const char* hf_class(const ash::ModelDims& d) {
  return d.mixer_norms() ? "FalconMambaForCausalLM" : d.mamba2() ? "Mamba2ForCausalLM" : "MambaForCausalLM";
}

// A Hugging Face MambaForCausalLM (FalconMambaForCausalLM, Mamba2ForCausalLM) folder as a checkpoint (ash::import_hf).
void run_import_hf(const std::string& dir, const std::string& out, const std::string& precision,
                   std::uint64_t max_memory) {
  const auto r = ash::import_hf(dir, out, precision, max_memory);
  const auto d = r.config.model();
  std::printf("read %s: %s, %s tensors, V=%lld D=%lld N=%lld layers %lld\n", dir.c_str(), hf_class(d),
              r.source_dtypes.c_str(), (long long)d.vocab, (long long)d.width, (long long)d.state,
              (long long)d.layers);
  std::printf("%s", mamba_line(d).c_str());
  if (!r.ignored.empty()) {
    std::string keys;
    for (const auto& k : r.ignored) keys += (keys.empty() ? "" : ", ") + k;
    std::printf("note: config.json keys transformers does not define, ignored: %s\n", keys.c_str());
  }
  std::printf("wrote %s: %lld parameters (%s), step 0\n", out.c_str(), (long long)r.parameters, precision.c_str());
}

// A Mamba (FalconMamba, Mamba-2) checkpoint as a folder transformers loads (ash::export_hf).
void run_export_hf(const std::string& ckpt, const std::string& dir, const std::string& dtype) {
  const auto r = ash::export_hf(ckpt, dir, dtype, [](const std::string& path) { return inspect(path); });
  std::printf("wrote %s: config.json and model.safetensors (%s), %s with V=%lld D=%lld N=%lld "
              "layers %lld, %lld parameters\n",
              dir.c_str(), r.dtype.c_str(), hf_class(r.dims), (long long)r.dims.vocab, (long long)r.dims.width, (long long)r.dims.state,
              (long long)r.dims.layers, (long long)r.parameters);
  std::printf("%s", mamba_line(r.dims).c_str());
}

// Numeric options are checked on their text, before CLI11 converts them (its
// conversion wraps 2^64 and saturates, and would print absurd bounds).
CLI::Validator integer_in(long long lo, long long hi) {
  return CLI::Validator(
      [lo, hi](std::string& s) -> std::string {
        errno = 0;
        char* end = nullptr;
        const long long v = std::strtoll(s.c_str(), &end, 10);
        if (s.empty() || *end != '\0' || errno == ERANGE || v < lo || v > hi)
          return "expects an integer from " + std::to_string(lo) + " to " + std::to_string(hi) + ", got '" + s + "'";
        return std::string();
      },
      "INT");
}
CLI::Validator unsigned_integer() {
  return CLI::Validator(
      [](std::string& s) -> std::string {
        errno = 0;
        char* end = nullptr;
        std::strtoull(s.c_str(), &end, 10);
        if (s.empty() || s.find_first_not_of("0123456789") != std::string::npos || *end != '\0' || errno == ERANGE)
          return "expects an integer from 0 to 18446744073709551615, got '" + s + "'";
        return std::string();
      },
      "UINT");
}
CLI::Validator finite_number() {
  return CLI::Validator(
      [](std::string& s) -> std::string {
        char* end = nullptr;
        const double v = std::strtod(s.c_str(), &end);
        if (s.empty() || *end != '\0' || !std::isfinite(v)) return "expects a finite number, got '" + s + "'";
        return std::string();
      },
      "NUMBER");
}
// (--truncate and --chunk take any int64: grad.truncate / grad.chunk then say what is allowed.)
constexpr long long min_int64 = std::numeric_limits<long long>::min(), max_int64 = std::numeric_limits<long long>::max();

// Every verb's options, filled by the parser (docs/cli.md).
struct Verbs {
  CLI::App *init = nullptr, *grad = nullptr, *train = nullptr, *generate = nullptr, *eval = nullptr,
           *plan = nullptr, *inspect = nullptr, *import_hf = nullptr, *export_hf = nullptr;
  Common init_common;
  std::string init_out, init_precision = "double";
  GradArgs g;
  Common train_common;
  std::string resume;
  long long until = 0;
  std::string gen_ckpt, prompt;
  long long gen_n = 200;
  double temperature = 0.8;
  unsigned long long gen_seed = 1;
  std::uint64_t gen_max_memory = 0;
  std::string eval_ckpt, eval_tokens, eval_precision;
  Common eval_common;
  bool eval_carry = false;
  Common plan_common;
  std::string plan_workload = "train", plan_precision;
  std::string inspect_path;
  bool inspect_no_verify = false;
  bool inspect_upgrade = false, inspect_in_place = false;
  std::string inspect_out;
  std::string hf_from, hf_import_out, hf_precision = "double";
  std::uint64_t hf_max_memory = 0;
  std::string hf_checkpoint, hf_export_out, hf_dtype;  // hf_dtype "": the checkpoint's precision
};

// The options several verbs take, spelled once.
void add_max_memory(CLI::App* verb, std::uint64_t& bytes,
                    const char* help = "refuse sizes predicted to need more bytes (default: RAM)") {
  verb->add_option("--max-memory", bytes, help)->check(unsigned_integer());
}
void add_precision(CLI::App* verb, std::string& type, const char* help) {
  verb->add_option("--precision", type, help)->check(CLI::IsMember({"float", "double"}));
}

// The verbs that write or differentiate a model.
void add_model_verbs(CLI::App& app, Verbs& v) {
  v.init = app.add_subcommand("init", "write a freshly initialised (seeded) model as a checkpoint");
  v.init->add_option("--config", v.init_common.config_file, "JSON configuration file")->check(CLI::ExistingFile);
  v.init->add_option("--set", v.init_common.sets, "override a config key: key=value")->take_all();
  v.init->add_option("--out", v.init_out, "checkpoint to write (.h5)")->required();
  add_precision(v.init, v.init_precision, "stored parameter type");
  add_max_memory(v.init, v.init_common.max_memory);

  v.grad = app.add_subcommand("grad", "loss and full gradient of a checkpoint on a token file");
  v.grad->add_option("--checkpoint", v.g.checkpoint, "model checkpoint (.h5)")->required();
  v.grad->add_option("--tokens", v.g.tokens, "token file: text bytes, .u16 or .u32")->required();
  v.grad->add_option("--engine", v.g.run.engine, "backprop | adjoint | adjoint-exact (default: grad.engine)");
  v.grad->add_option("--truncate", v.g.run.truncate, "window T-bar (adjoint engines)")->check(integer_in(min_int64, max_int64));
  v.grad->add_flag("--detach-inputs", v.g.detach, "stop-gradient on every layer input");
  v.grad->add_option("--chunk", v.g.run.chunk, "chunk length (adjoint-exact)")->check(integer_in(min_int64, max_int64));
  add_precision(v.grad, v.g.precision, "compute type (default: the checkpoint's)");
  v.grad->add_option("--set", v.g.common.sets, "override a config key: key=value")->take_all();
  v.grad->add_option("--out", v.g.out, "gradient file to write (.h5)")->required();
  add_max_memory(v.grad, v.g.common.max_memory);

  v.train = app.add_subcommand("train", "train with AdamW; progress, metrics, checkpoints");
  v.train->add_option("--config", v.train_common.config_file, "JSON configuration file")->check(CLI::ExistingFile);
  v.train->add_option("--set", v.train_common.sets, "override a config key: key=value")->take_all();
  v.train->add_option("--resume", v.resume, "continue from this checkpoint");
  v.train->add_option("--until", v.until, "stop after this step (schedule unchanged; resume later)")
      ->check(integer_in(0, max_int64));
  add_max_memory(v.train, v.train_common.max_memory);

}

// The verbs that read a model or a configuration.
void add_reading_verbs(CLI::App& app, Verbs& v) {
  v.generate = app.add_subcommand("generate", "sample text from a checkpoint (recurrent, O(1) per token)");
  v.generate->add_option("--checkpoint", v.gen_ckpt, "model checkpoint (.h5)")->required();
  v.generate->add_option("--prompt", v.prompt, "text to start from")->required();
  v.generate->add_option("--tokens", v.gen_n, "how many tokens to sample")->check(integer_in(0, ash::max_generate_tokens));
  v.generate->add_option("--temperature", v.temperature, "softmax temperature (0: greedy)")->check(finite_number());
  v.generate->add_option("--seed", v.gen_seed, "sampling seed")->check(unsigned_integer());
  add_max_memory(v.generate, v.gen_max_memory);

  v.eval = app.add_subcommand("eval", "loss and bits per token of a checkpoint over a whole token file (forward)");
  v.eval->add_option("--checkpoint", v.eval_ckpt, "model checkpoint (.h5)")->required();
  v.eval->add_option("--tokens", v.eval_tokens, "token file: text bytes, .u16 or .u32")->required();
  add_precision(v.eval, v.eval_precision, "compute type (default: the checkpoint's)");
  v.eval->add_option("--set", v.eval_common.sets, "override a config key: key=value (data.seq_len, data.batch)")
      ->take_all();
  v.eval->add_flag("--carry-state", v.eval_carry,
                 "stream the file as one sequence: each window starts from the previous one's state; "
                 "prints bits/token with and without the carried state");
  add_max_memory(v.eval, v.eval_common.max_memory);

  v.plan = app.add_subcommand("plan", "predicted peak memory per component for a configuration (no allocation)");
  v.plan->add_option("--config", v.plan_common.config_file, "JSON configuration file")->check(CLI::ExistingFile);
  v.plan->add_option("--set", v.plan_common.sets, "override a config key: key=value")->take_all();
  v.plan->add_option("--for", v.plan_workload, "train (default) or grad")->check(CLI::IsMember({"train", "grad"}));
  add_precision(v.plan, v.plan_precision, "compute type (default: run.precision)");
  add_max_memory(v.plan, v.plan_common.max_memory, "compare with this many bytes (default: RAM)");

  v.inspect = app.add_subcommand("inspect", "print the configuration and the shapes in a checkpoint");
  v.inspect->add_option("checkpoint", v.inspect_path, "checkpoint (.h5)")->required();
  auto* no_verify = v.inspect->add_flag(
      "--no-verify", v.inspect_no_verify,
      "a quick look: do not read the tensors or check the digests (the structure is still checked)");
  auto* upgrade = v.inspect->add_flag("--upgrade", v.inspect_upgrade,
                                      "rewrite a format-1 or format-2 file as format 3 (with digests), after "
                                      "every check its format has; needs --out or --in-place");
  upgrade->excludes(no_verify);
  auto* up_out = v.inspect->add_option("--out", v.inspect_out, "--upgrade: the format-3 file to write (a new file)");
  auto* in_place = v.inspect->add_flag("--in-place", v.inspect_in_place, "--upgrade: replace CKPT (atomically)");
  up_out->needs(upgrade)->excludes(in_place);
  in_place->needs(upgrade);

}

// The verbs that convert Hugging Face MambaForCausalLM, FalconMambaForCausalLM and Mamba2ForCausalLM folders (issue 34).
void add_hf_verbs(CLI::App& app, Verbs& v) {
  v.import_hf = app.add_subcommand("import-hf",
                                   "write a checkpoint from a Hugging Face (Falcon)Mamba(2)ForCausalLM folder");
  v.import_hf->add_option("--from", v.hf_from, "folder: config.json and model.safetensors (or its index)")->required();
  v.import_hf->add_option("--out", v.hf_import_out, "checkpoint to write (.h5)")->required();
  add_precision(v.import_hf, v.hf_precision, "stored parameter type (default double)");
  add_max_memory(v.import_hf, v.hf_max_memory);

  v.export_hf = app.add_subcommand("export-hf",
                                   "write a (Falcon)Mamba(2) checkpoint as a folder (Falcon)Mamba(2)ForCausalLM loads");
  v.export_hf->add_option("--checkpoint", v.hf_checkpoint, "model checkpoint (.h5, model.arch = mamba, falcon_mamba or mamba2)")
      ->required();
  v.export_hf->add_option("--out", v.hf_export_out, "folder to write config.json and model.safetensors in")->required();
  v.export_hf->add_option("--dtype", v.hf_dtype, "tensor type written (default: the checkpoint's precision)")
      ->check(CLI::IsMember({"float", "double"}));
}

// Runs the verb the command line chose; its exit code.
int run_verb(const Verbs& v) {
  if (*v.init) {
    const auto cfg = load_config(v.init_common);
    if (v.init_precision == "float")
      run_init<float>(cfg, v.init_common, v.init_out);
    else
      run_init<double>(cfg, v.init_common, v.init_out);
  } else if (*v.grad) {
    ash::require_distinct_output(v.g.out, {{"--checkpoint", v.g.checkpoint}, {"--tokens", v.g.tokens}});
    const auto info = inspect(v.g.checkpoint);
    const std::string prec = v.g.precision.empty() ? info.precision : v.g.precision;
    if (prec == "float")
      run_grad<float>(v.g, info);
    else
      run_grad<double>(v.g, info);
  } else if (*v.eval) {
    const auto info = inspect(v.eval_ckpt);
    const std::string prec = v.eval_precision.empty() ? info.precision : v.eval_precision;
    if (prec == "float")
      run_eval<float>(v.eval_ckpt, info, v.eval_tokens, v.eval_common, v.eval_carry);
    else
      run_eval<double>(v.eval_ckpt, info, v.eval_tokens, v.eval_common, v.eval_carry);
  } else if (*v.train) {
    return run_train(v.train_common, v.resume, v.until);
  } else if (*v.generate) {
    run_generate(v.gen_ckpt, v.prompt, v.gen_n, v.temperature, v.gen_seed, v.gen_max_memory);
  } else if (*v.plan) {
    return run_plan(v.plan_common, v.plan_workload, v.plan_precision);  // "": run.precision
  } else if (*v.inspect) {
    if (v.inspect_upgrade)
      run_upgrade(v.inspect_path, v.inspect_out, v.inspect_in_place);
    else
      run_inspect(v.inspect_path, !v.inspect_no_verify);
  } else if (*v.import_hf) {
    run_import_hf(v.hf_from, v.hf_import_out, v.hf_precision, v.hf_max_memory);
  } else if (*v.export_hf) {
    run_export_hf(v.hf_checkpoint, v.hf_export_out, v.hf_dtype);
  }
  return 0;
}

// A user error (exit 2) or an internal one (exit 3): printed once, and in an
// MPI run every rank ends, never a hang.
int fail(const std::string& msg, int code) {
#ifdef ASH_HAVE_MPI
  int inited = 0, world = 1;
  MPI_Initialized(&inited);
  if (inited) MPI_Comm_size(MPI_COMM_WORLD, &world);
  if (world > 1) ash::dist::fail_all(code == 2 ? msg : "internal error: " + msg, code);
#endif
  std::fprintf(stderr, code == 2 ? "ash: error: %s\n" : "ash: internal error: %s\n", msg.c_str());
  return code;
}

// run_verb with every failure turned into an exit code (docs/design.md §7).
int run_guarded(const Verbs& v) {
  try {
    return run_verb(v);
  } catch (const ash::Error& e) {
    return fail(e.what(), 2);
  } catch (const std::bad_alloc& e) {
    // An allocation that failed is a resource problem, not a bug (§7).
    return fail(std::string("out of memory (") + e.what() +
                    "): reduce data.batch, data.seq_len or the model sizes", 2);
  } catch (const std::length_error& e) {
    return fail(std::string("sizes too large for this machine (") + e.what() + ")", 2);
  } catch (const std::runtime_error& e) {
    // Kokkos reports a failed View allocation as a plain runtime_error:
    // "Kokkos failed to allocate memory ..." (3.x to 4.3), "Kokkos ERROR: <space>
    // memory space failed to allocate <size> ..." (4.4 and later).
    const std::string what = e.what();
    if (what.find("Kokkos failed to allocate memory") != std::string::npos ||
        (what.find("Kokkos ERROR") != std::string::npos && what.find("failed to allocate") != std::string::npos))
      return fail("out of memory: " + what.substr(0, what.find("  Allocation using")) +
                      " (reduce data.batch, data.seq_len or the model sizes)", 2);
    return fail(what, 3);
  } catch (const std::exception& e) {
    return fail(e.what(), 3);
  }
}

// The command line split in two: Kokkos' own arguments (--kokkos-..., up to a
// "--") and ash's, each led by the program name. Kokkos sees only its own, so
// `ash --help` is ash's help alone (Kokkos prints a banner of its own on --help).
struct SplitArgs {
  std::vector<char*> ash, kokkos;
};

SplitArgs split_kokkos_args(int argc, char* argv[]) {
  SplitArgs s;
  s.ash.push_back(argv[0]);
  s.kokkos.push_back(argv[0]);
  bool operands = false;  // after "--" every word is ash's
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--") operands = true;
    (!operands && a.rfind("--kokkos-", 0) == 0 ? s.kokkos : s.ash).push_back(argv[i]);
  }
  return s;
}

// The verb the command line names when it is none of ash's (the first word, when
// it is not an option): the parser would only say that a verb is required.
std::optional<std::string> unknown_verb(CLI::App& app, const std::vector<char*>& args) {
  if (args.size() < 2 || args[1][0] == '-') return std::nullopt;
  const std::string word = args[1];
  for (const CLI::App* verb : app.get_subcommands([](const CLI::App*) { return true; }))
    if (verb->get_name() == word) return std::nullopt;
  return word;
}

std::string verb_names(CLI::App& app) {
  std::string names;
  for (const CLI::App* verb : app.get_subcommands([](const CLI::App*) { return true; }))
    names += (names.empty() ? "" : ", ") + verb->get_name();
  return names;
}

}  // namespace

int main(int argc, char* argv[]) {
  // A file-size limit (ulimit -f) makes write() fail with EFBIG, reported
  // with the file's name, instead of killing the process (§7).
  std::signal(SIGXFSZ, SIG_IGN);
  // Under an address-space limit (ulimit -v) below this, OpenBLAS's worker
  // threads (started before main) retry their buffer allocations forever and
  // the process never exits: say so and leave at once, skipping the exit
  // handlers that would wait for them.
  constexpr rlim_t min_address_space = rlim_t(256) << 20;
  if (rlimit lim{}; ::getrlimit(RLIMIT_AS, &lim) == 0 && lim.rlim_cur != RLIM_INFINITY &&
                    lim.rlim_cur < min_address_space) {
    std::fprintf(stderr,
                 "ash: error: the address-space limit (ulimit -v) is %llu KiB; ash needs at least %llu KiB to start "
                 "(its BLAS threads reserve their buffers at start-up)\n",
                 (unsigned long long)(lim.rlim_cur >> 10), (unsigned long long)(min_address_space >> 10));
    std::fflush(stderr);
    std::_Exit(2);
  }
#ifdef ASH_HAVE_MPI
  // MPI first, and only under a launcher: a one-process verb starts no MPI runtime.
  ash::dist::Session mpi(&argc, &argv, /*only_under_launcher=*/true);
  if (mpi.rank() != 0 && !std::freopen("/dev/null", "w", stdout)) return 3;  // only rank 0 prints progress
  g_print_warnings = mpi.rank() == 0;
#endif
  // Then the command line, before Kokkos: --help and usage errors never start it.
  SplitArgs args = split_kokkos_args(argc, argv);
  // Kokkos' arguments (e.g. --kokkos-threads=N) start Kokkos later; it destroys
  // before MPI ends (declared after the session).
  std::unique_ptr<Kokkos::ScopeGuard> kokkos;
  // A backend that cannot start (no usable GPU, a CUDA runtime refused by an
  // address-space limit) is a clear error, not an uncaught exception.
  const auto start_kokkos = [&]() -> int {
    int kokkos_argc = int(args.kokkos.size());
    std::vector<char*> kokkos_argv = args.kokkos;
    kokkos_argv.push_back(nullptr);
    try {
      kokkos = std::make_unique<Kokkos::ScopeGuard>(kokkos_argc, kokkos_argv.data());
    } catch (const std::exception& e) {
      return fail(std::string("cannot start Kokkos (") + Kokkos::DefaultExecutionSpace::name() + "): " + e.what(), 2);
    }
    // Kokkos removes the arguments it knows: what is left is none of its own
    // (--kokkos-tools-... excepted: those are a loaded tool's, as Kokkos says).
    for (int i = 1; i < kokkos_argc; ++i)
      if (std::string(kokkos_argv[i]).rfind("--kokkos-tool", 0) != 0)
        return fail(std::string("unknown Kokkos argument '") + kokkos_argv[i] + "' (ash --kokkos-help lists Kokkos' own)",
                    2);
    return 0;
  };
  for (const char* a : args.kokkos)
    if (std::string(a) == "--kokkos-help") return start_kokkos();  // Kokkos prints its own help

  CLI::App app{"ash: adjoint-sharding training and gradients for SSM language models"};
  app.require_subcommand(1);
  app.footer("Kokkos takes its own --kokkos-... arguments (ash --kokkos-help lists them).");
  Verbs v;
  add_model_verbs(app, v);
  add_reading_verbs(app, v);
  add_hf_verbs(app, v);
  try {
    app.parse(int(args.ash.size()), args.ash.data());
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == int(CLI::ExitCodes::Success)) return app.exit(e);  // --help
    // A usage error is exit 2 with the parser's message on one line (§7).
    if (const auto verb = unknown_verb(app, args.ash))
      return fail("unknown verb '" + *verb + "' (the verbs: " + verb_names(app) + "; ash --help)", 2);
    std::string msg = e.what();
    for (auto& c : msg)
      if (c == '\n') c = ' ';
    return fail(msg + " (ash --help; ash VERB --help)", 2);
  }
  if (const int rc = start_kokkos()) return rc;
  ash::MemoryTracker::install();
  return run_guarded(v);
}
