// Python bindings of the C++ core: the private module elastic_emb._core.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <utility>
#include <vector>

#include "check.h"
#include "table.h"
#include "thread_pool.h"

#ifndef EE_CXX_FLAGS
#define EE_CXX_FLAGS ""
#endif
#ifndef EE_WITH_CUDA
#define EE_WITH_CUDA 0
#endif

namespace py = pybind11;
using elastic_emb::InvalidArgument;

namespace {

// Checks dtype, C-contiguity and shape of an argument before any C++ runs.
// shape entries of -1 match any size.
template <typename T>
py::array_t<T> CheckArray(const py::array& a, const char* name, std::vector<py::ssize_t> shape) {
  EE_CHECK(py::isinstance<py::array_t<T>>(a) && a.dtype().is(py::dtype::of<T>()),
           "`" << name << "` must have dtype " << std::string(py::str(py::dtype::of<T>()))
               << ", got " << std::string(py::str(a.dtype())));
  EE_CHECK(a.ndim() == static_cast<py::ssize_t>(shape.size()),
           "`" << name << "` must have " << shape.size() << " dimension(s), got " << a.ndim());
  for (size_t d = 0; d < shape.size(); ++d) {
    EE_CHECK(shape[d] < 0 || a.shape(d) == shape[d], "`" << name << "` has size " << a.shape(d)
                                                         << " in dimension " << d << ", expected "
                                                         << shape[d]);
  }
  EE_CHECK(a.flags() & py::array::c_style, "`" << name << "` must be C-contiguous");
  return py::array_t<T>(a);
}

// Hands a vector's buffer to numpy without copying.
template <typename T>
py::array_t<T> ToNumpy(std::vector<T>&& v, std::vector<py::ssize_t> shape) {
  auto* owned = new std::vector<T>(std::move(v));
  py::capsule free_when_done(owned, [](void* p) { delete static_cast<std::vector<T>*>(p); });
  return py::array_t<T>(shape, owned->data(), free_when_done);
}

elastic_emb::TableOptions MakeOptions(int dim, const std::string& initializer, float init_a,
                                      float init_b, uint64_t seed, const std::string& optimizer,
                                      const py::dict& optimizer_args, int shard_bits) {
  elastic_emb::TableOptions o;
  o.dim = dim;
  o.shard_bits = shard_bits;
  o.initializer.kind = elastic_emb::ParseInitKind(initializer);
  o.initializer.a = init_a;
  o.initializer.b = init_b;
  o.initializer.seed = seed;
  elastic_emb::OptimizerOptions& p = o.optimizer;
  p.kind = elastic_emb::ParseOptimizerKind(optimizer);
  for (auto item : optimizer_args) {
    const std::string k = py::cast<std::string>(item.first);
    const py::handle v = item.second;
    if (k == "momentum")
      p.momentum = py::cast<double>(v);
    else if (k == "nesterov")
      p.nesterov = py::cast<bool>(v);
    else if (k == "beta_1")
      p.beta_1 = py::cast<double>(v);
    else if (k == "beta_2")
      p.beta_2 = py::cast<double>(v);
    else if (k == "epsilon")
      p.epsilon = py::cast<double>(v);
    else if (k == "initial_accumulator_value")
      p.initial_accumulator_value = py::cast<double>(v);
    else if (k == "learning_rate_power")
      p.learning_rate_power = py::cast<double>(v);
    else if (k == "l1_regularization_strength")
      p.l1_regularization_strength = py::cast<double>(v);
    else if (k == "l2_regularization_strength")
      p.l2_regularization_strength = py::cast<double>(v);
    else if (k == "l2_shrinkage_regularization_strength")
      p.l2_shrinkage_regularization_strength = py::cast<double>(v);
    else if (k == "beta")
      p.beta = py::cast<double>(v);
    else
      EE_CHECK(false, "unknown optimizer option '" << k << "'");
  }
  return o;
}

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "elastic_emb C++ core (private; use the elastic_emb package).";
  py::register_exception<InvalidArgument>(m, "InvalidArgument", PyExc_ValueError);

  m.attr("cxx_flags") = EE_CXX_FLAGS;
  m.attr("with_cuda") = static_cast<bool>(EE_WITH_CUDA);
  m.def("pool_threads", &elastic_emb::PoolThreads, "Threads used by batch calls.");
  m.def("compiler", [] {
#if defined(__clang__)
    return std::string("clang ") + __clang_version__;
#elif defined(__GNUC__)
    return std::string("gcc ") + __VERSION__;
#else
    return std::string("unknown");
#endif
  });

  using elastic_emb::Table;
  py::class_<Table>(m, "Table")
      .def(py::init([](int dim, const std::string& initializer, float init_a, float init_b,
                       uint64_t seed, const std::string& optimizer, const py::dict& optimizer_args,
                       int shard_bits) {
             return new Table(MakeOptions(dim, initializer, init_a, init_b, seed, optimizer,
                                          optimizer_args, shard_bits));
           }),
           py::arg("dim"), py::arg("initializer"), py::arg("init_a"), py::arg("init_b"),
           py::arg("seed"), py::arg("optimizer"), py::arg("optimizer_args"),
           py::arg("shard_bits") = 6)
      .def_property_readonly("dim", &Table::dim)
      .def_property_readonly("num_slots", &Table::num_slots)
      .def(
          "pull",
          [](Table& t, const py::array& keys_in, bool train) {
            auto keys = CheckArray<int64_t>(keys_in, "keys", {-1});
            const py::ssize_t n = keys.shape(0);
            py::array_t<float> out({n, static_cast<py::ssize_t>(t.dim())});
            const int64_t* k = keys.data();
            float* o = out.mutable_data();
            {
              py::gil_scoped_release release;
              t.Pull(n, k, o, train);
            }
            return out;
          },
          py::arg("keys"), py::arg("train"))
      .def(
          "push",
          [](Table& t, const py::array& keys_in, const py::array& grads_in, float learning_rate,
             int64_t step) {
            auto keys = CheckArray<int64_t>(keys_in, "keys", {-1});
            auto grads = CheckArray<float>(grads_in, "grads", {keys.shape(0), t.dim()});
            const int64_t* k = keys.data();
            const float* g = grads.data();
            py::gil_scoped_release release;
            t.Push(keys.shape(0), k, g, learning_rate, step);
          },
          py::arg("keys"), py::arg("grads"), py::arg("learning_rate"), py::arg("step"))
      .def(
          "import_rows",
          [](Table& t, const py::array& keys_in, const py::array& values_in,
             const py::object& slots_in, const py::object& last_step_in,
             const py::object& update_count_in) {
            auto keys = CheckArray<int64_t>(keys_in, "keys", {-1});
            const py::ssize_t n = keys.shape(0);
            auto values = CheckArray<float>(values_in, "values", {n, t.dim()});
            py::array_t<float> slots;
            py::array_t<uint32_t> last_step, update_count;
            if (!slots_in.is_none()) {
              slots = CheckArray<float>(slots_in, "slots", {n, t.num_slots() * t.dim()});
            }
            if (!last_step_in.is_none()) {
              last_step = CheckArray<uint32_t>(last_step_in, "last_step", {n});
            }
            if (!update_count_in.is_none()) {
              update_count = CheckArray<uint32_t>(update_count_in, "update_count", {n});
            }
            const float* s = slots_in.is_none() ? nullptr : slots.data();
            const uint32_t* ls = last_step_in.is_none() ? nullptr : last_step.data();
            const uint32_t* uc = update_count_in.is_none() ? nullptr : update_count.data();
            const int64_t* k = keys.data();
            const float* v = values.data();
            py::gil_scoped_release release;
            t.Import(n, k, v, s, ls, uc);
          },
          py::arg("keys"), py::arg("values"), py::arg("slots") = py::none(),
          py::arg("last_step") = py::none(), py::arg("update_count") = py::none())
      .def("export_rows",
           [](const Table& t) {
             elastic_emb::ExportedRows rows;
             {
               py::gil_scoped_release release;
               rows = t.Export();
             }
             const auto m = static_cast<py::ssize_t>(rows.keys.size());
             const py::ssize_t dim = t.dim(), slot_width = t.num_slots() * t.dim();
             return py::make_tuple(ToNumpy(std::move(rows.keys), {m}),
                                   ToNumpy(std::move(rows.values), {m, dim}),
                                   ToNumpy(std::move(rows.slots), {m, slot_width}),
                                   ToNumpy(std::move(rows.last_step), {m}),
                                   ToNumpy(std::move(rows.update_count), {m}));
           })
      .def(
          "erase",
          [](Table& t, const py::array& keys_in) {
            auto keys = CheckArray<int64_t>(keys_in, "keys", {-1});
            const int64_t* k = keys.data();
            py::gil_scoped_release release;
            return t.Erase(keys.shape(0), k);
          },
          py::arg("keys"))
      .def(
          "metadata",
          [](const Table& t, const py::array& keys_in) {
            auto keys = CheckArray<int64_t>(keys_in, "keys", {-1});
            const py::ssize_t n = keys.shape(0);
            py::array_t<int64_t> last_step(n), update_count(n);
            const int64_t* k = keys.data();
            int64_t* ls = last_step.mutable_data();
            int64_t* uc = update_count.mutable_data();
            {
              py::gil_scoped_release release;
              t.Metadata(n, k, ls, uc);
            }
            return py::make_tuple(last_step, update_count);
          },
          py::arg("keys"))
      .def("size", &Table::Size, py::call_guard<py::gil_scoped_release>())
      .def("memory_bytes", &Table::MemoryBytes, py::call_guard<py::gil_scoped_release>());
}
