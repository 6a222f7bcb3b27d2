# Finds Kokkos and Kokkos Kernels and exposes them as one target,
# AdjointSharding::kokkos_stack, for the library and for users of the installed
# package (AdjointShardingConfig.cmake includes this file too).
#
# Handles Debian's Trilinos 13.2 packages (Kokkos 3.4; see docs/design.md §3, "Building"):
#   - Kokkos::kokkos points at a non-existent include directory,
#   - there is no Kokkos::kokkoskernels target, only trilinos_* libraries,
#   - KokkosKernels has no version file (so it is found without a version).
# A user's Kokkos 4.x is selected with -DCMAKE_PREFIX_PATH=<prefix> (or both
# Kokkos_ROOT and KokkosKernels_ROOT); we check that both come from one release.

include_guard(GLOBAL)

if(NOT TARGET Kokkos::kokkos)
  find_package(Kokkos REQUIRED)
endif()
if(NOT TARGET Kokkos::kokkoskernels AND NOT DEFINED KokkosKernels_LIBRARIES)
  find_package(KokkosKernels REQUIRED)
endif()

# Debian: the exported include directory does not exist.
get_target_property(_ash_kk_inc Kokkos::kokkos INTERFACE_INCLUDE_DIRECTORIES)
set(_ash_bad_inc FALSE)
foreach(_d IN LISTS _ash_kk_inc)
  if(NOT _d MATCHES "^\\$<" AND NOT EXISTS "${_d}")
    set(_ash_bad_inc TRUE)
  endif()
endforeach()
if(_ash_bad_inc AND Kokkos_INCLUDE_DIRS)
  set_target_properties(Kokkos::kokkos PROPERTIES INTERFACE_INCLUDE_DIRECTORIES "${Kokkos_INCLUDE_DIRS}")
endif()

if(NOT TARGET AdjointSharding::kokkos_stack)
  add_library(AdjointSharding::kokkos_stack INTERFACE IMPORTED GLOBAL)
  if(TARGET Kokkos::kokkoskernels)
    # Kokkos Kernels 4.x: a proper target that carries Kokkos::kokkos.
    set(ASH_KOKKOSKERNELS_FLAVOUR "Kokkos::kokkoskernels")
    target_link_libraries(AdjointSharding::kokkos_stack INTERFACE Kokkos::kokkoskernels Kokkos::kokkos)
  else()
    # Debian / Trilinos: plain library names plus include directories.
    set(ASH_KOKKOSKERNELS_FLAVOUR "Trilinos KokkosKernels")
    target_link_libraries(AdjointSharding::kokkos_stack INTERFACE Kokkos::kokkos ${KokkosKernels_LIBRARIES})
    target_include_directories(AdjointSharding::kokkos_stack INTERFACE ${KokkosKernels_INCLUDE_DIRS})
  endif()
endif()

# Refuse a Kokkos 4.x core mixed with Debian's Kokkos Kernels 3.4 (or the reverse).
if(Kokkos_VERSION AND Kokkos_VERSION VERSION_GREATER_EQUAL 4.0 AND NOT TARGET Kokkos::kokkoskernels)
  message(FATAL_ERROR "Kokkos ${Kokkos_VERSION} (${Kokkos_DIR}) was found together with a Trilinos-style "
                      "Kokkos Kernels (${KokkosKernels_DIR}). Select both from one prefix: "
                      "-DCMAKE_PREFIX_PATH=<prefix> or Kokkos_ROOT and KokkosKernels_ROOT.")
endif()
if(KokkosKernels_VERSION AND Kokkos_VERSION AND NOT KokkosKernels_VERSION VERSION_EQUAL Kokkos_VERSION)
  string(REGEX MATCH "^[0-9]+" _kmaj "${Kokkos_VERSION}")
  string(REGEX MATCH "^[0-9]+" _kkmaj "${KokkosKernels_VERSION}")
  if(NOT _kmaj STREQUAL _kkmaj)
    message(FATAL_ERROR "Kokkos ${Kokkos_VERSION} and Kokkos Kernels ${KokkosKernels_VERSION} come from different releases.")
  endif()
endif()

# The backends this Kokkos was built with (ASH_KOKKOS_BACKENDS, upper case as Kokkos
# spells them: Kokkos_DEVICES in 3.4 and 4.x, else the Kokkos_ENABLE_* variables) and
# the one the library runs on (ASH_KOKKOS_DEFAULT_BACKEND): ash::ExecSpace is Kokkos'
# default execution space, which Kokkos picks at its build in this order
# (Kokkos_Macros.hpp). The tests run per backend from these (unit_tests/CMakeLists.txt).
set(ASH_KOKKOS_BACKENDS "${Kokkos_DEVICES}")
if(NOT ASH_KOKKOS_BACKENDS)
  foreach(_b SERIAL OPENMP THREADS PTHREAD HPX CUDA HIP SYCL OPENACC OPENMPTARGET)
    if(Kokkos_ENABLE_${_b})
      list(APPEND ASH_KOKKOS_BACKENDS ${_b})
    endif()
  endforeach()
endif()
set(ASH_KOKKOS_DEFAULT_BACKEND "")
foreach(_b CUDA HIP SYCL OPENACC OPENMPTARGET OPENMP THREADS PTHREAD HPX SERIAL)
  if(NOT ASH_KOKKOS_DEFAULT_BACKEND AND _b IN_LIST ASH_KOKKOS_BACKENDS)
    set(ASH_KOKKOS_DEFAULT_BACKEND ${_b})
  endif()
endforeach()

if(NOT ASH_KOKKOS_REPORTED)
  set(ASH_KOKKOS_REPORTED TRUE)
  message(STATUS "AdjointSharding: Kokkos ${Kokkos_VERSION} from ${Kokkos_DIR}")
  message(STATUS "AdjointSharding: Kokkos backends: ${ASH_KOKKOS_BACKENDS} (the library runs on ${ASH_KOKKOS_DEFAULT_BACKEND})")
  message(STATUS "AdjointSharding: Kokkos Kernels ${KokkosKernels_VERSION}${Trilinos_VERSION} (${ASH_KOKKOSKERNELS_FLAVOUR}) from ${KokkosKernels_DIR}")
endif()
