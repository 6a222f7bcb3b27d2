#pragma once
// `ash import-hf` / `ash export-hf` and Python's import_hf / export_hf as one
// library call each (the use-case floor, docs/architecture.md; issue 34): a
// Hugging Face MambaForCausalLM, FalconMambaForCausalLM or Mamba2ForCausalLM folder (app/hf_mamba)
// to a checkpoint of ours and back, through the one checkpoint writer and reader.
#include <cstdint>
#include <string>
#include <vector>

#include "ash/app/run_checks.hpp"
#include "ash/core/config.hpp"

namespace ash {

// What import_hf read and wrote, for the front ends to print.
struct HfImport {
  Config config;                     // the configuration stored in the checkpoint
  std::string source_dtypes;         // the folder's tensor dtypes: "F32", or "BF16, F32" when mixed
  std::vector<std::string> ignored;  // config.json keys transformers does not define
  std::int64_t parameters = 0;
};

// ash import-hf: reads the MambaForCausalLM (FalconMambaForCausalLM, Mamba2ForCausalLM) folder
// `dir` (open_hf_mamba: every tensor checked before anything is written) and
// writes the checkpoint `out`
// (format 3, step 0; its configuration the defaults with the folder's model.*
// keys and run.precision = precision) in `precision` ("float" or "double":
// F64 tensors rounded to float for "float", every other dtype exact), through
// save_checkpoint, under the run lock of out's directory when it has one, after
// check_memory's Workload::init estimate against max_memory (0: the machine's),
// made from config.json and the headers before any tensor is read; each tensor is
// then read into the parameters a block at a time (read_hf_mamba_values).
// `out` may not be one of the files read (config.json, the weights, the index
// and every shard it names; by name, through links or by inode).
HfImport import_hf(const std::string& dir, const std::string& out, const std::string& precision = "double",
                   std::uint64_t max_memory = 0);

// What export_hf wrote.
struct HfExport {
  ModelDims dims;
  std::string dtype;  // the safetensors dtype written: "F32" or "F64"
  std::int64_t parameters = 0;
};

// ash export-hf: the checkpoint `checkpoint` (a Mamba, FalconMamba or Mamba-2: an
// SSM-ResNet is an ash::Error saying so) as a folder MambaForCausalLM.from_pretrained(dir)
// (FalconMambaForCausalLM's, Mamba2ForCausalLM's) loads (write_hf_mamba: config.json and model.safetensors, the folder replaced as one
// step, io::AtomicFolder; created when missing). dtype "float" (F32) or
// "double" (F64); "" writes the checkpoint's precision. Neither file may be the
// checkpoint itself. read: how the header is read (the tool warns on old
// formats; none: inspect_checkpoint).
HfExport export_hf(const std::string& checkpoint, const std::string& dir, const std::string& dtype = "",
                   const CheckpointReader& read = {});

}  // namespace ash
