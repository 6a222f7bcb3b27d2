#pragma once
// Checked size arithmetic (docs/design.md §7): products of configuration sizes
// formed with overflow checks, so an absurd configuration is a clear error
// ("sizes overflow: ...") before anything multiplies or allocates.
#include <cstdint>
#include <string>

#include "ash/core/options.hpp"

namespace ash {

// a * b, or ash::Error naming `what` when the product overflows int64 (or an
// operand is negative).
std::int64_t checked_mul(std::int64_t a, std::int64_t b, const std::string& what);
std::int64_t checked_add(std::int64_t a, std::int64_t b, const std::string& what);

// Parameter count of a model, overflow-checked (parameter_count() is not).
std::int64_t checked_parameter_count(const ModelDims& d);

// The products of sizes the engines, the planner and the file writers form
// for `batch` windows of `seq_len` tokens, in bytes of the widest type:
// parameters with the gradient and Adam moments, every layer's kept
// activations of E1/E2 (h and A: K·B·T·P·N) and the layer inputs (K·B·T·P).
// Throws ash::Error ("sizes overflow: ...") when one does not fit in 64 bits.
void check_size_products(const ModelDims& d, std::int64_t batch, std::int64_t seq_len);

// Layer indices and rank counts are 32-bit (LayerRange, MPI): the largest
// model.layers, and the largest dist.* rank count.
constexpr std::int64_t max_layers = std::int64_t(1) << 30;
constexpr std::int64_t max_ranks = (std::int64_t(1) << 31) - 1;

// The model sizes a configuration or a checkpoint may hold (V >= 2 and in
// int32, P, N >= 1, 1 <= K <= max_layers, every product checked); throws
// ash::Error naming `origin` ("model.vocab" for a configuration).
void check_model_dims(const ModelDims& d);

// The rules of grad.truncate, grad.chunk, grad.wave and grad.head_chunk, stated
// once: for the configuration (Config::settings) and for EngineOptions built in
// code (make_layer_adjoint). Throws ash::Error naming the key.
void check_grad_numbers(const EngineOptions& g);

// grad.layer_checkpoint as m >= 1: 0 ("auto") gives round(sqrt(K)).
std::int64_t resolve_layer_checkpoint(std::int64_t m, std::int64_t layers);

}  // namespace ash
