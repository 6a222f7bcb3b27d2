#pragma once
// A Hugging Face `MambaForCausalLM`, `FalconMambaForCausalLM` or `Mamba2ForCausalLM`
// folder (config.json + model.safetensors, or a sharded model.safetensors.index.json)
// in our names and keys, and back (issue 34: `ash import-hf` / `ash export-hf`,
// docs/file_format.md "Hugging Face Mamba folders"). Independent of the model code:
// the configuration is a JSON fragment of our keys ({"model": {"arch": "mamba",
// "width": D, ...}}) that Config::merge takes, the tensors are plain arrays by their
// /params names ("layers/000/in_proj"). A FalconMamba's tensors and names are a
// Mamba's (its mixer norms have no weights); only its configuration differs. A
// Mamba-2 has its own tensors (one Δ, decay and D per head, the gated norm).
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "ash/io/safetensors.hpp"

namespace ash {

// One tensor in our layout: shape (row-major [out, in], as transformers'), values.
struct HfTensor {
  std::vector<std::int64_t> shape;
  std::vector<double> values;
  TensorDtype dtype = TensorDtype::f32;  // as read from the file (reading); ignored when writing
};
using HfTensors = std::map<std::string, HfTensor>;  // by our name: "embedding", "layers/000/in_proj", ...

// The sizes a Mamba (FalconMamba, Mamba-2) configuration implies.
struct MambaDims {
  std::int64_t width = 0, state = 0, layers = 0, vocab = 0, expand = 2, conv_kernel = 4;
  std::int64_t dt_rank = 0;  // as configured: 0 = ceil(width / 16) (a Mamba-2 has none)
  bool tie_embeddings = true;
  double norm_eps = 1e-5;
  bool falcon = false;          // model.arch = "falcon_mamba": FalconMambaForCausalLM
  double mixer_rms_eps = 1e-6;  // a FalconMamba's mixer norms' epsilon
  bool mamba2 = false;          // model.arch = "mamba2": Mamba2ForCausalLM
  std::int64_t head_dim = 64, heads = 0;                  // a Mamba-2's P and H (0: E / P)
  std::int64_t n_groups = 1;                              // a Mamba-2's groups of B and C
  double time_step_limit_min = 0, time_step_limit_max = 0;  // a Mamba-2's Δ clamp (max 0: none)
  // our model.arch, their model_type
  const char* arch() const { return mamba2 ? "mamba2" : falcon ? "falcon_mamba" : "mamba"; }
  const char* hf_class() const {
    return mamba2 ? "Mamba2ForCausalLM" : falcon ? "FalconMambaForCausalLM" : "MambaForCausalLM";
  }
  const char* kind() const { return mamba2 ? "Mamba2" : falcon ? "FalconMamba" : "Mamba"; }  // for messages
  std::int64_t inner() const { return expand * width; }  // E (checked when the dims are made)
  std::int64_t rank() const { return dt_rank > 0 ? dt_rank : width / 16 + (width % 16 != 0); }  // R
  std::int64_t head_count() const { return heads > 0 ? heads : inner() / head_dim; }  // H (Mamba-2)
  std::int64_t conv_dim() const { return inner() + 2 * n_groups * state; }  // C = E + 2GN: a Mamba-2's x, B, C
};

// Our keys from a parsed config.json (`origin` names it in messages): MambaConfig's
// hidden_size, state_size, num_hidden_layers, vocab_size (required) and expand,
// conv_kernel, time_step_rank ("auto" -> 0), tie_word_embeddings,
// layer_norm_epsilon (transformers' defaults when absent) become model.width,
// .state, .layers, .vocab, .expand, .conv_kernel, .dt_rank, .tie_embeddings,
// .norm_eps and model.arch = "mamba". FalconMambaConfig's (model_type
// "falcon_mamba", or no model_type and architectures ["FalconMambaForCausalLM"])
// give model.arch = "falcon_mamba" and mixer_rms_eps (1e-6 when absent) its
// model.mixer_rms_eps; its other keys are MambaConfig's. Refused (ash::Error
// naming the key): a model_type other than "mamba" or "falcon_mamba",
// architectures other than that model_type's ["MambaForCausalLM"] or
// ["FalconMambaForCausalLM"], use_bias = true, use_conv_bias = false, hidden_act other than "silu",
// intermediate_size != expand × hidden_size, rms_norm = false (mamba-ssm's
// LayerNorm), a size that is not a positive integer. Keys that change nothing we
// compute (initialisation, generation, bookkeeping, residual_in_fp32) are accepted
// and, when `ignored` is given, those transformers does not define are listed there.
// Mamba2Config's (model_type "mamba2", or no model_type and architectures
// ["Mamba2ForCausalLM"]): hidden_size, state_size, num_hidden_layers, vocab_size
// (required), expand, conv_kernel, head_dim, num_heads, n_groups,
// tie_word_embeddings, layer_norm_epsilon (Mamba2Config's defaults when absent:
// 2, 4, 64, 128, 8, false, 1e-5) and time_step_limit [min, max] (max Infinity,
// as {"__float__": "Infinity"} or Python's bare Infinity, is 0: no limit) become
// model.arch = "mamba2", .width, ..., .head_dim, .heads, .n_groups,
// .tie_embeddings, .norm_eps, .time_step_limit_min/max. Refused besides the
// Mamba's use_bias, use_conv_bias and hidden_act: n_groups other than 1,
// num_heads × head_dim != expand × hidden_size, a time_step_limit that is not
// [min >= 0, max > min or Infinity]. time_step_rank, chunk_size (the chunked
// scan's block, the same sums), residual_in_fp32 and the initialisation keys
// change nothing we compute and are accepted.
nlohmann::json hf_mamba_config_to_ash(const nlohmann::json& hf, const std::string& origin,
                                      std::vector<std::string>* ignored = nullptr);
// The dims of a fragment of our keys (its "model" object; keys absent take the
// defaults of issue 34; model.arch, when present, must be "mamba",
// "falcon_mamba" or "mamba2" (absent: "mamba"); model.mixer_rms_eps is read for a
// FalconMamba only, model.head_dim, .heads, .n_groups (must be 1) and
// .time_step_limit_min/max for a Mamba-2 only (whose model.dt_rank must be 0 or
// absent); other model.* keys such as model.seed are not read). Every size checked (positive; E, R + 2N
// and the tensor sizes fit in 64 bits; a Mamba-2's heads × head_dim = E).
MambaDims mamba_dims(const nlohmann::json& ash_config, const std::string& origin);
// config.json for a folder transformers loads as MambaForCausalLM (or, for
// model.arch = "falcon_mamba", FalconMambaForCausalLM, with mixer_rms_eps), with
// `dtype` its torch dtype ("float32", "float64", ...): MambaConfig's keys, sorted,
// its defaults for what we do not configure; residual_in_fp32 false for F64 (the
// residual stays in double, as ours) and true otherwise (transformers' default).
// A Mamba-2 (Mamba2ForCausalLM): Mamba2Config's keys alike, n_groups 1,
// time_step_limit [min, max] with no limit as {"__float__": "Infinity"} (what
// save_pretrained writes).
nlohmann::json ash_config_to_hf_mamba(const nlohmann::json& ash_config, TensorDtype dtype);

// Our name of each transformers tensor name and back, with the shape the dims
// imply (conv1d.weight is [E, 1, Kc] there and [E, Kc] here; a Mamba-2's [C, 1, Kc]
// and [C, Kc], its mixer.norm.weight our gated_norm).
struct HfName {
  std::string hf, ash;
  std::vector<std::int64_t> hf_shape, ash_shape;
};
// The tensors of layer `layer` ("backbone.layers.{i}.*" <-> "layers/NNN/*").
std::vector<HfName> hf_mamba_layer_names(const MambaDims& d, std::int64_t layer);
// The tensors outside the layers: embedding, final_norm, and head when untied.
std::vector<HfName> hf_mamba_global_names(const MambaDims& d);

// A MambaForCausalLM (FalconMambaForCausalLM, Mamba2ForCausalLM) folder opened for reading: config.json and every
// safetensors header read and checked, no tensor value read yet (import-hf
// checks the memory the values need before it reads them).
struct HfMambaFolder {
  nlohmann::json config;             // our keys: {"model": {...}}
  std::vector<std::string> ignored;  // config.json keys that transformers does not define
  SafetensorsSet set;
  std::vector<HfName> names;  // the configuration's tensors, each in `set` with its shape
  bool tied_copy = false;     // a tied model's lm_head.weight, to be equal to the embedding
  std::string where;          // "Mamba folder 'DIR'" ("FalconMamba ...", "Mamba2 ..."), for messages
};

// Opens a MambaForCausalLM, FalconMambaForCausalLM or Mamba2ForCausalLM folder: config.json, then model.safetensors or the
// index and its shards (F64, F32, BF16, F16; SafetensorsSet's file rules). Every
// tensor the configuration implies present with its shape; any other tensor is
// refused by name, except lm_head.weight of a tied model with the embedding's
// shape (older savers kept it; its values are compared by read_hf_mamba_values).
// ash::Error naming the folder and the tensor.
HfMambaFolder open_hf_mamba(const std::string& dir);

// The values of every tensor of f.names, converted to T (SafetensorsReader::read),
// each written to dest(name): room for the elements of its shape. First a tied
// lm_head.weight is compared with the embedding, value for value (ash::Error when
// it differs). Memory beyond dest's: a few blocks.
template <class T>
void read_hf_mamba_values(const HfMambaFolder& f, const std::function<T*(const HfName&)>& dest);

struct HfMambaModel {
  nlohmann::json config;             // our keys: {"model": {...}}
  HfTensors tensors;                 // by our name, in double
  std::vector<std::string> ignored;  // config.json keys that transformers does not define
};

// open_hf_mamba and every tensor's values in double.
HfMambaModel read_hf_mamba(const std::string& dir);

// Writes a folder that MambaForCausalLM.from_pretrained(dir) (a FalconMamba's:
// FalconMambaForCausalLM's; a Mamba-2's: Mamba2ForCausalLM's) loads: config.json
// (ash_config_to_hf_mamba) and model.safetensors in `dtype`, with transformers'
// names, shapes and metadata ({"format": "pt"}); the folder replaced as one step
// (io::AtomicFolder: staged beside it and swapped in), created when missing. `tensors` holds exactly the tensors of the
// configuration (by our name, our shapes); anything missing, extra, or of another
// shape or value count is an ash::Error naming it, before anything is written.
void write_hf_mamba(const std::string& dir, const nlohmann::json& ash_config, const HfTensors& tensors,
                    TensorDtype dtype = TensorDtype::f32);

}  // namespace ash
