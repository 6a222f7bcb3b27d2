#pragma once
// Forward-only evaluation of a whole token file (`ash eval`, docs/cli.md):
// the loss over every target, window after window, one layer's activations
// alive at a time.
#include <cstdint>
#include <functional>
#include <vector>

#include "ash/model/params.hpp"

namespace ash {

struct EvalTotals {
  double nats = 0;      // summed loss over the targets scored
  index_t targets = 0;  // targets scored
  index_t tokens = 0;   // tokens read
  double seconds = 0;   // forward time (fenced)
  double bits_per_token() const;
};

// starts (data.separator; null: none): the tokens that start a document, whose
// state restarts from zero and which are nobody's target (docs/design.md §1).
//
// Consecutive windows of T tokens (a shorter last window when 2 or more
// tokens remain), B at a time, each from h = 0. `progress` is called with the
// totals so far at most every 10 s.
template <class S>
EvalTotals evaluate_windows(const ParamSet<S>& params, const std::vector<std::uint32_t>& ids, index_t T, index_t B,
                            index_t head_chunk, const std::function<void(const EvalTotals&)>& progress = {},
                            const std::vector<std::uint8_t>* starts = nullptr);

// The file as one stream, window after window of T tokens; every target is
// scored (each window's last token predicts the next window's first). carry:
// each window starts from the previous one's state (exactly the forward of
// the whole file as one sequence); else from h = 0.
template <class S>
EvalTotals evaluate_stream(const ParamSet<S>& params, const std::vector<std::uint32_t>& ids, index_t T,
                           index_t head_chunk, bool carry, const std::vector<std::uint8_t>* starts = nullptr);

}  // namespace ash
