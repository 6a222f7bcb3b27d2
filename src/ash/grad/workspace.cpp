#include "ash/grad/workspace.hpp"

#include <algorithm>
#include <utility>

#include "ash/core/error.hpp"
#include "ash/kernels/row_sums.hpp"

namespace ash {

double BufferSpec::bytes() const {
  if (owner == Owner::team_scratch) return scratch_bytes;
  double n = double(elem) * double(copies);
  for (const index_t e : extents) n *= double(e);
  return n;
}

WorkspaceSpec& WorkspaceSpec::add(const std::string& label, std::size_t elem, std::vector<index_t> extents,
                                  bool zeroed, index_t copies) {
  require(extents.size() >= 1 && extents.size() <= 3, "workspace: buffer " + label + " must have rank 1 to 3");
  require(find(label) == nullptr, "workspace: buffer " + label + " described twice");
  BufferSpec b;
  b.label = label;
  b.elem = elem;
  b.extents = std::move(extents);
  b.zeroed = zeroed;
  b.copies = copies;
  buffers_.push_back(std::move(b));
  return *this;
}

// As LayerCotangents' constructor (model/ssm_layer.cpp) allocates them;
// Workspace::plan checks the two agree.
WorkspaceSpec& WorkspaceSpec::cotangents(index_t rows, index_t P, index_t N, bool row_partials, std::size_t elem,
                                         index_t groups, bool gather_rows) {
  const index_t rb = impl::row_blocks(rows);
  const std::size_t first = buffers_.size();
  add("ash::cot::gyhat", elem, {rows, P}, true);
  add("ash::cot::gz", elem, {rows, P}, true);
  add("ash::cot::gbeta", elem, {rows, groups * N}, true);
  add("ash::cot::ggamma", elem, {rows, groups * N}, true);
  if (gather_rows) add("ash::cot::yhat_rows", elem, {rows, P}, true);
  add("ash::cot::norm_part", elem, {rb, P}, false);
  if (row_partials) {
    add("ash::cot::alog_part", elem, {rb, P, N}, true);
    add("ash::cot::d_part", elem, {rb, P}, true);
    add("ash::cot::bd_part", elem, {rb, P}, true);
  }
  for (std::size_t i = first; i < buffers_.size(); ++i) buffers_[i].owner = BufferSpec::Owner::cotangents;
  return *this;
}

// As LayerActivations' constructor (model/ssm_layer.cpp) allocates them with
// Store::projections_only; Workspace::plan checks the two agree.
WorkspaceSpec& WorkspaceSpec::projections(index_t rows, index_t P, index_t N, std::size_t elem, index_t groups) {
  const std::size_t first = buffers_.size();
  add("ash::act::rstd", elem, {rows}, true);
  add("ash::act::yhat", elem, {rows, P}, true);
  add("ash::act::delta", elem, {rows, P}, true);
  add("ash::act::beta", elem, {rows, groups * N}, true);
  add("ash::act::gamma", elem, {rows, groups * N}, true);
  add("ash::act::a", elem, {P, N}, true);
  for (std::size_t i = first; i < buffers_.size(); ++i) buffers_[i].owner = BufferSpec::Owner::projections;
  return *this;
}

WorkspaceSpec& WorkspaceSpec::activations(index_t rows, index_t P, index_t N, bool h_and_A, std::size_t elem,
                                          index_t groups) {
  projections(rows, P, N, elem, groups);
  if (h_and_A) add("ash::act::hprev", elem, {rows, P, N}, true).add("ash::act::A", elem, {rows, P, N}, true);
  return *this;
}

WorkspaceSpec& WorkspaceSpec::team_scratch(const std::string& label, double bytes) {
  BufferSpec b;
  b.label = label;
  b.owner = BufferSpec::Owner::team_scratch;
  b.scratch_bytes = bytes;
  buffers_.push_back(std::move(b));
  return *this;
}

WorkspaceSpec& WorkspaceSpec::stored_rows(const std::string& label, std::size_t elem, index_t rows, index_t cols,
                                          index_t copies) {
  add(label, elem, {rows, cols}, false, copies);
  buffers_.back().owner = BufferSpec::Owner::stored_rows;
  return *this;
}

WorkspaceSpec& WorkspaceSpec::append(const WorkspaceSpec& o, index_t copies) {
  for (const auto& b : o.buffers_) {
    require(find(b.label) == nullptr, "workspace: buffer " + b.label + " described twice");
    buffers_.push_back(b);
    buffers_.back().copies *= copies;
    buffers_.back().scratch_bytes *= double(copies);
  }
  return *this;
}

const BufferSpec* WorkspaceSpec::find(const std::string& label) const {
  for (const auto& b : buffers_)
    if (b.label == label) return &b;
  return nullptr;
}

// Sizes are whole numbers of bytes below 2^53, so these sums are exact in any order.
double WorkspaceSpec::bytes() const {
  double t = 0;
  for (const auto& b : buffers_) t += b.bytes();
  return t;
}

double WorkspaceSpec::bytes(const std::string& prefix) const {
  double t = 0;
  for (const auto& b : buffers_)
    if (b.label.compare(0, prefix.size(), prefix) == 0) t += b.bytes();
  return t;
}

WorkspaceSpec window_workspace(const std::string& mu_label, const LayerShape& sh, bool cotangents) {
  WorkspaceSpec w;
  w.add(mu_label, sh.scalar_bytes, {sh.rows(), sh.P, sh.N}, true);
  if (cotangents) w.cotangents(sh.rows(), sh.P, sh.N, true, sh.scalar_bytes);
  return w;
}

namespace {

template <class S>
void require_shape(const BufferSpec& b, std::size_t rank) {
  require(b.owner == BufferSpec::Owner::workspace && b.extents.size() == rank && b.elem == sizeof(S),
          "workspace: buffer " + b.label + " is not a rank-" + std::to_string(rank) + " View of " +
              std::to_string(sizeof(S)) + "-byte scalars");
}

// Whether a LayerCotangents View is the spec's entry of its label (or empty and absent from it).
template <class V>
bool matches(const std::vector<BufferSpec>& spec, const V& v, std::size_t rank, std::size_t& found) {
  if (v.size() == 0 && v.label().empty()) return true;
  for (const auto& b : spec) {
    if (b.label != v.label()) continue;
    bool same = b.extents.size() == rank && b.elem == sizeof(typename V::value_type);
    for (std::size_t i = 0; same && i < rank; ++i) same = index_t(v.extent(i)) == b.extents[i];
    found += same ? 1 : 0;
    return same;
  }
  return false;
}

}  // namespace

template <class S>
View2<S> make_view2(const BufferSpec& b) {
  require_shape<S>(b, 2);
  const auto& e = b.extents;
  if (b.zeroed) return View2<S>(b.label, e[0], e[1]);
  return View2<S>(Kokkos::view_alloc(b.label, Kokkos::WithoutInitializing), e[0], e[1]);
}

template <class S>
View3<S> make_view3(const BufferSpec& b) {
  require_shape<S>(b, 3);
  const auto& e = b.extents;
  if (b.zeroed) return View3<S>(b.label, e[0], e[1], e[2]);
  return View3<S>(Kokkos::view_alloc(b.label, Kokkos::WithoutInitializing), e[0], e[1], e[2]);
}

namespace {

std::vector<BufferSpec> owned_by(const WorkspaceSpec& spec, BufferSpec::Owner owner) {
  std::vector<BufferSpec> out;
  for (const auto& b : spec.buffers())
    if (b.owner == owner) out.push_back(b);
  return out;
}

bool same(const std::vector<BufferSpec>& a, const std::vector<BufferSpec>& b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin(),
                                            [](const BufferSpec& x, const BufferSpec& y) { return x.same_shape(y); });
}

const BufferSpec& entry(const std::vector<BufferSpec>& v, const std::string& label) {
  for (const auto& b : v)
    if (b.label == label) return b;
  throw Error("workspace: no buffer " + label + " in its spec");
}

}  // namespace

template <class S>
void Workspace<S>::plan(const WorkspaceSpec& spec) {
  const auto cot = owned_by(spec, BufferSpec::Owner::cotangents),
             proj = owned_by(spec, BufferSpec::Owner::projections);
  // Free what the spec no longer holds in the same shape, then allocate what is missing.
  slots_.erase(std::remove_if(slots_.begin(), slots_.end(),
                              [&](const Slot& s) {
                                const BufferSpec* b = spec.find(s.spec.label);
                                return !b || !b->same_shape(s.spec);
                              }),
               slots_.end());
  if (!same(cot, cot_spec_)) {
    cot_.reset();
    cot_spec_.clear();
  }
  if (!same(proj, proj_spec_)) {
    proj_.reset();
    proj_spec_.clear();
  }
  for (const auto& b : spec.buffers()) {
    if (b.owner != BufferSpec::Owner::workspace) continue;
    if (std::any_of(slots_.begin(), slots_.end(), [&](const Slot& s) { return s.spec.label == b.label; })) continue;
    Slot s;
    s.spec = b;
    for (index_t i = 0; i < b.copies; ++i) {
      if (b.extents.size() == 2)
        s.v2.push_back(make_view2<S>(b));
      else
        s.v3.push_back(make_view3<S>(b));
    }
    slots_.push_back(std::move(s));
  }
  // The model's structs allocate their own Views; they must be what the spec describes, no more, no less.
  if (!cot.empty() && !cot_) {
    const BufferSpec &gy = entry(cot, "ash::cot::gyhat"), &gb = entry(cot, "ash::cot::gbeta");
    const BufferSpec* alog = spec.find("ash::cot::alog_part");
    // N from the A_log partials [rb, P, N] when there are any; β's columns are groups·N.
    const index_t N = alog ? alog->extents.at(2) : gb.extents.at(1), groups = gb.extents.at(1) / N;
    auto c = std::make_unique<LayerCotangents<S>>(gy.extents[0], gy.extents.at(1), N, alog != nullptr, groups,
                                                  spec.find("ash::cot::yhat_rows") != nullptr);
    std::size_t found = 0;
    const bool ok = matches(cot, c->gyhat, 2, found) && matches(cot, c->gz, 2, found) &&
                    matches(cot, c->gbeta, 2, found) && matches(cot, c->ggamma, 2, found) &&
                    matches(cot, c->yhat_rows, 2, found) && matches(cot, c->alog_part, 3, found) &&
                    matches(cot, c->d_part, 2, found) && matches(cot, c->bd_part, 2, found) &&
                    matches(cot, c->norm_part, 2, found);
    require(ok && found == cot.size(),
            "workspace: LayerCotangents allocates other buffers than WorkspaceSpec::cotangents describes");
    cot_ = std::move(c);
    cot_spec_ = cot;
  }
  if (!proj.empty() && !proj_) {
    const BufferSpec &yh = entry(proj, "ash::act::yhat"), &a = entry(proj, "ash::act::a"),
                     &be = entry(proj, "ash::act::beta");
    auto p = std::make_unique<LayerActivations<S>>(SeqShape{yh.extents[0], 1}, a.extents.at(0), a.extents.at(1),
                                                   LayerActivations<S>::projections_only,
                                                   be.extents.at(1) / a.extents.at(1));
    std::size_t found = 0;
    const bool ok = matches(proj, p->rstd, 1, found) && matches(proj, p->yhat, 2, found) &&
                    matches(proj, p->delta, 2, found) && matches(proj, p->beta, 2, found) &&
                    matches(proj, p->gamma, 2, found) && matches(proj, p->a, 2, found) &&
                    matches(proj, p->hprev, 3, found) && matches(proj, p->A, 3, found);
    require(ok && found == proj.size(),
            "workspace: LayerActivations allocates other buffers than WorkspaceSpec::projections describes");
    proj_ = std::move(p);
    proj_spec_ = proj;
  }
}

template <class S>
const typename Workspace<S>::Slot& Workspace<S>::slot(const std::string& label, std::size_t rank, index_t i) const {
  for (const auto& s : slots_)
    if (s.spec.label == label) {
      require_shape<S>(s.spec, rank);
      require(i >= 0 && i < s.spec.copies, "workspace: buffer " + label + " has no copy " + std::to_string(i));
      return s;
    }
  throw Error("workspace: no buffer " + label + " in its spec");
}

template <class S>
const LayerCotangents<S>& Workspace<S>::cotangents() const {
  require(cot_ != nullptr, "workspace: its spec has no cotangents");
  return *cot_;
}

template <class S>
const LayerActivations<S>& Workspace<S>::projections() const {
  require(proj_ != nullptr, "workspace: its spec has no projections");
  return *proj_;
}

template <class S>
void Workspace<S>::release() {
  slots_.clear();
  cot_.reset();
  cot_spec_.clear();
  proj_.reset();
  proj_spec_.clear();
}

template View2<float> make_view2<float>(const BufferSpec&);
template View2<double> make_view2<double>(const BufferSpec&);
template View3<float> make_view3<float>(const BufferSpec&);
template View3<double> make_view3<double>(const BufferSpec&);
template class Workspace<float>;
template class Workspace<double>;

}  // namespace ash
