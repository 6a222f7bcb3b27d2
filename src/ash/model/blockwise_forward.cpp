#include "ash/model/blockwise_forward.hpp"

#include <string>

#include "ash/core/error.hpp"

namespace ash {

template <class S>
BlockwiseForward<S>::BlockwiseForward(const ModelDims& d, int k0, int k1, index_t Bt, const TokenBlocks& blocks,
                                      bool keep_block_states)
    : k0_(k0), Bt_(Bt), blocks_(blocks), keep_(keep_block_states) {
  const index_t P = d.width, N = d.state;
  for (int k = k0; k < k1; ++k)
    h_start_.emplace_back(std::string(keep_ ? "ash::blockwise::h_block_start" : "ash::blockwise::h_carry"),
                          keep_ ? blocks.n : index_t(1), Bt * P, N);
  if (keep_) h_run_ = View2<S>("ash::blockwise::h_run", Bt * P, N);
}

template <class S>
View2<S> BlockwiseForward<S>::state_before(int k, index_t j) const {
  require(keep_ || j == 0, "BlockwiseForward: block states are not kept");
  return Kokkos::subview(h_start_.at(std::size_t(k - k0_)), j, Kokkos::ALL(), Kokkos::ALL());
}

template <class S>
void BlockwiseForward<S>::start_from(int k, const View2<S>& h0, const ExecSpace& exec) {
  Kokkos::deep_copy(exec, state_before(k, 0), h0);
}

template <class S>
View2<S> BlockwiseForward<S>::advance(const LayerParams<S>& p, int k, index_t j, const View2<S>& y,
                                      const LayerActivations<S>& act, const View2<S>& yo, const ExecSpace& exec) {
  if (!keep_) {  // the running state in place
    const View2<S> h = state_before(k, 0);
    ssm_layer_forward(p, shape(j), y, act, yo, h, exec);
    return h;
  }
  Kokkos::deep_copy(exec, h_run_, state_before(k, j));
  ssm_layer_forward(p, shape(j), y, act, yo, h_run_, exec);
  if (j + 1 < blocks_.n) Kokkos::deep_copy(exec, state_before(k, j + 1), h_run_);
  return h_run_;
}

template <class S>
View2<S> BlockwiseForward<S>::replay(const LayerParams<S>& p, int k, index_t j, const View2<S>& y,
                                     const LayerActivations<S>& act, const View2<S>& yo, const ExecSpace& exec,
                                     const View2<S>& from) const {
  require(keep_, "BlockwiseForward: block states are not kept");
  Kokkos::deep_copy(exec, h_run_, from.extent(0) > 0 ? from : state_before(k, j));
  ssm_layer_forward(p, shape(j), y, act, yo, h_run_, exec);
  return h_run_;
}

template class BlockwiseForward<float>;
template class BlockwiseForward<double>;

}  // namespace ash
