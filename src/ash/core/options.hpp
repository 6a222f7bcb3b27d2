#pragma once
// The typed configuration (docs/design.md §4): every key of the JSON
// configuration parsed and validated once (Config::settings()) into these
// structs; nothing below the CLI reads a string key.
#include <cstdint>
#include <string>

#include "ash/core/types.hpp"

namespace ash {

// model.arch (docs/design.md §1): today's SSM-ResNet layer, the Mamba block
// of transformers' MambaForCausalLM (pre-norm RMSNorm, in_proj, causal conv,
// SiLU, low-rank Δ, the same selective scan, gate, out_proj, residual), or
// FalconMambaForCausalLM's (the same block with weightless RMSNorms on x_proj's
// δ, B and C outputs), or Mamba2ForCausalLM's (the SSD block: in_proj to z, the
// conv's x, B, C and a Δ per head, a scalar decay per head, a gated RMSNorm).
enum class Arch { ssm_resnet, mamba, falcon_mamba, mamba2 };
// "ssm-resnet", "mamba", "falcon_mamba" or "mamba2" (the config's spelling: transformers' model_type).
std::string arch_name(Arch a);
// The reverse; throws ash::Error naming model.arch for anything else.
Arch parse_arch(const std::string& s);

struct ModelDims {
  std::int64_t vocab = 256;   // V
  std::int64_t width = 64;    // P (SSM-ResNet), D (Mamba: hidden size)
  std::int64_t state = 16;    // N
  std::int64_t layers = 2;    // K
  std::uint64_t seed = 1234;  // initialisation seed
  Arch arch = Arch::ssm_resnet;
  // Mamba-1 blocks only (model.arch = "mamba" or "falcon_mamba"; an SSM-ResNet keeps the defaults):
  std::int64_t expand = 2;        // E = expand · D, the mixer's inner width
  std::int64_t conv_kernel = 4;   // Kc, the causal depthwise conv's taps
  std::int64_t dt_rank = 0;       // R, the rank of Δ's projection; 0: ceil(D / 16)
  bool tie_embeddings = true;     // the head is the embedding (no /params/head)
  double norm_eps = 1e-5;         // the RMSNorms' epsilon
  // FalconMamba only (the others keep the default):
  double mixer_rms_eps = 1e-6;    // the weightless RMSNorms' epsilon (transformers' mixer_rms_eps)
  // Mamba-2 only (the others keep the defaults); E = expand·D = heads·head_dim:
  std::int64_t head_dim = 64;     // P, the channels of a head
  std::int64_t heads = 0;         // H; 0: E / head_dim
  std::int64_t n_groups = 1;      // G, the groups of B and C (and of the gated norm)
  double time_step_limit_min = 0;  // Δ clamped to [min, max] after softplus (transformers' time_step_limit)
  double time_step_limit_max = 0;  // 0: no upper limit (transformers' inf)
  // A Mamba block (mamba, falcon_mamba or mamba2): MambaActivations, MambaState,
  // the conv's state and the scan over E channels; the engines' forms of MambaKind.
  bool mamba() const { return arch == Arch::mamba || arch == Arch::falcon_mamba || arch == Arch::mamba2; }
  // The block normalises δ, B and C after x_proj (FalconMamba).
  bool mixer_norms() const { return arch == Arch::falcon_mamba; }
  // The Mamba-2 (SSD) block.
  bool mamba2() const { return arch == Arch::mamba2; }
  std::int64_t head_count() const { return heads > 0 ? heads : inner() / head_dim; }  // H
  // The conv's channels: x of a Mamba-1 block [E]; x, B and C of a Mamba-2 block [E + 2·G·N].
  std::int64_t conv_dim() const { return mamba2() ? inner() + 2 * n_groups * state : inner(); }
  // The head is the embedding's matrix (a Mamba with model.tie_embeddings; an
  // SSM-ResNet always has its own /params/head): a layer pipeline's last rank
  // holds a copy of the embedding.
  bool tied_head() const { return mamba() && tie_embeddings; }
  std::int64_t inner() const { return expand * width; }                          // E
  std::int64_t rank() const { return dt_rank > 0 ? dt_rank : (width + 15) / 16; }  // R
  // One layer's carried state (data.carry_state, /train/carry_state, docs/design.md §8) is
  // [batch · carry_rows(), carry_cols()]: an SSM-ResNet's h, rows b·P + p, N columns; a
  // Mamba's MambaState side by side, rows b·E + e, the conv's Kc−1 inputs then h's N.
  // (A Mamba-2's rows are its conv's channels, E + 2·G·N: h fills the first E rows' N columns.)
  std::int64_t carry_rows() const { return mamba() ? conv_dim() : width; }
  std::int64_t carry_cols() const { return mamba() ? conv_kernel - 1 + state : state; }
  bool operator==(const ModelDims& o) const {
    return vocab == o.vocab && width == o.width && state == o.state && layers == o.layers && arch == o.arch &&
           expand == o.expand && conv_kernel == o.conv_kernel && dt_rank == o.dt_rank &&
           tie_embeddings == o.tie_embeddings && norm_eps == o.norm_eps && mixer_rms_eps == o.mixer_rms_eps &&
           head_dim == o.head_dim && heads == o.heads && n_groups == o.n_groups &&
           time_step_limit_min == o.time_step_limit_min && time_step_limit_max == o.time_step_limit_max;
  }
};

// The per-layer gradient method (grad.engine, docs/design.md §2): E1, E2, E3.
enum class Method { backprop, adjoint, adjoint_exact };
// "backprop", "adjoint", "adjoint-exact" (the config's spelling).
std::string method_name(Method m);
// The reverse; throws ash::Error naming grad.engine for anything else.
Method parse_method(const std::string& s);

// How the engine keeps the activations it stores between forward and backward
// (run.storage, docs/design.md §8): the compute type, bf16 or fp16.
enum class Storage { full, bf16, fp16 };
// "float" (full), "bf16" or "fp16"; throws ash::Error naming run.storage for anything else.
Storage parse_storage(const std::string& s);
std::string storage_name(Storage s);
// Bytes of one stored number (full: sizeof the compute type).
inline std::size_t storage_bytes(Storage s, std::size_t scalar_bytes) { return s == Storage::full ? scalar_bytes : 2; }

// How the dense products multiply in float (run.matmul, docs/design.md §6): fp32
// exactly; tf32 and bf16 round both inputs of every product to 10 or 7 mantissa bits
// and accumulate in FP32, as tensor cores do (ash/kernels/matmul.hpp).
enum class Matmul { fp32, tf32, bf16 };
// "fp32", "tf32" or "bf16"; throws ash::Error naming run.matmul for anything else.
Matmul parse_matmul(const std::string& s);
std::string matmul_name(Matmul m);

// data.*
struct DataOptions {
  std::string train;             // token file
  double valid_fraction = 0.05;  // tail of the file held out
  index_t seq_len = 256;         // T
  index_t batch = 4;             // windows per step
  bool sequential = false;       // consecutive windows instead of random ones
  bool carry_state = false;      // windows start from the previous window's state (needs sequential)
  std::string separator;         // bytes that end a document ("" = no documents); docs/design.md §1
  bool pack = false;             // whole documents packed into windows (needs separator)
};

// grad.* (and run.storage, data.carry_state: the engine's memory levers).
struct EngineOptions {
  Method method = Method::backprop;
  index_t truncate = 0;        // T̄; 0 = the full window T
  bool detach_inputs = false;  // stop-gradient on every layer input
  index_t chunk = 64;          // E3 chunk length C
  index_t wave = 0;            // E3: tokens whose A, h, μ are recomputed at once; 0: auto (e3_wave_length)
  index_t head_chunk = 0;      // tokens per head chunk (T×V logits never whole); 0: auto (head_chunk_rows)
  // E3's h replay (C++ API only; docs/design.md §6): chunk-parallel from the
  // chunk-boundary states (a GPU's form), or sequential through each
  // sequence's waves from a running state (a host's form). Defaults to the
  // backend's form; tests run the other one too.
  bool e3_chunked_h = !host_backend;
  // E3's per-token state VJPs fused into per-chunk kernels (C++ API only;
  // docs/design.md §6): h, A and μ of a chunk stay in team scratch instead of
  // [wave, P, N] buffers, with either h form. Exact and detached modes (a
  // window keeps the wave buffers). On by default; tests run both. For a
  // Mamba-2 it selects the SSD's chunked matrix form (model/ssd_scan.hpp), off
  // the per-channel wave form.
  bool e3_fused = true;
  // Within the fused form, E3's reverse walk (grad/impl/e3_walk.hpp; C++ API
  // and the benches only): a team per (sequence, chunk) over every channel,
  // threads over tokens with a two-level scan, one exp serving h and μ, the
  // channel sums in scratch. Off by default until a GPU measures it.
  bool e3_walk = false;
  // A kind's scan core (a Mamba's, a FalconMamba's) on a whole window or a token block in the
  // fused form (or the walk) as well, not the wave form (C++ API and the
  // benches): a GPU's default; on a host the waves are faster (one forward
  // scan fewer). Tests run both.
  bool e3_scan_fused = !host_backend;
  // The local engine (no memory lever) keeps its layer inputs, g and the layer
  // method's workspace between compute calls on windows of one shape (C++ API
  // and the benches): a warm call then allocates and zero-fills almost
  // nothing, as a framework's caching allocator does. The memory stays held
  // until the engine is destroyed or the shape changes, so the peak grows by
  // what a call allocates beside it (the head's chunk buffers) and by y_K,
  // held through the backward.
  bool keep_buffers = false;
  index_t e3_channel_block = 0;  // the fused form's channels per team, the walk's per step (0: auto)
  index_t e3_fused_launch = 0;   // the fused form's tokens per kernel launch within a wave (0: auto, e3_fused_waves)
  // The memory levers of docs/design.md §8 (E3 only; any of them selects the
  // block-wise engine of ash/grad/blockwise_engine.hpp):
  Storage storage = Storage::full;  // how kept layer inputs are stored (run.storage)
  Matmul matmul = Matmul::fp32;     // how the dense products multiply (run.matmul; not a memory lever)
  index_t layer_checkpoint = 1;     // keep every m-th layer input, recompute the rest (resolved: >= 1)
  index_t token_block = 0;          // tokens per block of the block-wise pass (0: auto)
  bool carry_state = false;         // windows start from the previous window's state (data.carry_state)

  // Whether a memory lever or a carried state is set: either selects the block-wise E3.
  bool blockwise_levers() const {
    return storage != Storage::full || layer_checkpoint != 1 || token_block > 0 || carry_state;
  }
  bool exact_adjoint() const { return method == Method::adjoint_exact; }
  // The grad.* keys of a Config (Config::settings().grad).
  static EngineOptions from_config(const class Config& cfg);
};

// optim.*: AdamW with warm-up and cosine decay (ash/train/optimizer.hpp).
struct AdamWOptions {
  double lr = 3e-3;
  double weight_decay = 0.1;  // decoupled; matrices only (TensorInfo::decay)
  double beta1 = 0.9, beta2 = 0.95, eps = 1e-8;
  double clip = 1.0;          // max global L2 norm of the gradient; <= 0: off
  std::int64_t warmup = 50;   // linear warm-up steps
  std::int64_t steps = 1000;  // schedule length (cosine to min_lr_ratio·lr)
  double min_lr_ratio = 0.1;
  static AdamWOptions from_config(const class Config& cfg);
};

// run.*
struct RunOptions {
  std::string out_dir = "run";
  std::int64_t log_every = 10, eval_every = 100, ckpt_every = 200;
  bool double_precision = false;  // run.precision: "double" (else "float")
  std::size_t scalar_bytes() const { return double_precision ? 8 : 4; }
  std::string precision() const { return double_precision ? "double" : "float"; }
};

// dist.*: the MPI rank layout asked for (dist::Layout is the one resolved
// against the world size).
struct DistOptions {
  index_t layer_ranks = 1;      // R
  index_t data_ranks = 0;       // D; 0: world / (R·S)
  index_t seq_ranks = 1;        // S
  index_t pipeline_blocks = 0;  // token blocks per window of the E3 pipeline (0: 4 per layer rank)
  // True when more than one rank is asked for.
  bool multi_rank() const { return layer_ranks > 1 || seq_ranks > 1 || data_ranks > 1; }
};

// The whole configuration, validated.
struct Settings {
  ModelDims model;
  DataOptions data;
  EngineOptions grad;
  AdamWOptions optim;
  RunOptions run;
  DistOptions dist;
};

}  // namespace ash
