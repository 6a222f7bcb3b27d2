#pragma once
// The registry of layer kinds (docs/design.md, "Layer kinds"): every
// architecture the engines run, each a type in its own file
// (kind_interface.hpp lists the members a kind supplies). An engine is
// written once over a kind K and instantiated per kind; with_layer_kind
// chooses the kind from the model's sizes and is the one place that maps
// model.arch to a type. A new architecture adds its kind's files and its
// name to the three lists below.
#include <cstddef>
#include <tuple>
#include <type_traits>
#include <utility>

#include "ash/grad/falcon_mamba_kind.hpp"
#include "ash/grad/mamba2_kind.hpp"
#include "ash/grad/mamba_kind.hpp"
#include "ash/grad/ssm_resnet_kind.hpp"

namespace ash {

// Every kind, for code generated per kind (a method's backward overloads, explicit instantiations).
#define ASH_FOR_EACH_LAYER_KIND(M) M(SsmResNetKind) M(MambaKind) M(FalconMambaKind) M(Mamba2Kind)
using LayerKinds = std::tuple<SsmResNetKind, MambaKind, FalconMambaKind, Mamba2Kind>;

// f(K{}) for the kind of d (model.arch); returns what f returns.
template <class F>
decltype(auto) with_layer_kind(const ModelDims& d, F&& f) {
  switch (d.arch) {
    case Arch::mamba: return std::forward<F>(f)(MambaKind{});
    case Arch::falcon_mamba: return std::forward<F>(f)(FalconMambaKind{});
    case Arch::mamba2: return std::forward<F>(f)(Mamba2Kind{});
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
// The position of K in LayerKinds (a kind may share another's Scratch type).
template <class K, class Kinds>
struct KindIndex;
template <class K, class... Ks>
struct KindIndex<K, std::tuple<K, Ks...>> : std::integral_constant<std::size_t, 0> {};
template <class K, class K0, class... Ks>
struct KindIndex<K, std::tuple<K0, Ks...>>
    : std::integral_constant<std::size_t, 1 + KindIndex<K, std::tuple<Ks...>>::value> {};
}  // namespace impl

// Every kind's Scratch, held by a method through a pass (each kind uses its own).
template <class S>
class KindScratches {
 public:
  template <class K>
  typename K::template Scratch<S>& get() {
    return std::get<impl::KindIndex<K, LayerKinds>::value>(all_);
  }
  void release() {
    std::apply([](auto&... s) { (s.release(), ...); }, all_);
  }

 private:
  typename impl::ScratchTuple<S, LayerKinds>::type all_;
};

}  // namespace ash
