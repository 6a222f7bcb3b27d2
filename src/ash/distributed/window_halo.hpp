#pragma once
// The paper's window T̄ across sequence ranks (docs/design.md §2 E4): μ_T̄ of a
// range's last T̄−1 tokens reads the next range's first T̄−1 tokens, so each
// rank receives that halo of g and of every layer's input from the next range,
// Bt·(T̄−1)·P values each. Shared by DistributedEngine (whole ranges) and
// SequenceBlockwise (the memory levers, or a kind without range maps; P: the
// model's width, the residual stream's).
#include <algorithm>
#include <functional>
#include <string>

#include "ash/core/error.hpp"
#include "ash/distributed/collectives.hpp"
#include "ash/distributed/layout.hpp"
#include "ash/kernels/blocks.hpp"

namespace ash::dist {

// Every range but the last must hold the halo the range before it reads. Every
// rank checks every range, so all throw alike and none waits for a halo.
inline void require_window_halos(std::int64_t T_all, int S, std::int64_t Tbar) {
  for (int r = 1; r < S; ++r) {
    const std::int64_t a = T_all * r / S, b = T_all * (r + 1) / S;
    require(std::min<std::int64_t>(Tbar - 1, T_all - a) <= b - a,
            "dist.seq_ranks: a window T-bar = " + std::to_string(Tbar) + " reads up to " + std::to_string(Tbar - 1) +
                " tokens past a token range, and sequence rank " + std::to_string(r) + " holds " +
                std::to_string(b - a) + "; use fewer sequence ranks or a smaller grad.truncate (each range needs >= "
                "T-bar - 1 tokens)");
  }
}

// One rank's halos: it reads H tokens per sequence of the next range and sends
// its own first H_prev to the previous range. ext() builds a layer's extended
// range [own T tokens | H halo tokens] per sequence.
template <class S>
class WindowHalo {
 public:
  using Timed = std::function<void(const std::function<void()>&)>;
  WindowHalo(const Layout& lay, index_t Bt, index_t P, std::int64_t T_all, index_t Tbar, int tag, MPI_Comm seq,
             Timed timed)
      : T_(index_t(lay.seq_end(T_all) - lay.seq_begin(T_all))),
        H_(halo_length(lay, T_all, Tbar)),
        H_prev_(lay.seq_rank > 0 ? std::min<index_t>(Tbar - 1, index_t(T_all - lay.seq_begin(T_all))) : 0),
        lay_(lay),
        tag_(tag),
        seq_(seq),
        timed_(std::move(timed)),
        out_("ash::dist::halo_out", Bt * H_prev_, P),
        in_("ash::dist::halo_in", Bt * H_, P) {}

  // H: the tokens of the next range a rank's window T̄ reads (up to T̄ - 1).
  static index_t halo_length(const Layout& lay, std::int64_t T_all, index_t Tbar) {
    return std::min<index_t>(Tbar - 1, index_t(T_all - lay.seq_end(T_all)));
  }
  index_t own() const { return T_; }
  index_t halo() const { return H_; }
  index_t extended() const { return T_ + H_; }

  // own ([Bt·T, P]): its first H_prev tokens to the previous range; the next
  // range's first H tokens into `into` ([Bt·H, P]).
  void exchange(const View2<S>& own, const View2<S>& into, const ExecSpace& exec) {
    if (H_prev_ > 0) {
      copy_block_rows(own, out_, BlockRows{H_prev_, T_, 0}, true, exec);
      exec.fence();
      timed_([&] { send(out_, lay_.seq_rank - 1, tag_, seq_); });
    }
    if (H_ > 0) timed_([&] { recv(into, lay_.seq_rank + 1, tag_, seq_); });
  }
  void exchange(const View2<S>& own, const ExecSpace& exec) { exchange(own, in_, exec); }
  const View2<S>& received() const { return in_; }

  // ext ([Bt·(T+H), P]) ← own rows, then halo rows, per sequence.
  void extend(const View2<S>& own, const View2<S>& halo_rows, const View2<S>& ext, const ExecSpace& exec) const {
    const index_t Te = extended();
    copy_block_rows(ext, own, BlockRows{T_, Te, 0}, false, exec);
    if (H_ > 0) copy_block_rows(ext, halo_rows, BlockRows{H_, Te, T_}, false, exec);
  }

 private:
  index_t T_, H_, H_prev_;
  const Layout& lay_;
  int tag_;
  MPI_Comm seq_;
  Timed timed_;
  View2<S> out_, in_;
};

}  // namespace ash::dist
