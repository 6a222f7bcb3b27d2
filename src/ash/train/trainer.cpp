#include "ash/train/trainer.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>

#include "ash/core/error.hpp"
#include "ash/core/memory.hpp"
#include "ash/grad/engine.hpp"
#include "ash/io/checkpoint.hpp"
#include "ash/io/dataset.hpp"
#include "ash/model/forward.hpp"
#include "ash/train/optimizer.hpp"
#ifdef ASH_HAVE_MPI
#include "ash/dist/distributed_engine.hpp"
#include "ash/dist/sharded_io.hpp"
#endif

namespace ash {

namespace {

constexpr index_t max_valid_windows = 16;

// What differs between one process and a rank of a distributed run (E4):
// which shard of the model lives here, the engine, validation, checkpoints,
// the gradient norm, and who prints.
template <class S>
struct Backend {
  LayerRange range;
  bool root = true;  // prints, writes metrics
#ifdef ASH_HAVE_MPI
  std::unique_ptr<dist::Grid> grid;
  dist::DistributedEngine<S>* dist_engine = nullptr;
#endif
  std::unique_ptr<GradientEngine<S>> engine;

  Backend(const Config& cfg, const ModelDims& d) : range(LayerRange::all(d)) {
#ifdef ASH_HAVE_MPI
    int inited = 0, world = 1, rank = 0;
    MPI_Initialized(&inited);
    if (inited) {
      MPI_Comm_size(MPI_COMM_WORLD, &world);
      MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    }
    if (world > 1 || cfg.get<std::int64_t>("dist.layer_ranks") > 1) {
      require(inited, "dist.layer_ranks > 1 needs MPI: run under mpiexec");
      grid = std::make_unique<dist::Grid>(cfg);
      range = grid->range(d);
      root = rank == 0;
      auto e = std::make_unique<dist::DistributedEngine<S>>(*grid, EngineOptions::from_config(cfg),
                                                             cfg.get<index_t>("dist.pipeline_blocks"));
      dist_engine = e.get();
      engine = std::move(e);
      return;
    }
#else
    require(cfg.get<std::int64_t>("dist.layer_ranks") == 1,
            "dist.layer_ranks > 1 needs the MPI build of AdjointSharding (ASH_ENABLE_MPI)");
#endif
    engine = make_engine<S>(EngineOptions::from_config(cfg));
  }

  double valid_loss(const ParamSet<S>& params, const TokenView& x) {
#ifdef ASH_HAVE_MPI
    if (dist_engine) return dist_engine->loss(params, x);
#endif
    return forward_loss(params, x);
  }
  std::function<double(double)> norm_reducer() const {
#ifdef ASH_HAVE_MPI
    if (grid) {
      const MPI_Comm lc = grid->layers();
      return [lc](double ss) { return dist::allreduce_sum(ss, lc); };
    }
#endif
    return {};
  }
  void save(const std::string& path, const Config& cfg, const ParamSet<S>& params, std::int64_t step,
            std::int64_t cursor, const AdamW<S>& opt) {
#ifdef ASH_HAVE_MPI
    if (grid) {
      dist::save_checkpoint(*grid, path, cfg, params, step, cursor, &opt.m(), &opt.v(), opt.step());
      return;
    }
#endif
    save_checkpoint(path, cfg, params, step, cursor, OptimizerState<S>{&opt.m(), &opt.v(), opt.step()});
  }
  // Every world rank's peak (collective under MPI).
  std::vector<std::uint64_t> rank_peaks() const {
    std::vector<std::uint64_t> all{MemoryTracker::peak(MemSpace::name())};
#ifdef ASH_HAVE_MPI
    if (grid) {
      all.resize(std::size_t(grid->layout().world_size));
      std::uint64_t mine = all[0];
      MPI_Allgather(&mine, 1, MPI_UINT64_T, all.data(), 1, MPI_UINT64_T, grid->world());
    }
#endif
    return all;
  }
  // The largest peak of any rank (this process's elsewhere).
  std::uint64_t peak_bytes() const {
    const std::uint64_t mine = MemoryTracker::peak(MemSpace::name());
#ifdef ASH_HAVE_MPI
    if (grid) return dist::allreduce_max(mine, grid->world());
#endif
    return mine;
  }
};

template <class S>
TrainSummary train_as(const Config& cfg, const std::string& resume, std::FILE* log, std::int64_t until) {
  const ModelDims d = cfg.model();
  const index_t T = cfg.get<index_t>("data.seq_len"), B = cfg.get<index_t>("data.batch");
  const std::int64_t steps = cfg.get<std::int64_t>("optim.steps");
  const std::int64_t log_every = std::max<std::int64_t>(1, cfg.get<std::int64_t>("run.log_every"));
  const std::int64_t eval_every = cfg.get<std::int64_t>("run.eval_every");
  const std::int64_t ckpt_every = cfg.get<std::int64_t>("run.ckpt_every");
  const std::string out_dir = cfg.get<std::string>("run.out_dir");
  const std::string ckpt_path = out_dir + "/checkpoint.h5";

  const auto data = TokenDataset::from_file(cfg.get<std::string>("data.train"), d.vocab, T,
                                            cfg.get<double>("data.valid_fraction"), d.seed,
                                            cfg.get<bool>("data.sequential"));
  Backend<S> be(cfg, d);
  if (!be.root) log = nullptr;
  std::error_code ec;
  std::filesystem::create_directories(out_dir, ec);
  require(!ec, "cannot create run.out_dir '" + out_dir + "': " + ec.message());

  ParamSet<S> params(d, be.range);
  AdamW<S> opt(d, be.range, AdamWOptions::from_config(cfg));
  std::int64_t step = 0, cursor = 0;
  if (resume.empty()) {
    initialize(params, d.seed);
  } else {
    CheckpointInfo info;
    params = load_checkpoint<S>(resume, be.range, &info);
    require(info.dims == d, "--resume: checkpoint '" + resume + "' has other model sizes than the configuration");
    require(info.precision == (sizeof(S) == 8 ? "double" : "float"),
            "--resume: checkpoint '" + resume + "' was trained in " + info.precision + ", run.precision is " +
                cfg.get<std::string>("run.precision"));
    std::int64_t opt_step = 0;
    if (load_optimizer_state(resume, opt.m(), opt.v(), &opt_step)) opt.set_step(opt_step);
    step = info.step;
    cursor = info.data_cursor;
  }
  auto& engine = be.engine;
  ParamSet<S> grad(d, be.range);
  TokenView valid;
  if (data.valid_windows() > 0) valid = data.valid_batch(max_valid_windows);

  TrainSummary sum;
  sum.first_step = step;
  sum.uniform_bits = std::log2(double(d.vocab));
  sum.val_loss = std::nan("");
  if (valid.extent(0) > 0) sum.unigram_bits = data.unigram_valid_bits(max_valid_windows);
  std::ofstream metrics;
  if (be.root) {
    metrics.open(out_dir + "/metrics.jsonl", std::ios::app);
    require(metrics.good(), "cannot open " + out_dir + "/metrics.jsonl for appending");
  }
  auto save = [&](std::int64_t at) {
    be.save(ckpt_path, cfg, params, at, cursor, opt);
    sum.checkpoint = ckpt_path;
  };
  if (log)
    std::fprintf(log,
                 "train: %s, %lld params (%s), %lld train / %lld valid tokens, T=%lld batch=%lld, steps %lld..%lld\n",
                 engine->name().c_str(), (long long)parameter_count(d), sizeof(S) == 8 ? "double" : "float",
                 (long long)data.train_tokens(), (long long)data.valid_tokens(), (long long)T, (long long)B,
                 (long long)step, (long long)steps);
  const auto t_start = std::chrono::steady_clock::now();
  auto t_last = t_start;
  std::int64_t tokens_since = 0;
  const std::int64_t stop = (until > 0 && until < steps) ? until : steps;
  while (step < stop) {
    const auto x = data.train_batch(step, B, &cursor);
    const double loss = engine->compute(params, x, grad);
    if (!std::isfinite(loss))
      throw Error("loss is " + std::to_string(loss) + " at step " + std::to_string(step) + "; stopped" +
                  (sum.checkpoint.empty() && resume.empty() ? std::string(" (no checkpoint written yet)")
                                                            : "; the last good checkpoint is kept: " +
                                                                  (sum.checkpoint.empty() ? resume : sum.checkpoint)));
    const double lr = learning_rate(opt.options(), opt.step());
    const double gnorm = opt.update(params, grad, be.norm_reducer());
    ++step;
    tokens_since += B * T;
    sum.last_loss = loss;
    const bool last = step == stop;
    nlohmann::json row{{"step", step}, {"loss", loss}, {"lr", lr}, {"grad_norm", gnorm}};
    if (valid.extent(0) > 0 && ((eval_every > 0 && step % eval_every == 0) || last)) {
      sum.val_loss = be.valid_loss(params, valid);
      sum.val_bits = sum.val_loss / std::log(2.0);
      row["val_loss"] = sum.val_loss;
      row["val_bits_per_token"] = sum.val_bits;
    }
    if (step % log_every == 0 || last) {
      const auto now = std::chrono::steady_clock::now();
      const double dt = std::chrono::duration<double>(now - t_last).count();
      const double elapsed = std::chrono::duration<double>(now - t_start).count();
      const double tps = dt > 0 ? double(tokens_since) / dt : 0.0;
      const double eta = double(stop - step) * elapsed / double(step - sum.first_step);
      row["tokens_per_s"] = tps;
      const std::uint64_t peak = be.peak_bytes();  // the largest rank's in a distributed run
      row["peak_bytes"] = peak;
      row["hwm_bytes"] = MemoryTracker::process_hwm_bytes();
      if (log) {
        std::fprintf(log, "step %6lld  loss %.4f", (long long)step, loss);
        if (row.contains("val_loss"))
          std::fprintf(log, "  val %.4f (%.3f bits/token)", sum.val_loss, sum.val_bits);
        std::fprintf(log, "  lr %.2e  |g| %.3f  %.0f tok/s  peak %s  ETA %.0fs\n", lr, gnorm, tps,
                     format_bytes(peak).c_str(), eta);
        std::fflush(log);
      }
      t_last = now;
      tokens_since = 0;
    }
    if (be.root) {
      metrics << row.dump() << "\n";
      metrics.flush();
    }
    if ((ckpt_every > 0 && step % ckpt_every == 0) || last) save(step);
  }
  sum.last_step = step;
  sum.rank_peak_bytes = be.rank_peaks();
  sum.peak_bytes = *std::max_element(sum.rank_peak_bytes.begin(), sum.rank_peak_bytes.end());
  if (sum.checkpoint.empty() && !resume.empty()) sum.checkpoint = resume;  // nothing left to run
  return sum;
}

}  // namespace

TrainSummary train(const Config& cfg, const std::string& resume, std::FILE* log, std::int64_t until) {
  cfg.validate();
  return cfg.get<std::string>("run.precision") == "double" ? train_as<double>(cfg, resume, log, until)
                                                           : train_as<float>(cfg, resume, log, until);
}

}  // namespace ash
