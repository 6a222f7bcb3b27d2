#include "ash/model/forward.hpp"

#include <string>
#include <utility>

#include "ash/core/error.hpp"

namespace ash {

template <class S>
ActivationStore<S>::ActivationStore(const SeqShape& s, const ModelDims& d, int k0, int k1, Store keep,
                                    bool keep_acts)
    : s_(s), d_(d), k0_(k0), k1_(k1) {
  require(0 <= k0 && k0 <= k1 && k1 <= d.layers, "ActivationStore: layer range out of bounds");
  for (int k = k0; k <= k1; ++k) ys_.push_back(View2<S>(std::string(k == k0 ? "ash::store::y_in" : "ash::store::y"), s.rows(), d.width));
  if (keep_acts)
    for (int k = k0; k < k1; ++k) {
      if (d.mamba())
        mamba_acts_.emplace_back(s, d, keep);
      else
        acts_.emplace_back(s, d, keep);
    }
}

template <class S>
bool ActivationStore<S>::fits(const SeqShape& s, const ModelDims& d, int k0, int k1) const {
  if (s.batch != s_.batch || s.T != s_.T || !(d == d_) || k0 != k0_ || k1 != k1_) return false;
  for (const auto& y : ys_)
    if (y.extent(0) == 0) return false;  // released
  return true;
}

template <class S>
void ActivationStore<S>::rebind(const SeqShape& s) {
  require(s.batch == s_.batch && s.T == s_.T, "ActivationStore::rebind: windows of another shape");
  s_ = s;  // the new windows' document starts; every buffer is the same
}

template <class S>
const MambaActivations<S>& ActivationStore<S>::mamba_scratch() {
  if (!has_mamba_scratch_) {
    mamba_scratch_ = MambaActivations<S>(s_, d_, LayerActivations<S>::projections_only);
    has_mamba_scratch_ = true;
  }
  return mamba_scratch_;
}

template <class S>
const LayerActivations<S>& ActivationStore<S>::scratch() {
  if (!has_scratch_) {
    scratch_ = LayerActivations<S>(s_, d_, LayerActivations<S>::projections_only);
    has_scratch_ = true;
  }
  return scratch_;
}

template <class S>
const LayerActivations<S>& ActivationStore<S>::activations(const LayerParams<S>& p, int k, const ExecSpace& exec) {
  if (keeps_acts()) return kept(k);
  const auto& act = scratch();
  ssm_layer_project(p, input(k), act, exec);
  return act;
}

template <class S>
void ActivationStore<S>::release(int k) {
  ys_.at(k - k0_) = View2<S>();
  if (!acts_.empty()) acts_.at(k - k0_) = LayerActivations<S>();
  if (!mamba_acts_.empty()) mamba_acts_.at(k - k0_) = MambaActivations<S>();
  if (k == k0_) {  // no block is recomputed after the range's first
    mamba_scratch_ = MambaActivations<S>();
    has_mamba_scratch_ = false;
  }
}

template <class S>
void forward_layers(const ParamSet<S>& params, ActivationStore<S>& store, const ExecSpace& exec) {
  const auto& s = store.shape();
  if (store.mamba()) {
    for (int k = store.k0(); k < store.k1(); ++k)
      with_mamba_block(params, k, [&](const auto& p) {
        mamba_layer_forward(p, params.dims(), s, store.input(k),
                            store.keeps_acts() ? store.kept_mamba(k) : store.mamba_scratch(), store.input(k + 1), exec);
      });
    return;
  }
  for (int k = store.k0(); k < store.k1(); ++k)
    ssm_layer_forward(params.layer(k), s, store.input(k), store.keeps_acts() ? store.kept(k) : store.scratch(),
                      store.input(k + 1), View2<S>(), exec);
}

namespace {
template <class S>
double forward_loss_impl(const ParamSet<S>& params, const TokenView& x, index_t head_chunk,
                         std::vector<View2<S>>* state, const TokenView& x_head, index_t targets) {
  const auto& d = params.dims();
  const SeqShape s = SeqShape::of(x);
  if (state) check_carried_state(*state, d, d.layers, s.batch);
  View2<S> y("ash::fwd::y", s.rows(), d.width);
  View2<S> y_next("ash::fwd::y_next", s.rows(), d.width);
  embedding_forward(params.global().embedding, x, y);
  if (d.mamba()) {
    const MambaActivations<S> act(s, d, LayerActivations<S>::projections_only);
    const MambaState<S> run = state ? MambaState<S>(s.batch, d) : MambaState<S>();
    for (int k = 0; k < d.layers; ++k) {
      with_mamba_block(params, k, [&](const auto& p) {
        if (state) {  // the carried form: from the state, which then holds the state after x
          mamba_state_from_carried((*state)[std::size_t(k)], run);
          mamba_layer_forward(p, d, s, y, act, y_next, run);
          mamba_state_to_carried(run, (*state)[std::size_t(k)]);
        } else {
          mamba_layer_forward(p, d, s, y, act, y_next);
        }
      });
      std::swap(y, y_next);
    }
    return head_loss<S>(params.global(), x_head, y, View2<S>(), nullptr, head_chunk, targets);
  }
  const LayerActivations<S> act(s, d, LayerActivations<S>::projections_only);
  for (int k = 0; k < d.layers; ++k) {
    ssm_layer_forward(params.layer(k), s, y, act, y_next, state ? (*state)[k] : View2<S>());
    std::swap(y, y_next);
  }
  return head_loss<S>(params.global(), x_head, y, View2<S>(), nullptr, head_chunk, targets);
}
}  // namespace

namespace {
// One carried [Bt·C, Kc−1+N] view (the conv's columns, then h's in the rows of
// the scan's E channels: all rows but a Mamba-2's B and C channels, whose h
// columns are 0) and a MambaState: copied into the state, or out of it when to_carried.
template <class S>
void copy_carried(const View2<S>& carried, const MambaState<S>& st, bool to_carried, const ExecSpace& exec) {
  const View2<S> conv = st.conv, ssm = st.ssm;
  const index_t Kc1 = conv.extent(1), N = ssm.extent(1);
  require(st.batch > 0 && carried.extent(0) == conv.extent(0) && index_t(carried.extent(1)) == Kc1 + N,
          "carried state: expected [batch·C, Kc-1+N] per Mamba layer");
  const index_t C = conv.extent(0) / st.batch, E = ssm.extent(0) / st.batch;
  Kokkos::parallel_for(
      "ash::mamba::copy_carried", Range2(exec, {0, 0}, {index_t(carried.extent(0)), Kc1 + N}),
      KOKKOS_LAMBDA(const index_t r, const index_t c) {
        const index_t b = r / C, ch = r % C;
        if (c >= Kc1 && ch >= E) {  // no h: the channel is not a scan channel
          if (to_carried) carried(r, c) = S(0);
          return;
        }
        S& part = c < Kc1 ? conv(r, c) : ssm(b * E + ch, c - Kc1);
        if (to_carried)
          carried(r, c) = part;
        else
          part = carried(r, c);
      });
}
}  // namespace

template <class S>
void mamba_state_from_carried(const View2<S>& carried, const MambaState<S>& st, const ExecSpace& exec) {
  copy_carried(carried, st, false, exec);
}

template <class S>
void mamba_state_to_carried(const MambaState<S>& st, const View2<S>& carried, const ExecSpace& exec) {
  copy_carried(carried, st, true, exec);
}

template <class S>
void check_carried_state(const std::vector<View2<S>>& state, const ModelDims& d, index_t layers, index_t batch) {
  const index_t R = batch * d.carry_rows(), C = d.carry_cols();
  require(index_t(state.size()) == layers, "carried state: expected one state per layer (" + std::to_string(layers) +
                                               "), got " + std::to_string(state.size()));
  const std::string shape = d.mamba2() ? "[batch·C, Kc-1+N] = [" : d.mamba() ? "[batch·E, Kc-1+N] = [" : "[batch·P, N] = [";
  for (const auto& h : state)
    require(index_t(h.extent(0)) == R && index_t(h.extent(1)) == C,
            "carried state: expected " + shape + std::to_string(R) + ", " + std::to_string(C) + "] per layer, got [" +
                std::to_string(h.extent(0)) + ", " + std::to_string(h.extent(1)) + "]");
}

template <class S>
double forward_loss(const ParamSet<S>& params, const TokenView& x, index_t head_chunk) {
  return forward_loss_impl<S>(params, x, head_chunk, nullptr, x, 0);
}

template <class S>
double forward_loss(const ParamSet<S>& params, const TokenView& x, index_t head_chunk, std::vector<View2<S>>& state,
                    const TokenView& x_head, index_t targets) {
  return forward_loss_impl<S>(params, x, head_chunk, &state, x_head, targets);
}

template <class S>
ForwardTape<S> forward_tape(const ParamSet<S>& params, const TokenView& x, const GlobalParams<S>* head_grad,
                            typename LayerActivations<S>::Store store, bool keep_acts, index_t head_chunk) {
  const auto& d = params.dims();
  require(!(d.mamba() && keep_acts), "forward_tape: kept activations are an SSM-ResNet's (a Mamba keeps MambaActivations)");
  const SeqShape s = SeqShape::of(x);
  ActivationStore<S> st(s, d, 0, int(d.layers), store, keep_acts);
  embedding_forward(params.global().embedding, x, st.input(0));
  forward_layers(params, st);
  ForwardTape<S> tape;
  for (int k = 0; k <= d.layers; ++k) tape.ys.push_back(st.input(k));
  if (keep_acts)
    for (int k = 0; k < d.layers; ++k) tape.acts.push_back(st.kept(k));
  tape.g = View2<S>("ash::tape::g", s.rows(), d.width);
  tape.loss = head_loss<S>(params.global(), x, tape.ys[d.layers], tape.g, head_grad, head_chunk);
  return tape;
}

#define ASH_INSTANTIATE(S)                                                                                  \
  template class ActivationStore<S>;                                                                       \
  template void forward_layers<S>(const ParamSet<S>&, ActivationStore<S>&, const ExecSpace&);              \
  template double forward_loss<S>(const ParamSet<S>&, const TokenView&, index_t);                          \
  template double forward_loss<S>(const ParamSet<S>&, const TokenView&, index_t, std::vector<View2<S>>&,     \
                                  const TokenView&, index_t);                                              \
  template void mamba_state_from_carried<S>(const View2<S>&, const MambaState<S>&, const ExecSpace&);           \
  template void mamba_state_to_carried<S>(const MambaState<S>&, const View2<S>&, const ExecSpace&);             \
  template void check_carried_state<S>(const std::vector<View2<S>>&, const ModelDims&, index_t, index_t);      \
  template ForwardTape<S> forward_tape<S>(const ParamSet<S>&, const TokenView&, const GlobalParams<S>*,     \
                                          typename LayerActivations<S>::Store, bool, index_t);
ASH_INSTANTIATE(float)
ASH_INSTANTIATE(double)

}  // namespace ash
