#include "shard_bindings.h"

#include <pybind11/functional.h>
#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "py_arrays.h"
#include "py_callables.h"
#include "shard_core.h"
#include "step_clock.h"
#include "table.h"

namespace py = pybind11;

namespace elastic_emb {
namespace {

using py_arrays::CheckArray;

// Parts as Python has them: [(table name, keys (n,) int64, gradients (n, dim) float32)].
StepParts PartsFromPython(const py::handle& parts) {
  StepParts out;
  for (py::handle item : parts) {
    auto t = item.cast<py::tuple>();
    auto keys = CheckArray<int64_t>(t[1], "keys", {-1});
    auto grads = CheckArray<float>(t[2], "gradients", {keys.shape(0), -1});
    StepPart part;
    part.table = t[0].cast<std::string>();
    part.dim = static_cast<int>(grads.shape(1));
    part.keys.assign(keys.data(), keys.data() + keys.size());
    part.gradients.assign(grads.data(), grads.data() + grads.size());
    out.push_back(std::move(part));
  }
  return out;
}

py::tuple PartToPython(const StepPart& p) {
  const auto n = static_cast<py::ssize_t>(p.keys.size());
  py::array_t<int64_t> keys(n);
  std::copy(p.keys.begin(), p.keys.end(), keys.mutable_data());
  py::array_t<float> grads({n, static_cast<py::ssize_t>(p.dim)});
  std::copy(p.gradients.begin(), p.gradients.end(), grads.mutable_data());
  return py::make_tuple(keys, grads);
}

py::list PartsToPython(const StepParts& parts) {
  py::list out;
  for (const StepPart& p : parts) {
    py::tuple kg = PartToPython(p);
    out.append(py::make_tuple(p.table, kg[0], kg[1]));
  }
  return out;
}

py::object ModeOrNone(int mode) {
  return mode == kNoMode ? py::object(py::none()) : py::int_(mode);
}

py::dict StateToPython(const ClockState& s) {
  py::dict state, pushed;
  for (const auto& [worker, step] : s.pushed) pushed[py::str(std::to_string(worker))] = step;
  state["mode"] = ModeOrNone(s.mode);
  state["num_workers"] = s.num_workers;
  state["elastic"] = s.elastic;
  state["live"] = std::vector<int64_t>(s.live.begin(), s.live.end());
  state["staleness"] = s.staleness;
  state["pushed"] = pushed;
  state["applied"] = s.applied;
  return state;
}

ClockState StateFromPython(const py::dict& d) {
  ClockState s;
  s.mode = d["mode"].is_none() ? kNoMode : d["mode"].cast<int>();
  s.num_workers = d["num_workers"].cast<int64_t>();
  s.elastic = d["elastic"].cast<bool>();
  for (py::handle w : d["live"]) s.live.insert(w.cast<int64_t>());
  s.staleness = d["staleness"].cast<int64_t>();
  for (auto item : d["pushed"].cast<py::dict>()) {
    s.pushed[std::stoll(item.first.cast<std::string>())] = item.second.cast<int64_t>();
  }
  s.applied = d["applied"].cast<int64_t>();
  return s;
}

py::dict StepsToPython(const std::map<int64_t, int64_t>& steps) {
  py::dict out;
  for (const auto& [worker, step] : steps) out[py::int_(worker)] = step;
  return out;
}

void BindStepClock(py::module_& m) {
  using Release = py::call_guard<py::gil_scoped_release>;
  py::class_<StepClock>(m, "StepClock", "A shard's step protocol (csrc/step_clock.h).")
      .def("join", &StepClock::Join, py::arg("worker"), py::arg("num_workers"), py::arg("mode"),
           py::arg("staleness"), py::arg("elastic") = false, py::arg("again") = false, Release())
      .def("leave", &StepClock::Leave, py::arg("worker"), Release())
      .def("retire", &StepClock::Retire, py::arg("why"), Release())
      .def("check_worker", &StepClock::CheckWorker, py::arg("worker"), py::arg("step"), Release())
      .def("check_pull_step", &StepClock::CheckPullStep, py::arg("worker"), py::arg("step"),
           Release())
      .def("wait_to_pull", &StepClock::WaitToPull, py::arg("worker"), py::arg("step"),
           py::arg("timeout"), Release())
      .def(
          "push",
          [](StepClock& c, int64_t worker, int64_t step, py::function queue, py::function apply) {
            py::gil_scoped_release release;
            return c.Push(
                worker, step,
                [&] {
                  py::gil_scoped_acquire gil;
                  return PartsFromPython(queue());
                },
                [&] {
                  py::gil_scoped_acquire gil;
                  apply();
                });
          },
          py::arg("worker"), py::arg("step"), py::arg("queue"), py::arg("apply"),
          "SYNC: queue() -> [(table, keys, gradients)], queued; ASYNC: apply() applies it.")
      .def("hold_at", &StepClock::HoldAt, py::arg("after_step"), Release())
      .def("release_hold", &StepClock::ReleaseHold, Release())
      .def(
          "wait_applied",
          [](StepClock& c, int64_t after_step, double timeout) {
            std::pair<int64_t, std::map<int64_t, int64_t>> r;
            {
              py::gil_scoped_release release;
              r = c.WaitApplied(after_step, timeout);
            }
            return py::make_tuple(r.first, StepsToPython(r.second));
          },
          py::arg("after_step"), py::arg("timeout"))
      .def("worker_steps",
           [](StepClock& c) {
             std::map<int64_t, int64_t> steps;
             {
               py::gil_scoped_release release;
               steps = c.WorkerSteps();
             }
             return StepsToPython(steps);
           })
      .def("mode_name",
           [](StepClock& c) -> py::object {
             int mode;
             {
               py::gil_scoped_release release;
               mode = c.mode();
             }
             if (mode == kNoMode) return py::none();
             return py::str(mode == kSync ? "sync" : "async");
           })
      .def("step", &StepClock::step, Release())
      .def(
          "export",
          [](StepClock& c) {
            std::pair<ClockState, std::vector<PendingPush>> e;
            {
              py::gil_scoped_release release;
              e = c.Export();
            }
            py::list pending;
            for (const PendingPush& p : e.second) {
              pending.append(py::make_tuple(p.worker, p.step, PartsToPython(p.parts)));
            }
            return py::make_tuple(StateToPython(e.first), pending);
          },
          "(state, JSON-ready; [(worker, step, parts)] of the sync steps not applied yet).")
      .def(
          "install",
          [](StepClock& c, const py::dict& state, const py::list& pending) {
            ClockState s = StateFromPython(state);
            std::vector<PendingPush> pushes;
            for (py::handle item : pending) {
              auto t = item.cast<py::tuple>();
              pushes.push_back({t[0].cast<int64_t>(), t[1].cast<int64_t>(), PartsFromPython(t[2])});
            }
            py::gil_scoped_release release;
            c.Install(s, std::move(pushes));
          },
          py::arg("state"), py::arg("pending"))
      .def(
          "keep_pending",
          [](StepClock& c, int64_t num_slots, int64_t begin, int64_t end, py::function first) {
            py::gil_scoped_release release;
            c.KeepPending(num_slots, begin, end, [&] {
              py::gil_scoped_acquire gil;
              first();
            });
          },
          py::arg("num_slots"), py::arg("begin"), py::arg("end"), py::arg("first"),
          "first(), then the pending pushes keep the keys of slots [begin, end).");
}

// ServerCore::Serve for a caller that waits on its thread (a gRPC handler): a parked
// request is waited for here, GIL released.
py::object ServeWaiting(ServerCore& core, uint8_t method, const py::bytes& payload, bool from_peer,
                        double seconds) {
  struct Waiting {
    std::mutex mu;
    std::condition_variable cv;
    std::optional<data_plane::Answer> answer;
    data_plane::Abandon abandon;
  };
  auto waiting = std::make_shared<Waiting>();
  const data_plane::Park park = [waiting](data_plane::Abandon abandon) -> data_plane::Respond {
    {
      std::lock_guard<std::mutex> lock(waiting->mu);
      waiting->abandon = std::move(abandon);
    }
    return [waiting](data_plane::Answer answer) {
      std::lock_guard<std::mutex> lock(waiting->mu);
      waiting->answer = std::move(answer);
      waiting->cv.notify_all();
    };
  };
  std::string request(payload);
  data_plane::Answer answer;
  Served served;
  {
    py::gil_scoped_release release;
    served = core.Serve(method, request, park, from_peer, &answer.status, &answer.payload);
    if (served == Served::kParked) {
      const auto deadline = std::chrono::steady_clock::now() +
                            std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                std::chrono::duration<double>(std::clamp(seconds, 0.0, 1e8)));
      data_plane::Abandon abandon;
      {
        std::unique_lock<std::mutex> lock(waiting->mu);
        if (waiting->cv.wait_until(lock, deadline, [&] { return waiting->answer.has_value(); })) {
          answer = std::move(*waiting->answer);
        } else {
          abandon = std::move(waiting->abandon);
          answer = {data_plane::kDeadlineExceeded,
                    "the call's deadline passed while the request waited"};
        }
      }
      if (abandon) abandon();
    }
  }
  if (served == Served::kPython) return py::none();
  return py::make_tuple(answer.status, py::bytes(answer.payload));
}

}  // namespace

void BindShards(py::module_& m) {
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const Refusal& e) {
      py::object cls =
          py::module_::import("elastic_emb.ps.server.request_error").attr("RequestError");
      py::object error = cls(e.code(), e.what());
      PyErr_SetObject(cls.ptr(), error.ptr());
    }
  });
  m.attr("MAX_PUSHES_IN_FLIGHT") = kMaxPushesInFlight;
  BindStepClock(m);

  py::class_<ShardCore, std::shared_ptr<ShardCore>>(
      m, "ShardCore", "A shard's step clock and tables as the data plane serves them.")
      .def(py::init([](py::function apply_in_python) {
             auto apply = SharedCallable(std::move(apply_in_python));
             return std::make_shared<ShardCore>([apply](int64_t step, const std::string& table,
                                                        const std::vector<const StepPart*>& parts) {
               py::gil_scoped_acquire gil;
               py::list out;
               for (const StepPart* p : parts) out.append(PartToPython(*p));
               (*apply)(step, table, out);
             });
           }),
           py::arg("apply_in_python"),
           "apply_in_python(step, table, [(keys, gradients)]): a sync step's parts of a table "
           "the plane does not push itself.")
      .def_property_readonly(
          "clock", [](ShardCore& s) -> StepClock& { return s.clock(); },
          py::return_value_policy::reference_internal)
      .def(
          "set_tables",
          [](ShardCore& s, const py::list& tables) {
            PlaneTables out;
            for (py::handle item : tables) {
              auto t = item.cast<py::tuple>();
              PlaneTable table;
              if (!t[1].is_none()) table.table = t[1].cast<std::shared_ptr<Table>>();
              if (!t[2].is_none()) {
                table.learning_rate = t[2].cast<float>();
                table.constant_rate = true;
              }
              out[t[0].cast<std::string>()] = std::move(table);
            }
            py::gil_scoped_release release;
            s.SetTables(std::move(out));
          },
          py::arg("tables"),
          "[(name, _core.Table or None, constant learning rate or None)]: the shard's tables.")
      .def(
          "set_slots",
          [](ShardCore& s, const py::object& slots, int64_t num_slots) {
            std::optional<SlotBounds> bounds;
            if (!slots.is_none()) {
              auto t = slots.cast<std::pair<int64_t, int64_t>>();
              bounds = SlotBounds{num_slots, t.first, t.second};
            }
            s.SetSlots(bounds);
          },
          py::arg("slots"), py::arg("num_slots"),
          "(begin, end): the virtual slots whose keys the range takes; None: every key.");

  py::class_<Replication, std::shared_ptr<Replication>>(
      m, "Replication", "A replica group's changes on the data plane (csrc/replication.h).")
      .def(
          "configure",
          [](Replication& r, py::function drop_fn, const std::string& token) {
            auto drop = SharedCallable(std::move(drop_fn));
            r.Configure(
                [drop](const std::string& backup, const std::string& why) {
                  py::gil_scoped_acquire gil;
                  try {
                    return (*drop)(backup, why).cast<bool>();
                  } catch (py::error_already_set& e) {
                    e.discard_as_unraisable("elastic_emb: dropping a backup");
                    return false;
                  }
                },
                token);
          },
          py::arg("drop"), py::arg("token"),
          "drop(backup, why) -> bool: removes a backup that did not apply a change (False: "
          "it could not); `token`: what this server's connections to the others give.")
      .def("set_tls", &Replication::SetTls, py::arg("tls"),
           "The TlsContext (a client's) of this server's connections to the other servers' "
           "data planes; None: plaintext.")
      .def(
          "lock_order", [](Replication& r) { r.order().lock(); },
          py::call_guard<py::gil_scoped_release>())
      .def("unlock_order", [](Replication& r) { r.order().unlock(); })
      .def(
          "set_role",
          [](Replication& r, const py::dict& d) {
            ReplicaRole role;
            role.address = d["address"].cast<std::string>();
            role.group = d["group"].cast<int32_t>();
            role.epoch = d["epoch"].cast<int64_t>();
            role.primary = d["primary"].cast<std::string>();
            role.holds = d["holds"].cast<std::vector<std::string>>();
            role.deposed = d["deposed"].cast<std::string>();
            role.changes = d["changes"].cast<bool>();
            for (auto item : d["backups"].cast<py::list>()) {
              auto t = item.cast<py::tuple>();
              role.backups.push_back(
                  Backup{t[0].cast<std::string>(), t[1].cast<std::string>(), t[2].cast<int>()});
            }
            py::gil_scoped_release release;
            r.SetRole(std::move(role));
          },
          py::arg("role"),
          "{address, group (-1: a spare), epoch, primary, holds: [address], deposed: the "
          "primary a backup taking over refuses, changes: bool, "
          "backups: [(address, host, data port)]}: this server's place in its group.")
      .def(
          "role",
          [](const Replication& r) {
            const auto role = r.role();
            py::list backups;
            for (const Backup& b : role->backups)
              backups.append(py::make_tuple(b.address, b.host, b.port));
            py::dict d;
            d["address"] = role->address;
            d["group"] = role->group;
            d["epoch"] = role->epoch;
            d["primary"] = role->primary;
            d["holds"] = role->holds;
            d["deposed"] = role->deposed;
            d["changes"] = role->changes;
            d["backups"] = backups;
            return d;
          },
          "What set_role last gave.")
      .def_property_readonly("applied", py::cpp_function(&Replication::applied,
                                                         py::call_guard<py::gil_scoped_release>()))
      .def_property_readonly(
          "applied_epoch",
          py::cpp_function(&Replication::applied_epoch, py::call_guard<py::gil_scoped_release>()))
      .def("count_acknowledged", &Replication::CountAcknowledged, py::arg("group"),
           py::arg("epoch"), py::arg("first"), py::arg("last"),
           "Counts changes first..last acknowledged at epoch of group (Python's path).")
      .def(
          "acknowledged",
          [](const Replication& r) {
            py::dict out;
            for (const auto& [key, a] : r.acknowledged()) {
              py::dict d;
              d["changes"] = a.changes;
              d["first_sequence"] = a.first_sequence;
              d["last_sequence"] = a.last_sequence;
              d["first_time"] = a.first_time;
              d["last_time"] = a.last_time;
              out[py::make_tuple(key.first, key.second)] = d;
            }
            return out;
          },
          "{(group, epoch): {changes, first_sequence, last_sequence, first_time, last_time}}: "
          "the changes this server acknowledged as a primary (times: Unix seconds).")
      .def(
          "set_applied",
          [](Replication& r, std::optional<int64_t> sequence, int64_t epoch,
             const std::string& method, const py::bytes& request) {
            const uint64_t digest =
                method.empty() ? 0 : ChangeDigest(method, std::string_view(request));
            py::gil_scoped_release release;
            r.SetApplied(sequence, epoch, digest);
          },
          py::arg("sequence"), py::arg("epoch"), py::arg("method") = "",
          py::arg("request") = py::bytes(),
          "Sets the last change applied (`method`, `request`: that change's, remembered so "
          "that another change sent as its sequence is refused).")
      .def(
          "wait_turn",
          [](Replication& r, int32_t group, int64_t epoch, int64_t sequence,
             const std::string& method, const py::bytes& request, const std::string& primary,
             double seconds) {
            wire::ReplicateRequest change;
            change.group = group;
            change.epoch = epoch;
            change.sequence = sequence;
            change.method = method;
            const std::string_view bytes(request);
            change.request = bytes;
            change.primary = primary;
            std::string why;
            Turn turn;
            {
              py::gil_scoped_release release;
              turn = r.WaitTurn(change, seconds, &why);
            }
            const char* names[] = {"apply", "done", "wait", "refuse", "diverged", "python"};
            return py::make_tuple(names[static_cast<int>(turn)], why);
          },
          py::arg("group"), py::arg("epoch"), py::arg("sequence"), py::arg("method"),
          py::arg("request"), py::arg("primary"), py::arg("seconds"),
          "A backup's turn for a change, waiting up to `seconds`: (\"apply\" | \"done\" | "
          "\"refuse\" | \"diverged\", why).")
      .def("check_sender", &Replication::CheckSender, py::arg("group"), py::arg("epoch"),
           py::arg("primary"),
           "Why this backup refuses a change or snapshot from `primary` (\"\": it does not).")
      .def(
          "same_change",
          [](const Replication& r, int64_t sequence, int64_t epoch, const std::string& method,
             const py::bytes& request) {
            return r.SameChange(sequence, epoch, ChangeDigest(method, std::string_view(request)));
          },
          py::arg("sequence"), py::arg("epoch"), py::arg("method"), py::arg("request"),
          "False when change `sequence` of `epoch` was applied here as another change.")
      .def("wait_applied", &Replication::WaitApplied, py::arg("seen"), py::arg("seconds"),
           py::call_guard<py::gil_scoped_release>(),
           "Waits until `applied` differs from `seen`, the role changes or `seconds` pass.");

  py::class_<ServerCore, std::shared_ptr<ServerCore>>(
      m, "ServerCore", "A server's shards by range, as the data plane serves them.")
      .def(py::init<>())
      .def_property_readonly("replication", &ServerCore::replication)
      .def("set_enabled", &ServerCore::SetEnabled, py::arg("enabled"), py::arg("pushes"))
      .def(
          "set_serving",
          [](ServerCore& s, const py::dict& serving) {
            std::map<int32_t, RangeServing> out;
            for (auto item : serving) {
              auto t = item.second.cast<py::tuple>();
              out[item.first.cast<int32_t>()] =
                  RangeServing{t[0].cast<bool>(), t[1].cast<bool>(), t[2].cast<double>()};
            }
            s.SetServing(std::move(out));
          },
          py::arg("serving"),
          "{range: (primary, member, until)}: where a coordinated server serves workers, "
          "until `until` (time.monotonic() seconds).")
      .def(
          "serving",
          [](const ServerCore& s) -> py::object {
            const auto serving = s.serving();
            if (!serving) return py::none();
            py::dict out;
            for (const auto& [range, r] : *serving) {
              out[py::int_(range)] = py::make_tuple(r.primary, r.member, r.until);
            }
            return std::move(out);
          },
          "What set_serving last gave (None: never called).")
      .def("meter_load", &ServerCore::MeterLoad, py::arg("num_slots"))
      .def("set_max_answer_bytes", &ServerCore::SetMaxAnswerBytes, py::arg("bytes"))
      .def("serve", &ServeWaiting, py::arg("method"), py::arg("payload"), py::arg("from_peer"),
           py::arg("seconds"),
           "A data-plane request that came another way (gRPC): (status, bytes) as the data "
           "plane answers it, waiting up to `seconds` for a parked one (then "
           "DEADLINE_EXCEEDED, and what it held is dropped); None: Python answers it.")
      .def(
          "load",
          [](const ServerCore& s) {
            std::vector<double> load = s.load();
            const auto width = static_cast<py::ssize_t>(load.size() / 3);
            return py_arrays::ToNumpy(std::move(load), {3, width});
          },
          "The load metered so far: (3, num_slots) totals of keys, bytes, CPU seconds.")
      .def("put_range", &ServerCore::PutRange, py::arg("range"), py::arg("shard"))
      .def("drop_range", &ServerCore::DropRange, py::arg("range"),
           py::call_guard<py::gil_scoped_release>())
      .def(
          "counts",
          [](const ServerCore& s) {
            py::dict out;
            for (const auto& [name, c] : s.counts()) {
              py::dict d;
              d["calls"] = c.calls;
              d["errors"] = c.errors;
              d["request_bytes"] = c.request_bytes;
              d["response_bytes"] = c.response_bytes;
              d["seconds"] = c.seconds;
              d["max_seconds"] = c.max_seconds;
              d["latency"] = std::vector<int64_t>(c.latency.begin(), c.latency.end());
              d["codes"] = c.codes;
              out[py::str(name)] = d;
            }
            return out;
          },
          "Per method: the calls the plane answered itself (servicer._MethodStats's fields).")
      .def_property_readonly("changes", &ServerCore::changes)
      .def_property_readonly("waits", &ServerCore::waits,
                             "(pulls answered after waiting for their step, their seconds).");
}

}  // namespace elastic_emb
