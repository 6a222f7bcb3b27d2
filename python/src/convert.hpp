#pragma once
// numpy / torch <-> the library's containers for adjoint_sharding._core (docs/python.md):
// parameters cross as dicts of arrays, copied into or out of a ParamSet per call
// (O(parameters)); token ids as 1-D uint32 arrays, copied into a vector. Arrays the
// library reads or writes in place (the stack's y0, yK, g, a Mamba's blocks, grad's
// carried state) must live where the library's Kokkos memory space is: host memory
// for Serial / OpenMP, the GPU Kokkos runs on for CUDA (torch tensors through DLPack).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstdint>
#include <cstring>
#include <set>
#include <string>
#include <type_traits>
#include <vector>

#include "ash/ash.hpp"

namespace ash_py {

namespace nb = nanobind;

// The device of the library's memory space, as DLPack names it.
#if defined(KOKKOS_ENABLE_CUDA)
constexpr bool device_is_cuda = std::is_same<ash::MemSpace, Kokkos::CudaSpace>::value;
#else
constexpr bool device_is_cuda = false;
#endif
static_assert(device_is_cuda || Kokkos::SpaceAccessibility<Kokkos::HostSpace, ash::MemSpace>::accessible,
              "the Python binding needs a host-accessible Kokkos memory space or CudaSpace");
using DeviceTag = std::conditional_t<device_is_cuda, nb::device::cuda, nb::device::cpu>;

// The GPU Kokkos runs on (0 on the host).
inline int device_id() {
#if defined(KOKKOS_ENABLE_CUDA)
  if constexpr (device_is_cuda) return Kokkos::Cuda().cuda_device();
#endif
  return 0;
}

// "cpu" or "cuda:N", as torch names a device.
inline std::string device_name() { return device_is_cuda ? "cuda:" + std::to_string(device_id()) : "cpu"; }

template <class S>
const char* dtype_name() {
  return sizeof(S) == 8 ? "float64" : "float32";
}

// What an array-like object is, for an error message: "a float64 array of shape [2, 3] on cpu".
inline std::string describe(nb::handle h) {
  nb::ndarray<> a;
  if (!nb::try_cast(h, a, false)) return std::string("a ") + nb::type_name(h.type()).c_str() + " (not an array)";
  const auto dt = a.dtype();
  const char* kind = dt.code == std::uint8_t(nb::dlpack::dtype_code::Float) ? "float"
                     : dt.code == std::uint8_t(nb::dlpack::dtype_code::Int) ? "int"
                     : dt.code == std::uint8_t(nb::dlpack::dtype_code::UInt) ? "uint"
                                                                              : "other-type";
  std::string shape = "[";
  for (std::size_t i = 0; i < a.ndim(); ++i) shape += (i ? ", " : "") + std::to_string(a.shape(i));
  const int dev = a.device_type();
  const std::string where = dev == nb::device::cpu::value    ? std::string("cpu")
                            : dev == nb::device::cuda::value ? "cuda:" + std::to_string(a.device_id())
                                                             : "device type " + std::to_string(dev);
  return std::string("a ") + kind + std::to_string(dt.bits) + " array of shape " + shape + "] on " + where;
}

// h as an array of S on the library's device (C-contiguous, Extra... constraints),
// viewed without a copy; otherwise an ash::Error naming `what` and what it got.
template <class S, class... Extra>
nb::ndarray<S, nb::c_contig, DeviceTag, Extra...> device_array(nb::handle h, const std::string& what,
                                                             const char* form = "") {
  nb::ndarray<S, nb::c_contig, DeviceTag, Extra...> a;
  const bool ok = nb::try_cast(h, a, false) && (!device_is_cuda || a.device_id() == device_id());
  ash::require(ok, what + " must be a C-contiguous " + form + dtype_name<S>() + " array on " + device_name() +
                       " (this build's device; Kokkos " + ash::ExecSpace::name() + "), got " + describe(h));
  return a;
}

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
  const auto host = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), ps.data());  // no copy on the host
  for (const auto& t : ps.tensors()) out[t.name.c_str()] = to_numpy<S>(host.data() + t.offset, t.shape);
  return out;
}

// Copies every tensor of ps's layout from `params` (a mapping name -> array of
// that shape: a host array, numpy's, or one on the library's device, e.g. a CUDA
// torch tensor, copied on the device).
template <class S>
void dict_to_paramset(const nb::dict& params, const ash::ParamSet<S>& ps) {
  // A name that is none of the layout's would be dropped silently: refused, named.
  std::set<std::string> names;
  for (const auto& t : ps.tensors()) names.insert(t.name);
  for (const auto& item : params) {
    const std::string key = nb::str(item.first).c_str();
    ash::require(names.count(key) > 0, "parameter '" + key + "' is none of this model's " + std::to_string(ps.tensors().size()) +
                            " tensors (the names load() gives, e.g. '" + ps.tensors().back().name + "')");
  }
  for (const auto& t : ps.tensors()) {
    ash::require(params.contains(t.name.c_str()), "parameter '" + t.name + "' is missing");
    const nb::handle h = params[t.name.c_str()];
    // A host array (numpy converts another float dtype), else one on the device, read in place.
    nb::ndarray<S, nb::c_contig, nb::device::cpu> host;
    nb::ndarray<S, nb::c_contig, DeviceTag> dev;
    const bool on_host = nb::try_cast(h, host);
    if (!on_host) dev = device_array<S>(h, "parameter '" + t.name + "'");
    const S* src = on_host ? host.data() : dev.data();
    const std::size_t ndim = on_host ? host.ndim() : dev.ndim();
    const auto extent = [&](std::size_t i) { return on_host ? host.shape(i) : dev.shape(i); };
    std::string want = "[", got = "[";
    bool same = ndim == t.shape.size();
    for (std::size_t i = 0; i < t.shape.size(); ++i) {
      want += (i ? ", " : "") + std::to_string(t.shape[i]);
      if (same && std::int64_t(extent(i)) != t.shape[i]) same = false;
    }
    for (std::size_t i = 0; i < ndim; ++i) got += (i ? ", " : "") + std::to_string(extent(i));
    ash::require(same, "parameter '" + t.name + "' has shape " + got + "], expected " + want + "]");
    if (!t.size()) continue;
    using Unmanaged = Kokkos::MemoryTraits<Kokkos::Unmanaged>;
    if (on_host)
      Kokkos::deep_copy(ps.flat(t), Kokkos::View<const S*, Kokkos::HostSpace, Unmanaged>(src, std::size_t(t.size())));
    else
      Kokkos::deep_copy(ps.flat(t), Kokkos::View<const S*, ash::MemSpace, Unmanaged>(src, std::size_t(t.size())));
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
void bind_stack(nb::module_& m);  // stack.cpp: the layer stacks (StackAdjoint: SSMStack's, wrap's)

}  // namespace ash_py
