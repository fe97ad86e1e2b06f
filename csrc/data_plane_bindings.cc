#include "data_plane_bindings.h"

#include <pybind11/functional.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "data_plane.h"
#include "py_callables.h"
#include "shard_core.h"

namespace py = pybind11;

namespace elastic_emb {
namespace {

using data_plane::Answer;

// The GIL, taken on a handler thread with a Python thread state made once per thread and
// kept (pybind11's gil_scoped_acquire makes and frees one each time on a thread Python
// did not start: tens of microseconds a request).
class HandlerGil {
 public:
  explicit HandlerGil(PyInterpreterState* interpreter) {
    thread_local PyThreadState* state = nullptr;
    if (state == nullptr) state = PyThreadState_New(interpreter);
    PyEval_RestoreThread(state);
  }
  ~HandlerGil() { PyEval_SaveThread(); }
  HandlerGil(const HandlerGil&) = delete;
  HandlerGil& operator=(const HandlerGil&) = delete;
};

// Owns a data_plane::Server for Python. A server whose handlers did not all return by
// the end of `stop` is kept alive (their threads still use it): the process is exiting.
class PyServer {
 public:
  PyServer(data_plane::ServerOptions options, py::function handle_fn, py::function authenticate_fn,
           std::shared_ptr<ServerCore> core) {
    // The Python callables are called with the GIL taken on a handler thread; they are
    // shared without touching their reference counts (released with the GIL taken).
    auto handle = SharedCallable(std::move(handle_fn));
    auto authenticate = SharedCallable(std::move(authenticate_fn));
    PyInterpreterState* interpreter = PyInterpreterState_Get();
    auto handler = [handle, interpreter, core](
                       uint8_t method, std::string payload, uint32_t deadline_ms,
                       const std::string& caller,
                       const data_plane::Park& park) -> std::optional<Answer> {
      if (core != nullptr) {
        Answer answer;
        // (a worker's connection may not send changes: Python refuses its Replicate)
        const bool from_peer = caller.rfind("worker ", 0) != 0;
        switch (core->Serve(method, payload, park, from_peer, &answer.status, &answer.payload)) {
          case Served::kAnswered:
            return answer;
          case Served::kParked:
            return std::nullopt;
          case Served::kPython:
            break;
        }
      }
      HandlerGil gil(interpreter);
      try {
        py::tuple answer =
            (*handle)(method, py::bytes(payload), deadline_ms, caller).cast<py::tuple>();
        return Answer{answer[0].cast<uint8_t>(), answer[1].cast<std::string>()};
      } catch (py::error_already_set& e) {
        return Answer{data_plane::kInternal, std::string("data plane handler: ") + e.what()};
      }
    };
    auto check = [authenticate, interpreter](const std::string& token, const std::string& peer,
                                             std::string* caller_or_why) {
      HandlerGil gil(interpreter);
      try {
        py::tuple result = (*authenticate)(py::bytes(token), peer).cast<py::tuple>();
        *caller_or_why = result[1].cast<std::string>();
        return result[0].cast<bool>();
      } catch (py::error_already_set& e) {
        *caller_or_why = std::string("data plane: cannot check the token: ") + e.what();
        return false;
      }
    };
    py::gil_scoped_release release;
    server_ = new data_plane::Server(options, handler, check);
  }
  ~PyServer() { Stop(0.0); }

  void Stop(double grace_seconds) {
    if (server_ == nullptr) return;
    {
      py::gil_scoped_release release;
      server_->Stop(grace_seconds);
    }
    if (server_->finished()) delete server_;
    server_ = nullptr;
  }

  data_plane::Server& server() {
    if (server_ == nullptr) throw std::runtime_error("the data plane server was stopped");
    return *server_;
  }

 private:
  data_plane::Server* server_ = nullptr;
};

}  // namespace

void BindDataPlane(py::module_& m) {
  m.attr("with_tls") = tls::Available();
  py::class_<tls::Context, std::shared_ptr<tls::Context>>(
      m, "TlsContext", "Certificates and verification of data-plane TLS (csrc/tls.h).")
      .def_static(
          "server",
          [](const py::bytes& cert, const py::bytes& key, const py::bytes& client_ca) {
            return tls::Context::Server(cert, key, client_ca);
          },
          py::arg("cert"), py::arg("key"), py::arg("client_ca") = py::bytes(),
          "A server's: its PEM certificate chain and key; with `client_ca`, clients must "
          "present a certificate it signed. ValueError if they are not usable.")
      .def_static(
          "client",
          [](const py::bytes& ca, const py::bytes& cert, const py::bytes& key) {
            return tls::Context::Client(ca, cert, key);
          },
          py::arg("ca"), py::arg("cert") = py::bytes(), py::arg("key") = py::bytes(),
          "A client's: the CA it trusts, and for mutual TLS its certificate and key.");

  py::class_<data_plane::ServerOptions>(m, "DataPlaneOptions")
      .def(py::init<>())
      .def_readwrite("host", &data_plane::ServerOptions::host)
      .def_readwrite("port", &data_plane::ServerOptions::port)
      .def_readwrite("max_frame_bytes", &data_plane::ServerOptions::max_frame_bytes)
      .def_readwrite("max_connections", &data_plane::ServerOptions::max_connections)
      .def_readwrite("idle_seconds", &data_plane::ServerOptions::idle_seconds)
      .def_readwrite("max_hello_bytes", &data_plane::ServerOptions::max_hello_bytes)
      .def_readwrite("hello_seconds", &data_plane::ServerOptions::hello_seconds)
      .def_readwrite("max_threads", &data_plane::ServerOptions::max_threads)
      .def_readwrite("max_active", &data_plane::ServerOptions::max_active)
      .def_readwrite("max_per_connection", &data_plane::ServerOptions::max_per_connection)
      .def_readwrite("tls", &data_plane::ServerOptions::tls,
                     "A server's TlsContext: every connection is TLS; None: plaintext.");

  py::class_<PyServer>(m, "DataPlaneServer")
      .def(py::init<data_plane::ServerOptions, py::function, py::function,
                    std::shared_ptr<ServerCore>>(),
           py::arg("options"), py::arg("handle"), py::arg("authenticate"),
           py::arg("core") = nullptr,
           "Listens and serves: `core` (a ServerCore) answers what it can; handle(method, "
           "payload, deadline_ms, caller) -> (status, bytes) the rest, and authenticate(token, "
           "peer) -> (ok, caller or why) the connections, on its threads.")
      .def_property_readonly("port", [](PyServer& s) { return s.server().port(); })
      .def("stop", &PyServer::Stop, py::arg("grace_seconds") = 0.0)
      .def("counters", [](PyServer& s) {
        const auto& c = s.server().counters();
        py::dict out;
        out["connections_accepted"] = c.connections_accepted.load();
        out["connections_refused"] = c.connections_refused.load();
        out["connections_closed_idle"] = c.connections_closed_idle.load();
        out["frames_refused"] = c.frames_refused.load();
        out["requests"] = c.requests.load();
        out["refused_overloaded"] = c.refused_overloaded.load();
        out["tls_refused"] = c.tls_refused.load();
        return out;
      });

  using data_plane::Connection;
  py::class_<Connection, std::shared_ptr<Connection>>(m, "DataPlaneConnection")
      .def(py::init<const std::string&, int, const std::string&, double,
                    std::shared_ptr<tls::Context>>(),
           py::arg("host"), py::arg("port"), py::arg("token"), py::arg("connect_timeout"),
           py::arg("tls") = nullptr, py::call_guard<py::gil_scoped_release>(),
           "Connects and says hello, over TLS with `tls` (a client's TlsContext); RuntimeError "
           "if it cannot (the message says why).")
      .def_property_readonly("alive", &Connection::alive);

  py::class_<Connection::Ticket>(m, "DataPlaneTicket")
      .def_readonly("sent", &Connection::Ticket::sent)
      .def("done", &Connection::Done, py::call_guard<py::gil_scoped_release>())
      .def(
          "answer",
          [](const Connection::Ticket& t) {
            if (!Connection::Done(t)) throw std::runtime_error("the call is not answered yet");
            return py::make_tuple(t.pending->answer.status, py::bytes(t.pending->answer.payload));
          },
          "(status, bytes): a gRPC status code (0: OK) and the response or the message.")
      .def_property_readonly(
          "retry_after_ms",
          [](const Connection::Ticket& t) {
            return Connection::Done(t) ? t.pending->answer.retry_after_ms : 0;
          },
          "An overload refusal's hint: milliseconds to wait before sending it again (else 0).")
      .def("forget", &Connection::Forget, py::call_guard<py::gil_scoped_release>());

  m.def(
      "data_plane_send",
      [](const std::vector<std::shared_ptr<Connection>>& connections,
         const std::vector<int>& methods, const std::vector<py::bytes>& payloads,
         double timeout_seconds) {
        if (connections.size() != methods.size() || methods.size() != payloads.size()) {
          throw std::invalid_argument("connections, methods and payloads differ in length");
        }
        std::vector<std::string> bodies(payloads.begin(), payloads.end());
        const auto deadline_ms = static_cast<uint32_t>(std::min(timeout_seconds * 1e3, 4e9));
        std::vector<Connection::Ticket> tickets;
        py::gil_scoped_release release;
        for (size_t i = 0; i < bodies.size(); ++i) {
          tickets.push_back(Connection::Send(connections[i], static_cast<uint8_t>(methods[i]),
                                             bodies[i], std::max<uint32_t>(deadline_ms, 1)));
        }
        return tickets;
      },
      py::arg("connections"), py::arg("methods"), py::arg("payloads"), py::arg("timeout"),
      "Sends payloads[i] as methods[i] on connections[i], all at once; their tickets.");
  m.def(
      "data_plane_wait",
      [](const std::vector<Connection::Ticket>& tickets, double seconds) {
        py::gil_scoped_release release;
        auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                            std::chrono::duration<double>(std::max(seconds, 0.0)));
        return Connection::Wait(tickets, deadline);
      },
      py::arg("tickets"), py::arg("seconds"),
      "Waits until every ticket is answered or `seconds` pass; whether all were.");
}

}  // namespace elastic_emb
