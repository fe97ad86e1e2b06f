// The data plane: Pull, Push and their range forms over TCP, served and called from C++.
//
// gRPC stays the control plane (docs/architecture.md, "Two planes"). On the data plane a
// connection carries frames, each a fixed header and then `length` bytes of today's
// protobuf request or response:
//
//   magic u32 | length u32 | request_id u64 | deadline_ms u32 | method u8 | status u8 |
//   retry_after_ms u16
//
// little-endian, 24 bytes (retry_after_ms: 0 in a request; in an answer refused because
// the server is overloaded, how long the client should wait before sending it again). A client
// opens one connection per server and multiplexes its requests on it by request_id; answers may
// come back in any order. The first frame of a connection is a kHello carrying the caller's token
// (empty without tokens); the server answers it before it reads anything else, and closes the
// connection if it refuses it. An answer's `status` is a gRPC status code (0: OK, its payload the
// response; otherwise the payload is the UTF-8 message).
//
// Server: leader/followers. Its threads wait on one epoll; the thread that gets a
// connection's event reads its frames and handles the last itself (no hand-off); the pool
// grows while requests wait, so that a thread always waits for events (up to
// Options::max_threads). Overload: a request that finds Options::max_active requests being
// handled already, or its connection with Options::max_per_connection in flight, is
// answered RESOURCE_EXHAUSTED with a retry_after_ms hint, before its handler sees it
// (nothing done: safe to send again); a kHello and a kReplicate are never refused so (a
// backup refusing its primary's changes would be dropped). A frame whose length is above
// Options::max_frame_bytes is refused before anything is allocated and its connection closed,
// and an answer above it is replaced by a RESOURCE_EXHAUSTED refusal;
// connections beyond Options::max_connections are refused at accept, and at the process's
// file-descriptor limit accepted on a spare descriptor and closed; a connection with no request
// in flight (or a frame half sent) for longer than Options::idle_seconds is closed. Before its
// peer is authenticated a connection costs little: its hello's body is at most
// Options::max_hello_bytes (a token), and one that has not sent a whole hello within
// Options::hello_seconds of its accept is closed.
//
// TLS (ServerOptions::tls, a client Connection's `tls`): every byte of a connection goes
// through a tls::Session (csrc/tls.h) under the same framing; the handshake comes first, within
// hello_seconds of the accept, and then the hello. A TLS server refuses plaintext connections
// (a plaintext hello is answered UNAUTHENTICATED, saying the port speaks TLS).
//
// Client: one connection per server, a reader thread per connection completing waiting
// calls (no thread per call, no polling). `Connection::Send` and `Wait` are thread-safe;
// `Wait` blocks until the answers or the deadline.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "tls.h"

namespace elastic_emb {
namespace data_plane {

constexpr uint32_t kMagic = 0x50444545;  // "EEDP"
constexpr size_t kHeaderBytes = 24;
// The largest frame body the 32-bit length can say (ServerOptions::max_frame_bytes is at most it).
constexpr uint64_t kMaxFrameBytes = UINT32_MAX;

// Frame methods. 1-5 are the ParameterServer methods of the same names (Replicate: a
// primary's change, to its backups).
enum Method : uint8_t {
  kHello = 0,
  kPull = 1,
  kPush = 2,
  kPullRanges = 3,
  kPushRanges = 4,
  kReplicate = 5,
};
constexpr uint8_t kLastMethod = kReplicate;

// gRPC's status codes, the ones the plane itself answers with.
enum Status : uint8_t {
  kOk = 0,
  kDeadlineExceeded = 4,
  kResourceExhausted = 8,
  kInvalidArgument = 3,
  kUnauthenticated = 16,
  kUnavailable = 14,
  kInternal = 13,
};

struct Header {
  uint32_t length = 0;
  uint64_t request_id = 0;
  uint32_t deadline_ms = 0;  // 0: none
  uint8_t method = 0;
  uint8_t status = 0;
  uint16_t retry_after_ms = 0;  // an overload refusal's hint (0: none)
};

// Writes `header` to out[0, kHeaderBytes).
void EncodeHeader(const Header& header, char* out);
// Parses in[0, kHeaderBytes); false if the magic is wrong.
bool DecodeHeader(const char* in, Header* header);

// An answer: a status code and the response (OK) or the error message.
struct Answer {
  uint8_t status = kOk;
  std::string payload;
  uint16_t retry_after_ms = 0;  // set on an overload refusal: send again after this long
};

// Sends the answer of a request its handler parked: once, from any thread; nothing once
// the server stopped.
using Respond = std::function<void(Answer)>;
// Drops what a parked request holds when its caller went away first (its connection
// closed): called at most once, on any thread, and then no answer is wanted.
using Abandon = std::function<void()>;
// Parks the request being handled: its answer goes through the Respond returned; `abandon`
// (may be empty) if the caller goes away before it is answered.
using Park = std::function<Respond(Abandon abandon)>;
// What a server does with a request: its answer, or nullopt once it called `park` (the
// request then holds no thread). Called on a handler thread, never the I/O thread; may
// block. `caller` is what the connection's Authenticate returned.
using Handler =
    std::function<std::optional<Answer>(uint8_t method, std::string payload, uint32_t deadline_ms,
                                        const std::string& caller, const Park& park)>;
// Decides a connection's kHello: true and the caller's name, or false and why not.
using Authenticate = std::function<bool(const std::string& token, const std::string& peer,
                                        std::string* caller_or_why)>;

struct ServerOptions {
  std::string host = "127.0.0.1";
  int port = 0;  // 0: any free port
  uint64_t max_frame_bytes = 1ull << 30;
  int max_connections = 4096;
  double idle_seconds = 600.0;
  uint32_t max_hello_bytes = 64 << 10;  // a hello's body: the token
  double hello_seconds = 10.0;          // from accept to a whole hello
  int max_threads = 2048;               // handler threads (a request waiting holds one)
  int max_active = 0;          // requests handled at once before refusing more (0: no limit)
  int max_per_connection = 0;  // requests in flight on one connection (0: no limit)
  // A server context (tls::Context::Server): every connection is TLS, its handshake within
  // hello_seconds of the accept, before its hello. Null: plaintext.
  std::shared_ptr<tls::Context> tls;
};

// The counters a server keeps (read by the metrics).
struct ServerCounters {
  std::atomic<uint64_t> connections_accepted{0};
  std::atomic<uint64_t> connections_refused{0};  // beyond max_connections
  std::atomic<uint64_t> connections_closed_idle{0};
  std::atomic<uint64_t> frames_refused{0};  // malformed, too large, before a kHello
  std::atomic<uint64_t> requests{0};
  std::atomic<uint64_t> refused_overloaded{0};  // RESOURCE_EXHAUSTED with a retry hint
  std::atomic<uint64_t> tls_refused{0};  // connections closed for a failed handshake or record
};

class Server {
 public:
  // Binds and starts serving. Throws std::runtime_error if it cannot listen.
  Server(const ServerOptions& options, Handler handler, Authenticate authenticate);
  ~Server();  // Stop()
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  int port() const { return port_; }
  // After Stop: whether every handler returned. If not, their threads still use this
  // object, which must then be kept (never destroyed).
  bool finished() const { return finished_; }
  // Refuses new connections and requests; waits up to `grace_seconds` for the requests
  // in flight to be answered, then closes every connection. Idempotent.
  void Stop(double grace_seconds = 0.0);
  int connections() const;
  const ServerCounters& counters() const { return counters_; }

 private:
  struct Connection;
  struct Frame;
  // What a parked request's Respond reaches: the server, until it is destroyed.
  struct Life {
    std::mutex mu;
    Server* server = nullptr;  // guarded by mu
  };
  void Work();  // a pool thread: wait for an event, serve it
  int Busy();   // a thread takes a request: how many are handled now with it; 0 once stopping
  void Idle();  // ... and is done with it
  void Accept();
  void Serve(uint64_t id, uint32_t events);
  bool Read(const std::shared_ptr<Connection>& c, std::vector<Frame>* frames);  // false: closed
  void Run(Frame frame);
  void RunQueued();
  void Handle(Frame frame);
  // Refuses `frame` as overloaded (`handled`: the requests being handled), if it is.
  bool RefuseOverloaded(const Frame& frame, int handled);
  // An overload refusal saying `why`, with its retry hint.
  Answer Overloaded(const std::string& why);
  void Reply(const std::shared_ptr<Connection>& c, const Header& request, Answer answer);
  // A request answered: its connection counts it done.
  static void Answered(Connection* c);
  void SendQueued(Connection* c);  // with c->write_mu held
  void Arm(Connection* c);         // with c->write_mu held, c open
  void Close(const std::shared_ptr<Connection>& c);
  void SweepIdle();
  bool Shed();
  // TLS: up to `room` of a connection's decrypted bytes, as recv would give them (with
  // c->read_mu held); and its records waiting to be sent, sent (without c->write_mu).
  ssize_t Receive(Connection* c, char* out, size_t room);
  void SendTlsOutput(Connection* c);

  ServerOptions options_;
  std::shared_ptr<Life> life_ = std::make_shared<Life>();
  Handler handler_;
  Authenticate authenticate_;
  int listen_fd_ = -1;
  int epoll_fd_ = -1;
  std::mutex spare_mu_;
  int spare_fd_ = -1;  // /dev/null, given up at the descriptor limit to shed a connection
  int wake_fd_ = -1;   // eventfd: Stop wakes every thread
  int tasks_fd_ = -1;  // eventfd (semaphore): frames queued in tasks_
  int port_ = 0;
  std::atomic<bool> stopping_{false};
  std::atomic<double> last_sweep_{0};
  std::atomic<double> handle_ms_{0.1};  // a request's handling time, moving average
  ServerCounters counters_;

  mutable std::mutex connections_mu_;
  std::map<uint64_t, std::shared_ptr<Connection>> connections_;  // by id
  uint64_t next_id_ = 3;  // (ids below are the listening socket's and the eventfds')

  mutable std::mutex pool_mu_;
  std::condition_variable idle_cv_;  // no request in flight (Stop waits for it)
  std::deque<Frame> tasks_;          // frames read with another, for the next free thread
  std::vector<std::thread> workers_;
  int pollers_ = 0;  // threads waiting for an event, or about to
  int in_flight_ = 0;
  bool pool_closed_ = false;
  bool finished_ = true;
};

// One connection to a server, multiplexed. Thread-safe; held by shared_ptr (a call in
// flight keeps its connection).
//
//   auto c = std::make_shared<Connection>("127.0.0.1", port, token, 5.0);
//   Ticket t = Connection::Send(c, kPull, request, /*deadline_ms=*/5000);
//   Connection::Wait({t}, deadline);  // then t.pending->answer
class Connection {
 public:
  // Connects to host:port and says kHello with `token`; with `tls` (a client context), over
  // TLS, the server's certificate checked against `host`. Throws std::runtime_error
  // (connection refused, timeout, a refused certificate or token: the message says which).
  Connection(const std::string& host, int port, const std::string& token,
             double connect_timeout_seconds, std::shared_ptr<tls::Context> tls = nullptr);
  ~Connection();
  Connection(const Connection&) = delete;
  Connection& operator=(const Connection&) = delete;

  // Whether the connection still stands (false once the server closed it or it broke).
  bool alive() const { return alive_.load(); }

  // Called once with a call's answer, on the connection's reader thread (or the sender's,
  // when the connection is broken); it must not block.
  using OnDone = std::function<void(const Answer&)>;
  struct Pending {
    bool done = false;  // guarded by its connection's mu_
    Answer answer;
    OnDone on_done;  // (set before it is sent)
  };
  // A call sent: `sent` is false when none of its bytes left this process (it failed
  // before, with kUnavailable: safe to send again).
  struct Ticket {
    std::shared_ptr<Connection> connection;
    uint64_t request_id = 0;
    std::shared_ptr<Pending> pending;
    bool sent = false;
  };
  // Sends one request; a broken connection answers it kUnavailable at once. Blocks only
  // while the socket takes the bytes. `on_done`: called with its answer.
  static Ticket Send(const std::shared_ptr<Connection>& c, uint8_t method,
                     const std::string& payload, uint32_t deadline_ms, OnDone on_done = nullptr);
  // Waits until every ticket is answered or `deadline` passes; whether all were.
  static bool Wait(const std::vector<Ticket>& tickets,
                   std::chrono::steady_clock::time_point deadline);
  // Whether the ticket is answered (then its pending->answer may be read).
  static bool Done(const Ticket& ticket);
  // Gives a call up: its answer, if it comes, is dropped.
  static void Forget(const Ticket& ticket);

 private:
  void ReadLoop();
  void Fail(const std::string& why);
  // The TLS handshake on the connected socket (fd_ closed and std::runtime_error if it fails).
  void Handshake(std::shared_ptr<tls::Context> context, const std::string& host);
  // Exactly `size` bytes of the server's frames (decrypted with TLS); false once closed.
  bool Receive(char* out, size_t size);
  // Sends `size` bytes with write_mu_ held (encrypted first with TLS); the bytes of them
  // that left, or of their records.
  size_t SendAll(const char* data, size_t size);

  int fd_ = -1;
  std::string where_;
  std::atomic<bool> alive_{true};
  std::mutex write_mu_;
  std::mutex mu_;  // guards pending_, the Pendings' fields, next_id_, failure_, refusal_
  std::condition_variable cv_;
  std::map<uint64_t, std::shared_ptr<Pending>> pending_;
  uint64_t next_id_ = 1;
  std::string failure_;
  std::string refusal_;                // the server's own message when it refused the connection
  std::unique_ptr<tls::Session> tls_;  // null: plaintext
  std::string tls_error_;              // why the session broke (written by Receive's caller)
  std::thread reader_;
};

}  // namespace data_plane
}  // namespace elastic_emb
