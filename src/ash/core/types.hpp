#pragma once
// Execution/memory spaces, View aliases and the Kokkos 3.4 / 4.x math alias.
#include <Kokkos_Core.hpp>
#include <cstdint>

namespace ash {

#if KOKKOS_VERSION >= 30700
namespace kmath = Kokkos;
#else
namespace kmath = Kokkos::Experimental;
#endif

using ExecSpace = Kokkos::DefaultExecutionSpace;
using MemSpace = ExecSpace::memory_space;
// True for host backends (Serial, OpenMP, Threads); false for a GPU (CUDA).
// Kernels pick their thread shape and row blocks by it (kernels/state_tile.hpp).
// Asked of the execution space, not the memory space: CUDA UVM memory is
// host-accessible, but its kernels still run on the GPU.
constexpr bool host_backend = Kokkos::SpaceAccessibility<ExecSpace, Kokkos::HostSpace>::accessible;
// 64-bit index: T*P*N passes 2^31 at long contexts.
using index_t = std::int64_t;
using token_t = std::int32_t;

// Row-major everywhere: HDF5 datasets are row-major and gemm handles LayoutRight.
template <class S>
using View1 = Kokkos::View<S*, Kokkos::LayoutRight, MemSpace>;
template <class S>
using View2 = Kokkos::View<S**, Kokkos::LayoutRight, MemSpace>;
template <class S>
using View3 = Kokkos::View<S***, Kokkos::LayoutRight, MemSpace>;
template <class S>
using Unmanaged1 = Kokkos::View<S*, Kokkos::LayoutRight, MemSpace, Kokkos::MemoryTraits<Kokkos::Unmanaged>>;
template <class S>
using Unmanaged2 = Kokkos::View<S**, Kokkos::LayoutRight, MemSpace, Kokkos::MemoryTraits<Kokkos::Unmanaged>>;

// [Bt, T] token ids; row m = b·T + t of every activation is token (b, t).
using TokenView = Kokkos::View<token_t**, Kokkos::LayoutRight, MemSpace>;

using Range = Kokkos::RangePolicy<ExecSpace, Kokkos::IndexType<index_t>>;
// Right-to-left iteration: the fastest index is the last, as in LayoutRight
// (the CUDA default iterates left, which would stride lanes by a row).
using Range2 = Kokkos::MDRangePolicy<ExecSpace, Kokkos::Rank<2, Kokkos::Iterate::Right, Kokkos::Iterate::Right>,
                                     Kokkos::IndexType<index_t>>;

}  // namespace ash
