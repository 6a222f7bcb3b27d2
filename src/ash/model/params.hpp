#pragma once
// Parameters of the model (docs/design.md §1; SSM-ResNet or Mamba, model.arch) in one flat device View.
//
// Every tensor is a slice of `data`, so a gradient, an Adam moment or a
// checkpoint is the same ParamSet layout, and flat operations (norms, axpy,
// cosine per group) need no per-tensor code. Tensor names are the checkpoint
// paths of docs/design.md §5: embedding, final_norm, head, layers/000/norm, ...
#include <string>
#include <vector>

#include "ash/core/config.hpp"
#include "ash/core/types.hpp"

namespace ash {

struct TensorInfo {
  std::string name;                 // checkpoint path under /params
  std::vector<std::int64_t> shape;  // row-major, [rows] or [rows, cols]
  index_t offset = 0;               // into ParamSet::data
  bool decay = false;               // AdamW's weight decay applies (the layout's matrices, as each architecture's reference decays them)
  index_t size() const {
    index_t s = 1;
    for (auto d : shape) s *= d;
    return s;
  }
};

// Views of one layer's parameters θ_k (unmanaged slices of ParamSet::data).
template <class S>
struct LayerParams {
  Unmanaged1<S> norm;     // w      [P]
  Unmanaged2<S> W_delta;  // Wδ     [P, P] (output, input)
  Unmanaged1<S> b_delta;  // bδ     [P]
  Unmanaged2<S> A_log;    // Alog   [P, N]
  Unmanaged2<S> W_B;      // WB     [N, P]
  Unmanaged2<S> W_C;      // WC     [N, P]
  Unmanaged1<S> D;        // D      [P]
};

// Views of one Mamba block's parameters (model.arch = "mamba", docs/design.md §1):
// the tensors of transformers' MambaBlock, the row blocks of in_proj and x_proj
// as separate views (row ranges of a row-major matrix are contiguous).
template <class S>
struct MambaLayerParams {
  Unmanaged1<S> norm;         // w        [D]
  Unmanaged2<S> in_x, in_z;   // in_proj  [2E, D]: rows [0, E) give x, [E, 2E) the gate z
  Unmanaged2<S> conv_weight;  // w_conv   [E, Kc] (tap Kc-1 multiplies the current token)
  Unmanaged1<S> conv_bias;    // b_conv   [E]
  Unmanaged2<S> x_dt, x_B, x_C;  // x_proj [R+2N, E]: rows [0, R) Δ's low rank, then B [N], then C [N]
  Unmanaged2<S> dt_proj;      // W_dt     [E, R]
  Unmanaged1<S> dt_bias;      // b_dt     [E]
  Unmanaged2<S> A_log;        // Alog     [E, N]
  Unmanaged1<S> D;            // D        [E]
  Unmanaged2<S> out_proj;     // W_out    [D, E]
};

// Views of one Mamba-2 block's parameters (model.arch = "mamba2", docs/design.md §1):
// the tensors of transformers' Mamba2Block, in_proj's row blocks as separate views.
// C = E + 2·G·N, the conv's channels (x, then B, then C); H heads of head_dim channels.
template <class S>
struct Mamba2LayerParams {
  Unmanaged1<S> norm;          // w        [D]
  Unmanaged2<S> in_z, in_xbc, in_dt;  // in_proj [E+C+H, D]: rows [0, E) the gate z, [E, E+C) x|B|C, then Δ per head
  Unmanaged2<S> conv_weight;   // w_conv   [C, Kc]
  Unmanaged1<S> conv_bias;     // b_conv   [C]
  Unmanaged1<S> dt_bias;       // b_dt     [H]
  Unmanaged1<S> A_log;         // Alog     [H]: a_h = −exp(Alog_h), every state of the head
  Unmanaged1<S> D;             // D        [H]
  Unmanaged1<S> gated_norm;    // w_g      [E]
  Unmanaged2<S> out_proj;      // W_out    [D, E]
};

template <class S>
struct GlobalParams {
  Unmanaged2<S> embedding;   // E  [V, P]
  Unmanaged1<S> final_norm;  // w_f [P]
  Unmanaged2<S> head;        // Ω  [V, P]; a Mamba with tied embeddings: the embedding's own View
  double norm_eps = 1e-5;    // the final RMSNorm's epsilon (model.norm_eps of a Mamba)
};

// The part of the model one ParamSet holds (docs/design.md §2, E4): layers
// [k0, k1), the embedding when it is the first block, the final norm and head
// when it is the last (a Mamba with tied embeddings: the last block holds a
// copy of the embedding, its head). A rank of a layer-sharded run allocates
// only its range.
struct LayerRange {
  int k0 = 0, k1 = 0;
  bool embedding = true, head = true;
  static LayerRange all(const ModelDims& d) { return {0, int(d.layers), true, true}; }
  // Block r of R contiguous blocks; the first K mod R blocks get one layer more.
  static LayerRange block(const ModelDims& d, int r, int R);
  bool owns(int k) const { return k >= k0 && k < k1; }
  bool is_all(const ModelDims& d) const { return k0 == 0 && k1 == int(d.layers) && embedding && head; }
  bool operator==(const LayerRange& o) const {
    return k0 == o.k0 && k1 == o.k1 && embedding == o.embedding && head == o.head;
  }
};

template <class S>
class ParamSet {
 public:
  ParamSet() = default;
  explicit ParamSet(const ModelDims& dims) : ParamSet(dims, LayerRange::all(dims)) {}  // zero-filled
  ParamSet(const ModelDims& dims, const LayerRange& range);                           // only that range

  const ModelDims& dims() const { return dims_; }
  const LayerRange& range() const { return range_; }
  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  const TensorInfo& tensor(const std::string& name) const;
  index_t size() const { return data_.extent(0); }
  View1<S> data() const { return data_; }

  Unmanaged1<S> flat(const TensorInfo& t) const { return Unmanaged1<S>(data_.data() + t.offset, t.size()); }
  // Layer k by its global index (must be in range()); an SSM-ResNet's.
  LayerParams<S> layer(int k) const;
  // Layer k of a Mamba-1 block (model.arch = "mamba" or "falcon_mamba").
  MambaLayerParams<S> mamba_layer(int k) const;
  // Layer k of a Mamba-2 (model.arch = "mamba2").
  Mamba2LayerParams<S> mamba2_layer(int k) const;
  // Embedding, final norm and head; the ones outside range() are empty Views.
  GlobalParams<S> global() const { return global_; }

  void fill_zero() const;
  // Deep copy of the values (the layouts must match).
  void copy_from(const ParamSet& other) const;
  ParamSet clone() const;

 private:
  ModelDims dims_;
  LayerRange range_;
  std::vector<TensorInfo> tensors_;
  View1<S> data_;
  std::vector<LayerParams<S>> layers_;
  std::vector<MambaLayerParams<S>> mamba_layers_;
  std::vector<Mamba2LayerParams<S>> mamba2_layers_;
  GlobalParams<S> global_;
};

// Documented, seeded initialisation (docs/design.md §1). An SSM-ResNet (Mamba-like):
//   embedding ~ N(0, 0.02²); head, W_delta, W_B, W_C ~ U(±1/sqrt(P));
//   Δ0 = exp(U(log 1e-3, log 1e-1)), b_delta = softplus⁻¹(Δ0);
//   A_log[p, n] = log(n + 1) (n 0-based); D = 1; norm = final_norm = 1.
// A Mamba as transformers' MambaPreTrainedModel._init_weights with MambaConfig's
// defaults (initializer_range 0.1, time_step_* 1e-3 / 0.1 / floor 1e-4 / scale 1,
// rescale_prenorm_residual false):
//   embedding, head, in_proj, x_proj ~ N(0, 0.1²); conv_weight ~ U(±1/sqrt(Kc));
//   conv_bias = 0; dt_proj ~ U(±1/sqrt(R)); Δ0 = max(exp(U(log 1e-3, log 1e-1)), 1e-4),
//   dt_bias = softplus⁻¹(Δ0); A_log[e, n] = log(n + 1); D = 1; out_proj ~ U(±1/sqrt(E));
//   norm = final_norm = 1.
// A Mamba-2 as transformers' Mamba2PreTrainedModel._init_weights (Mamba2Config's
// initializer_range 0.1, time_step_* as above): embedding, head, in_proj ~ N(0, 0.1²);
//   conv_weight ~ U(±1/sqrt(Kc)); conv_bias = 0; dt_bias = softplus⁻¹(Δ0) per head;
//   A_log[h] = log(h + 1); D = 1; out_proj ~ U(±1/sqrt(E)); norm = gated_norm = final_norm = 1.
// Random numbers come from a 64-bit Mersenne twister with our own
// uniform/normal transforms, so the values are the same on every platform.
template <class S>
void initialize(const ParamSet<S>& params, std::uint64_t seed);

// Names, shapes and offsets of every tensor of a range, in storage order.
std::vector<TensorInfo> param_layout(const ModelDims& dims);
std::vector<TensorInfo> param_layout(const ModelDims& dims, const LayerRange& range);

// Number of parameters of the whole model.
index_t parameter_count(const ModelDims& dims);

// Layer name helper: "layers/007/".
std::string layer_prefix(int k);

}  // namespace ash
