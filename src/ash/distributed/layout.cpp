#include "ash/distributed/layout.hpp"

#include <string>

#include "ash/core/error.hpp"

namespace ash::dist {

Layout Layout::from_settings(const Settings& st, int world_rank, int world_size) {
  Layout l;
  l.world_rank = world_rank;
  l.world_size = world_size;
  const auto R = st.dist.layer_ranks;
  const auto Dcfg = st.dist.data_ranks;
  const auto Sq = st.dist.seq_ranks;
  const auto K = st.model.layers;
  const auto T = st.data.seq_len;
  require(Sq >= 1 && Sq <= T, "dist.seq_ranks = " + std::to_string(Sq) +
                                  " would leave a token range empty (data.seq_len = " + std::to_string(T) + ")");
  require(R >= 1 && R <= K, "dist.layer_ranks = " + std::to_string(R) + " does not fit model.layers = " +
                                std::to_string(K) + " (each layer rank needs at least one layer)");
  require(world_size % (R * Sq) == 0,
          "the world has " + std::to_string(world_size) +
              " ranks, not a multiple of dist.layer_ranks × dist.seq_ranks = " + std::to_string(R * Sq));
  const std::int64_t D = Dcfg > 0 ? Dcfg : world_size / (R * Sq);
  require(R * Sq * D == world_size, "dist.layer_ranks × dist.seq_ranks × dist.data_ranks = " + std::to_string(R) +
                                        " × " + std::to_string(Sq) + " × " + std::to_string(D) + " = " +
                                        std::to_string(R * Sq * D) + ", but the world has " +
                                        std::to_string(world_size) + " ranks");
  const auto B = st.data.batch;
  require(B >= D, "data.batch = " + std::to_string(B) + " windows cannot be shared by dist.data_ranks = " +
                      std::to_string(D) + " replicas (each needs at least one window)");
  l.R = int(R);
  l.D = int(D);
  l.S = int(Sq);
  return l.for_rank(world_rank);
}

Layout Layout::for_rank(int w) const {
  Layout l = *this;  // w = (d·R + r)·S + s
  l.world_rank = w;
  l.seq_rank = w % S;
  l.layer_rank = (w / S) % R;
  l.data_rank = w / (S * R);
  return l;
}

Grid::Grid(const Settings& st, MPI_Comm world) : world_(world) {
  int r = 0, n = 1;
  MPI_Comm_rank(world, &r);
  MPI_Comm_size(world, &n);
  lay_ = Layout::from_settings(st, r, n);
  int dims[3] = {lay_.D, lay_.R, lay_.S}, periods[3] = {0, 0, 0};
  MPI_Cart_create(world, 3, dims, periods, /*reorder=*/0, &cart_);
  int keep_layers[3] = {0, 1, 0}, keep_data[3] = {1, 0, 0}, keep_seq[3] = {0, 0, 1}, keep_rep[3] = {1, 0, 1};
  MPI_Cart_sub(cart_, keep_layers, &layer_comm_);
  MPI_Cart_sub(cart_, keep_data, &data_comm_);
  MPI_Cart_sub(cart_, keep_seq, &seq_comm_);
  MPI_Cart_sub(cart_, keep_rep, &replica_comm_);
  MPI_Comm_split(seq_comm_, 0, lay_.S - 1 - lay_.seq_rank, &seq_rev_);
  int lr = 0, dr = 0, sr = 0;
  MPI_Comm_rank(layer_comm_, &lr);
  MPI_Comm_rank(data_comm_, &dr);
  MPI_Comm_rank(seq_comm_, &sr);
  require(lr == lay_.layer_rank && dr == lay_.data_rank && sr == lay_.seq_rank,
          "MPI_Cart_sub gave an unexpected rank order");
}

Grid::~Grid() {
  for (MPI_Comm* c : {&seq_rev_, &replica_comm_, &seq_comm_, &data_comm_, &layer_comm_, &cart_})
    if (*c != MPI_COMM_NULL) MPI_Comm_free(c);
}

}  // namespace ash::dist
