#include "ash/app/grad_file.hpp"

#include <chrono>
#include <cmath>
#include <memory>

#include "ash/app/run_checks.hpp"
#include "ash/core/documents.hpp"
#include "ash/core/error.hpp"
#include "ash/core/memory.hpp"
#include "ash/io/run_lock.hpp"
#include "ash/model/forward.hpp"
#include "ash/plan/memory_plan.hpp"

namespace ash {

template <class S>
GradFileResult<S> grad_file(const std::string& checkpoint, const Config& cfg, const TokenSource& tokens,
                            const GradFileOptions& opts, std::vector<View2<S>>* state) {
  const Settings st = cfg.settings();
  check_memory(st, Workload::grad, sizeof(S), opts.max_memory);
  RunContext<S> ctx(st);  // one process, or this rank of the dist.* layout
  if (state) {
    require(st.data.carry_state && !ctx.distributed(), "a carried state needs data.carry_state=true in one process");
    check_carried_state(*state, st.model, st.model.layers, st.data.batch);
    ctx.engine().set_carried_state(state);
  }
  if (opts.fail_rank >= 0) ctx.fail_before_backward(opts.fail_rank);
  const auto T = st.data.seq_len, B = st.data.batch;
  const auto x = [&] {  // the file's tokens freed once the windows are cut
    std::vector<std::uint32_t> storage;
    return first_windows(tokens.read(storage), st);
  }();
  // A loss over no target is 0 and its gradient all zeros: not a result.
  require(target_count(x) > 0,
          no_targets_message(tokens.name(), "the " + std::to_string(B) + " window(s) of T=" + std::to_string(T) + " tokens"));
  const auto params = ctx.load(checkpoint);
  GradFileResult<S> r;
  r.grad = ParamSet<S>(st.model, ctx.range());
  MemoryTracker::reset_peak();
  ctx.barrier();
  const auto t0 = std::chrono::steady_clock::now();
  r.loss = ctx.engine().compute(params, x, r.grad);
  Kokkos::fence();
  ctx.barrier();
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  require(std::isfinite(r.loss), "the loss is not finite (" + std::to_string(r.loss) + "): nothing written");
  if (!opts.out.empty()) {
    std::unique_ptr<RunLock> lock;  // a run directory: not while its train runs (world rank 0 writes)
    ctx.on_root([&] { lock = RunLock::for_output(opts.out); });
    ctx.save_gradients(opts.out, cfg, r.loss, r.grad);
  }
  const auto* pipe = ctx.pipeline_stats();
  r.usage = ctx.allgather({MemoryTracker::peak(MemSpace::name()), MemoryTracker::process_hwm_bytes(),
                           pipe ? pipe->bytes_sent : 0});
  r.engine = ctx.engine().name();
  r.distributed = ctx.distributed();
  if (pipe) r.pipeline = *pipe;
  if (r.distributed) r.places = ctx.places(st.model, T);
  r.memory = MemoryTracker::summary();
  if (!r.distributed) r.planned_peak = plan_memory(st, Workload::grad, sizeof(S)).total();
  return r;
}

template GradFileResult<float> grad_file<float>(const std::string&, const Config&, const TokenSource&,
                                                const GradFileOptions&, std::vector<View2<float>>*);
template GradFileResult<double> grad_file<double>(const std::string&, const Config&, const TokenSource&,
                                                  const GradFileOptions&, std::vector<View2<double>>*);

}  // namespace ash
