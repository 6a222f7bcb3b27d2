#include "ash/train/trainer.hpp"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstring>
#include <ctime>
#include <filesystem>

#include "ash/core/documents.hpp"
#include "ash/core/error.hpp"
#include "ash/core/memory.hpp"
#include "ash/distributed/run_context.hpp"
#include "ash/grad/engine.hpp"
#include "ash/io/atomic_write.hpp"
#include "ash/io/checkpoint.hpp"
#include "ash/io/dataset.hpp"
#include "ash/io/run_lock.hpp"
#include "ash/kernels/matmul.hpp"
#include "ash/model/forward.hpp"
#include "ash/train/optimizer.hpp"

namespace ash {

namespace {

constexpr index_t max_valid_windows = 16;

// The token file with its documents (data.separator, data.pack) marked.
TokenDataset open_dataset(const Settings& st) {
  auto d = TokenDataset::from_file(st.data.train, st.model.vocab, st.data.seq_len, st.data.valid_fraction,
                                   st.model.seed, st.data.sequential, st.data.carry_state);
  d.set_documents(separator_tokens(st.data.separator), st.data.pack);
  return d;
}

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

// SIGINT / SIGTERM / SIGUSR1 (a batch system's warning before the time
// limit: Slurm's --signal=USR1@N): the first asks the loop to stop after the
// current step with a checkpoint; a second signal ends the process at once
// (the default action), except the same SIGTERM or SIGUSR1 again within a
// second: Slurm delivers one SIGTERM to each task twice (from slurmstepd, and
// forwarded by srun, which gets it too) at the time limit or on scancel.
constexpr int stop_signals[] = {SIGINT, SIGTERM, SIGUSR1};
constexpr long long repeat_window_ns = 1000000000LL;
volatile std::sig_atomic_t g_signal = 0;
timespec g_first_signal{};  // when g_signal was set; only the handler touches it (the mask keeps it from nesting)
extern "C" void on_stop_signal(int sig) {
  timespec now{};
  clock_gettime(CLOCK_MONOTONIC, &now);  // async-signal-safe, as are sigaction and raise
  if (g_signal == 0) {
    g_first_signal = now;
    g_signal = sig;
    return;
  }
  const long long since = (now.tv_sec - g_first_signal.tv_sec) * 1000000000LL + (now.tv_nsec - g_first_signal.tv_nsec);
  if (sig == g_signal && sig != SIGINT && since < repeat_window_ns) return;  // one signal delivered twice
  struct sigaction dfl {};
  dfl.sa_handler = SIG_DFL;
  sigemptyset(&dfl.sa_mask);
  for (const int s : stop_signals) sigaction(s, &dfl, nullptr);
  raise(sig);  // blocked until the handler returns, then the default action
}

// Installs the handlers for the lifetime of one train() call.
class StopSignals {
 public:
  StopSignals() {
    g_signal = 0;
    struct sigaction sa {};
    sa.sa_handler = on_stop_signal;
    sigemptyset(&sa.sa_mask);
    for (const int s : stop_signals) sigaddset(&sa.sa_mask, s);
    for (int i = 0; i < 3; ++i) sigaction(stop_signals[i], &sa, &old_[i]);
  }
  ~StopSignals() {
    for (int i = 0; i < 3; ++i) sigaction(stop_signals[i], &old_[i], nullptr);
  }
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;

 private:
  struct sigaction old_[3] {};
};

// Temp files of writers that were killed (checkpoint.h5.tmp.XXXXXX, the
// names write_atomically uses, and checkpoint.h5.tmp.<pid> of older builds):
// regular files only, safe to remove once this run holds the lock.
void remove_stale_temps(const std::string& dir) {
  std::error_code ec;
  std::vector<std::filesystem::path> stale;
  for (std::filesystem::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const auto name = it->path().filename().string();
    const auto at = name.find(".h5.tmp.");
    if (at == std::string::npos || at + 8 == name.size()) continue;
    if (name.find_first_not_of(io::temporary_suffix_chars, at + 8) == std::string::npos &&
        it->symlink_status(ec).type() == std::filesystem::file_type::regular)
      stale.push_back(it->path());
  }
  for (const auto& p : stale) std::filesystem::remove(p, ec);
}

// <run.out_dir>/metrics.jsonl, appended to across resumes. It is opened
// without following a symbolic link (a link there is refused, its target
// untouched) and must be a regular file.
class MetricsFile {
 public:
  MetricsFile() = default;
  MetricsFile(const MetricsFile&) = delete;
  MetricsFile& operator=(const MetricsFile&) = delete;
  ~MetricsFile() {
    if (fd_ >= 0) ::close(fd_);
  }
  void open(const std::string& path) {
    const std::string link = "the metrics file '" + path + "' is a symbolic link, which ash never writes through; remove it";
    const std::string other = "the metrics file '" + path + "' is not a regular file; remove it";
    fd_ = ::open(path.c_str(), O_WRONLY | O_APPEND | O_CREAT | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC, 0644);
    struct stat st {};
    if (fd_ < 0) {  // a link (ELOOP), a directory (EISDIR), a FIFO without a reader (ENXIO), ...
      const int err = errno;
      if (::lstat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode)) throw Error(S_ISLNK(st.st_mode) ? link : other);
      throw Error("cannot open " + path + " for appending: " + std::strerror(err));
    }
    if (::fstat(fd_, &st) != 0 || !S_ISREG(st.st_mode)) {
      ::close(fd_);
      fd_ = -1;
      throw Error(other);
    }
  }
  // Appends one line; false (errno set) when the write fails.
  bool write_line(const std::string& text) {
    const std::string line = text + "\n";
    for (std::size_t done = 0; done < line.size();) {
      const ssize_t w = ::write(fd_, line.data() + done, line.size() - done);
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) {
        if (w == 0) errno = EIO;
        return false;
      }
      done += std::size_t(w);
    }
    return true;
  }

 private:
  int fd_ = -1;
};

template <class S>
class Trainer {
 public:
  Trainer(const Config& cfg, const Settings& st, const std::string& resume, std::FILE* log, std::int64_t until);
  TrainSummary run();

 private:
  void open_run_dir();
  void restore();
  void save(std::int64_t at);
  std::string last_good() const;
  // Validation when due, the progress line when due, and the metrics row.
  void report(nlohmann::json& row, double loss, double lr, double gnorm, bool last);

  const Config& cfg_;
  const Settings& st_;
  const ModelDims d_;
  const index_t T_, B_;
  const std::string resume_, out_dir_, ckpt_path_;
  std::FILE* log_;
  const std::int64_t stop_;
  TokenDataset data_;
  std::uint64_t fingerprint_;  // data_'s, stored with the cursor
  RunContext<S> ctx_;
  StopSignals signals_;  // SIGINT / SIGTERM / SIGUSR1: stop after the step with a checkpoint
  std::unique_ptr<RunLock> lock_;
  ParamSet<S> params_, grad_;
  AdamW<S> opt_;
  std::int64_t step_ = 0, cursor_ = 0, saved_at_ = -1;
  // data.carry_state: every layer's state after the previous window of each
  // stream, restored on resume (a checkpoint without one starts from zero).
  std::vector<View2<S>> carried_;
  TokenView valid_;
  MetricsFile metrics_;
  TrainSummary sum_;
  // The last good checkpoint and its step, for the messages of §7.
  std::string good_path_;
  std::int64_t good_step_ = 0;
  // Progress: tokens and time since the last progress line.
  std::chrono::steady_clock::time_point t_start_, t_last_;
  std::int64_t tokens_since_ = 0;
};

template <class S>
Trainer<S>::Trainer(const Config& cfg, const Settings& st, const std::string& resume, std::FILE* log,
                    std::int64_t until)
    : cfg_(cfg),
      st_(st),
      d_(st.model),
      T_(st.data.seq_len),
      B_(st.data.batch),
      resume_(resume),
      out_dir_(st.run.out_dir),
      ckpt_path_(st.run.out_dir + "/checkpoint.h5"),
      log_(log),
      stop_((until > 0 && until < st.optim.steps) ? until : st.optim.steps),
      data_(open_dataset(st)),
      fingerprint_(data_.fingerprint()),
      ctx_(st),
      params_(d_, ctx_.range()),
      grad_(d_, ctx_.range()),
      opt_(d_, ctx_.range(), st.optim) {
  if (!ctx_.root()) log_ = nullptr;
  open_run_dir();
  restore();
  if (data_.valid_windows() > 0) valid_ = data_.valid_batch(max_valid_windows);
  // Validation over no target would print a loss of 0 (the training part is checked by set_documents).
  require(valid_.extent(0) == 0 || target_count(valid_) > 0,
          "the validation windows of token file '" + data_.path() + "' hold no target: every token after the " +
              "first of a window starts a document (data.separator), so there is nothing to score; set " +
              "data.valid_fraction=0 or give a file whose validation tail holds text");
  sum_.first_step = step_;
  sum_.uniform_bits = std::log2(double(d_.vocab));
  sum_.val_loss = std::nan("");
  if (valid_.extent(0) > 0) sum_.unigram_bits = data_.unigram_valid_bits(max_valid_windows);
  if (ctx_.root()) {
    metrics_.open(out_dir_ + "/metrics.jsonl");
  }
  good_path_ = resume_;
  good_step_ = step_;
}

// World rank 0 creates and locks the run directory (it alone writes there).
template <class S>
void Trainer<S>::open_run_dir() {
  ctx_.on_root([&] {
    std::error_code ec;
    std::filesystem::create_directories(out_dir_, ec);
    require(!ec, "cannot create run.out_dir '" + out_dir_ + "': " + ec.message());
    lock_ = std::make_unique<RunLock>(out_dir_);
    remove_stale_temps(out_dir_);
    // Refused now, not at the first checkpoint: a FIFO, device or link at checkpoint.h5.
    io::require_output_path(ckpt_path_, "the run's checkpoint");
  });
}

// A fresh model, or the parameters, Adam moments, step, data cursor and
// carried state of --resume.
template <class S>
void Trainer<S>::restore() {
  if (resume_.empty()) {
    initialize(params_, d_.seed);
  } else {
    CheckpointInfo info;
    params_ = ctx_.load(resume_, &info);
    require(info.dims == d_, "--resume: checkpoint '" + resume_ + "' has other model sizes than the configuration");
    require(info.precision == (sizeof(S) == 8 ? "double" : "float"),
            "--resume: checkpoint '" + resume_ + "' was trained in " + info.precision + ", run.precision is " +
                st_.run.precision());
    std::int64_t opt_step = 0;
    if (load_optimizer_state(resume_, opt_.m(), opt_.v(), &opt_step)) opt_.set_step(opt_step);
    step_ = info.step;
    cursor_ = info.data_cursor;
    // A cursor indexes the file it was written with (sequential and stream modes), as
    // packed windows where data.pack was on: packing on one side only is named as such
    // (the counts are of different things, not of two files).
    const auto& stored = info.config.json();
    if ((st_.data.sequential || st_.data.carry_state) && info.data_tokens >= 0 && stored.contains("data") &&
        stored["data"].contains("pack") && stored["data"]["pack"].is_boolean()) {
      const bool was_packed = stored["data"]["pack"].get<bool>();
      require(was_packed == st_.data.pack,
              "--resume: checkpoint '" + resume_ + "' was written by a run with data.pack=" +
                  (was_packed ? "true" : "false") + ", this one has data.pack=" + (st_.data.pack ? "true" : "false") +
                  ": its data cursor " + std::to_string(cursor_) + " indexes the " +
                  (was_packed ? "packed windows" : "tokens") + " of data.train (" + std::to_string(info.data_tokens) +
                  (was_packed ? " packed" : "") + " tokens); resume with data.pack=" + (was_packed ? "true" : "false"));
    }
    if ((st_.data.sequential || st_.data.carry_state) && info.data_tokens >= 0)
      require(info.data_tokens == index_t(data_.tokens().size()) && info.data_fingerprint == data_.fingerprint(),
              "--resume: checkpoint '" + resume_ + "' was written reading a token file of " +
                  std::to_string(info.data_tokens) + " tokens (fingerprint " + std::to_string(info.data_fingerprint) +
                  "), and data.train '" + data_.path() + "' has " + std::to_string(data_.tokens().size()) +
                  " tokens (fingerprint " + std::to_string(data_.fingerprint()) + "): its data cursor " +
                  std::to_string(cursor_) + " belongs to the other file");
    data_.check_cursor(cursor_, B_);
  }
  if (st_.data.carry_state) {
    for (index_t k = 0; k < d_.layers; ++k) carried_.emplace_back("ash::train::carried_state", B_ * d_.carry_rows(), d_.carry_cols());
    if (!resume_.empty()) load_carried_state(resume_, carried_);
    ctx_.engine().set_carried_state(&carried_);
  }
}

template <class S>
std::string Trainer<S>::last_good() const {
  return good_path_.empty() ? std::string("no checkpoint written yet")
                            : "the last good checkpoint is kept: " + good_path_ + " (step " +
                                  std::to_string(good_step_) + ")";
}

template <class S>
void Trainer<S>::save(std::int64_t at) {
  // Never write a bad state over a good one: parameters and Adam moments
  // are checked on every rank before the collective write.
  const index_t bad = bad_values(params_.data()) + bad_values(opt_.m().data()) + bad_values(opt_.v().data());
  if (ctx_.any(bad > 0))
    throw Error("parameters or optimizer state are not finite (or |x| > 1e30) after step " + std::to_string(at) +
                "; stopped; " + last_good());
  // Finite but diverged parameters (the loss overflows) are bad too: they
  // must give a finite loss on the next batch before they replace a good
  // file. One forward per checkpoint.
  std::int64_t probe_cursor = cursor_;
  const double probe = ctx_.loss(params_, data_.train_batch(at, B_, &probe_cursor));
  if (ctx_.any(!std::isfinite(probe)))
    throw Error("the parameters after step " + std::to_string(at) + " give a non-finite loss (" +
                std::to_string(probe) + "); stopped; " + last_good());
  ctx_.save_checkpoint(ckpt_path_, cfg_, params_, at, cursor_,
                       OptimizerState<S>{&opt_.m(), &opt_.v(), opt_.step(), carried_.empty() ? nullptr : &carried_,
                                         index_t(data_.tokens().size()), fingerprint_});
  sum_.checkpoint = ckpt_path_;
  good_path_ = ckpt_path_;
  good_step_ = at;
  saved_at_ = at;
}

template <class S>
void Trainer<S>::report(nlohmann::json& row, double loss, double lr, double gnorm, bool last) {
  const std::int64_t eval_every = st_.run.eval_every, log_every = std::max<std::int64_t>(1, st_.run.log_every);
  if (valid_.extent(0) > 0 && ((eval_every > 0 && step_ % eval_every == 0) || last)) {
    sum_.val_loss = ctx_.loss(params_, valid_);
    sum_.val_bits = sum_.val_loss / std::log(2.0);
    row["val_loss"] = sum_.val_loss;
    row["val_bits_per_token"] = sum_.val_bits;
  }
  if (step_ % log_every == 0 || last) {
    const auto now = std::chrono::steady_clock::now();
    const double dt = std::chrono::duration<double>(now - t_last_).count();
    const double elapsed = std::chrono::duration<double>(now - t_start_).count();
    const double tps = dt > 0 ? double(tokens_since_) / dt : 0.0;
    const double eta = double(stop_ - step_) * elapsed / double(step_ - sum_.first_step);
    row["tokens_per_s"] = tps;
    const std::uint64_t mine = MemoryTracker::peak(MemSpace::name());
    const auto peaks = ctx_.allgather({mine});
    const std::uint64_t peak = *std::max_element(peaks.begin(), peaks.end());  // the largest rank's
    row["peak_bytes"] = peak;
    row["hwm_bytes"] = MemoryTracker::process_hwm_bytes();
    if (log_) {
      std::fprintf(log_, "step %6lld  loss %.4f", (long long)step_, loss);
      if (row.contains("val_loss")) std::fprintf(log_, "  val %.4f (%.3f bits/token)", sum_.val_loss, sum_.val_bits);
      std::fprintf(log_, "  lr %.2e  |g| %.3f  %.0f tok/s  peak %s  ETA %.0fs\n", lr, gnorm, tps,
                   format_bytes(peak).c_str(), eta);
      std::fflush(log_);
    }
    t_last_ = now;
    tokens_since_ = 0;
  }
  if (ctx_.root()) {
    if (!metrics_.write_line(row.dump()))
      throw Error("cannot write " + out_dir_ + "/metrics.jsonl: " + std::strerror(errno) + " (disk full?); " +
                  last_good());
  }
}

template <class S>
TrainSummary Trainer<S>::run() {
  auto& engine = ctx_.engine();
  if (log_)
    std::fprintf(log_,
                 "train: %s, %lld params (%s), %lld train / %lld valid tokens, T=%lld batch=%lld, steps %lld..%lld\n",
                 engine.name().c_str(), (long long)parameter_count(d_), sizeof(S) == 8 ? "double" : "float",
                 (long long)data_.train_tokens(), (long long)data_.valid_tokens(), (long long)T_, (long long)B_,
                 (long long)step_, (long long)st_.optim.steps);
  if (log_ && data_.documents() > 0)
    std::fprintf(log_, "train: %lld documents (data.separator)%s\n", (long long)data_.documents(),
                 st_.data.pack ? (", packed: " + std::to_string(int(100 * data_.pack_fill() + 0.5)) +
                                  "% of the training windows' tokens are documents, the rest padding")
                                     .c_str()
                               : "");
  t_start_ = t_last_ = std::chrono::steady_clock::now();
  const std::int64_t ckpt_every = st_.run.ckpt_every;
  double train_s = 0.0;  // wall-clock of the steps alone: no validation, no checkpoints
  while (step_ < stop_) {
    const auto t_step = std::chrono::steady_clock::now();
    if (!carried_.empty() && cursor_ == 0)  // the streams (re)start: no state before their first window
      for (auto& h : carried_) Kokkos::deep_copy(h, S(0));
    const auto x = data_.train_batch(step_, B_, &cursor_);
    const double loss = engine.compute(params_, x, grad_);
    if (!std::isfinite(loss))
      throw Error("loss is " + std::to_string(loss) + " at step " + std::to_string(step_) + "; stopped; " +
                  last_good());
    const double lr = learning_rate(opt_.options(), opt_.step());
    const double gnorm = opt_.update(params_, grad_, ctx_.norm_reducer(grad_));
    const double step_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_step).count();
    train_s += step_s;
    ++step_;
    tokens_since_ += B_ * T_;
    sum_.last_loss = loss;
    const bool last = step_ == stop_;
    nlohmann::json row{{"step", step_}, {"loss", loss}, {"lr", lr}, {"grad_norm", gnorm},
                        {"step_s", step_s}, {"train_s", train_s}};
    report(row, loss, lr, gnorm, last);
    if ((ckpt_every > 0 && step_ % ckpt_every == 0) || last) save(step_);
    // All ranks agree once per step (mpiexec forwards the signal to each,
    // not necessarily at the same step).
    const int sig = ctx_.max_signal(int(g_signal));
    if (sig != 0) {
      if (saved_at_ != step_) save(step_);
      sum_.signal = sig;
      break;
    }
  }
  sum_.last_step = step_;
  sum_.rank_peak_bytes = ctx_.allgather({MemoryTracker::peak(MemSpace::name())});
  sum_.peak_bytes = *std::max_element(sum_.rank_peak_bytes.begin(), sum_.rank_peak_bytes.end());
  if (sum_.checkpoint.empty() && !resume_.empty()) sum_.checkpoint = resume_;  // nothing left to run
  return sum_;
}

}  // namespace

TrainSummary train(const Config& cfg, const std::string& resume, std::FILE* log, std::int64_t until) {
  const Settings st = cfg.settings();
  const MatmulScope matmul(st.grad.matmul, st.run.scalar_bytes());  // the steps and the validation forward
  if (st.run.double_precision) return Trainer<double>(cfg, st, resume, log, until).run();
  return Trainer<float>(cfg, st, resume, log, until).run();
}

}  // namespace ash
