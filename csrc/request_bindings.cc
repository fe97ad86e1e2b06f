#include "request_bindings.h"

#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "batch_keys.h"
#include "py_arrays.h"
#include "table.h"
#include "wire.h"

namespace py = pybind11;

namespace elastic_emb {
namespace {

using py_arrays::CheckArray;

std::string_view View(const py::bytes& raw) {
  char* data = nullptr;
  Py_ssize_t size = 0;
  if (PyBytes_AsStringAndSize(raw.ptr(), &data, &size) != 0) throw py::error_already_set();
  return {data, static_cast<size_t>(size)};
}

template <typename T>
py::array_t<T> Copy(const std::vector<T>& v, std::vector<py::ssize_t> shape) {
  py::array_t<T> out(shape);
  std::copy(v.begin(), v.end(), out.mutable_data());
  return out;
}

template <typename Tables>
py::list Names(const Tables& tables) {
  py::list out;
  for (const auto& t : tables) {
    PyObject* name =
        PyUnicode_DecodeUTF8(t.name.data(), static_cast<Py_ssize_t>(t.name.size()), "strict");
    if (name == nullptr) {
      PyErr_Clear();
      throw InvalidArgument("a table name is not UTF-8");
    }
    out.append(py::reinterpret_steal<py::str>(name));
  }
  return out;
}

template <typename Tables>
void CheckIndex(const Tables& tables, size_t i) {
  if (i >= tables.size()) throw py::index_error("no table " + std::to_string(i));
}

// A Pull as it came off the wire: parsed (keys decoded) without the GIL.
class PullMessage {
 public:
  explicit PullMessage(py::bytes raw) : raw_(std::move(raw)) {
    const std::string_view bytes = View(raw_);
    py::gil_scoped_release release;
    request_ = wire::ParsePullRequest(bytes);
  }

  const wire::PullRequest& request() const { return request_; }
  const py::bytes& raw() const { return raw_; }

  // The response's bytes; sources[i]: a Table, or (rows, versions or None) gathered already.
  py::bytes Answer(const py::list& sources) const {
    if (sources.size() != request_.tables.size()) {
      throw InvalidArgument(std::to_string(sources.size()) + " row sources for a pull of " +
                            std::to_string(request_.tables.size()) + " tables");
    }
    std::vector<wire::RowSource> rows(sources.size());
    std::vector<py::object> kept;  // alive while the GIL is released
    for (size_t i = 0; i < sources.size(); ++i) {
      py::handle s = sources[i];
      if (py::isinstance<Table>(s)) {
        rows[i].table = s.cast<Table*>();
        continue;
      }
      auto pair = s.cast<py::tuple>();
      const auto n = static_cast<py::ssize_t>(request_.tables[i].keys.size());
      auto values = CheckArray<float>(pair[0], "rows", {n, -1});
      rows[i].rows = values.data();
      rows[i].dim = static_cast<int>(values.shape(1));
      kept.push_back(values);
      if (!pair[1].is_none()) {
        auto versions = CheckArray<uint32_t>(pair[1], "versions", {n});
        rows[i].versions = versions.data();
        kept.push_back(versions);
      }
    }
    std::string out;
    {
      py::gil_scoped_release release;
      out = wire::AnswerPull(request_, rows);
    }
    return py::bytes(out);
  }

 private:
  py::bytes raw_;
  wire::PullRequest request_;
};

// A Push as it came off the wire; its gradients decoded by `decode`.
class PushMessage {
 public:
  explicit PushMessage(py::bytes raw) : raw_(std::move(raw)) {
    const std::string_view bytes = View(raw_);
    py::gil_scoped_release release;
    request_ = wire::ParsePushRequest(bytes);
  }

  const wire::PushRequest& request() const { return request_; }
  const py::bytes& raw() const { return raw_; }

  // Decodes the gradients (table i of width dims[i]); per table, why its push must
  // not be applied ("" when it may: wire::NonfiniteProblem).
  std::vector<std::string> Decode(const std::vector<int>& dims) {
    std::vector<std::string> problems(request_.tables.size());
    py::gil_scoped_release release;
    wire::DecodeGradients(request_, dims);
    for (size_t i = 0; i < request_.tables.size(); ++i) {
      const auto& t = request_.tables[i];
      problems[i] = wire::NonfiniteProblem(t.keys, t.gradients, dims[i]);
    }
    dims_ = dims;
    return problems;
  }

  py::array_t<float> Gradients(size_t i) const {
    CheckIndex(request_.tables, i);
    CheckDecoded();
    const auto& t = request_.tables[i];
    return Copy(t.gradients, {static_cast<py::ssize_t>(t.keys.size()), dims_[i]});
  }

  // One optimizer step of each table i whose tables[i] is not None.
  void Apply(const py::list& tables, const std::vector<float>& learning_rates,
             const std::vector<int64_t>& steps) const {
    CheckDecoded();
    const size_t n = request_.tables.size();
    if (tables.size() != n || learning_rates.size() != n || steps.size() != n) {
      throw InvalidArgument("apply needs a table, a learning rate and a step per pushed table");
    }
    std::vector<Table*> cores(n, nullptr);
    for (size_t i = 0; i < n; ++i) {
      if (!tables[i].is_none()) {
        cores[i] = tables[i].cast<Table*>();
        const auto& t = request_.tables[i];
        if (t.gradients.size() != t.keys.size() * static_cast<size_t>(cores[i]->dim())) {
          throw InvalidArgument("the gradients of '" + t.name + "' were decoded for another dim");
        }
      }
    }
    py::gil_scoped_release release;
    for (size_t i = 0; i < n; ++i) {
      if (cores[i] == nullptr) continue;
      const auto& t = request_.tables[i];
      cores[i]->Push(static_cast<int64_t>(t.keys.size()), t.keys.data(), t.gradients.data(),
                     learning_rates[i], steps[i]);
    }
  }

 private:
  void CheckDecoded() const {
    if (dims_.empty() && !request_.tables.empty())
      throw std::logic_error("PushMessage: decode the gradients first");
  }

  py::bytes raw_;
  wire::PushRequest request_;
  std::vector<int> dims_;  // the tables' widths, once decoded
};

// What both messages share: the request's bytes, its keys, slot checks and counts.
template <typename Message>
void BindCommon(py::class_<Message>& cls) {
  cls.def_property_readonly("worker", [](const Message& m) { return m.request().worker; })
      .def_property_readonly("step", [](const Message& m) { return m.request().step; })
      .def_property_readonly("encoding", [](const Message& m) { return m.request().encoding; })
      .def_property_readonly("range", [](const Message& m) { return m.request().range; })
      .def_property_readonly(
          "names", [](const Message& m) { return Names(m.request().tables); },
          "The tables' names, in request order.")
      .def(
          "keys",
          [](const Message& m, size_t i) {
            CheckIndex(m.request().tables, i);
            const auto& keys = m.request().tables[i].keys;
            return Copy(keys, {static_cast<py::ssize_t>(keys.size())});
          },
          py::arg("i"), "The keys of table i (a copy).")
      .def(
          "num_keys",
          [](const Message& m) {
            size_t n = 0;
            for (const auto& t : m.request().tables) n += t.keys.size();
            return n;
          },
          "Keys of all tables together.")
      .def(
          "keys_outside",
          [](const Message& m, int64_t num_slots, int64_t begin, int64_t end) {
            EE_CHECK(num_slots > 0, "`num_slots` must be positive, got " << num_slots);
            py::gil_scoped_release release;
            for (const auto& t : m.request().tables) {
              if (wire::KeysOutside(t.keys, num_slots, begin, end)) return true;
            }
            return false;
          },
          py::arg("num_slots"), py::arg("begin"), py::arg("end"),
          "Whether a key's virtual slot is outside [begin, end).")
      .def(
          "count_by_slot",
          [](const Message& m, int64_t num_slots) {
            EE_CHECK(num_slots > 0, "`num_slots` must be positive, got " << num_slots);
            py::array_t<int64_t> counts(num_slots);
            int64_t* c = counts.mutable_data();
            std::fill(c, c + num_slots, 0);
            py::gil_scoped_release release;
            for (const auto& t : m.request().tables) {
              CountBySlot(static_cast<int64_t>(t.keys.size()), t.keys.data(), num_slots, c);
            }
            return counts;
          },
          py::arg("num_slots"), "The number of keys of all tables in each virtual slot.")
      .def(
          "SerializeToString", [](const Message& m) { return m.raw(); },
          "The message's bytes, as received.")
      .def("ByteSize", [](const Message& m) { return py::len(m.raw()); });
}

// The starts of the ranges, checked as SplitBySlotRange needs them.
std::vector<int64_t> RangeStarts(const py::array& starts_in, int64_t num_slots) {
  auto starts = CheckArray<int64_t>(starts_in, "starts", {-1});
  const py::ssize_t ranges = starts.shape(0);
  EE_CHECK(num_slots > 0, "`num_slots` must be positive, got " << num_slots);
  EE_CHECK(ranges > 0 && starts.data()[0] == 0, "`starts` must begin with slot 0");
  for (py::ssize_t r = 1; r < ranges; ++r) {
    EE_CHECK(starts.data()[r - 1] <= starts.data()[r] && starts.data()[r] <= num_slots,
             "`starts` must ascend within [0, num_slots]");
  }
  return {starts.data(), starts.data() + ranges};
}

// A worker's tables of one request: names, keys (kept alive), widths.
struct Outgoing {
  std::vector<wire::OutgoingTable> tables;
  std::vector<py::object> kept;
  std::vector<std::pair<const int64_t*, int64_t>> keys;

  Outgoing(const std::vector<std::string>& names, const py::list& keys_in,
           const std::vector<int>& dims) {
    EE_CHECK(keys_in.size() == names.size() && dims.size() == names.size(),
             "a name, keys and a dim per table: got " << names.size() << ", " << keys_in.size()
                                                      << " and " << dims.size());
    tables.resize(names.size());
    for (size_t t = 0; t < names.size(); ++t) {
      auto k = CheckArray<int64_t>(keys_in[t], "keys", {-1});
      EE_CHECK(dims[t] > 0, "`dim` of '" << names[t] << "' must be positive, got " << dims[t]);
      tables[t].name = names[t];
      tables[t].keys = k.data();
      tables[t].dim = dims[t];
      keys.emplace_back(k.data(), k.shape(0));
      kept.push_back(k);
    }
  }
};

// A worker's Pull of many tables: split by slot range, one request per range, the answers
// decoded into each table's rows.
class PullPlan {
 public:
  PullPlan(const std::vector<std::string>& names, const py::list& keys,
           const std::vector<int>& dims, const py::array& starts, int64_t num_slots)
      : outgoing_(names, keys, dims) {
    const std::vector<int64_t> s = RangeStarts(starts, num_slots);
    py::gil_scoped_release release;
    split_ = std::make_unique<wire::RangeSplit>(outgoing_.keys, s, num_slots);
  }

  // Each range's PullRequest (None: no keys there); `held`: per table the versions of the
  // rows the worker caches, or None (no cache).
  py::list Requests(int32_t worker, int64_t step, bool train, int32_t encoding, int64_t timeout_ms,
                    const py::object& held) {
    cached_ = !held.is_none();
    std::vector<py::object> kept;
    if (cached_) {
      auto lists = held.cast<py::list>();
      EE_CHECK(lists.size() == outgoing_.tables.size(), "`held` needs one array per table");
      for (size_t t = 0; t < lists.size(); ++t) {
        auto v = CheckArray<uint32_t>(lists[t], "held", {outgoing_.keys[t].second});
        outgoing_.tables[t].held = v.data();
        kept.push_back(v);
      }
    }
    std::vector<std::string> requests(static_cast<size_t>(split_->num_ranges()));
    {
      py::gil_scoped_release release;
      for (int64_t r = 0; r < split_->num_ranges(); ++r) {
        requests[r] = wire::EncodePull(worker, step, train, encoding, timeout_ms, outgoing_.tables,
                                       *split_, r);
      }
    }
    for (auto& t : outgoing_.tables) t.held = nullptr;
    py::list out;
    for (const auto& request : requests) {
      if (request.empty()) {
        out.append(py::none());
      } else {
        out.append(py::bytes(request));
      }
    }
    return out;
  }

  // Per table (rows, versions, unchanged) from each range's PullResponse (None where no
  // request went); without a cache versions are 0 and no row is unchanged.
  py::tuple Rows(const py::list& responses) const {
    const auto ranges = static_cast<size_t>(split_->num_ranges());
    EE_CHECK(responses.size() == ranges, responses.size()
                                             << " answers for " << ranges << " ranges");
    std::vector<std::string_view> views(ranges);
    std::vector<bool> answered(ranges);
    for (size_t r = 0; r < ranges; ++r) {
      answered[r] = !responses[r].is_none();
      if (answered[r]) views[r] = View(responses[r].cast<py::bytes>());
    }
    const size_t n_tables = outgoing_.tables.size();
    std::vector<py::array_t<float>> rows;
    std::vector<py::array_t<uint32_t>> versions;
    std::vector<py::array_t<bool>> unchanged;
    std::vector<wire::IncomingTable> into(n_tables);
    for (size_t t = 0; t < n_tables; ++t) {
      const py::ssize_t n = outgoing_.keys[t].second;
      rows.emplace_back(std::vector<py::ssize_t>{n, outgoing_.tables[t].dim});
      versions.emplace_back(n);
      unchanged.emplace_back(n);
      into[t].rows = rows.back().mutable_data();
      std::fill_n(versions.back().mutable_data(), n, 0);
      std::fill_n(unchanged.back().mutable_data(), n, false);
      if (cached_) {
        into[t].versions = versions.back().mutable_data();
        into[t].unchanged = reinterpret_cast<uint8_t*>(unchanged.back().mutable_data());
      }
    }
    {
      py::gil_scoped_release release;
      for (size_t r = 0; r < ranges; ++r) {
        bool asked = false;
        for (size_t t = 0; t < n_tables && !asked; ++t) {
          int64_t n;
          split_->positions(t, static_cast<int64_t>(r), n);
          asked = n > 0;
        }
        if (!asked) continue;
        if (!answered[r]) {
          throw InvalidArgument("range " + std::to_string(r) + " was asked but not answered");
        }
        wire::DecodePull(views[r], outgoing_.tables, *split_, static_cast<int64_t>(r), into);
      }
    }
    return py::make_tuple(py::cast(rows), py::cast(versions), py::cast(unchanged));
  }

 private:
  Outgoing outgoing_;
  std::unique_ptr<wire::RangeSplit> split_;
  bool cached_ = false;
};

}  // namespace

void BindRequests(py::module_& m) {
  py::class_<PullPlan>(m, "PullPlan",
                       "A worker's Pull of many tables, split by slot range: `requests`, then "
                       "`rows` of the answers.")
      .def(py::init<const std::vector<std::string>&, const py::list&, const std::vector<int>&,
                    const py::array&, int64_t>(),
           py::arg("names"), py::arg("keys"), py::arg("dims"), py::arg("starts"),
           py::arg("num_slots"))
      .def("requests", &PullPlan::Requests, py::arg("worker"), py::arg("step"), py::arg("train"),
           py::arg("encoding"), py::arg("timeout_ms"), py::arg("held"),
           "Each range's PullRequest bytes without `range` (None: no keys there).")
      .def("rows", &PullPlan::Rows, py::arg("responses"),
           "Per table (rows, versions, unchanged) from each range's PullResponse bytes.");
  m.def(
      "push_requests",
      [](const std::vector<std::string>& names, const py::list& keys, const py::list& grads,
         const py::array& starts_in, int64_t num_slots, int32_t worker, int64_t step,
         int32_t encoding) {
        std::vector<int> dims;
        std::vector<py::array_t<float>> gradients;
        EE_CHECK(grads.size() == names.size(),
                 "gradients for each of " << names.size() << " tables expected");
        for (size_t t = 0; t < names.size(); ++t) {
          const auto n = py::len(keys[t]);
          gradients.push_back(
              CheckArray<float>(grads[t], "grads", {static_cast<py::ssize_t>(n), -1}));
          dims.push_back(static_cast<int>(gradients.back().shape(1)));
        }
        Outgoing outgoing(names, keys, dims);
        for (size_t t = 0; t < names.size(); ++t)
          outgoing.tables[t].gradients = gradients[t].data();
        const std::vector<int64_t> s = RangeStarts(starts_in, num_slots);
        std::vector<std::string> requests(s.size());
        {
          py::gil_scoped_release release;
          const wire::RangeSplit split(outgoing.keys, s, num_slots);
          for (size_t r = 0; r < s.size(); ++r) {
            requests[r] = wire::EncodePush(worker, step, encoding, outgoing.tables, split,
                                           static_cast<int64_t>(r));
          }
        }
        py::list out;
        for (const auto& request : requests) out.append(py::bytes(request));
        return out;
      },
      py::arg("names"), py::arg("keys"), py::arg("grads"), py::arg("starts"), py::arg("num_slots"),
      py::arg("worker"), py::arg("step"), py::arg("encoding"),
      "Each range's PushRequest bytes without `range`: every table, its keys in the range "
      "and their float32 (n, dim) gradients in `encoding`.");
  py::class_<PullMessage> pull(m, "PullMessage",
                               "A PullRequest's bytes, parsed; answered by `answer`.");
  pull.def(py::init<py::bytes>(), py::arg("raw"))
      .def_property_readonly("train", [](const PullMessage& p) { return p.request().train; })
      .def_property_readonly("timeout_ms",
                             [](const PullMessage& p) { return p.request().timeout_ms; })
      .def(
          "cached",
          [](const PullMessage& p) {
            std::vector<bool> out;
            for (const auto& t : p.request().tables) out.push_back(t.has_versions);
            return out;
          },
          "Per table, whether the worker caches its rows (sent versions).")
      .def(
          "held_versions",
          [](const PullMessage& p, size_t i) -> py::object {
            CheckIndex(p.request().tables, i);
            const auto& t = p.request().tables[i];
            if (!t.has_versions) return py::none();
            return Copy(t.versions, {static_cast<py::ssize_t>(t.versions.size())});
          },
          py::arg("i"), "The versions of the rows the worker holds of table i (None: no cache).")
      .def("answer", &PullMessage::Answer, py::arg("sources"),
           "The PullResponse's bytes; sources[i]: the `Table` of table i (versions read, then "
           "rows gathered now, without the GIL) or (rows, versions now or None).");
  BindCommon(pull);

  py::class_<PushMessage> push(m, "PushMessage",
                               "A PushRequest's bytes, parsed; `decode`, then `apply`.");
  push.def(py::init<py::bytes>(), py::arg("raw"))
      .def("decode", &PushMessage::Decode, py::arg("dims"),
           "Decodes the gradients (table i of width dims[i]); per table the reason its push "
           "must not be applied (NaN, Inf, or a sum beyond float32), '' when it may.")
      .def("gradients", &PushMessage::Gradients, py::arg("i"),
           "The float32 gradients of table i (a copy).")
      .def("apply", &PushMessage::Apply, py::arg("tables"), py::arg("learning_rates"),
           py::arg("steps"),
           "One push of each table i whose tables[i] (a `Table`) is not None, with its "
           "learning rate and step, without the GIL.");
  BindCommon(push);

  m.def(
      "request_parts",
      [](const py::bytes& raw) {
        std::vector<std::string_view> parts;
        {
          const std::string_view bytes = View(raw);
          py::gil_scoped_release release;
          parts = wire::ParseParts(bytes);
        }
        py::list out;
        for (const auto& p : parts) out.append(py::bytes(p.data(), p.size()));
        return out;
      },
      py::arg("raw"), "The parts' bytes of a PullRangesRequest or PushRangesRequest.");
  m.def(
      "join_parts",
      [](const std::vector<py::bytes>& parts) {
        std::vector<std::string_view> views;
        for (const auto& p : parts) views.push_back(View(p));
        return py::bytes(wire::JoinParts(views));
      },
      py::arg("parts"), "A PullRangesResponse or PushRangesResponse of the parts' bytes.");
}

}  // namespace elastic_emb
