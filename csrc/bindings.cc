// Python bindings of the C++ core: the private module elastic_emb._core.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "batch_keys.h"
#include "check.h"
#include "data_plane_bindings.h"
#include "py_arrays.h"
#include "request_bindings.h"
#include "shard_bindings.h"
#include "string_keys.h"
#include "table.h"
#include "thread_pool.h"
#include "varint.h"

#ifndef EE_CXX_FLAGS
#define EE_CXX_FLAGS ""
#endif
#ifndef EE_WITH_CUDA
#define EE_WITH_CUDA 0
#endif
#if EE_WITH_CUDA
#include "device_table.h"
#endif

namespace py = pybind11;
using TableClass = py::class_<elastic_emb::Table, std::shared_ptr<elastic_emb::Table>>;
using elastic_emb::InvalidArgument;

namespace {

using elastic_emb::py_arrays::CheckArray;
using elastic_emb::py_arrays::ToNumpy;

// The options of Table and DeviceTable: plain structs, checked by their
// Validate() when a table is built.
void BindOptions(py::module_& m) {
  using elastic_emb::AdmissionOptions;
  using elastic_emb::EvictionKind;
  using elastic_emb::EvictionOptions;
  using elastic_emb::InitializerOptions;
  using elastic_emb::InitKind;
  using elastic_emb::OptimizerKind;
  using elastic_emb::OptimizerOptions;
  using elastic_emb::TableOptions;
  py::enum_<OptimizerKind>(m, "OptimizerKind")
      .value("sgd", OptimizerKind::kSgd)
      .value("adagrad", OptimizerKind::kAdagrad)
      .value("adam", OptimizerKind::kAdam)
      .value("ftrl", OptimizerKind::kFtrl)
      .value("rmsprop", OptimizerKind::kRmsprop);
  py::enum_<InitKind>(m, "InitKind")
      .value("zeros", InitKind::kZeros)
      .value("ones", InitKind::kOnes)
      .value("constant", InitKind::kConstant)
      .value("uniform", InitKind::kUniform)
      .value("normal", InitKind::kNormal)
      .value("truncated_normal", InitKind::kTruncatedNormal);
  py::class_<OptimizerOptions>(m, "OptimizerOptions")
      .def(py::init<>())
      .def_readwrite("kind", &OptimizerOptions::kind)
      .def_readwrite("momentum", &OptimizerOptions::momentum)
      .def_readwrite("nesterov", &OptimizerOptions::nesterov)
      .def_readwrite("rho", &OptimizerOptions::rho)
      .def_readwrite("centered", &OptimizerOptions::centered)
      .def_readwrite("beta_1", &OptimizerOptions::beta_1)
      .def_readwrite("beta_2", &OptimizerOptions::beta_2)
      .def_readwrite("epsilon", &OptimizerOptions::epsilon)
      .def_readwrite("initial_accumulator_value", &OptimizerOptions::initial_accumulator_value)
      .def_readwrite("learning_rate_power", &OptimizerOptions::learning_rate_power)
      .def_readwrite("l1_regularization_strength", &OptimizerOptions::l1_regularization_strength)
      .def_readwrite("l2_regularization_strength", &OptimizerOptions::l2_regularization_strength)
      .def_readwrite("l2_shrinkage_regularization_strength",
                     &OptimizerOptions::l2_shrinkage_regularization_strength)
      .def_readwrite("beta", &OptimizerOptions::beta);
  py::class_<InitializerOptions>(m, "InitializerOptions")
      .def(py::init<>())
      .def_readwrite("kind", &InitializerOptions::kind)
      .def_readwrite("a", &InitializerOptions::a)
      .def_readwrite("b", &InitializerOptions::b)
      .def_readwrite("seed", &InitializerOptions::seed);
  py::class_<AdmissionOptions>(m, "AdmissionOptions")
      .def(py::init<>())
      .def_readwrite("min_count", &AdmissionOptions::min_count)
      .def_readwrite("sketch_bytes", &AdmissionOptions::sketch_bytes)
      .def_readwrite("sketch_depth", &AdmissionOptions::sketch_depth);
  py::enum_<elastic_emb::RowDtype>(m, "RowDtype")
      .value("float32", elastic_emb::RowDtype::kFloat32)
      .value("float16", elastic_emb::RowDtype::kFloat16)
      .value("bfloat16", elastic_emb::RowDtype::kBfloat16);
  py::enum_<EvictionKind>(m, "EvictionKind")
      .value("none", EvictionKind::kNone)
      .value("ttl", EvictionKind::kTtl)
      .value("lru", EvictionKind::kLru)
      .value("lfu", EvictionKind::kLfu);
  py::class_<EvictionOptions>(m, "EvictionOptions")
      .def(py::init<>())
      .def_readwrite("kind", &EvictionOptions::kind)
      .def_readwrite("ttl_steps", &EvictionOptions::ttl_steps)
      .def_readwrite("max_rows", &EvictionOptions::max_rows)
      .def_readwrite("protect_steps", &EvictionOptions::protect_steps)
      .def_readwrite("keep_evicted", &EvictionOptions::keep_evicted);
  // Nested options are returned by reference: o.optimizer.momentum = 0.9 sets o.
  py::class_<TableOptions>(m, "TableOptions")
      .def(py::init<>())
      .def_readwrite("dim", &TableOptions::dim)
      .def_readwrite("initializer", &TableOptions::initializer)
      .def_readwrite("optimizer", &TableOptions::optimizer)
      .def_readwrite("row_dtype", &TableOptions::row_dtype)
      .def_readwrite("admission", &TableOptions::admission)
      .def_readwrite("eviction", &TableOptions::eviction)
      .def_readwrite("shard_bits", &TableOptions::shard_bits);
}

void PullToHost(elastic_emb::Table& t, int64_t n, const int64_t* k, float* o, bool train) {
  t.Pull(n, k, o, train);
}

void PushFromHost(elastic_emb::Table& t, int64_t n, const int64_t* k, const float* g, float lr,
                  int64_t step) {
  t.Push(n, k, g, lr, step);
}

#if EE_WITH_CUDA
void PullToHost(elastic_emb::DeviceTable& t, int64_t n, const int64_t* k, float* o, bool train) {
  t.Pull(n, k, o, /*out_on_device=*/false, train);
}

void PushFromHost(elastic_emb::DeviceTable& t, int64_t n, const int64_t* k, const float* g,
                  float lr, int64_t step) {
  t.Push(n, k, g, /*grads_on_device=*/false, lr, step);
}

#endif

// The methods Table and DeviceTable share, with the same Python signatures.
// (keys, values, slots, last_step, update_count) as NumPy arrays; takes the rows' buffers.
template <typename T>
py::tuple RowsTuple(const T& t, elastic_emb::ExportedRows& rows) {
  const auto m = static_cast<py::ssize_t>(rows.keys.size());
  const py::ssize_t dim = t.dim(), slot_width = t.num_slots() * t.dim();
  return py::make_tuple(
      ToNumpy(std::move(rows.keys), {m}), ToNumpy(std::move(rows.values), {m, dim}),
      ToNumpy(std::move(rows.slots), {m, slot_width}), ToNumpy(std::move(rows.last_step), {m}),
      ToNumpy(std::move(rows.update_count), {m}));
}

template <typename T, typename... Extra>
void BindTableMethods(py::class_<T, Extra...>& cls) {
  cls.def_property_readonly("dim", &T::dim)
      .def_property_readonly("num_slots", &T::num_slots)
      .def(
          "pull",
          [](T& t, const py::array& keys_in, bool train) {
            auto keys = CheckArray<int64_t>(keys_in, "keys", {-1});
            const py::ssize_t n = keys.shape(0);
            py::array_t<float> out({n, static_cast<py::ssize_t>(t.dim())});
            const int64_t* k = keys.data();
            float* o = out.mutable_data();
            {
              py::gil_scoped_release release;
              PullToHost(t, n, k, o, train);
            }
            return out;
          },
          py::arg("keys"), py::arg("train"))
      .def(
          "push",
          [](T& t, const py::array& keys_in, const py::array& grads_in, float learning_rate,
             int64_t step) {
            auto keys = CheckArray<int64_t>(keys_in, "keys", {-1});
            auto grads = CheckArray<float>(grads_in, "grads", {keys.shape(0), t.dim()});
            const int64_t* k = keys.data();
            const float* g = grads.data();
            py::gil_scoped_release release;
            PushFromHost(t, keys.shape(0), k, g, learning_rate, step);
          },
          py::arg("keys"), py::arg("grads"), py::arg("learning_rate"), py::arg("step"))
      .def(
          "import_rows",
          [](T& t, const py::array& keys_in, const py::array& values_in, const py::object& slots_in,
             const py::object& last_step_in, const py::object& update_count_in) {
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
      .def(
          "export_rows",
          [](T& t, bool with_state) -> py::tuple {
            elastic_emb::ExportedRows rows;
            {
              py::gil_scoped_release release;
              rows = t.Export(with_state);
            }
            if (with_state) return RowsTuple(t, rows);
            const auto m = static_cast<py::ssize_t>(rows.keys.size());
            return py::make_tuple(ToNumpy(std::move(rows.keys), {m}),
                                  ToNumpy(std::move(rows.values), {m, t.dim()}));
          },
          py::arg("with_state") = true,
          "(keys, values, slots, last_step, update_count) of every row; (keys, values) "
          "without with_state.")
      .def(
          "erase",
          [](T& t, const py::array& keys_in) {
            auto keys = CheckArray<int64_t>(keys_in, "keys", {-1});
            const int64_t* k = keys.data();
            py::gil_scoped_release release;
            return t.Erase(keys.shape(0), k);
          },
          py::arg("keys"))
      .def(
          "metadata",
          [](T& t, const py::array& keys_in) {
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
      .def("size", &T::Size, py::call_guard<py::gil_scoped_release>())
      .def("memory_bytes", &T::MemoryBytes, py::call_guard<py::gil_scoped_release>());
}

// Change tracking of the CPU table (incremental checkpoints).
void BindChangeTracking(TableClass& cls) {
  cls.def("memory_in_use", &elastic_emb::Table::MemoryInUse,
          py::call_guard<py::gil_scoped_release>());
  cls.def(
      "export_changes",
      [](elastic_emb::Table& t, bool all) {
        elastic_emb::ExportedChanges changes;
        {
          py::gil_scoped_release release;
          changes = t.ExportChanges(all);
        }
        const auto e = static_cast<py::ssize_t>(changes.erased.size());
        return py::tuple(
            RowsTuple(t, changes.rows) +
            py::make_tuple(ToNumpy(std::move(changes.erased), {e}), changes.change_set));
      },
      py::arg("all"),
      "Closes the change set: (keys, values, slots, last_step, update_count) of the rows "
      "changed since the previous call (every row with all=True), the keys erased since "
      "(int64 (e,)), and the number of the change set.");
}

// Admission and eviction of the CPU table.
void BindPolicies(TableClass& cls) {
  cls.def(
         "export_counts",
         [](elastic_emb::Table& t) {
           std::vector<uint8_t> counts;
           {
             py::gil_scoped_release release;
             counts = t.ExportCounts();
           }
           const auto n = static_cast<py::ssize_t>(counts.size());
           return ToNumpy(std::move(counts), {n});
         },
         "The admission sketch's counters, uint8 (c,); empty without admission.")
      .def(
          "import_counts",
          [](elastic_emb::Table& t, const py::array& counts_in, bool add) {
            auto counts = CheckArray<uint8_t>(counts_in, "counts", {t.NumCounts()});
            const uint8_t* c = counts.data();
            py::gil_scoped_release release;
            t.ImportCounts(t.NumCounts(), c, add);
          },
          py::arg("counts"), py::arg("add"),
          "Replaces the admission sketch's counters (add=True: saturating sum).")
      .def_property_readonly("num_counts", &elastic_emb::Table::NumCounts)
      .def(
          "take_evicted",
          [](elastic_emb::Table& t) {
            elastic_emb::ExportedRows rows;
            {
              py::gil_scoped_release release;
              rows = t.TakeEvicted();
            }
            return RowsTuple(t, rows);
          },
          "export_rows of the rows eviction erased since the last call (keep_evicted).")
      .def("evict_now", &elastic_emb::Table::EvictNow, py::call_guard<py::gil_scoped_release>(),
           "An eviction pass now, as after a push that used no row.")
      .def(
          "lock_step",
          [](elastic_emb::Table& t) {
            std::mutex& mu = t.step_state().mu;
            if (mu.try_lock()) return;  // (uncontended: keeps the GIL)
            py::gil_scoped_release release;
            mu.lock();
          },
          "Takes the table's step lock (LocalTable: one push at a time, numbered in order).")
      .def(
          "unlock_step", [](elastic_emb::Table& t) { t.step_state().mu.unlock(); },
          "Releases the step lock (taken by this thread).")
      .def_property_readonly(
          "step_order", [](const elastic_emb::Table& t) { return reinterpret_cast<uintptr_t>(&t); },
          "The order in which callers take several tables' step locks (no deadlock).")
      .def_property(
          "iterations", [](elastic_emb::Table& t) { return t.step_state().iterations; },
          [](elastic_emb::Table& t, int64_t n) { t.step_state().iterations = n; },
          "Pushes applied so far (read and written with the step lock held).")
      .def_property(
          "nonfinite_pushes", [](elastic_emb::Table& t) { return t.step_state().nonfinite_pushes; },
          [](elastic_emb::Table& t, int64_t n) { t.step_state().nonfinite_pushes = n; },
          "Pushes skipped for gradients not finite (with the step lock held).")
      .def("set_clock", &elastic_emb::Table::SetClock, py::arg("step"),
           "The step of the table's last push (after a restore): pulls mark rows used at the "
           "next step.")
      .def(
          "policy_counts",
          [](const elastic_emb::Table& t) {
            const elastic_emb::PolicyCounts c = t.Counts();
            py::dict out;
            out["evicted_rows"] = c.evicted_rows;
            out["evicted_bytes"] = c.evicted_bytes;
            out["admitted_keys"] = c.admitted_keys;
            out["rejected_updates"] = c.rejected_updates;
            return out;
          },
          "What admission and eviction did so far.");
}

// Slot ranges of the CPU table (a parameter server moving a range between groups).
void BindSlotRanges(TableClass& cls) {
  cls.def(
         "export_slots",
         [](elastic_emb::Table& t, int64_t num_slots, int64_t begin, int64_t end) {
           elastic_emb::ExportedRows rows;
           {
             py::gil_scoped_release release;
             rows = t.ExportSlots(num_slots, begin, end);
           }
           return RowsTuple(t, rows);
         },
         py::arg("num_slots"), py::arg("begin"), py::arg("end"),
         "export_rows, of the keys whose virtual slot is in [begin, end).")
      .def("erase_slots", &elastic_emb::Table::EraseSlots, py::arg("num_slots"), py::arg("begin"),
           py::arg("end"), py::call_guard<py::gil_scoped_release>(),
           "Erases the keys whose virtual slot is in [begin, end); returns how many.");
}

#if EE_WITH_CUDA
// DLPack (https://dmlc.github.io/dlpack): the C ABI of a tensor handed
// between frameworks in a PyCapsule named "dltensor".
struct DLDevice {
  int32_t device_type;  // 1: CPU, 2: CUDA
  int32_t device_id;
};
struct DLDataType {
  uint8_t code;  // 0: int, 1: uint, 2: float
  uint8_t bits;
  uint16_t lanes;
};
struct DLTensor {
  void* data;
  DLDevice device;
  int32_t ndim;
  DLDataType dtype;
  int64_t* shape;
  int64_t* strides;  // in elements; null: C-contiguous
  uint64_t byte_offset;
};
struct DLManagedTensor {
  DLTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(DLManagedTensor*);
};

// A DLManagedTensor over memory owned by a Python object (kept alive until
// the consumer calls the deleter).
struct Exported {
  DLManagedTensor managed;
  std::vector<int64_t> shape;
  PyObject* owner;
};

py::capsule ToDlpack(uintptr_t data, std::vector<int64_t> shape, int code, int bits, int device_id,
                     py::object owner) {
  auto* e = new Exported{};
  e->shape = std::move(shape);
  e->owner = owner.release().ptr();
  DLTensor& t = e->managed.dl_tensor;
  t.data = reinterpret_cast<void*>(data);
  t.device = {2, device_id};
  t.ndim = static_cast<int32_t>(e->shape.size());
  t.dtype = {static_cast<uint8_t>(code), static_cast<uint8_t>(bits), 1};
  t.shape = e->shape.data();
  t.strides = nullptr;
  t.byte_offset = 0;
  e->managed.manager_ctx = e;
  e->managed.deleter = [](DLManagedTensor* self) {
    auto* owned = static_cast<Exported*>(self->manager_ctx);
    py::gil_scoped_acquire gil;
    Py_XDECREF(owned->owner);
    delete owned;
  };
  return py::capsule(&e->managed, "dltensor", [](PyObject* capsule) {
    // Unconsumed (still named "dltensor"): the producer frees it.
    if (PyCapsule_IsValid(capsule, "dltensor")) {
      auto* managed = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule, "dltensor"));
      managed->deleter(managed);
    }
  });
}

// What a "dltensor" capsule describes; the capsule must outlive the use.
py::dict DlpackInfo(const py::capsule& capsule) {
  EE_CHECK(PyCapsule_IsValid(capsule.ptr(), "dltensor"),
           "expected an unconsumed DLPack capsule named 'dltensor'");
  const auto* managed =
      static_cast<const DLManagedTensor*>(PyCapsule_GetPointer(capsule.ptr(), "dltensor"));
  const DLTensor& t = managed->dl_tensor;
  std::vector<int64_t> shape(t.shape, t.shape + t.ndim);
  py::object strides = py::none();
  if (t.strides != nullptr) strides = py::cast(std::vector<int64_t>(t.strides, t.strides + t.ndim));
  py::dict info;
  info["data"] = reinterpret_cast<uintptr_t>(t.data) + t.byte_offset;
  info["device_type"] = t.device.device_type;
  info["device_id"] = t.device.device_id;
  info["shape"] = shape;
  info["strides"] = strides;
  info["code"] = static_cast<int>(t.dtype.code);
  info["bits"] = static_cast<int>(t.dtype.bits);
  info["lanes"] = static_cast<int>(t.dtype.lanes);
  return info;
}

void BindDevice(py::module_& m) {
  using elastic_emb::DeviceTable;
  py::register_exception<elastic_emb::CudaError>(m, "CudaError", PyExc_RuntimeError);
  py::register_exception<elastic_emb::CudaOutOfMemory>(m, "CudaOutOfMemory", PyExc_MemoryError);
  py::class_<DeviceTable> cls(m, "DeviceTable");
  // shard_bits is checked but unused: the GPU table has one index.
  cls.def(py::init<const elastic_emb::TableOptions&>(), py::arg("options"));
  BindTableMethods(cls);
  // Device pointers are passed as integers; the Python wrapper checks them.
  cls.def(
         "pull_to_device",
         [](DeviceTable& t, const py::array& keys_in, uintptr_t out, bool train) {
           auto keys = CheckArray<int64_t>(keys_in, "keys", {-1});
           const int64_t* k = keys.data();
           py::gil_scoped_release release;
           t.Pull(keys.shape(0), k, reinterpret_cast<float*>(out), /*out_on_device=*/true, train);
         },
         py::arg("keys"), py::arg("out"), py::arg("train"))
      .def(
          "push_from_device",
          [](DeviceTable& t, const py::array& keys_in, uintptr_t grads, float learning_rate,
             int64_t step) {
            auto keys = CheckArray<int64_t>(keys_in, "keys", {-1});
            const int64_t* k = keys.data();
            py::gil_scoped_release release;
            t.Push(keys.shape(0), k, reinterpret_cast<const float*>(grads),
                   /*grads_on_device=*/true, learning_rate, step);
          },
          py::arg("keys"), py::arg("grads"), py::arg("learning_rate"), py::arg("step"))
      .def("reserve", &DeviceTable::Reserve, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("capacity", &DeviceTable::capacity)
      .def(
          "gather_rows",
          [](DeviceTable& t, uintptr_t rows, int64_t n, uintptr_t out) {
            t.GatherRows(reinterpret_cast<const uint32_t*>(rows), n, reinterpret_cast<float*>(out));
          },
          py::arg("rows"), py::arg("n"), py::arg("out"), py::call_guard<py::gil_scoped_release>())
      .def(
          "apply_rows",
          [](DeviceTable& t, uintptr_t rows, int64_t n, uintptr_t grads, float lr, int64_t step) {
            t.ApplyRows(reinterpret_cast<const uint32_t*>(rows), n,
                        reinterpret_cast<const float*>(grads), lr, step);
          },
          py::arg("rows"), py::arg("n"), py::arg("grads"), py::arg("learning_rate"),
          py::arg("step"), py::call_guard<py::gil_scoped_release>())
      .def("synchronize", &DeviceTable::Synchronize, py::call_guard<py::gil_scoped_release>());

  m.def("device_malloc", [](int64_t bytes) {
    return reinterpret_cast<uintptr_t>(elastic_emb::DeviceMalloc(bytes));
  });
  m.def("device_free", [](uintptr_t p) { elastic_emb::DeviceFree(reinterpret_cast<void*>(p)); });
  m.def("copy_to_host", [](py::array out, uintptr_t src) {
    EE_CHECK(out.flags() & py::array::c_style, "`out` must be C-contiguous");
    elastic_emb::CopyToHost(out.mutable_data(), reinterpret_cast<const void*>(src), out.nbytes());
  });
  m.def("copy_to_device", [](uintptr_t dst, const py::array& in) {
    EE_CHECK(in.flags() & py::array::c_style, "`in` must be C-contiguous");
    elastic_emb::CopyToDevice(reinterpret_cast<void*>(dst), in.data(), in.nbytes());
  });
  m.def("device_synchronize", &elastic_emb::DeviceSynchronize,
        py::call_guard<py::gil_scoped_release>());
  m.def("to_dlpack", &ToDlpack, py::arg("data"), py::arg("shape"), py::arg("code"), py::arg("bits"),
        py::arg("device_id"), py::arg("owner"));
  m.def("dlpack_info", &DlpackInfo, py::arg("capsule"));
}
#endif

void BindStringKeys(py::module_& m) {
  m.def(
      "string_keys",
      [](const py::sequence& strings) {
        // The bytes of each (a str as UTF-8, as TensorFlow stores it), then hashed without the GIL.
        const auto n = static_cast<py::ssize_t>(strings.size());
        std::vector<py::object> held(static_cast<size_t>(n));
        std::vector<std::pair<const char*, Py_ssize_t>> spans(static_cast<size_t>(n));
        for (py::ssize_t i = 0; i < n; ++i) {
          held[i] = strings[i];
          PyObject* s = held[i].ptr();
          char* data = nullptr;
          Py_ssize_t len = 0;
          if (PyBytes_Check(s)) {
            PyBytes_AsStringAndSize(s, &data, &len);
          } else if (PyUnicode_Check(s)) {
            const char* utf8 = PyUnicode_AsUTF8AndSize(s, &len);
            if (utf8 == nullptr) throw py::error_already_set();
            data = const_cast<char*>(utf8);
          } else {
            throw py::type_error("string keys are made from str or bytes; item " +
                                 std::to_string(i) + " is " +
                                 std::string(py::str(py::type::of(held[i]).attr("__name__"))));
          }
          spans[i] = {data, len};
        }
        py::array_t<int64_t> keys(n);
        int64_t* out = keys.mutable_data();
        {
          py::gil_scoped_release release;
          for (py::ssize_t i = 0; i < n; ++i) {
            const uint64_t key = elastic_emb::StringFingerprint(
                spans[i].first, static_cast<size_t>(spans[i].second));
            std::memcpy(&out[i], &key, sizeof(key));
          }
        }
        return keys;
      },
      py::arg("strings"),
      "int64 keys of a sequence of str/bytes: tf.fingerprint's FarmHash64, bit for bit.");
}

void BindBatchKeys(py::module_& m) {
  m.def(
      "unique_keys",
      [](const py::array& keys_in) {
        auto keys = CheckArray<int64_t>(keys_in, "keys", {-1});
        const py::ssize_t n = keys.shape(0);
        py::array_t<int64_t> index(n);
        std::vector<int64_t> unique;
        const int64_t* k = keys.data();
        int64_t* i = index.mutable_data();
        {
          py::gil_scoped_release release;
          elastic_emb::UniqueKeys(n, k, unique, i);
        }
        const auto u = static_cast<py::ssize_t>(unique.size());
        return py::make_tuple(ToNumpy(std::move(unique), {u}), index);
      },
      py::arg("keys"),
      "(distinct keys in order of first occurrence, position of each key among them).");
  m.def(
      "sum_by_key",
      [](const py::array& keys_in, const py::array& grads_in) {
        auto keys = CheckArray<int64_t>(keys_in, "keys", {-1});
        const py::ssize_t n = keys.shape(0);
        EE_CHECK(grads_in.ndim() == 2, "`grads` must have 2 dimension(s), got " << grads_in.ndim());
        auto grads = CheckArray<float>(grads_in, "grads", {n, -1});
        const auto dim = static_cast<int>(grads.shape(1));
        std::vector<int64_t> unique;
        std::vector<float> sums;
        const int64_t* k = keys.data();
        const float* g = grads.data();
        {
          py::gil_scoped_release release;
          elastic_emb::SumByKey(n, k, g, dim, unique, sums);
        }
        const auto u = static_cast<py::ssize_t>(unique.size());
        return py::make_tuple(ToNumpy(std::move(unique), {u}), ToNumpy(std::move(sums), {u, dim}));
      },
      py::arg("keys"), py::arg("grads"),
      "(distinct keys, their rows of grads summed in input order from +0.0).");
  m.def(
      "split_by_slot_range",
      [](const py::array& keys_in, const py::array& starts_in, int64_t num_slots) {
        auto keys = CheckArray<int64_t>(keys_in, "keys", {-1});
        auto starts = CheckArray<int64_t>(starts_in, "starts", {-1});
        const py::ssize_t n = keys.shape(0), ranges = starts.shape(0);
        EE_CHECK(num_slots > 0, "`num_slots` must be positive, got " << num_slots);
        EE_CHECK(ranges > 0 && starts.data()[0] == 0, "`starts` must begin with slot 0");
        for (py::ssize_t r = 1; r < ranges; ++r) {
          EE_CHECK(starts.data()[r - 1] <= starts.data()[r] && starts.data()[r] <= num_slots,
                   "`starts` must ascend within [0, num_slots]");
        }
        py::array_t<int64_t> order(n), bounds(ranges + 1);
        const int64_t *k = keys.data(), *s = starts.data();
        int64_t *o = order.mutable_data(), *b = bounds.mutable_data();
        {
          py::gil_scoped_release release;
          elastic_emb::SplitBySlotRange(n, k, ranges, s, num_slots, o, b);
        }
        return py::make_tuple(order, bounds);
      },
      py::arg("keys"), py::arg("starts"), py::arg("num_slots"),
      "(positions of the keys ordered by slot range, then key as uint64; range bounds).");
  m.def(
      "count_by_slot",
      [](const py::array& keys_in, int64_t num_slots) {
        auto keys = CheckArray<int64_t>(keys_in, "keys", {-1});
        EE_CHECK(num_slots > 0, "`num_slots` must be positive, got " << num_slots);
        py::array_t<int64_t> counts(num_slots);
        int64_t* c = counts.mutable_data();
        std::fill(c, c + num_slots, 0);
        const int64_t* k = keys.data();
        {
          py::gil_scoped_release release;
          elastic_emb::CountBySlot(keys.shape(0), k, num_slots, c);
        }
        return counts;
      },
      py::arg("keys"), py::arg("num_slots"), "The number of keys in each virtual slot.");
}

void BindVarint(py::module_& m) {
  m.def(
      "encode_delta_varint",
      [](const py::array& keys_in) {
        auto keys = CheckArray<int64_t>(keys_in, "keys", {-1});
        std::string out;
        const int64_t* k = keys.data();
        {
          py::gil_scoped_release release;
          elastic_emb::EncodeDeltaVarint(keys.shape(0), k, out);
        }
        return py::bytes(out);
      },
      py::arg("keys"), "int64 keys -> bytes: deltas (modulo 2^64) as LEB128 varints.");
  m.def(
      "decode_delta_varint",
      [](const py::buffer& raw) {
        const py::buffer_info info = raw.request();
        EE_CHECK(info.ndim == 1 && info.itemsize == 1, "`raw` must be bytes");
        std::vector<int64_t> keys;
        std::string error;
        bool ok;
        {
          py::gil_scoped_release release;
          ok = elastic_emb::DecodeDeltaVarint(static_cast<const uint8_t*>(info.ptr),
                                              static_cast<size_t>(info.size), keys, error);
        }
        if (!ok) keys.clear();
        const auto n = static_cast<py::ssize_t>(keys.size());
        return py::make_tuple(ToNumpy(std::move(keys), {n}),
                              ok ? py::object(py::none()) : py::object(py::str(error)));
      },
      py::arg("raw"),
      "The inverse of encode_delta_varint: (keys, None), or (empty keys, what is malformed).");
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

  BindOptions(m);
  BindBatchKeys(m);
  BindStringKeys(m);
  BindVarint(m);
  elastic_emb::BindRequests(m);
  // Held by shared_ptr: the data plane's shards share the tables (csrc/shard_core.h).
  TableClass table(m, "Table");
  table.def(py::init<const elastic_emb::TableOptions&>(), py::arg("options"));
  BindTableMethods(table);
  BindChangeTracking(table);
  BindSlotRanges(table);
  elastic_emb::BindShards(m);
  elastic_emb::BindDataPlane(m);
  BindPolicies(table);

#if EE_WITH_CUDA
  BindDevice(m);
  m.def("cuda_device_count", &elastic_emb::CudaDeviceCount, "Visible CUDA devices.");
#else
  m.def("cuda_device_count", [] { return 0; }, "Visible CUDA devices (none: CPU-only build).");
#endif
}
