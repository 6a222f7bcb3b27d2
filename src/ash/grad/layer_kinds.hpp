#pragma once
// The registry of layer kinds (docs/design.md, "Layer kinds"): every
// architecture the engines run, each a type in its own file
// (kind_interface.hpp lists the members a kind supplies). An engine is
// written once over a kind K and instantiated per kind; with_layer_kind
// chooses the kind from the model's sizes and is the one place that maps
// model.arch to a type. A new architecture adds its kind's files and its
// name to the three lists below.
#include <tuple>
#include <utility>

#include "ash/grad/mamba_kind.hpp"
#include "ash/grad/ssm_resnet_kind.hpp"

namespace ash {

// Every kind, for code generated per kind (a method's backward overloads, explicit instantiations).
#define ASH_FOR_EACH_LAYER_KIND(M) M(SsmResNetKind) M(MambaKind)
using LayerKinds = std::tuple<SsmResNetKind, MambaKind>;

// f(K{}) for the kind of d (model.arch); returns what f returns.
template <class F>
decltype(auto) with_layer_kind(const ModelDims& d, F&& f) {
  switch (d.arch) {
    case Arch::mamba: return std::forward<F>(f)(MambaKind{});
    case Arch::ssm_resnet: break;
  }
  return std::forward<F>(f)(SsmResNetKind{});
}

namespace impl {
template <class S, class Kinds>
struct ScratchTuple;
template <class S, class... Ks>
struct ScratchTuple<S, std::tuple<Ks...>> {
  using type = std::tuple<typename Ks::template Scratch<S>...>;
};
}  // namespace impl

// Every kind's Scratch, held by a method through a pass (each kind uses its own).
template <class S>
class KindScratches {
 public:
  template <class K>
  typename K::template Scratch<S>& get() {
    return std::get<typename K::template Scratch<S>>(all_);
  }
  void release() {
    std::apply([](auto&... s) { (s.release(), ...); }, all_);
  }

 private:
  typename impl::ScratchTuple<S, LayerKinds>::type all_;
};

}  // namespace ash
