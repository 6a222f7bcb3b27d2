// adjoint_sharding._core's layer stacks: StackAdjoint (grad/stack_adjoint) of the
// SSM-ResNet kind over per-token arrays y_0, y_K, g [B, T, P] that cross without
// copies, as views of the caller's buffer (numpy through the buffer protocol, torch
// through DLPack; on the device the library was built for: host memory, or the GPU of
// a CUDA build); the adjoint_sharding.torch SSMStack module calls these. The Mamba
// stack (StackAdjoint of the Mamba or the FalconMamba kind, by the options' arch;
// adjoint_sharding.torch.wrap) reads its
// blocks' parameters in place too, and writes their gradients into arrays the caller
// allocated.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <iomanip>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "convert.hpp"

namespace ash_py {

using namespace nb::literals;

namespace {

template <class S>
using SsmStack = ash::StackAdjoint<S, ash::SsmResNetKind>;
// K: ash::MambaKind or ash::FalconMambaKind (the same tensors; the latter's blocks norm δ, B and C),
// or ash::Mamba2Kind (its own tensors).
template <class S, class K>
using MambaStack = ash::StackAdjoint<S, K>;

struct StackOptions {
  std::int64_t vocab = 256, width = 0, state = 0, layers = 0;
  bool detach_inputs = false;
  std::int64_t truncate = 0, chunk = 64, layer_checkpoint = 1, token_block = 0;
  std::string storage = "float";
};

// The E3 keys both stacks share (StackOptions, MambaStackOptions: the same
// member names), set for windows of T tokens, then the whole configuration checked.
template <class O>
void set_engine_keys(ash::Config& cfg, const O& o, std::int64_t T) {
  cfg.set("data.seq_len=" + std::to_string(T < 2 ? 2 : T));
  cfg.set("data.batch=1");
  cfg.set("grad.engine=adjoint-exact");
  cfg.set("grad.truncate=" + std::to_string(o.truncate));
  cfg.set("grad.chunk=" + std::to_string(o.chunk));
  cfg.set(std::string("grad.detach_inputs=") + (o.detach_inputs ? "true" : "false"));
  cfg.set("grad.layer_checkpoint=" + std::to_string(o.layer_checkpoint));
  cfg.set("grad.token_block=" + std::to_string(o.token_block));
  cfg.set("run.storage=" + o.storage);
  cfg.validate();
}

// The stack's options as a configuration, so that every one is checked as `ash grad`
// checks it (sizes included: no narrowing of a layer count past 2^31, no negative width).
ash::Config stack_config(const StackOptions& o, std::int64_t T) {
  ash::Config cfg;
  cfg.set("model.vocab=" + std::to_string(o.vocab));
  cfg.set("model.width=" + std::to_string(o.width));
  cfg.set("model.state=" + std::to_string(o.state));
  cfg.set("model.layers=" + std::to_string(o.layers));
  set_engine_keys(cfg, o, T);
  return cfg;
}

ash::ModelDims stack_dims(const StackOptions& o) { return stack_config(o, 2).model(); }
ash::EngineOptions stack_engine(const StackOptions& o, std::int64_t T) { return stack_config(o, T).settings().grad; }

// [B, T, P] arrays on the library's device (convert.hpp), read and written in place.
template <class S>
using Tensor3 = nb::ndarray<S, nb::c_contig, DeviceTag, nb::ndim<3>>;

template <class S>
Tensor3<S> tensor3(nb::handle h, const char* what) {
  return device_array<S, nb::ndim<3>>(h, what, "3-D ");
}

// Calls f(S{}) with S the float type of y0 (float32 or float64; any other is refused by name).
template <class F>
auto by_dtype(nb::handle y0, F&& f) {
  nb::ndarray<> a;
  const bool is64 = nb::try_cast(y0, a, false) && a.dtype() == nb::dtype<double>();
  return is64 ? f(double{}) : f(float{});
}

template <class S>
ash::View2<S> rows_view(const Tensor3<S>& a) {
  return ash::View2<S>(const_cast<S*>(a.data()), a.shape(0) * a.shape(1), a.shape(2));
}

template <class S>
void check_shape(const Tensor3<S>& a, const char* what, std::size_t B, std::size_t T, std::size_t P) {
  ash::require(a.shape(0) == B && a.shape(1) == T && a.shape(2) == P,
               std::string(what) + " has shape [" + std::to_string(a.shape(0)) + ", " + std::to_string(a.shape(1)) +
                   ", " + std::to_string(a.shape(2)) + "], expected [" + std::to_string(B) + ", " +
                   std::to_string(T) + ", " + std::to_string(P) + "]");
}

// The shape of y0 [B, T, P] with document starts from cu_seqlens (flat offsets
// b·T + t of the B·T rows, docs/design.md §1; empty: none).
ash::SeqShape stack_shape(std::int64_t B, std::int64_t T, const std::vector<std::int64_t>& cu_seqlens) {
  ash::SeqShape s{ash::index_t(B), ash::index_t(T)};
  if (cu_seqlens.empty()) return s;
  Kokkos::View<ash::index_t*, ash::MemSpace> starts("ash::py::cu_seqlens", cu_seqlens.size());
  auto h = Kokkos::create_mirror_view(starts);
  for (std::size_t i = 0; i < cu_seqlens.size(); ++i) h(i) = ash::index_t(cu_seqlens[i]);
  Kokkos::deep_copy(starts, h);
  const ash::TokenView x("ash::py::document_starts", B, T);
  ash::set_document_starts(x, starts);
  s.docs = ash::DocStarts(x);
  return s;
}

// What stack_forward and stack_backward share: y0's width and the other
// array's shape checked (`name`: "yK" or "g", never y0's buffer), y0's shape
// with its documents, the engine of the options and the parameters.
template <class S>
struct StackCall {
  ash::ModelDims d;
  ash::SeqShape s;
  SsmStack<S> stack;
  ash::ParamSet<S> ps;

  StackCall(const nb::dict& params, const StackOptions& o, const Tensor3<S>& y0, const Tensor3<S>& other,
            const char* name, const std::vector<std::int64_t>& cu_seqlens)
      : d(checked_dims(o, y0, other, name)),
        s(stack_shape(y0.shape(0), y0.shape(1), cu_seqlens)),
        stack(d, stack_engine(o, s.T)),
        ps(d, SsmStack<S>::range(d)) {
    dict_to_paramset(params, ps);
  }

  static ash::ModelDims checked_dims(const StackOptions& o, const Tensor3<S>& y0, const Tensor3<S>& other,
                                     const char* name) {
    const auto d = stack_dims(o);
    ash::require(std::int64_t(y0.shape(2)) == d.width, "y0's last dimension is " + std::to_string(y0.shape(2)) +
                                                           ", expected the width P = " + std::to_string(d.width));
    check_shape(other, name, y0.shape(0), y0.shape(1), y0.shape(2));
    ash::require(y0.data() != other.data(), std::string(name) + " must not be y0");
    return d;
  }
};

template <class S>
void stack_forward(const nb::dict& params, const StackOptions& o, Tensor3<S> y0, Tensor3<S> yK,
                   const std::vector<std::int64_t>& cu_seqlens) {
  StackCall<S> c(params, o, y0, yK, "yK", cu_seqlens);
  nb::gil_scoped_release nogil;
  c.stack.forward(c.ps, c.s, rows_view(y0), rows_view(yK));
  Kokkos::fence();
}

template <class S>
nb::dict stack_backward(const nb::dict& params, const StackOptions& o, Tensor3<S> y0, Tensor3<S> g,
                        const std::vector<std::int64_t>& cu_seqlens) {
  StackCall<S> c(params, o, y0, g, "g", cu_seqlens);
  ash::ParamSet<S> grad(c.d, SsmStack<S>::range(c.d));
  {
    nb::gil_scoped_release nogil;
    c.stack.backward(c.ps, c.s, rows_view(y0), rows_view(g), grad);
    Kokkos::fence();
  }
  return paramset_to_dict(grad);
}

// Constructing the stack checks the sizes and options as `ash grad` would (SSMStack's
// constructor and set_options: before any tensor is allocated or read).
void stack_check(const StackOptions& o) { const SsmStack<double> stack(stack_dims(o), stack_engine(o, 2)); }

std::vector<std::pair<std::string, std::vector<std::int64_t>>> stack_layout(const StackOptions& o) {
  const auto d = stack_dims(o);
  std::vector<std::pair<std::string, std::vector<std::int64_t>>> out;
  for (const auto& t : ash::param_layout(d, SsmStack<double>::range(d))) out.push_back({t.name, t.shape});
  return out;
}

// A Mamba, FalconMamba or Mamba-2 layer stack's sizes and E3 options (adjoint_sharding.torch.wrap).
struct MambaStackOptions {
  std::string arch = "mamba";  // model.arch: "mamba", "falcon_mamba" or "mamba2"
  std::int64_t width = 0, state = 0, layers = 0, expand = 2, conv_kernel = 4, dt_rank = 0;
  double norm_eps = 1e-5;
  double mixer_rms_eps = 1e-6;  // a FalconMamba's
  std::int64_t head_dim = 64, heads = 0, n_groups = 1;      // a Mamba-2's
  double time_step_limit_min = 0, time_step_limit_max = 0;  // a Mamba-2's (max 0: none)
  bool detach_inputs = false;
  std::int64_t truncate = 0, chunk = 64, layer_checkpoint = 1, token_block = 0;
  std::string storage = "float";
};

std::string exact_double(double v) {
  std::ostringstream o;
  o << std::setprecision(17) << v;
  return o.str();
}

// The options as a configuration, checked as `ash grad` checks them; the
// Mamba stack itself refuses what it does not run (StackAdjoint's constructor).
std::pair<ash::ModelDims, ash::EngineOptions> mamba_stack_settings(const MambaStackOptions& o, std::int64_t T) {
  ash::require(o.arch == "mamba" || o.arch == "falcon_mamba" || o.arch == "mamba2",
               "the stack's arch must be mamba, falcon_mamba or mamba2 (got '" + o.arch + "')");
  ash::Config cfg;
  cfg.set("model.arch=" + o.arch);
  cfg.set("model.vocab=256");  // unused: the stack has no embedding or head
  cfg.set("model.width=" + std::to_string(o.width));
  cfg.set("model.state=" + std::to_string(o.state));
  cfg.set("model.layers=" + std::to_string(o.layers));
  cfg.set("model.expand=" + std::to_string(o.expand));
  cfg.set("model.conv_kernel=" + std::to_string(o.conv_kernel));
  cfg.set("model.dt_rank=" + std::to_string(o.dt_rank));
  cfg.set("model.norm_eps=" + exact_double(o.norm_eps));
  if (o.arch == "falcon_mamba") cfg.set("model.mixer_rms_eps=" + exact_double(o.mixer_rms_eps));
  if (o.arch == "mamba2") {
    cfg.set("model.head_dim=" + std::to_string(o.head_dim));
    cfg.set("model.heads=" + std::to_string(o.heads));
    cfg.set("model.n_groups=" + std::to_string(o.n_groups));
    cfg.set("model.time_step_limit_min=" + exact_double(o.time_step_limit_min));
    cfg.set("model.time_step_limit_max=" + exact_double(o.time_step_limit_max));
  }
  set_engine_keys(cfg, o, T);
  const auto st = cfg.settings();
  return {st.model, st.grad};
}

// One block's tensors, in this order (the checkpoint's names, docs/file_format.md):
// a Mamba-1 block's norm [D], in_proj [2E, D], conv_weight [E, Kc], conv_bias [E],
// x_proj [R+2N, E], dt_proj [E, R], dt_bias [E], A_log [E, N], D [E], out_proj [D, E];
// a Mamba-2 block's norm [D], in_proj [E+C+H, D], conv_weight [C, Kc], conv_bias [C],
// dt_bias [H], A_log [H], D [H], gated_norm [E], out_proj [D, E] (C = E + 2N).
std::vector<const char*> block_tensor_names(const ash::ModelDims& d) {
  if (d.mamba2()) return {"norm", "in_proj", "conv_weight", "conv_bias", "dt_bias", "A_log", "D", "gated_norm", "out_proj"};
  return {"norm", "in_proj", "conv_weight", "conv_bias", "x_proj", "dt_proj", "dt_bias", "A_log", "D", "out_proj"};
}

std::vector<std::vector<std::int64_t>> block_tensor_shapes(const ash::ModelDims& d) {
  const std::int64_t D = d.width, E = d.inner(), N = d.state, R = d.rank(), Kc = d.conv_kernel;
  if (d.mamba2()) {
    const std::int64_t C = d.conv_dim(), H = d.head_count();
    return {{D}, {E + C + H, D}, {C, Kc}, {C}, {H}, {H}, {H}, {E}, {D, E}};
  }
  return {{D}, {2 * E, D}, {E, Kc}, {E}, {R + 2 * N, E}, {E, R}, {E}, {E, N}, {E}, {D, E}};
}

// One block's parameter views over the arrays `ptr` (block_tensor_names' order), by kind.
template <class S, class K>
typename K::template Params<S> block_params(K, const std::vector<S*>& ptr, const ash::ModelDims& d) {
  using U1 = ash::Unmanaged1<S>;
  using U2 = ash::Unmanaged2<S>;
  const std::int64_t D = d.width, E = d.inner(), N = d.state, R = d.rank(), Kc = d.conv_kernel;
  ash::MambaLayerParams<S> p;
  p.norm = U1(ptr[0], D);
  p.in_x = U2(ptr[1], E, D);  // in_proj's rows [0, E), then [E, 2E)
  p.in_z = U2(ptr[1] + E * D, E, D);
  p.conv_weight = U2(ptr[2], E, Kc);
  p.conv_bias = U1(ptr[3], E);
  p.x_dt = U2(ptr[4], R, E);  // x_proj's rows [0, R), [R, R+N), [R+N, R+2N)
  p.x_B = U2(ptr[4] + R * E, N, E);
  p.x_C = U2(ptr[4] + (R + N) * E, N, E);
  p.dt_proj = U2(ptr[5], E, R);
  p.dt_bias = U1(ptr[6], E);
  p.A_log = U2(ptr[7], E, N);
  p.D = U1(ptr[8], E);
  p.out_proj = U2(ptr[9], D, E);
  return typename K::template Params<S>{p};
}

template <class S>
ash::Mamba2LayerParams<S> block_params(ash::Mamba2Kind, const std::vector<S*>& ptr, const ash::ModelDims& d) {
  using U1 = ash::Unmanaged1<S>;
  using U2 = ash::Unmanaged2<S>;
  const std::int64_t D = d.width, E = d.inner(), C = d.conv_dim(), H = d.head_count(), Kc = d.conv_kernel;
  ash::Mamba2LayerParams<S> p;
  p.norm = U1(ptr[0], D);
  p.in_z = U2(ptr[1], E, D);  // in_proj's rows [0, E) z, [E, E+C) x|B|C, [E+C, E+C+H) Δ
  p.in_xbc = U2(ptr[1] + E * D, C, D);
  p.in_dt = U2(ptr[1] + (E + C) * D, H, D);
  p.conv_weight = U2(ptr[2], C, Kc);
  p.conv_bias = U1(ptr[3], C);
  p.dt_bias = U1(ptr[4], H);
  p.A_log = U1(ptr[5], H);
  p.D = U1(ptr[6], H);
  p.gated_norm = U1(ptr[7], E);
  p.out_proj = U2(ptr[8], D, E);
  return p;
}

template <class S>
using AnyArray = nb::ndarray<S, nb::c_contig, DeviceTag>;

// Views of the caller's arrays, without copies (a wrong dtype, layout or device
// is refused, never converted: a converted copy of a gradient would be lost).
// `arrays` keeps the arrays referenced for the call.
template <class S, class K>
typename MambaStack<S, K>::Blocks mamba_blocks(const nb::list& blocks, const ash::ModelDims& d, const char* what,
                                               std::vector<AnyArray<S>>& arrays) {
  ash::require(std::int64_t(blocks.size()) == d.layers, std::string(what) + " has " + std::to_string(blocks.size()) +
                                                            " blocks, expected K = " + std::to_string(d.layers));
  const auto names = block_tensor_names(d);
  const auto shapes = block_tensor_shapes(d);
  const std::size_t count = names.size();
  typename MambaStack<S, K>::Blocks out;
  for (std::size_t k = 0; k < blocks.size(); ++k) {
    const nb::handle bk = blocks[k];
    const std::string where = std::string(what) + " of block " + std::to_string(k);
    ash::require(nb::isinstance<nb::list>(bk) || nb::isinstance<nb::tuple>(bk), where + " must be a list of arrays");
    const nb::sequence seq = nb::borrow<nb::sequence>(bk);
    ash::require(nb::len(seq) == count,
                 where + " must have " + std::to_string(count) + " arrays, got " + std::to_string(nb::len(seq)));
    std::vector<S*> ptr;
    for (std::size_t i = 0; i < count; ++i) {
      const std::string name = where + ": " + names[i];
      const AnyArray<S> a = device_array<S>(seq[i], name);
      const auto& want = shapes[i];
      bool same = a.ndim() == want.size();
      std::string got = "[", exp = "[";
      for (std::size_t j = 0; j < want.size(); ++j) {
        exp += (j ? ", " : "") + std::to_string(want[j]);
        if (same && std::int64_t(a.shape(j)) != want[j]) same = false;
      }
      for (std::size_t j = 0; j < a.ndim(); ++j) got += (j ? ", " : "") + std::to_string(a.shape(j));
      ash::require(same, name + " has shape " + got + "], expected " + exp + "]");
      ptr.push_back(a.data());
      arrays.push_back(a);
    }
    out.push_back(block_params(K{}, ptr, d));
  }
  return out;
}

// f(K{}) for the stack's kind: a FalconMamba's, a Mamba-2's or a Mamba's.
template <class F>
void with_mamba_kind(const ash::ModelDims& d, F&& f) {
  if (d.mixer_norms())
    f(ash::FalconMambaKind{});
  else if (d.mamba2())
    f(ash::Mamba2Kind{});
  else
    f(ash::MambaKind{});
}

template <class S, class K>
void mamba_stack_forward(const nb::list& blocks, const ash::ModelDims& d, const ash::EngineOptions& opts,
                         Tensor3<S> y0, Tensor3<S> yK) {
  ash::require(std::int64_t(y0.shape(2)) == d.width, "y0's last dimension is " + std::to_string(y0.shape(2)) +
                                                         ", expected the hidden size D = " + std::to_string(d.width));
  check_shape(yK, "yK", y0.shape(0), y0.shape(1), y0.shape(2));
  std::vector<AnyArray<S>> keep;
  const auto ps = mamba_blocks<S, K>(blocks, d, "the parameters", keep);
  const MambaStack<S, K> stack(d, opts);
  const ash::SeqShape s{ash::index_t(y0.shape(0)), ash::index_t(y0.shape(1))};
  nb::gil_scoped_release nogil;
  stack.forward(ps, s, rows_view(y0), rows_view(yK));
  Kokkos::fence();
}

template <class S>
void mamba_stack_forward(const nb::list& blocks, const MambaStackOptions& o, Tensor3<S> y0, Tensor3<S> yK) {
  const auto [d, opts] = mamba_stack_settings(o, std::int64_t(y0.shape(1)));
  with_mamba_kind(d, [&, &d = d, &opts = opts](auto kind) {
    mamba_stack_forward<S, decltype(kind)>(blocks, d, opts, y0, yK);
  });
}

template <class S, class K>
void mamba_stack_backward(const nb::list& blocks, const nb::list& grads, const ash::ModelDims& d,
                          const ash::EngineOptions& opts, Tensor3<S> y0, Tensor3<S> g) {
  ash::require(std::int64_t(y0.shape(2)) == d.width, "y0's last dimension is " + std::to_string(y0.shape(2)) +
                                                         ", expected the hidden size D = " + std::to_string(d.width));
  check_shape(g, "g", y0.shape(0), y0.shape(1), y0.shape(2));
  std::vector<AnyArray<S>> keep;
  const auto ps = mamba_blocks<S, K>(blocks, d, "the parameters", keep);
  const auto gs = mamba_blocks<S, K>(grads, d, "the gradient", keep);
  const MambaStack<S, K> stack(d, opts);
  const ash::SeqShape s{ash::index_t(y0.shape(0)), ash::index_t(y0.shape(1))};
  nb::gil_scoped_release nogil;
  stack.backward(ps, s, rows_view(y0), rows_view(g), gs);
  Kokkos::fence();
}

template <class S>
void mamba_stack_backward(const nb::list& blocks, const nb::list& grads, const MambaStackOptions& o, Tensor3<S> y0,
                          Tensor3<S> g) {
  const auto [d, opts] = mamba_stack_settings(o, std::int64_t(y0.shape(1)));
  with_mamba_kind(d, [&, &d = d, &opts = opts](auto kind) {
    mamba_stack_backward<S, decltype(kind)>(blocks, grads, d, opts, y0, g);
  });
}

// Constructing the stack checks the options (the refusals come before any tensor is touched).
void mamba_stack_check(const MambaStackOptions& o) {
  const auto [d, opts] = mamba_stack_settings(o, 2);
  with_mamba_kind(d, [&, &d = d, &opts = opts](auto kind) { const MambaStack<double, decltype(kind)> stack(d, opts); });
}

}  // namespace

void bind_stack(nb::module_& m) {
  nb::class_<StackOptions>(m, "StackOptions")
      .def(nb::init<>())
      .def_rw("vocab", &StackOptions::vocab)
      .def_rw("width", &StackOptions::width)
      .def_rw("state", &StackOptions::state)
      .def_rw("layers", &StackOptions::layers)
      .def_rw("detach_inputs", &StackOptions::detach_inputs)
      .def_rw("truncate", &StackOptions::truncate)
      .def_rw("chunk", &StackOptions::chunk)
      .def_rw("layer_checkpoint", &StackOptions::layer_checkpoint)
      .def_rw("token_block", &StackOptions::token_block)
      .def_rw("storage", &StackOptions::storage);
  m.def("stack_layout", &stack_layout, "options"_a);
  m.def("stack_check", &stack_check, "options"_a);
  // y0's dtype picks the precision; every array is then checked by its name (dtype, device, layout).
  m.def(
      "stack_forward",
      [](const nb::dict& params, const StackOptions& o, nb::handle y0, nb::handle yK,
         const std::vector<std::int64_t>& cu_seqlens) {
        by_dtype(y0, [&](auto tag) {
          using S = decltype(tag);
          const auto a = tensor3<S>(y0, "y0");  // y0 first: the arguments are checked in order
          stack_forward<S>(params, o, a, tensor3<S>(yK, "yK"), cu_seqlens);
        });
      },
      "params"_a, "options"_a, "y0"_a, "yK"_a, "cu_seqlens"_a = std::vector<std::int64_t>());
  m.def(
      "stack_backward",
      [](const nb::dict& params, const StackOptions& o, nb::handle y0, nb::handle g,
         const std::vector<std::int64_t>& cu_seqlens) {
        return by_dtype(y0, [&](auto tag) {
          using S = decltype(tag);
          const auto a = tensor3<S>(y0, "y0");
          return stack_backward<S>(params, o, a, tensor3<S>(g, "g"), cu_seqlens);
        });
      },
      "params"_a, "options"_a, "y0"_a, "g"_a, "cu_seqlens"_a = std::vector<std::int64_t>());
  nb::class_<MambaStackOptions>(m, "MambaStackOptions")
      .def(nb::init<>())
      .def_rw("arch", &MambaStackOptions::arch)
      .def_rw("width", &MambaStackOptions::width)
      .def_rw("state", &MambaStackOptions::state)
      .def_rw("layers", &MambaStackOptions::layers)
      .def_rw("expand", &MambaStackOptions::expand)
      .def_rw("conv_kernel", &MambaStackOptions::conv_kernel)
      .def_rw("dt_rank", &MambaStackOptions::dt_rank)
      .def_rw("norm_eps", &MambaStackOptions::norm_eps)
      .def_rw("mixer_rms_eps", &MambaStackOptions::mixer_rms_eps)
      .def_rw("head_dim", &MambaStackOptions::head_dim)
      .def_rw("heads", &MambaStackOptions::heads)
      .def_rw("n_groups", &MambaStackOptions::n_groups)
      .def_rw("time_step_limit_min", &MambaStackOptions::time_step_limit_min)
      .def_rw("time_step_limit_max", &MambaStackOptions::time_step_limit_max)
      .def_rw("detach_inputs", &MambaStackOptions::detach_inputs)
      .def_rw("truncate", &MambaStackOptions::truncate)
      .def_rw("chunk", &MambaStackOptions::chunk)
      .def_rw("layer_checkpoint", &MambaStackOptions::layer_checkpoint)
      .def_rw("token_block", &MambaStackOptions::token_block)
      .def_rw("storage", &MambaStackOptions::storage);
  m.def("mamba_stack_check", &mamba_stack_check, "options"_a);
  m.def(
      "mamba_stack_forward",
      [](const nb::list& blocks, const MambaStackOptions& o, nb::handle y0, nb::handle yK) {
        by_dtype(y0, [&](auto tag) {
          using S = decltype(tag);
          const auto a = tensor3<S>(y0, "y0");
          mamba_stack_forward<S>(blocks, o, a, tensor3<S>(yK, "yK"));
        });
      },
      "blocks"_a, "options"_a, "y0"_a, "yK"_a);
  m.def(
      "mamba_stack_backward",
      [](const nb::list& blocks, const nb::list& grads, const MambaStackOptions& o, nb::handle y0, nb::handle g) {
        by_dtype(y0, [&](auto tag) {
          using S = decltype(tag);
          const auto a = tensor3<S>(y0, "y0");
          mamba_stack_backward<S>(blocks, grads, o, a, tensor3<S>(g, "g"));
        });
      },
      "blocks"_a, "grads"_a, "options"_a, "y0"_a, "g"_a);
}

}  // namespace ash_py
