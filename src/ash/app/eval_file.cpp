#include "ash/app/eval_file.hpp"

#include "ash/app/run_checks.hpp"
#include "ash/core/error.hpp"
#include "ash/io/checkpoint.hpp"
#include "ash/kernels/matmul.hpp"
#include "ash/plan/memory_plan.hpp"

namespace ash {

template <class S>
EvalFileResult eval_file(const std::string& checkpoint, const Config& cfg, const TokenSource& tokens,
                         const EvalFileOptions& opts) {
  const Settings st = cfg.settings();
  require(!st.dist.multi_rank(), "ash eval runs in one process (dist.* asks for several ranks)");
  Config sizing = cfg;  // the forward keeps one layer at a time: E3's estimate bounds it
  sizing.set("grad.engine=adjoint-exact");
  check_memory(sizing, Workload::grad, sizeof(S), opts.max_memory);
  const MatmulScope matmul(st.grad.matmul, sizeof(S));
  const auto params = load_checkpoint<S>(checkpoint);
  std::vector<std::uint32_t> storage;
  const auto& ids = tokens.read(storage);
  const auto T = st.data.seq_len, B = st.data.batch;
  const auto n = index_t(ids.size());
  require(n >= 2, tokens.name() + " has " + std::to_string(n) + " token(s): nothing to predict");
  EvalFileStart start{n, n / T, n % T, T, 0};
  const auto document = document_starts(ids, st.data.separator);
  const std::vector<std::uint8_t>* docs = document.documents();
  if (docs) {
    start.documents = 1;
    for (const auto f : document.flags) start.documents += f;
  }
  if (opts.on_start) opts.on_start(start);
  if (docs) {
    // The tokens scored: every one after the first of its window (carry: after
    // the first of the source), windows of T from 0 and a last one of >= 2.
    const index_t end = start.full * T + (start.rest >= 2 ? start.rest : 0);
    bool any = false;
    for (index_t i = 1; i < (opts.carry ? n : end) && !any; ++i)
      any = (opts.carry || i % T != 0) && !document.flags[std::size_t(i)];
    require(any, no_targets_message(tokens.name(), "its windows"));
  }
  EvalFileResult r;
  if (!opts.carry) {
    r.totals = evaluate_windows(params, ids, T, B, st.grad.head_chunk, opts.progress, docs);
    require(r.totals.targets > 0, no_targets_message(tokens.name(), "its windows"));
    return r;
  }
  for (int pass = 0; pass < 2; ++pass) {
    r.passes[pass] = evaluate_stream(params, ids, T, st.grad.head_chunk, pass == 0, docs);
    require(r.passes[pass].targets > 0, no_targets_message(tokens.name(), "its windows"));
    if (opts.on_pass) opts.on_pass(pass, r.passes[pass]);
  }
  return r;
}

template EvalFileResult eval_file<float>(const std::string&, const Config&, const TokenSource&, const EvalFileOptions&);
template EvalFileResult eval_file<double>(const std::string&, const Config&, const TokenSource&,
                                          const EvalFileOptions&);

}  // namespace ash
