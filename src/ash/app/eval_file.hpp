#pragma once
// `ash eval` and Python's evaluate as one library call (the use-case floor,
// docs/architecture.md): forward only over a whole token source, consecutive
// windows of T tokens (data.seq_len; a shorter last window when 2 or more tokens
// remain), B at a time (data.batch), each window from h = 0; or, carrying the
// state, the source as one stream. Documents from data.separator are scored each
// on its own.
#include <cstdint>
#include <functional>
#include <string>

#include "ash/app/token_windows.hpp"
#include "ash/core/config.hpp"
#include "ash/train/evaluate.hpp"

namespace ash {

// What the source holds, known before the forward starts.
struct EvalFileStart {
  index_t tokens = 0;     // tokens read
  index_t full = 0;       // windows of T
  index_t rest = 0;       // tokens after them (a last window when >= 2)
  index_t seq_len = 0;    // T
  long long documents = 0;  // documents (data.separator), 0 without a separator
};

struct EvalFileOptions {
  std::uint64_t max_memory = 0;  // check_memory's limit (0: the machine's)
  // carry: score the source as one stream twice, once with every layer's state
  // carried from the window before and once from h = 0 (ash eval --carry-state).
  bool carry = false;
  std::function<void(const EvalFileStart&)> on_start;  // before the document check and the forward
  std::function<void(const EvalTotals&)> progress;     // evaluate_windows' progress (not with carry)
  std::function<void(int pass, const EvalTotals&)> on_pass;  // carry: after each pass (0 carried, 1 from h = 0)
};

struct EvalFileResult {
  EvalTotals totals;      // without carry
  EvalTotals passes[2];   // with carry: carried state, each window from h = 0
};

// Compute type S; cfg: the checkpoint's run configuration (checkpoint_run_config).
// Throws ash::Error for a multi-rank dist.* layout, fewer than 2 tokens, or windows
// that hold no target.
template <class S>
EvalFileResult eval_file(const std::string& checkpoint, const Config& cfg, const TokenSource& tokens,
                         const EvalFileOptions& opts = {});

}  // namespace ash
