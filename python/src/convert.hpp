#pragma once
// numpy <-> the library's containers for adjoint_sharding._core (docs/python.md):
// parameters cross as dicts of numpy arrays, copied into or out of a ParamSet per
// call (O(parameters)); token ids as 1-D uint32 arrays, copied into a vector.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "ash/ash.hpp"

namespace ash_py {

namespace nb = nanobind;

static_assert(Kokkos::SpaceAccessibility<Kokkos::HostSpace, ash::MemSpace>::accessible,
              "the Python binding needs a host-accessible Kokkos memory space (Serial, OpenMP, Threads)");

template <class S>
using Array = nb::ndarray<nb::numpy, S>;

// A numpy array (owned by Python) holding a copy of `n` values at src with `shape`.
template <class S>
nb::object to_numpy(const S* src, const std::vector<std::int64_t>& shape) {
  std::size_t n = 1;
  std::vector<std::size_t> sh;
  for (auto d : shape) {
    n *= std::size_t(d);
    sh.push_back(std::size_t(d));
  }
  S* buf = new S[n > 0 ? n : 1];
  if (n) std::memcpy(buf, src, n * sizeof(S));
  nb::capsule owner(buf, [](void* p) noexcept { delete[] static_cast<S*>(p); });
  return nb::cast(Array<S>(buf, sh.size(), sh.data(), owner));
}

template <class S>
nb::dict paramset_to_dict(const ash::ParamSet<S>& ps) {
  nb::dict out;
  Kokkos::fence();
  for (const auto& t : ps.tensors()) out[t.name.c_str()] = to_numpy<S>(ps.data().data() + t.offset, t.shape);
  return out;
}

// Copies every tensor of ps's layout from `params` (a mapping name -> array of
// that shape; any float dtype, converted by numpy on the Python side).
template <class S>
void dict_to_paramset(const nb::dict& params, const ash::ParamSet<S>& ps) {
  for (const auto& t : ps.tensors()) {
    ash::require(params.contains(t.name.c_str()), "parameter '" + t.name + "' is missing");
    nb::ndarray<S, nb::c_contig, nb::device::cpu> a;
    ash::require(nb::try_cast(params[t.name.c_str()], a),
                 "parameter '" + t.name + "' must be a C-contiguous " + (sizeof(S) == 8 ? "float64" : "float32") +
                     " CPU array");
    std::string want = "[", got = "[";
    bool same = a.ndim() == t.shape.size();
    for (std::size_t i = 0; i < t.shape.size(); ++i) {
      want += (i ? ", " : "") + std::to_string(t.shape[i]);
      if (same && std::int64_t(a.shape(i)) != t.shape[i]) same = false;
    }
    for (std::size_t i = 0; i < a.ndim(); ++i) got += (i ? ", " : "") + std::to_string(a.shape(i));
    ash::require(same, "parameter '" + t.name + "' has shape " + got + "], expected " + want + "]");
    if (t.size()) std::memcpy(ps.data().data() + t.offset, a.data(), std::size_t(t.size()) * sizeof(S));
  }
}

using Ids = nb::ndarray<const std::uint32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
inline std::vector<std::uint32_t> ids_of(const Ids& a) {
  return std::vector<std::uint32_t>(a.data(), a.data() + a.shape(0));
}

// "float" or "double"; "" : fallback (a checkpoint's stored precision).
inline std::string precision_or(const std::string& precision, const std::string& fallback) {
  const std::string p = precision.empty() ? fallback : precision;
  ash::require(p == "float" || p == "double", "precision must be 'float' or 'double', got '" + p + "'");
  return p;
}

// The module's rooms, each adding its functions and classes to the module.
void bind_verbs(nb::module_& m);  // verbs.cpp: grad, load, save, init_params, evaluate, train, generate, plan
void bind_stack(nb::module_& m);  // stack.cpp: the layer stack (SSMStack's StackAdjoint)

}  // namespace ash_py
