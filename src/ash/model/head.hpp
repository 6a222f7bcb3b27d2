#pragma once
// The head: ŷ_K = RMSNorm(y_K; w_f), o = Ω ŷ_K, l^t = -log softmax(o^t)[x^{t+1}],
// L = mean over the tokens that have a target: Bt·(T-1), less the targets
// that start a document (docs/design.md §1).
#include "ash/model/embedding.hpp"
#include "ash/model/params.hpp"

namespace ash {

// Returns L. When g is allocated it receives g^t = ∂L/∂y_K^t (0 for the last
// token of each window); when grad is non-null, ∂L/∂Ω and ∂L/∂w_f are added to it.
// The T×V logits are formed chunk_rows tokens at a time (0: head_chunk_rows), never whole.
// yK has T rows per sequence of x; x has T tokens per sequence, or T + 1 when
// the next token range's first token is the last row's target (context parallelism).
// targets: the count the mean divides by, 0 for x's own (target_count(x)); a data-parallel
// replica passes the whole batch's, so the replicas' losses and g sum to the batch's.
template <class S>
double head_loss(const GlobalParams<S>& p, const TokenView& x, const View2<S>& yK, const View2<S>& g,
                 const GlobalParams<S>* grad, index_t chunk_rows = 1024, index_t targets = 0,
                 const ExecSpace& exec = ExecSpace());

// Rows per head chunk for grad.head_chunk = `requested`; 0 (auto) gives 1024
// on a host backend and, on a GPU, enough rows that a chunk's logits hold
// 2^24 numbers (at least 1024): one chunk of 1024 rows leaves an H100 idle and
// turns a long window into thousands of small launches.
index_t head_chunk_rows(index_t requested, index_t V);

// Logits o = Ω RMSNorm(y; w_f) for the rows of y ([R, P] -> [R, V]).
template <class S>
void head_logits(const GlobalParams<S>& p, const View2<S>& y, const View2<S>& logits);

}  // namespace ash
