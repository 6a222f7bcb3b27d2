#pragma once
// What the ranks of a communicator exchange (docs/design.md §2): Views sent,
// received, broadcast, summed and scanned, scalar sums and maxima, the bytes
// sent, and running a step on one rank with its error made everyone's.
#include <mpi.h>

#include <cstdint>
#include <functional>

namespace ash::dist {

template <class S>
MPI_Datatype mpi_type();

// Point-to-point and collectives on contiguous Views; a View in a memory space
// the host cannot read (CUDA without CUDA-aware MPI) is staged through a host
// mirror. Bytes sent are added to bytes_sent() (per process, for reports).
template <class View>
void send(const View& v, int dest, int tag, MPI_Comm comm);
template <class View>
void recv(const View& v, int src, int tag, MPI_Comm comm);
// Each view that for_each hands out (for_each(f) calls f(v) per view in a
// fixed order, e.g. a layer kind's K::for_each_view of its state): one
// message per view, tags tag, tag + 1, ...
template <class ForEach>
void send_each(const ForEach& for_each, int dest, int tag, MPI_Comm comm) {
  for_each([&](const auto& v) { send(v, dest, tag++, comm); });
}
template <class ForEach>
void recv_each(const ForEach& for_each, int src, int tag, MPI_Comm comm) {
  for_each([&](const auto& v) { recv(v, src, tag++, comm); });
}
template <class View>
void broadcast(const View& v, int root, MPI_Comm comm);
template <class View>
void allreduce_sum(const View& v, MPI_Comm comm);
double allreduce_sum(double x, MPI_Comm comm);
// Exclusive scan of elementwise affine maps x ↦ a ⊙ x + b over comm's ranks:
// on return rank i holds in (a, b) the composition of ranks 0..i-1's maps
// (first rank 0's, then 1's, ...); rank 0 gets the identity (a = 1, b = 0).
// O(size of a) bytes per rank, whatever the sequence length.
template <class View>
void exscan_affine(const View& a, const View& b, MPI_Comm comm);
std::uint64_t allreduce_max(std::uint64_t x, MPI_Comm comm);

// The bytes this process has sent through the functions above (for reports).
std::uint64_t& bytes_sent();

// Runs fn on world rank 0 of comm and makes its ash::Error an error on every
// rank (a failed write is an error everywhere, never a hang). Collective.
void run_on_root(MPI_Comm comm, const std::function<void()>& fn);

}  // namespace ash::dist
