#pragma once
// Workspaces that are plans (docs/design.md §6, "Workspaces"): a layer method
// or engine describes the buffers of one call once, as a WorkspaceSpec built
// from the shapes (its public header declares the function); the Workspace
// allocates the Views from that spec and hands them out by label, checked;
// the memory planner (plan/memory_plan.cpp) sums the same spec. kokkos-fft's
// Plan is the model: built from the shapes, owns its buffers. Every buffer
// lives in the engines' memory space (MemSpace), the one the planner plans.
#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "ash/model/ssm_layer.hpp"

namespace ash {

// The shape a layer method's workspace follows: batch sequences of T tokens,
// P channels, N states, scalars of scalar_bytes.
struct LayerShape {
  index_t batch = 0, T = 0, P = 0, N = 0;
  std::size_t scalar_bytes = 0;
  index_t groups = 1;  // B and C in groups (a Mamba-2's n_groups): β, γ and their cotangents [rows, groups·N]
  index_t rows() const { return batch * T; }
};
// The shape of layer p's backward on s.
template <class S>
LayerShape layer_shape(const SeqShape& s, const LayerParams<S>& p) {
  return LayerShape{s.batch, s.T, index_t(p.W_delta.extent(0)), index_t(p.W_B.extent(0)), sizeof(S)};
}

// One buffer: its Kokkos label, element size and extents (rank 1 to 3), in
// `copies` Views of that label (the layers' carries, a segment's inputs).
struct BufferSpec {
  // Who allocates it: the Workspace (a View, zeroed or not), the
  // LayerCotangents or LayerActivations (projections only) constructor (the
  // Workspace builds one and checks its Views against these entries), the
  // engine (StoredRows in run.storage's format, elem bytes each; it checks
  // the count), or Kokkos (a team's scratch that it keeps once grown:
  // counted, never allocated here).
  enum class Owner { workspace, cotangents, projections, stored_rows, team_scratch };
  std::string label;
  std::size_t elem = 0;
  std::vector<index_t> extents;
  bool zeroed = false;
  index_t copies = 1;
  Owner owner = Owner::workspace;
  double scratch_bytes = 0;  // team_scratch only
  double bytes() const;
  bool same_shape(const BufferSpec& o) const {
    return label == o.label && elem == o.elem && extents == o.extents && zeroed == o.zeroed && copies == o.copies &&
           owner == o.owner;
  }
};

class WorkspaceSpec {
 public:
  // `copies` Views of `extents` (rank 2 or 3) elements of `elem` bytes;
  // zeroed on allocation (not on reuse) or left uninitialized.
  WorkspaceSpec& add(const std::string& label, std::size_t elem, std::vector<index_t> extents, bool zeroed,
                     index_t copies = 1);
  // LayerCotangents(rows, {P, N}, row_partials): its buffers, as its constructor allocates them.
  WorkspaceSpec& cotangents(index_t rows, index_t P, index_t N, bool row_partials, std::size_t elem,
                            index_t groups = 1, bool gather_rows = true);
  // LayerActivations of `rows` tokens, projections only (ŷ, r, Δ, β, γ and the decay rates a).
  WorkspaceSpec& projections(index_t rows, index_t P, index_t N, std::size_t elem, index_t groups = 1);
  // LayerActivations of `rows` tokens: projections, with h_and_A also h^{t-1} and A [rows, P, N]
  // (Store::with_hprev_and_A, what E1 and E2 keep), as its constructor allocates them.
  WorkspaceSpec& activations(index_t rows, index_t P, index_t N, bool h_and_A, std::size_t elem,
                             index_t groups = 1);
  // `copies` StoredRows of rows x cols in a storage format of elem bytes.
  WorkspaceSpec& stored_rows(const std::string& label, std::size_t elem, index_t rows, index_t cols, index_t copies);
  // Team scratch Kokkos holds for a kernel (bytes in all).
  WorkspaceSpec& team_scratch(const std::string& label, double bytes);
  // o's buffers, each `copies` times as many (one per layer).
  WorkspaceSpec& append(const WorkspaceSpec& o, index_t copies = 1);
  const std::vector<BufferSpec>& buffers() const { return buffers_; }
  const BufferSpec* find(const std::string& label) const;
  // Bytes of every buffer; of those whose label starts with `prefix`.
  double bytes() const;
  double bytes(const std::string& prefix) const;

 private:
  std::vector<BufferSpec> buffers_;
};

// The buffers of one layer call of the whole-window methods E1 and E2: the
// h-adjoint μ of every token [rows, P, N] and the cotangents of its rows (not
// for a kind whose scan cotangents are its own scratch's: cotangents = false).
WorkspaceSpec window_workspace(const std::string& mu_label, const LayerShape& sh, bool cotangents = true);

// A View of the buffer `b` describes (rank 2 or 3, scalars S; throws ash::Error otherwise).
template <class S>
View2<S> make_view2(const BufferSpec& b);
template <class S>
View3<S> make_view3(const BufferSpec& b);

// Owns the buffers of a WorkspaceSpec of scalars S. plan() makes them those
// of the spec, keeping a buffer whose label and shape are unchanged (a
// pass's layers and equal token blocks allocate once) and freeing the others
// before allocating (the peak holds one copy); release() frees all.
template <class S>
class Workspace {
 public:
  void plan(const WorkspaceSpec& spec);
  // Copy i of the buffer of that label: throws ash::Error when the spec has
  // none of this rank and scalar, or fewer copies.
  View2<S> view2(const std::string& label, index_t i = 0) const { return slot(label, 2, i).v2[std::size_t(i)]; }
  View3<S> view3(const std::string& label, index_t i = 0) const { return slot(label, 3, i).v3[std::size_t(i)]; }
  // The spec's cotangents, projections (throws when it has none).
  const LayerCotangents<S>& cotangents() const;
  const LayerActivations<S>& projections() const;
  void release();

 private:
  struct Slot {
    BufferSpec spec;
    std::vector<View2<S>> v2;
    std::vector<View3<S>> v3;
  };
  const Slot& slot(const std::string& label, std::size_t rank, index_t i) const;
  std::vector<Slot> slots_;
  std::vector<BufferSpec> cot_spec_, proj_spec_;
  std::unique_ptr<LayerCotangents<S>> cot_;
  std::unique_ptr<LayerActivations<S>> proj_;
};

}  // namespace ash
