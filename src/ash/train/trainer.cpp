#include "ash/train/trainer.hpp"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstring>
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

// §7: a state with |x| above this is as good as lost (the next step overflows).
constexpr double absurd_value = 1e30;

// Number of parameters / moments that are non-finite or absurd.
template <class S>
index_t bad_values(const View1<S>& v) {
  index_t bad = 0;
  Kokkos::parallel_reduce(
      "ash::train::bad_values", Range(0, index_t(v.extent(0))),
      KOKKOS_LAMBDA(index_t i, index_t & n) {
        const double x = double(v(i));
        if (!(x == x) || x > absurd_value || x < -absurd_value) ++n;  // NaN, Inf, absurd
      },
      bad);
  return bad;
}

// SIGINT / SIGTERM: the first asks the loop to stop after the current step
// with a checkpoint; the handler then restores the defaults, so a second
// signal ends the process at once.
volatile std::sig_atomic_t g_signal = 0;
extern "C" void on_stop_signal(int sig) {
  g_signal = sig;
  struct sigaction dfl {};  // sigaction is async-signal-safe
  dfl.sa_handler = SIG_DFL;
  sigemptyset(&dfl.sa_mask);
  sigaction(SIGINT, &dfl, nullptr);
  sigaction(SIGTERM, &dfl, nullptr);
}

// Installs the handlers for the lifetime of one train() call.
class StopSignals {
 public:
  StopSignals() {
    g_signal = 0;
    struct sigaction sa {};
    sa.sa_handler = on_stop_signal;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, &old_int_);
    sigaction(SIGTERM, &sa, &old_term_);
  }
  ~StopSignals() {
    sigaction(SIGINT, &old_int_, nullptr);
    sigaction(SIGTERM, &old_term_, nullptr);
  }
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;

 private:
  struct sigaction old_int_ {}, old_term_ {};
};

// One writer per run directory: flock on <out_dir>/.lock, held until train()
// returns; the kernel drops it when the holder dies, so a stale lock never
// blocks. The file holds the holder's PID for the message.
class RunLock {
 public:
  explicit RunLock(const std::string& dir) : path_(dir + "/.lock") {
    fd_ = ::open(path_.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    require(fd_ >= 0, "cannot open the lock file '" + path_ + "': " + std::strerror(errno));
    if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
      char buf[32] = {0};
      const ssize_t n = ::pread(fd_, buf, sizeof buf - 1, 0);
      ::close(fd_);
      fd_ = -1;
      std::string pid = n > 0 ? std::string(buf, std::size_t(n)) : std::string("unknown");
      while (!pid.empty() && (pid.back() == '\n' || pid.back() == ' ')) pid.pop_back();
      throw Error("run.out_dir '" + dir + "' is in use by another ash train (PID " + pid +
                  "); wait for it to finish or choose another run.out_dir");
    }
    // The lock holds even if this fails; only the PID in messages is missing.
    const std::string me = std::to_string(::getpid()) + "\n";
    if (::ftruncate(fd_, 0) == 0) (void)!::pwrite(fd_, me.data(), me.size(), 0);
  }
  ~RunLock() {
    if (fd_ >= 0) ::close(fd_);  // releases the flock
  }
  RunLock(const RunLock&) = delete;
  RunLock& operator=(const RunLock&) = delete;

 private:
  std::string path_;
  int fd_ = -1;
};

// Temp files of writers that were killed (checkpoint.h5.tmp.<pid>, the
// names write_atomically uses); safe to remove once this run holds the lock.
void remove_stale_temps(const std::string& dir) {
  std::error_code ec;
  std::vector<std::filesystem::path> stale;
  for (std::filesystem::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const auto name = it->path().filename().string();
    const auto at = name.find(".h5.tmp.");
    if (at == std::string::npos || at + 8 == name.size()) continue;
    if (name.find_first_not_of("0123456789", at + 8) == std::string::npos && it->is_regular_file(ec))
      stale.push_back(it->path());
  }
  for (const auto& p : stale) std::filesystem::remove(p, ec);
}

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

  index_t batch = 1;  // data.batch: the validation forward scores this many windows at a time

  Backend(const Config& cfg, const Settings& st) : range(LayerRange::all(st.model)), batch(st.data.batch) {
    const ModelDims& d = st.model;
#ifdef ASH_HAVE_MPI
    int inited = 0, world = 1, rank = 0;
    MPI_Initialized(&inited);
    if (inited) {
      MPI_Comm_size(MPI_COMM_WORLD, &world);
      MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    }
    if (world > 1 || st.dist.multi_rank()) {
      require(inited, "dist.* asks for several ranks: run under mpiexec");
      grid = std::make_unique<dist::Grid>(cfg);
      range = grid->range(d);
      root = rank == 0;
      auto e = std::make_unique<dist::DistributedEngine<S>>(*grid, st.grad, st.dist.pipeline_blocks);
      dist_engine = e.get();
      engine = std::move(e);
      return;
    }
#else
    (void)cfg;
    require(!st.dist.multi_rank(), "dist.* asks for several ranks: that needs the MPI build of AdjointSharding (ASH_ENABLE_MPI)");
#endif
    engine = make_engine<S>(st.grad);
  }

  double valid_loss(const ParamSet<S>& params, const TokenView& x) {
#ifdef ASH_HAVE_MPI
    if (dist_engine) return dist_engine->loss(params, x);
#endif
    // The validation windows (up to 16) go through data.batch at a time, so
    // scoring them never needs more activation memory than a training step.
    const index_t nv = x.extent(0), T = x.extent(1);
    if (nv <= batch) return forward_loss(params, x);
    double sum = 0;
    for (index_t i0 = 0; i0 < nv; i0 += batch) {
      const index_t n = std::min(batch, nv - i0);
      TokenView xs("ash::train::valid_windows", n, T);
      Kokkos::deep_copy(xs, Kokkos::subview(x, Kokkos::make_pair(i0, i0 + n), Kokkos::ALL()));
      sum += forward_loss(params, xs) * double(n);  // every window has T - 1 targets
    }
    return sum / double(nv);
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
            std::int64_t cursor, const AdamW<S>& opt, const std::vector<View2<S>>* carry) {
#ifdef ASH_HAVE_MPI
    if (grid) {
      dist::save_checkpoint(*grid, path, cfg, params, step, cursor, &opt.m(), &opt.v(), opt.step());
      return;
    }
#endif
    save_checkpoint(path, cfg, params, step, cursor, OptimizerState<S>{&opt.m(), &opt.v(), opt.step(), carry});
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
  // True on every rank when `mine` is true on any (the collective decisions
  // of §7: a non-finite shard or a signal on one rank stops all ranks).
  bool any(bool mine) const {
#ifdef ASH_HAVE_MPI
    if (grid) return dist::allreduce_max(std::uint64_t(mine), grid->world()) != 0;
#endif
    return mine;
  }
  int max_signal(int mine) const {
#ifdef ASH_HAVE_MPI
    if (grid) return int(dist::allreduce_max(std::uint64_t(mine), grid->world()));
#endif
    return mine;
  }
  // Runs fn on the root; its ash::Error becomes an error on every rank.
  template <class Fn>
  void on_root(Fn&& fn) {
    std::string err;
    if (root) {
      try {
        fn();
      } catch (const Error& e) {
        err = e.what();
      }
    }
#ifdef ASH_HAVE_MPI
    if (grid) {
      int len = int(err.size());
      MPI_Bcast(&len, 1, MPI_INT, 0, grid->world());
      err.resize(std::size_t(len));
      if (len > 0) MPI_Bcast(&err[0], len, MPI_CHAR, 0, grid->world());
    }
#endif
    require(err.empty(), err);
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
TrainSummary train_as(const Config& cfg, const Settings& st, const std::string& resume, std::FILE* log,
                      std::int64_t until) {
  const ModelDims d = st.model;
  const index_t T = st.data.seq_len, B = st.data.batch;
  const std::int64_t steps = st.optim.steps;
  const std::int64_t log_every = std::max<std::int64_t>(1, st.run.log_every);
  const std::int64_t eval_every = st.run.eval_every;
  const std::int64_t ckpt_every = st.run.ckpt_every;
  const std::string out_dir = st.run.out_dir;
  const std::string ckpt_path = out_dir + "/checkpoint.h5";

  const auto data = TokenDataset::from_file(st.data.train, d.vocab, T, st.data.valid_fraction, d.seed,
                                            st.data.sequential, st.data.carry_state);
  Backend<S> be(cfg, st);
  if (!be.root) log = nullptr;
  std::unique_ptr<RunLock> lock;
  be.on_root([&] {
    std::error_code ec;
    std::filesystem::create_directories(out_dir, ec);
    require(!ec, "cannot create run.out_dir '" + out_dir + "': " + ec.message());
    lock = std::make_unique<RunLock>(out_dir);  // world rank 0 writes, so it alone locks
    remove_stale_temps(out_dir);
  });
  StopSignals signals;

  ParamSet<S> params(d, be.range);
  AdamW<S> opt(d, be.range, st.optim);
  std::int64_t step = 0, cursor = 0;
  if (resume.empty()) {
    initialize(params, d.seed);
  } else {
    CheckpointInfo info;
    params = load_checkpoint<S>(resume, be.range, &info);
    require(info.dims == d, "--resume: checkpoint '" + resume + "' has other model sizes than the configuration");
    require(info.precision == (sizeof(S) == 8 ? "double" : "float"),
            "--resume: checkpoint '" + resume + "' was trained in " + info.precision + ", run.precision is " +
                st.run.precision());
    std::int64_t opt_step = 0;
    if (load_optimizer_state(resume, opt.m(), opt.v(), &opt_step)) opt.set_step(opt_step);
    step = info.step;
    cursor = info.data_cursor;
  }
  auto& engine = be.engine;
  // data.carry_state: every layer's state after the previous window of each
  // stream, restored on resume (a checkpoint without one starts from zero).
  std::vector<View2<S>> carried;
  if (st.data.carry_state) {
    for (index_t k = 0; k < d.layers; ++k) carried.emplace_back("ash::train::carried_state", B * d.width, d.state);
    if (!resume.empty()) load_carried_state(resume, carried);
    engine->set_carried_state(&carried);
  }
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
  // The last good checkpoint and its step, for the messages of §7.
  std::string good_path = resume;
  std::int64_t good_step = step;
  auto last_good = [&]() {
    return good_path.empty() ? std::string("no checkpoint written yet")
                             : "the last good checkpoint is kept: " + good_path + " (step " + std::to_string(good_step) +
                                   ")";
  };
  std::int64_t saved_at = -1;
  auto save = [&](std::int64_t at) {
    // Never write a bad state over a good one: parameters and Adam moments
    // are checked on every rank before the collective write.
    const index_t bad = bad_values(params.data()) + bad_values(opt.m().data()) + bad_values(opt.v().data());
    if (be.any(bad > 0))
      throw Error("parameters or optimizer state are not finite (or |x| > 1e30) after step " + std::to_string(at) +
                  "; stopped; " + last_good());
    // Finite but diverged parameters (the loss overflows) are bad too: they
    // must give a finite loss on the next batch before they replace a good
    // file. One forward per checkpoint.
    std::int64_t probe_cursor = cursor;
    const double probe = be.valid_loss(params, data.train_batch(at, B, &probe_cursor));
    if (be.any(!std::isfinite(probe)))
      throw Error("the parameters after step " + std::to_string(at) + " give a non-finite loss (" +
                  std::to_string(probe) + "); stopped; " + last_good());
    be.save(ckpt_path, cfg, params, at, cursor, opt, carried.empty() ? nullptr : &carried);
    sum.checkpoint = ckpt_path;
    good_path = ckpt_path;
    good_step = at;
    saved_at = at;
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
  double train_s = 0.0;  // wall-clock of the steps alone: no validation, no checkpoints
  while (step < stop) {
    const auto t_step = std::chrono::steady_clock::now();
    if (!carried.empty() && cursor == 0)  // the streams (re)start: no state before their first window
      for (auto& h : carried) Kokkos::deep_copy(h, S(0));
    const auto x = data.train_batch(step, B, &cursor);
    const double loss = engine->compute(params, x, grad);
    if (!std::isfinite(loss))
      throw Error("loss is " + std::to_string(loss) + " at step " + std::to_string(step) + "; stopped; " +
                  last_good());
    const double lr = learning_rate(opt.options(), opt.step());
    const double gnorm = opt.update(params, grad, be.norm_reducer());
    const double step_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_step).count();
    train_s += step_s;
    ++step;
    tokens_since += B * T;
    sum.last_loss = loss;
    const bool last = step == stop;
    nlohmann::json row{{"step", step}, {"loss", loss}, {"lr", lr}, {"grad_norm", gnorm},
                        {"step_s", step_s}, {"train_s", train_s}};
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
      require(metrics.good(), "cannot write " + out_dir + "/metrics.jsonl (disk full?); " + last_good());
    }
    if ((ckpt_every > 0 && step % ckpt_every == 0) || last) save(step);
    // All ranks agree once per step (mpiexec forwards the signal to each,
    // not necessarily at the same step).
    const int sig = be.max_signal(int(g_signal));
    if (sig != 0) {
      if (saved_at != step) save(step);
      sum.signal = sig;
      break;
    }
  }
  sum.last_step = step;
  sum.rank_peak_bytes = be.rank_peaks();
  sum.peak_bytes = *std::max_element(sum.rank_peak_bytes.begin(), sum.rank_peak_bytes.end());
  if (sum.checkpoint.empty() && !resume.empty()) sum.checkpoint = resume;  // nothing left to run
  return sum;
}

}  // namespace

TrainSummary train(const Config& cfg, const std::string& resume, std::FILE* log, std::int64_t until) {
  const Settings st = cfg.settings();
  return st.run.double_precision ? train_as<double>(cfg, st, resume, log, until)
                                 : train_as<float>(cfg, st, resume, log, until);
}

}  // namespace ash
