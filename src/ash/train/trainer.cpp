#include "ash/train/trainer.hpp"

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

namespace ash {

namespace {

constexpr index_t max_valid_windows = 16;

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
  std::error_code ec;
  std::filesystem::create_directories(out_dir, ec);
  require(!ec, "cannot create run.out_dir '" + out_dir + "': " + ec.message());

  ParamSet<S> params(d);
  AdamW<S> opt(d, AdamWOptions::from_config(cfg));
  std::int64_t step = 0, cursor = 0;
  if (resume.empty()) {
    initialize(params, d.seed);
  } else {
    CheckpointInfo info;
    params = load_checkpoint<S>(resume, &info);
    require(info.dims == d, "--resume: checkpoint '" + resume + "' has other model sizes than the configuration");
    require(info.precision == (sizeof(S) == 8 ? "double" : "float"),
            "--resume: checkpoint '" + resume + "' was trained in " + info.precision + ", run.precision is " +
                cfg.get<std::string>("run.precision"));
    std::int64_t opt_step = 0;
    if (load_optimizer_state(resume, opt.m(), opt.v(), &opt_step)) opt.set_step(opt_step);
    step = info.step;
    cursor = info.data_cursor;
  }
  auto engine = make_engine<S>(EngineOptions::from_config(cfg));
  ParamSet<S> grad(d);
  TokenView valid;
  if (data.valid_windows() > 0) valid = data.valid_batch(max_valid_windows);

  TrainSummary sum;
  sum.first_step = step;
  sum.uniform_bits = std::log2(double(d.vocab));
  sum.val_loss = std::nan("");
  if (valid.extent(0) > 0) sum.unigram_bits = data.unigram_valid_bits(max_valid_windows);
  std::ofstream metrics(out_dir + "/metrics.jsonl", std::ios::app);
  require(metrics.good(), "cannot open " + out_dir + "/metrics.jsonl for appending");
  auto save = [&](std::int64_t at) {
    save_checkpoint(ckpt_path, cfg, params, at, cursor, OptimizerState<S>{&opt.m(), &opt.v(), opt.step()});
    sum.checkpoint = ckpt_path;
  };
  if (log)
    std::fprintf(log,
                 "train: %s, %lld params (%s), %lld train / %lld valid tokens, T=%lld batch=%lld, steps %lld..%lld\n",
                 engine->name().c_str(), (long long)params.size(), sizeof(S) == 8 ? "double" : "float",
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
    const double gnorm = opt.update(params, grad);
    ++step;
    tokens_since += B * T;
    sum.last_loss = loss;
    const bool last = step == stop;
    nlohmann::json row{{"step", step}, {"loss", loss}, {"lr", lr}, {"grad_norm", gnorm}};
    if (valid.extent(0) > 0 && ((eval_every > 0 && step % eval_every == 0) || last)) {
      sum.val_loss = forward_loss(params, valid);
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
      row["peak_bytes"] = MemoryTracker::peak(MemSpace::name());
      row["hwm_bytes"] = MemoryTracker::process_hwm_bytes();
      if (log) {
        std::fprintf(log, "step %6lld  loss %.4f", (long long)step, loss);
        if (row.contains("val_loss"))
          std::fprintf(log, "  val %.4f (%.3f bits/token)", sum.val_loss, sum.val_bits);
        std::fprintf(log, "  lr %.2e  |g| %.3f  %.0f tok/s  peak %s  ETA %.0fs\n", lr, gnorm, tps,
                     format_bytes(MemoryTracker::peak(MemSpace::name())).c_str(), eta);
        std::fflush(log);
      }
      t_last = now;
      tokens_since = 0;
    }
    metrics << row.dump() << "\n";
    metrics.flush();
    if ((ckpt_every > 0 && step % ckpt_every == 0) || last) save(step);
  }
  sum.last_step = step;
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
