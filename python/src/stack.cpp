// adjoint_sharding._core's layer stack: StackAdjoint (grad/stack_adjoint) over
// per-token arrays y_0, y_K, g [B, T, P] that cross without copies, as views of the
// caller's buffer (numpy through the buffer protocol, torch through DLPack); the
// adjoint_sharding.torch SSMStack module calls these.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "convert.hpp"

namespace ash_py {

using namespace nb::literals;

namespace {

struct StackOptions {
  std::int64_t vocab = 256, width = 0, state = 0, layers = 0;
  bool detach_inputs = false;
  std::int64_t truncate = 0, chunk = 64, layer_checkpoint = 1, token_block = 0;
  std::string storage = "float";
};

// The stack's options as a configuration, so that every one is checked as `ash grad`
// checks it (sizes included: no narrowing of a layer count past 2^31, no negative width).
ash::Config stack_config(const StackOptions& o, std::int64_t T) {
  ash::Config cfg;
  cfg.set("model.vocab=" + std::to_string(o.vocab));
  cfg.set("model.width=" + std::to_string(o.width));
  cfg.set("model.state=" + std::to_string(o.state));
  cfg.set("model.layers=" + std::to_string(o.layers));
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
  return cfg;
}

ash::ModelDims stack_dims(const StackOptions& o) { return stack_config(o, 2).model(); }
ash::EngineOptions stack_engine(const StackOptions& o, std::int64_t T) { return stack_config(o, T).settings().grad; }

template <class S>
using Tensor3 = nb::ndarray<S, nb::ndim<3>, nb::c_contig, nb::device::cpu>;

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
  ash::StackAdjoint<S> stack;
  ash::ParamSet<S> ps;

  StackCall(const nb::dict& params, const StackOptions& o, const Tensor3<S>& y0, const Tensor3<S>& other,
            const char* name, const std::vector<std::int64_t>& cu_seqlens)
      : d(checked_dims(o, y0, other, name)),
        s(stack_shape(y0.shape(0), y0.shape(1), cu_seqlens)),
        stack(stack_engine(o, s.T)),
        ps(d, ash::StackAdjoint<S>::range(d)) {
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
  ash::ParamSet<S> grad(c.d, ash::StackAdjoint<S>::range(c.d));
  {
    nb::gil_scoped_release nogil;
    c.stack.backward(c.ps, c.s, rows_view(y0), rows_view(g), grad);
    Kokkos::fence();
  }
  return paramset_to_dict(grad);
}

std::vector<std::pair<std::string, std::vector<std::int64_t>>> stack_layout(const StackOptions& o) {
  const auto d = stack_dims(o);
  std::vector<std::pair<std::string, std::vector<std::int64_t>>> out;
  for (const auto& t : ash::param_layout(d, ash::StackAdjoint<double>::range(d))) out.push_back({t.name, t.shape});
  return out;
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
  m.def("stack_forward", &stack_forward<float>, "params"_a, "options"_a, "y0"_a.noconvert(), "yK"_a.noconvert(),
        "cu_seqlens"_a = std::vector<std::int64_t>());
  m.def("stack_forward", &stack_forward<double>, "params"_a, "options"_a, "y0"_a.noconvert(), "yK"_a.noconvert(),
        "cu_seqlens"_a = std::vector<std::int64_t>());
  m.def("stack_backward", &stack_backward<float>, "params"_a, "options"_a, "y0"_a.noconvert(), "g"_a.noconvert(),
        "cu_seqlens"_a = std::vector<std::int64_t>());
  m.def("stack_backward", &stack_backward<double>, "params"_a, "options"_a, "y0"_a.noconvert(), "g"_a.noconvert(),
        "cu_seqlens"_a = std::vector<std::int64_t>());
}

}  // namespace ash_py
