#include "ash/distributed/sharded_io.hpp"

#include "ash/core/error.hpp"
#include "ash/distributed/collectives.hpp"
#include "ash/model/forward.hpp"

namespace ash::dist {

template <class S>
ParamSet<S> gather(const Grid& grid, const ParamSet<S>& shard) {
  const auto& lay = grid.layout();
  const auto& d = shard.dims();
  if (lay.data_rank != 0 || lay.seq_rank != 0) return ParamSet<S>();  // replicas hold the same values
  constexpr int tag = 7001;
  if (!lay.first()) {
    send(shard.data(), 0, tag, grid.layers());
    return ParamSet<S>();
  }
  ParamSet<S> full(d);
  auto put = [&](const ParamSet<S>& part) {
    for (const auto& t : part.tensors()) Kokkos::deep_copy(full.flat(full.tensor(t.name)), part.flat(t));
  };
  put(shard);
  for (int r = 1; r < lay.R; ++r) {
    ParamSet<S> part(d, LayerRange::block(d, r, lay.R));
    recv(part.data(), r, tag, grid.layers());
    put(part);
  }
  return full;
}

namespace {

// The whole carried state on world rank 0: each rank contributes its layers'
// rows of its windows (the rest zero), summed over the world. A window's rows:
// d.carry_rows(), each of d.carry_cols() (the kind's, ModelDims).
template <class S>
std::vector<View2<S>> gather_carry(const Grid& grid, const ModelDims& d, const std::vector<View2<S>>& carry) {
  const auto& lay = grid.layout();
  const index_t rows = carry.empty() ? 0 : carry[0].extent(0), W = d.carry_rows(), C = d.carry_cols();
  check_carried_state(carry, d, d.layers, rows / W);
  const index_t per = rows * C;
  View1<S> flat("ash::dist::carry_sum", index_t(carry.size()) * per);
  const LayerRange mine = grid.range(d);
  if (lay.seq_rank == lay.S - 1) {
    const auto w = lay.windows(rows / W);
    for (int k = mine.k0; k < mine.k1; ++k) {
      const auto part = Kokkos::subview(carry[std::size_t(k)], Kokkos::make_pair(w.first * W, w.second * W), Kokkos::ALL());
      Kokkos::deep_copy(Unmanaged2<S>(flat.data() + index_t(k) * per + w.first * W * C, part.extent(0), C), part);
    }
  }
  allreduce_sum(flat, grid.world());
  std::vector<View2<S>> whole;
  if (lay.world_rank != 0) return whole;
  for (index_t k = 0; k < index_t(carry.size()); ++k) {
    whole.emplace_back("ash::dist::carry_whole", rows, C);
    Kokkos::deep_copy(whole.back(), Unmanaged2<S>(flat.data() + k * per, rows, C));
  }
  return whole;
}

}  // namespace

template <class S>
void save_checkpoint(const Grid& grid, const std::string& path, const Config& cfg, const ParamSet<S>& params,
                     std::int64_t step, std::int64_t cursor, const OptimizerState<S>& opt) {
  const auto full = gather(grid, params);
  ParamSet<S> fm, fv;
  OptimizerState<S> whole;  // the gathered moments and the data identity
  whole.data_tokens = opt.data_tokens;
  whole.data_fingerprint = opt.data_fingerprint;
  if (opt.m && opt.v) {
    fm = gather(grid, *opt.m);
    fv = gather(grid, *opt.v);
    whole.m = &fm;
    whole.v = &fv;
    whole.step = opt.step;
  }
  std::vector<View2<S>> carry;
  if (opt.carry && !opt.carry->empty()) {
    carry = gather_carry(grid, params.dims(), *opt.carry);
    whole.carry = &carry;
  }
  run_on_root(grid.world(), [&] { ash::save_checkpoint(path, cfg, full, step, cursor, whole); });
}

template <class S>
void save_gradients(const Grid& grid, const std::string& path, const Config& cfg, double loss,
                    const ParamSet<S>& grad) {
  const auto full = gather(grid, grad);
  run_on_root(grid.world(), [&] { ash::save_gradients(path, cfg, loss, full); });
}

#define ASH_INSTANTIATE(S)                                                                                    \
  template ParamSet<S> gather<S>(const Grid&, const ParamSet<S>&);                                            \
  template void save_checkpoint<S>(const Grid&, const std::string&, const Config&, const ParamSet<S>&,        \
                                   std::int64_t, std::int64_t, const OptimizerState<S>&);                     \
  template void save_gradients<S>(const Grid&, const std::string&, const Config&, double, const ParamSet<S>&);
ASH_INSTANTIATE(float)
ASH_INSTANTIATE(double)

}  // namespace ash::dist
