// adjoint_sharding._core: the library's Python binding (nanobind). Stateless
// functions in two rooms: verbs.cpp (the verbs' library forms, src/ash/app/,
// with parameters as dicts of numpy arrays, copied per call: O(parameters)) and
// stack.cpp (the layer stack, whose per-token arrays cross without copies);
// convert.hpp converts. No Kokkos object outlives a call, so Kokkos can be
// finalised at exit (docs/python.md). This file starts Kokkos and binds the rooms.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include "convert.hpp"

namespace {

namespace nb = nanobind;

bool g_we_initialized = false;

bool kokkos_finalized() {
#if KOKKOS_VERSION >= 30700
  return Kokkos::is_finalized();
#else
  return false;  // Kokkos 3.4-3.6 cannot say; this module finalises only what it started, once
#endif
}

void finalize_kokkos() {
  if (g_we_initialized && Kokkos::is_initialized() && !kokkos_finalized()) Kokkos::finalize();
  g_we_initialized = false;
}

}  // namespace

NB_MODULE(_core, m) {
  m.doc() = "AdjointSharding's C++ library (docs/python.md); use the adjoint_sharding package, not this module.";
  // Kokkos once per process: a second import of the package (or another
  // extension that started Kokkos) finds it running and leaves it alone.
  if (!Kokkos::is_initialized() && !kokkos_finalized()) {
    Kokkos::initialize();
    g_we_initialized = true;
    ash::MemoryTracker::install();
  }
  nb::module_::import_("atexit").attr("register")(nb::cpp_function(&finalize_kokkos));
  // Objects a torch module keeps until interpreter shutdown are not leaks worth a warning.
  nb::set_leak_warnings(false);
  m.attr("backend") = ash::ExecSpace::name();
  // Where the arrays read in place must be: "cpu", or "cuda:N" for a CUDA build.
  m.def("device", &ash_py::device_name);
  // The library's own allocations (Kokkos Views) per memory space, peak since the last reset
  // (bytes): on a GPU, what torch.cuda.max_memory_allocated does not see.
  m.def("memory_peak", [] {
    nb::dict d;
    for (const auto& u : ash::MemoryTracker::usage()) d[u.space.c_str()] = u.peak;
    return d;
  });
  m.def("memory_reset_peak", &ash::MemoryTracker::reset_peak);
  nb::exception<ash::Error>(m, "Error", PyExc_ValueError);
  ash_py::bind_verbs(m);
  ash_py::bind_stack(m);
}
