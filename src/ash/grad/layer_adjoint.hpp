#pragma once
// The per-layer half of every gradient engine (docs/design.md §2): given a
// layer's input and activations (from an ActivationStore) and g_k = ∂L/∂y_k,
// add θ_k's gradient and turn g_k into g_{k-1} (unless the layer input is
// detached, the paper's mode, where g is left as it is). Orchestrators (the
// local engine, the MPI layer pipeline) decide the order of layers and ranks;
// the methods E1, E2, E3 live behind this interface.
#include <memory>
#include <string>

#include "ash/model/forward.hpp"

namespace ash {

struct EngineOptions;

template <class S>
class LayerAdjoint {
 public:
  using Store = typename LayerActivations<S>::Store;
  virtual ~LayerAdjoint() = default;
  virtual std::string name() const = 0;
  // What the forward must keep of every layer: keeps_activations() false means
  // only the layer inputs (the activations are recomputed on request).
  virtual bool keeps_activations() const = 0;
  virtual Store store() const = 0;
  // True when every layer input is detached: layers are independent given g
  // (paper mode: no communication between layer ranks after g).
  virtual bool detached() const = 0;
  // Reverse mode of layer k (global index) over the whole window. g is g_k on
  // entry and g_{k-1} on return (unchanged when detached()).
  virtual void backward(const LayerParams<S>& p, int k, ActivationStore<S>& store, const View2<S>& g,
                        const LayerParams<S>& grad) = 0;
  // Frees the scratch kept between layers (called at the end of a pass).
  virtual void release() {}
  // The execution-space instance the layer's kernels run on (default: the
  // default instance). An orchestrator may give the layer method its own
  // instance so communication can overlap compute; it must then fence between
  // the two (dense products stay on the default instance in Kokkos Kernels 3.4).
  void set_execution_space(const ExecSpace& exec) { exec_ = exec; }
  const ExecSpace& execution_space() const { return exec_; }

 protected:
  ExecSpace exec_;
};

// What the whole-window methods (E1, E2) keep between layers: the h-adjoint μ
// of every token and the cotangent scratch for its rows.
template <class S>
struct WindowScratch {
  View3<S> mu;  // [rows, P, N]
  std::unique_ptr<LayerCotangents<S>> cot;
  // Allocates for `rows` tokens (kept while the size stays the same).
  void ensure(const char* label, index_t rows, index_t P, index_t N) {
    if (index_t(mu.extent(0)) == rows) return;
    mu = View3<S>(std::string(label), rows, P, N);
    ModelDims d;
    d.width = P;
    d.state = N;
    cot = std::make_unique<LayerCotangents<S>>(rows, d);
  }
  void release() {
    mu = View3<S>();
    cot.reset();
  }
};

// E1 backprop, E2 adjoint or E3 adjoint-exact by opts.engine; throws
// ash::Error for an unknown engine or options it does not support.
template <class S>
std::unique_ptr<LayerAdjoint<S>> make_layer_adjoint(const EngineOptions& opts);

}  // namespace ash
