#include "ash/distributed/sharded_io.hpp"

#include "ash/core/error.hpp"

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
