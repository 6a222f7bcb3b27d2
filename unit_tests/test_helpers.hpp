#pragma once
// Shared test fixtures: tiny models, random tokens, host copies, allclose.
#include <gtest/gtest.h>
#include <hdf5.h>

#include <fstream>
#include <iterator>

#include <cmath>
#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "ash/ash.hpp"
#include "ash/io/hdf5_digest.hpp"  // the library's own digest code, for reseal()
#include "ash/io/hdf5_rows.hpp"

namespace ash::test {

using Scalars = ::testing::Types<float, double>;

// Tolerances a real bug would break: double ~ rounding, float ~ 1e-4 relative.
template <class S>
struct Tol;
template <>
struct Tol<double> {
  static constexpr double forward = 1e-12;
  static constexpr double grad_vs_double = 1e-12;
};
template <>
struct Tol<float> {
  static constexpr double forward = 2e-5;
  static constexpr double grad_vs_double = 2e-3;
};

inline ModelDims tiny_dims(int K, std::int64_t V = 17, std::int64_t P = 8, std::int64_t N = 4) {
  ModelDims d;
  d.vocab = V;
  d.width = P;
  d.state = N;
  d.layers = K;
  d.seed = 7;
  return d;
}

// A tiny Mamba (V = 11, D = 4, N = 3, E = 8) for the tests: K blocks, conv
// kernel Kc, Δ rank R, tied or untied embeddings; arch falcon_mamba: a
// FalconMamba of the same sizes (the mixer's norms at transformers' default epsilon).
inline ModelDims mamba_tiny_dims(int K, bool tied, std::int64_t Kc = 3, std::int64_t R = 2, Arch arch = Arch::mamba) {
  ModelDims d = tiny_dims(K, 11, 4, 3);
  d.arch = arch;
  d.expand = 2;
  d.conv_kernel = Kc;
  d.dt_rank = R;
  d.tie_embeddings = tied;
  d.norm_eps = 1e-4;
  return d;
}

// A tiny Mamba-2 (V = 11, D = 4, N = 3, E = 8 in H = 4 heads of 2, n_groups G,
// C = 8 + 6G conv channels): K blocks, conv kernel Kc, tied or untied embeddings.
inline ModelDims mamba2_tiny_dims(int K, bool tied, std::int64_t Kc = 3, std::int64_t G = 1) {
  ModelDims d = tiny_dims(K, 11, 4, 3);
  d.arch = Arch::mamba2;
  d.expand = 2;
  d.conv_kernel = Kc;
  d.head_dim = 2;
  d.n_groups = G;
  d.tie_embeddings = tied;
  d.norm_eps = 1e-4;
  return d;
}

// A Mamba's carried state (data.carry_state, docs/design.md §8): one
// [B·carry_rows, carry_cols] view per layer, zero; a deep copy; max |a − b| and max |b|.
inline std::vector<View2<double>> carried_state(const ModelDims& d, index_t B) {
  std::vector<View2<double>> st;
  for (int k = 0; k < d.layers; ++k) st.emplace_back("carried", B * d.carry_rows(), d.carry_cols());
  return st;
}

inline std::vector<View2<double>> copy_of(const std::vector<View2<double>>& src) {
  std::vector<View2<double>> c;
  for (const auto& v : src) {
    c.emplace_back("carried_copy", v.extent(0), v.extent(1));
    Kokkos::deep_copy(c.back(), v);
  }
  return c;
}

// max |a - b| over every layer's state, and max |b|.
inline std::pair<double, double> state_diff(const std::vector<View2<double>>& a, const std::vector<View2<double>>& b) {
  double diff = 0, ref = 0;
  for (std::size_t k = 0; k < a.size(); ++k) {
    auto ha = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), a[k]);
    auto hb = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), b[k]);
    for (std::size_t i = 0; i < ha.extent(0); ++i)
      for (std::size_t j = 0; j < ha.extent(1); ++j) {
        diff = std::max(diff, std::fabs(ha(i, j) - hb(i, j)));
        ref = std::max(ref, std::fabs(hb(i, j)));
      }
  }
  return {diff, ref};
}

// A Mamba's logits [T, V] of every position of one window by the full forward (no state).
inline std::vector<std::vector<double>> full_logits(const ParamSet<double>& ps, const TokenView& x) {
  const auto& d = ps.dims();
  const SeqShape s = SeqShape::of(x);
  View2<double> y("y", s.rows(), d.width), y_next("y_next", s.rows(), d.width);
  embedding_forward(ps.global().embedding, x, y);
  const MambaActivations<double> act(s, d, LayerActivations<double>::projections_only);
  for (int k = 0; k < d.layers; ++k) {
    with_mamba_block(ps, k, [&](const auto& p) { mamba_layer_forward(p, d, s, y, act, y_next); });
    std::swap(y, y_next);
  }
  View2<double> logits("logits", s.rows(), d.vocab);
  head_logits(ps.global(), y, logits);
  const auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), logits);
  std::vector<std::vector<double>> out(s.rows());
  for (index_t m = 0; m < s.rows(); ++m)
    for (index_t v = 0; v < d.vocab; ++v) out[m].push_back(h(m, v));
  return out;
}


// x with document starts at the given flat offsets (set_document_starts).
inline TokenView with_document_starts(const TokenView& x, const std::vector<index_t>& starts) {
  Kokkos::View<index_t*, MemSpace> s("starts", starts.size());
  auto h = Kokkos::create_mirror_view(s);
  for (std::size_t i = 0; i < starts.size(); ++i) h(i) = starts[i];
  Kokkos::deep_copy(s, h);
  set_document_starts(x, s);
  return x;
}

template <class S>
std::vector<double> to_host(const ParamSet<S>& ps) {
  auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), ps.data());
  return std::vector<double>(h.data(), h.data() + h.extent(0));
}

template <class S>
void from_host(const ParamSet<S>& ps, const std::vector<double>& v) {
  auto h = Kokkos::create_mirror_view(ps.data());
  for (std::size_t i = 0; i < v.size(); ++i) h(i) = S(v[i]);
  Kokkos::deep_copy(ps.data(), h);
}

// The documented initialisation, then every tensor moved off its special
// values (w = 1, D = 1, ...) so that every gradient path is exercised.
template <class S>
ParamSet<S> random_model(const ModelDims& d, std::uint64_t seed) {
  ParamSet<S> ps(d);
  initialize(ps, seed);
  auto v = to_host(ps);
  std::mt19937_64 gen(seed + 99);
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  for (const auto& t : ps.tensors()) {
    const bool big = t.name == "embedding";  // so RMSNorm sees O(1) inputs
    for (index_t i = 0; i < t.size(); ++i) v[t.offset + i] += (big ? 1.0 : 0.3) * u(gen);
  }
  from_host(ps, v);
  return ps;
}

// A double model in scalar type S (exact for double, rounded for float).
template <class S>
ParamSet<S> cast_model(const ParamSet<double>& ref) {
  ParamSet<S> ps(ref.dims());
  from_host(ps, to_host(ref));
  return ps;
}

// A Mamba's random_model, with Δ moved from transformers' 1e-3..0.1 to O(1): the
// gradients through Δ and A are then large enough for central differences to
// resolve (at Δ ~ 0.01 some are ~1e-8, below the differences' noise).
inline ParamSet<double> fd_model(const ModelDims& d, std::uint64_t seed) {
  auto ps = random_model<double>(d, seed);
  auto v = to_host(ps);
  for (const auto& t : ps.tensors())
    if (t.name.size() > 7 && t.name.substr(t.name.size() - 7) == "dt_bias")
      for (index_t i = 0; i < t.size(); ++i) v[t.offset + i] += 4.5;
  from_host(ps, v);
  return ps;
}

inline EngineOptions engine_options(const std::string& name, index_t Tbar = 0, bool detach = false) {
  EngineOptions o;
  o.method = parse_method(name);
  o.truncate = Tbar;
  o.detach_inputs = detach;
  return o;
}

// E3's six forms in one source (docs/design.md §6): h replayed sequentially
// through the waves (a host's default) or from chunk-boundary states (a
// GPU's), each with the per-token state VJPs from [wave, P, N] buffers, fused
// into per-chunk kernels (the default), or in the reverse walk (threads over
// tokens, every channel in one team). Tests run every form on every backend.
enum class E3Form { sequential, chunked, fused_sequential, fused_chunked, walk_sequential, walk_chunked };
inline const std::vector<E3Form>& e3_forms() {
  static const std::vector<E3Form> forms{E3Form::sequential,       E3Form::chunked,
                                         E3Form::fused_sequential, E3Form::fused_chunked,
                                         E3Form::walk_sequential,  E3Form::walk_chunked};
  return forms;
}
inline E3Form default_e3_form() { return host_backend ? E3Form::fused_sequential : E3Form::fused_chunked; }
inline std::string e3_form_name(E3Form f) {
  switch (f) {
    case E3Form::sequential: return "sequential h, wave buffers";
    case E3Form::chunked: return "chunked h, wave buffers";
    case E3Form::fused_sequential: return "sequential h, fused";
    case E3Form::fused_chunked: return "chunked h, fused";
    case E3Form::walk_sequential: return "sequential h, walk";
    default: return "chunked h, walk";
  }
}
inline EngineOptions with_e3_form(EngineOptions o, E3Form f) {
  o.e3_chunked_h = f == E3Form::chunked || f == E3Form::fused_chunked || f == E3Form::walk_chunked;
  o.e3_walk = f == E3Form::walk_sequential || f == E3Form::walk_chunked;
  o.e3_fused = f != E3Form::sequential && f != E3Form::chunked;
  o.e3_scan_fused = o.e3_fused;  // a Mamba's scan core too
  return o;
}

// The gradient an engine computes, flattened to the host (and the loss).
template <class S>
std::vector<double> grad_of(const EngineOptions& o, const ParamSet<S>& ps, const TokenView& x,
                            double* loss = nullptr) {
  ParamSet<S> g(ps.dims());
  const double l = make_engine<S>(o)->compute(ps, x, g);
  if (loss) *loss = l;
  return to_host(g);
}

// The float with these IEEE-754 bits.
inline float bits_to_float(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// A configuration with a model's sizes and seed.
inline Config config_for(const ModelDims& d) {
  Config c;
  c.set("model.vocab=" + std::to_string(d.vocab));
  c.set("model.width=" + std::to_string(d.width));
  c.set("model.state=" + std::to_string(d.state));
  c.set("model.layers=" + std::to_string(d.layers));
  c.set("model.seed=" + std::to_string(d.seed));
  if (d.mamba()) {  // the Mamba block's keys (a checkpoint's /config must give the parameters' sizes)
    c.set("model.arch=" + arch_name(d.arch));
    c.set("model.expand=" + std::to_string(d.expand));
    c.set("model.conv_kernel=" + std::to_string(d.conv_kernel));
    c.set("model.dt_rank=" + std::to_string(d.dt_rank));
    c.set(std::string("model.tie_embeddings=") + (d.tie_embeddings ? "true" : "false"));
    c.set("model.norm_eps=" + std::to_string(d.norm_eps));
    if (d.mixer_norms()) c.set("model.mixer_rms_eps=" + std::to_string(d.mixer_rms_eps));
    if (d.mamba2()) {
      for (const std::string k : {"head_dim=" + std::to_string(d.head_dim), "heads=" + std::to_string(d.heads),
                                  "n_groups=" + std::to_string(d.n_groups)})
        c.set("model." + k);
      std::ostringstream lo, hi;  // exactly (std::to_string rounds to 6 digits)
      lo.precision(17);
      hi.precision(17);
      lo << d.time_step_limit_min;
      hi << d.time_step_limit_max;
      c.set("model.time_step_limit_min=" + lo.str());
      c.set("model.time_step_limit_max=" + hi.str());
    }
  }
  return c;
}

inline std::vector<std::uint32_t> random_token_ids(index_t n, index_t V, std::uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::vector<std::uint32_t> ids(n);
  for (auto& x : ids) x = std::uint32_t(gen() % std::uint64_t(V));
  return ids;
}

inline TokenView random_tokens(index_t batch, index_t T, index_t V, std::uint64_t seed) {
  return make_windows(random_token_ids(batch * T, V, seed), batch, T, V);
}

// A path in the test temp directory unique to the running test: ctest runs the
// tests of one executable as concurrent processes, so fixed names would race.
inline std::string tmp_path(const std::string& name) {
  const auto* t = ::testing::UnitTest::GetInstance()->current_test_info();
  std::string id = t ? std::string(t->test_suite_name()) + "." + t->name() : std::string("global");
  for (auto& c : id)
    if (c == '/') c = '_';
  return ::testing::TempDir() + "ash_" + id + "_" + name;
}

// A ~30 KB text of words in a fixed random order (training corpora for tests).
inline std::string word_corpus(const std::string& path) {
  std::mt19937_64 gen(3);
  const char* words[] = {"adjoint ", "sharding ", "state ", "space ", "model ", "the ", "of ", "long ", "context. "};
  std::string s;
  while (s.size() < 30000) s += words[gen() % 9];
  std::ofstream(path, std::ios::binary) << s;
  return path;
}

// f() throws an ash::Error whose message contains needle.
template <class F>
void expect_error(F&& f, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "expected an error mentioning '" << needle << "'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

inline std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// Rewrites a checkpoint's format_version attribute in place (bad-file tests).
inline void set_format_version(const std::string& path, std::int64_t v) {
  hid_t f = H5Fopen(path.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
  hid_t a = H5Aopen(f, "format_version", H5P_DEFAULT);
  H5Awrite(a, H5T_NATIVE_INT64, &v);
  H5Aclose(a);
  H5Fclose(f);
}

// Replaces a file's int64 attribute `name` by v (bad-file tests).
inline void rewrite_attr_i64(const std::string& path, const char* name, std::int64_t v) {
  hid_t f = H5Fopen(path.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
  H5Adelete(f, name);
  hid_t sp = H5Screate(H5S_SCALAR);
  hid_t a = H5Acreate2(f, name, H5T_STD_I64LE, sp, H5P_DEFAULT, H5P_DEFAULT);
  H5Awrite(a, H5T_NATIVE_INT64, &v);
  H5Aclose(a);
  H5Sclose(sp);
  H5Fclose(f);
}

// Rewrites every value of a dataset through HDF5 (Fletcher-32 recomputed,
// the digest not).
inline void set_all_values(const std::string& path, const char* ds_path, double value) {
  hid_t f = H5Fopen(path.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
  hid_t ds = H5Dopen2(f, ds_path, H5P_DEFAULT);
  hid_t sp = H5Dget_space(ds);
  std::vector<double> v(static_cast<std::size_t>(H5Sget_simple_extent_npoints(sp)), value);
  EXPECT_GE(H5Dwrite(ds, H5T_NATIVE_DOUBLE, H5S_ALL, H5S_ALL, H5P_DEFAULT, v.data()), 0);
  H5Sclose(sp);
  H5Dclose(ds);
  H5Fclose(f);
}

// Recomputes every digest of an edited format-3 file, as a tool that knows
// the format can (docs/file_format.md: digests catch accidents, not a
// deliberate editor). The file is then altered but consistent, so only the
// reader's other checks (schema, values) can refuse it.
// Replaces (or adds) the fixed-length string attribute `name` of object f with v.
inline void replace_attr_str(hid_t f, const char* name, const std::string& v) {
  if (H5Aexists(f, name) > 0) H5Adelete(f, name);
  hid_t sp = H5Screate(H5S_SCALAR), t = H5Tcopy(H5T_C_S1);
  H5Tset_size(t, v.size());
  H5Tset_strpad(t, H5T_STR_NULLPAD);
  hid_t a = H5Acreate2(f, name, t, sp, H5P_DEFAULT, H5P_DEFAULT);
  H5Awrite(a, t, v.data());
  H5Aclose(a);
  H5Tclose(t);
  H5Sclose(sp);
}

// A format-3 `digest` attribute (of value 0) on object obj.
inline void add_zero_digest(hid_t obj) {
  hid_t sp = H5Screate(H5S_SCALAR);
  hid_t a = H5Acreate2(obj, "digest", H5T_STD_U64LE, sp, H5P_DEFAULT, H5P_DEFAULT);
  const std::uint64_t zero = 0;
  H5Awrite(a, H5T_NATIVE_UINT64, &zero);
  H5Aclose(a);
  H5Sclose(sp);
}

inline void reseal(const std::string& path) {
  hid_t f = H5Fopen(path.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
  ASSERT_GE(f, 0) << path;
  io::seal_datasets(f);
  io::seal_header(f);
  H5Fclose(f);
}

// A format-3 file turned into what the format-2 writer produced: the same
// objects and Fletcher-32 filters, no digest attributes, format_version 2.
// The paths of the datasets an open checkpoint or gradient file holds (of an
// SSM-ResNet of its `layers`).
inline std::vector<std::string> file_datasets(hid_t f) {
  std::vector<std::string> datasets{"/loss", "/train/carry_state"}, found;
  hid_t a = H5Aopen(f, "layers", H5P_DEFAULT);
  std::int64_t K = 0;
  H5Aread(a, H5T_NATIVE_INT64, &K);
  H5Aclose(a);
  ModelDims d;
  d.layers = K;
  for (const char* root : {"/params/", "/optimizer/m/", "/optimizer/v/", "/grad/"})
    for (const auto& t : param_layout(d)) datasets.push_back(root + t.name);
  for (const auto& p : datasets)
    if (H5Lexists(f, p.substr(0, p.find('/', 1)).c_str(), H5P_DEFAULT) > 0 &&
        H5Oexists_by_name(f, p.c_str(), H5P_DEFAULT) > 0)
      found.push_back(p);
  return found;
}

inline void downgrade_to_v2(const std::string& path) {
  hid_t f = H5Fopen(path.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
  ASSERT_GE(f, 0) << path;
  for (const auto& p : file_datasets(f))
    if (H5Aexists_by_name(f, p.c_str(), "digest", H5P_DEFAULT) > 0)
      EXPECT_GE(H5Adelete_by_name(f, p.c_str(), "digest", H5P_DEFAULT), 0) << p;
  EXPECT_GE(H5Adelete(f, "digest"), 0);
  std::int64_t v = 2;
  hid_t a = H5Aopen(f, "format_version", H5P_DEFAULT);
  H5Awrite(a, H5T_NATIVE_INT64, &v);
  H5Aclose(a);
  H5Fclose(f);
}

// Central differences of loss(ps) for every parameter (double); ps is restored.
template <class Loss>
std::vector<double> finite_difference(const ParamSet<double>& ps, Loss&& loss, double h) {
  const auto theta = to_host(ps);
  std::vector<double> fd(theta.size());
  auto hostv = Kokkos::create_mirror_view(ps.data());
  Kokkos::deep_copy(hostv, ps.data());
  for (std::size_t i = 0; i < theta.size(); ++i) {
    hostv(i) = theta[i] + h;
    Kokkos::deep_copy(ps.data(), hostv);
    const double lp = loss(ps);
    hostv(i) = theta[i] - h;
    Kokkos::deep_copy(ps.data(), hostv);
    const double lm = loss(ps);
    hostv(i) = theta[i];
    fd[i] = (lp - lm) / (2 * h);
  }
  Kokkos::deep_copy(ps.data(), hostv);
  return fd;
}

// ||a - b|| / max(||b||, tiny) over a slice.
inline double rel_l2(const std::vector<double>& a, const std::vector<double>& b, std::size_t off = 0,
                     std::size_t n = std::size_t(-1)) {
  if (n == std::size_t(-1)) n = a.size() - off;
  double num = 0, den = 0;
  for (std::size_t i = off; i < off + n; ++i) {
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += b[i] * b[i];
  }
  return std::sqrt(num) / std::max(std::sqrt(den), 1e-300);
}

// The cosine of a and b over [off, off + n).
inline double cosine(const std::vector<double>& a, const std::vector<double>& b, std::size_t off, std::size_t n) {
  double ab = 0, aa = 0, bb = 0;
  for (std::size_t i = off; i < off + n; ++i) {
    ab += a[i] * b[i];
    aa += a[i] * a[i];
    bb += b[i] * b[i];
  }
  return ab / std::sqrt(aa * bb);
}

// Per-tensor relative L2 error of got against ref is at most tol.
inline void expect_close(const std::vector<double>& got, const std::vector<double>& ref, const ModelDims& d,
                         double tol, const std::string& what = "") {
  for (const auto& t : param_layout(d)) EXPECT_LE(rel_l2(got, ref, t.offset, t.size()), tol) << t.name << " " << what;
}

// E1 in scalar type S on model d against E1 in double (itself checked
// against finite differences): the loss within Tol<S>::forward, the gradient
// within Tol<S>::grad_vs_double per tensor.
template <class S>
void expect_agrees_with_double(const ModelDims& d) {
  auto ref = random_model<double>(d, 5);
  const auto x = random_tokens(2, 21, d.vocab, 6);
  double lref = 0, l = 0;
  const auto b = grad_of(EngineOptions{}, ref, x, &lref);
  const auto a = grad_of(EngineOptions{}, cast_model<S>(ref), x, &l);
  EXPECT_NEAR(l, lref, Tol<S>::forward * lref);
  expect_close(a, b, d, Tol<S>::grad_vs_double);
}

}  // namespace ash::test
