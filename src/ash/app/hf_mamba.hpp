#pragma once
// A Hugging Face `MambaForCausalLM` or `FalconMambaForCausalLM` folder (config.json
// + model.safetensors, or a sharded model.safetensors.index.json) in our names and
// keys, and back (issue 34: `ash import-hf` / `ash export-hf`, docs/file_format.md
// "Hugging Face Mamba folders"). Independent of the model code: the configuration
// is a JSON fragment of our keys ({"model": {"arch": "mamba", "width": D, ...}})
// that Config::merge takes, the tensors are plain arrays by their /params names
// ("layers/000/in_proj"). A FalconMamba's tensors and names are a Mamba's (its
// mixer norms have no weights); only its configuration differs.
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

// The sizes a Mamba (or FalconMamba) configuration implies.
struct MambaDims {
  std::int64_t width = 0, state = 0, layers = 0, vocab = 0, expand = 2, conv_kernel = 4;
  std::int64_t dt_rank = 0;  // as configured: 0 = ceil(width / 16)
  bool tie_embeddings = true;
  double norm_eps = 1e-5;
  bool falcon = false;          // model.arch = "falcon_mamba": FalconMambaForCausalLM
  double mixer_rms_eps = 1e-6;  // a FalconMamba's mixer norms' epsilon
  const char* arch() const { return falcon ? "falcon_mamba" : "mamba"; }  // our model.arch, their model_type
  const char* hf_class() const { return falcon ? "FalconMambaForCausalLM" : "MambaForCausalLM"; }
  std::int64_t inner() const { return expand * width; }  // E (checked when the dims are made)
  std::int64_t rank() const { return dt_rank > 0 ? dt_rank : width / 16 + (width % 16 != 0); }  // R
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
nlohmann::json hf_mamba_config_to_ash(const nlohmann::json& hf, const std::string& origin,
                                      std::vector<std::string>* ignored = nullptr);
// The dims of a fragment of our keys (its "model" object; keys absent take the
// defaults of issue 34; model.arch, when present, must be "mamba" or
// "falcon_mamba" (absent: "mamba"); model.mixer_rms_eps is read for a
// FalconMamba only; other model.* keys such as model.seed are not read). Every size checked (positive; E, R + 2N
// and the tensor sizes fit in 64 bits).
MambaDims mamba_dims(const nlohmann::json& ash_config, const std::string& origin);
// config.json for a folder transformers loads as MambaForCausalLM (or, for
// model.arch = "falcon_mamba", FalconMambaForCausalLM, with mixer_rms_eps), with
// `dtype` its torch dtype ("float32", "float64", ...): MambaConfig's keys, sorted,
// its defaults for what we do not configure; residual_in_fp32 false for F64 (the
// residual stays in double, as ours) and true otherwise (transformers' default).
nlohmann::json ash_config_to_hf_mamba(const nlohmann::json& ash_config, TensorDtype dtype);

// Our name of each transformers tensor name and back, with the shape the dims
// imply (conv1d.weight is [E, 1, Kc] there and [E, Kc] here).
struct HfName {
  std::string hf, ash;
  std::vector<std::int64_t> hf_shape, ash_shape;
};
// The tensors of layer `layer` ("backbone.layers.{i}.*" <-> "layers/NNN/*").
std::vector<HfName> hf_mamba_layer_names(const MambaDims& d, std::int64_t layer);
// The tensors outside the layers: embedding, final_norm, and head when untied.
std::vector<HfName> hf_mamba_global_names(const MambaDims& d);

// A MambaForCausalLM (or FalconMambaForCausalLM) folder opened for reading: config.json and every
// safetensors header read and checked, no tensor value read yet (import-hf
// checks the memory the values need before it reads them).
struct HfMambaFolder {
  nlohmann::json config;             // our keys: {"model": {...}}
  std::vector<std::string> ignored;  // config.json keys that transformers does not define
  SafetensorsSet set;
  std::vector<HfName> names;  // the configuration's tensors, each in `set` with its shape
  bool tied_copy = false;     // a tied model's lm_head.weight, to be equal to the embedding
  std::string where;          // "Mamba folder 'DIR'" ("FalconMamba folder 'DIR'"), for messages
};

// Opens a MambaForCausalLM or FalconMambaForCausalLM folder: config.json, then model.safetensors or the
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
// FalconMambaForCausalLM's) loads: config.json
// (ash_config_to_hf_mamba) and model.safetensors in `dtype`, with transformers'
// names, shapes and metadata ({"format": "pt"}); the folder replaced as one step
// (io::AtomicFolder: staged beside it and swapped in), created when missing. `tensors` holds exactly the tensors of the
// configuration (by our name, our shapes); anything missing, extra, or of another
// shape or value count is an ash::Error naming it, before anything is written.
void write_hf_mamba(const std::string& dir, const nlohmann::json& ash_config, const HfTensors& tensors,
                    TensorDtype dtype = TensorDtype::f32);

}  // namespace ash
