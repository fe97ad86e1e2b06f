#include "data_plane.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <deque>
#include <stdexcept>
#include <tuple>

namespace elastic_emb {
namespace data_plane {
namespace {

using Clock = std::chrono::steady_clock;

double Now() { return std::chrono::duration<double>(Clock::now().time_since_epoch()).count(); }

template <typename T>
void Put(char*& p, T value) {
  std::memcpy(p, &value, sizeof(T));  // little-endian hosts only (x86-64, aarch64)
  p += sizeof(T);
}

template <typename T>
T Get(const char*& p) {
  T value;
  std::memcpy(&value, p, sizeof(T));
  p += sizeof(T);
  return value;
}

void SetNonBlocking(int fd, bool on) {
  int flags = fcntl(fd, F_GETFL, 0);
  fcntl(fd, F_SETFL, on ? (flags | O_NONBLOCK) : (flags & ~O_NONBLOCK));
}

void SetNoDelay(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

// The addresses of host:port (numeric or a name), for a listening (passive) or a
// connecting socket. Throws std::runtime_error naming the host.
addrinfo* Resolve(const std::string& host, int port, bool passive) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = passive ? AI_PASSIVE : 0;
  addrinfo* found = nullptr;
  std::string bare = host;
  if (bare.size() > 1 && bare.front() == '[' && bare.back() == ']') {
    bare = bare.substr(1, bare.size() - 2);
  }
  int rc = getaddrinfo(bare.c_str(), std::to_string(port).c_str(), &hints, &found);
  if (rc != 0) {
    throw std::runtime_error("data plane: cannot resolve " + host + ": " + gai_strerror(rc));
  }
  return found;
}

std::string Encode(const Header& header, const std::string& payload) {
  std::string frame(kHeaderBytes + payload.size(), '\0');
  EncodeHeader(header, &frame[0]);
  std::memcpy(&frame[kHeaderBytes], payload.data(), payload.size());
  return frame;
}

// Reads exactly `size` bytes (through EINTR and short reads); false on EOF or an error.
bool RecvAll(int fd, char* out, size_t size) {
  while (size > 0) {
    ssize_t got = recv(fd, out, size, 0);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) return false;
    out += got;
    size -= static_cast<size_t>(got);
  }
  return true;
}

// Writes `size` bytes to a blocking socket (through EINTR and short writes); how many were
// written (fewer on an error).
size_t SendRaw(int fd, const char* data, size_t size) {
  size_t written = 0;
  while (written < size) {
    ssize_t sent = send(fd, data + written, size - written, MSG_NOSIGNAL);
    if (sent < 0 && errno == EINTR) continue;
    if (sent <= 0) break;
    written += static_cast<size_t>(sent);
  }
  return written;
}

}  // namespace

void EncodeHeader(const Header& header, char* out) {
  Put<uint32_t>(out, kMagic);
  Put<uint32_t>(out, header.length);
  Put<uint64_t>(out, header.request_id);
  Put<uint32_t>(out, header.deadline_ms);
  Put<uint8_t>(out, header.method);
  Put<uint8_t>(out, header.status);
  Put<uint16_t>(out, header.retry_after_ms);
}

bool DecodeHeader(const char* in, Header* header) {
  if (Get<uint32_t>(in) != kMagic) return false;
  header->length = Get<uint32_t>(in);
  header->request_id = Get<uint64_t>(in);
  header->deadline_ms = Get<uint32_t>(in);
  header->method = Get<uint8_t>(in);
  header->status = Get<uint8_t>(in);
  header->retry_after_ms = Get<uint16_t>(in);
  return true;
}

// ---------------------------------------------------------------------------------------
// Server: leader/followers. Every thread of the pool waits in epoll_wait; the one that
// gets a connection's event reads its frames, re-arms the connection and handles the last
// frame itself (the others go to the queue, for the next free thread): no hand-off
// between a reading thread and a handling one. A connection is armed EPOLLONESHOT, so one
// thread reads it at a time (`read_mu` covers a re-arm by a writer meanwhile).

namespace {

// epoll user data: these, or a connection's id.
constexpr uint64_t kListenId = 0;
constexpr uint64_t kWakeId = 1;   // Stop: level-triggered, wakes every thread
constexpr uint64_t kTasksId = 2;  // a frame queued (a semaphore eventfd)
constexpr uint64_t kFirstConnectionId = 3;

// Whether an overloaded server may refuse a request of `method`: not a connection's hello,
// nor a primary's change (a backup that refused it would be dropped from its group).
bool Refusable(uint8_t method) { return method != kHello && method != kReplicate; }

// Writes a header and its payload with one call, without copying them; the bytes written
// (fewer when the socket's buffer fills; 0 on an error, which its reader then sees).
size_t SendNow(int fd, const char* header, const std::string& payload) {
  iovec parts[2] = {{const_cast<char*>(header), kHeaderBytes},
                    {const_cast<char*>(payload.data()), payload.size()}};
  msghdr message{};
  message.msg_iov = parts;
  message.msg_iovlen = payload.empty() ? 1 : 2;
  while (true) {
    ssize_t sent = sendmsg(fd, &message, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (sent >= 0) return static_cast<size_t>(sent);
    if (errno != EINTR) return 0;
  }
}

}  // namespace

// A connection the server accepted. Its read state is guarded by read_mu, its write state
// by write_mu (answers are written by whichever thread handled their request).
struct Server::Connection {
  uint64_t id = 0;
  int fd = -1;
  std::string peer;
  std::mutex read_mu;
  char header_bytes[kHeaderBytes];
  size_t header_have = 0;
  bool in_body = false;
  Header header;
  std::string body;
  size_t body_have = 0;
  double accepted_at = 0;
  std::atomic<double> last_activity{0};    // a read, or its last request answered
  std::atomic<bool> greeted{false};        // its kHello was accepted
  std::atomic<bool> hello_pending{false};  // its kHello is being decided
  std::atomic<double> draining_until{0};   // refused: input discarded until then, then closed
  std::string caller;                      // written before `greeted`, read after
  std::atomic<int> in_flight{0};
  std::mutex parked_mu;
  std::map<uint64_t, Abandon> parked;  // its parked requests' (by a number of the server's)
  uint64_t next_parked = 0;            // guarded by parked_mu
  std::unique_ptr<tls::Session> tls;   // with a TLS server (its own mutex)
  bool tls_fed = false;                // (read_mu) bytes came: a plaintext hello is told apart
  bool plaintext_hello = false;        // (read_mu) its first bytes were a frame's, not TLS
  bool tls_drained = false;            // (read_mu) its last socket read emptied the socket
  std::mutex write_mu;
  std::string out;
  size_t out_sent = 0;
  bool closed = false;
  bool writing = false;  // EPOLLOUT armed
};

struct Server::Frame {
  std::shared_ptr<Connection> connection;
  Header header;
  std::string payload;
  double received = 0;
};

Server::Server(const ServerOptions& options, Handler handler, Authenticate authenticate)
    : options_(options), handler_(std::move(handler)), authenticate_(std::move(authenticate)) {
  life_->server = this;
  if (options_.max_connections < 1 || options_.max_threads < 1 || options_.idle_seconds <= 0 ||
      options_.max_frame_bytes < 1 || options_.max_hello_bytes < 1 || options_.hello_seconds <= 0) {
    throw std::invalid_argument(
        "data plane: max_connections, max_threads, idle_seconds, max_frame_bytes, "
        "max_hello_bytes and hello_seconds must be positive");
  }
  if (options_.max_frame_bytes > kMaxFrameBytes) {
    throw std::invalid_argument("data plane: max_frame_bytes is above " +
                                std::to_string(kMaxFrameBytes) + " (a frame's length has 32 bits)");
  }
  addrinfo* found = Resolve(options_.host, options_.port, true);
  std::string why = "no address";
  for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
    int fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(fd, a->ai_addr, a->ai_addrlen) == 0 && listen(fd, 1024) == 0) {
      listen_fd_ = fd;
      break;
    }
    why = std::strerror(errno);
    close(fd);
  }
  freeaddrinfo(found);
  if (listen_fd_ < 0) {
    throw std::runtime_error("data plane: cannot listen on " + options_.host + ":" +
                             std::to_string(options_.port) + " (" + why + ")");
  }
  sockaddr_storage bound{};
  socklen_t size = sizeof(bound);
  getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&bound), &size);
  port_ = ntohs(bound.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                                            : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  SetNonBlocking(listen_fd_, true);
  spare_fd_ = open("/dev/null", O_RDONLY | O_CLOEXEC);
  epoll_fd_ = epoll_create1(EPOLL_CLOEXEC);
  wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  tasks_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC | EFD_SEMAPHORE);
  for (auto [fd, id, exclusive] :
       {std::tuple{listen_fd_, kListenId, true}, std::tuple{wake_fd_, kWakeId, false},
        std::tuple{tasks_fd_, kTasksId, true}}) {
    epoll_event event{};
    event.events = EPOLLIN | (exclusive ? EPOLLEXCLUSIVE : 0);
    event.data.u64 = id;
    epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, fd, &event);
  }
  last_sweep_ = Now();
  std::lock_guard<std::mutex> lock(pool_mu_);
  pollers_ = 1;
  workers_.emplace_back([this] { Work(); });
}

Server::~Server() {
  Stop(0.0);
  std::lock_guard<std::mutex> lock(life_->mu);
  life_->server = nullptr;  // parked requests are answered no more
}

int Server::connections() const {
  std::lock_guard<std::mutex> lock(connections_mu_);
  return static_cast<int>(connections_.size());
}

void Server::Stop(double grace_seconds) {
  if (stopping_.exchange(true)) return;
  uint64_t one = 1;
  (void)!write(wake_fd_, &one, sizeof(one));  // never read: every waiting thread wakes
  std::vector<std::thread> workers;
  {
    std::unique_lock<std::mutex> lock(pool_mu_);
    idle_cv_.wait_for(lock, std::chrono::duration<double>(grace_seconds),
                      [this] { return in_flight_ == 0; });
    pool_closed_ = true;  // no thread is started from here on
    workers.swap(workers_);
    finished_ = in_flight_ == 0;
  }
  std::vector<std::shared_ptr<Connection>> open;
  {
    std::lock_guard<std::mutex> lock(connections_mu_);
    for (auto& entry : connections_) open.push_back(entry.second);
    connections_.clear();
  }
  for (auto& c : open) {
    std::lock_guard<std::mutex> lock(c->write_mu);
    if (!c->closed) {
      c->closed = true;
      close(c->fd);
    }
  }
  // A handler still waiting (a pull parked beyond the grace) finishes on its own; its
  // answer goes nowhere, and its thread ends after it.
  for (auto& w : workers) {
    if (finished_) {
      w.join();
    } else {
      w.detach();  // the caller must then keep this object (see `finished`)
    }
  }
  if (finished_) {
    close(listen_fd_);
    if (spare_fd_ >= 0) close(spare_fd_);
    close(epoll_fd_);
    close(wake_fd_);
    close(tasks_fd_);
  }
}

void Server::Work() {
  epoll_event event;
  while (!stopping_.load()) {
    int n = epoll_wait(epoll_fd_, &event, 1, 500);
    if (stopping_.load()) break;
    const double now = Now();
    double last = last_sweep_.load();
    if (now - last >= 0.5 && last_sweep_.compare_exchange_strong(last, now)) SweepIdle();
    if (n <= 0) continue;
    const uint64_t id = event.data.u64;
    if (id == kListenId) {
      Accept();
    } else if (id == kTasksId) {
      RunQueued();
    } else if (id >= kFirstConnectionId) {
      Serve(id, event.events);
    }
  }
}

int Server::Busy() {
  std::lock_guard<std::mutex> lock(pool_mu_);
  if (stopping_.load()) return 0;  // (Stop waits only for what it saw in flight)
  pollers_--;
  in_flight_++;
  // Someone must keep reading while this thread handles a request (it may wait long).
  if (pollers_ == 0 && !pool_closed_ && static_cast<int>(workers_.size()) < options_.max_threads) {
    pollers_++;
    workers_.emplace_back([this] { Work(); });
  }
  return in_flight_;
}

void Server::Idle() {
  std::lock_guard<std::mutex> lock(pool_mu_);
  pollers_++;
  if (--in_flight_ == 0) idle_cv_.notify_all();
}

void Server::Accept() {
  while (true) {
    sockaddr_storage address{};
    socklen_t size = sizeof(address);
    int fd = accept4(listen_fd_, reinterpret_cast<sockaddr*>(&address), &size,
                     SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if ((errno == EMFILE || errno == ENFILE) && Shed()) continue;
      return;  // EAGAIN, or a connection that went away meanwhile
    }
    if (connections() >= options_.max_connections) {
      counters_.connections_refused++;
      Header refusal;
      refusal.status = kResourceExhausted;
      std::string why = "data plane: this server has its maximum of " +
                        std::to_string(options_.max_connections) + " connections";
      refusal.length = static_cast<uint32_t>(why.size());
      std::string frame = Encode(refusal, why);
      (void)!send(fd, frame.data(), frame.size(), MSG_NOSIGNAL);
      close(fd);
      continue;
    }
    SetNoDelay(fd);
    auto c = std::make_shared<Connection>();
    c->fd = fd;
    if (options_.tls != nullptr) {
      try {
        c->tls = std::make_unique<tls::Session>(options_.tls, "");
      } catch (const std::runtime_error&) {
        counters_.tls_refused++;
        close(fd);
        continue;
      }
    }
    char host[INET6_ADDRSTRLEN] = "?";
    if (address.ss_family == AF_INET) {
      auto* in = reinterpret_cast<sockaddr_in*>(&address);
      inet_ntop(AF_INET, &in->sin_addr, host, sizeof(host));
      c->peer = std::string("ipv4:") + host + ":" + std::to_string(ntohs(in->sin_port));
    } else {
      auto* in = reinterpret_cast<sockaddr_in6*>(&address);
      inet_ntop(AF_INET6, &in->sin6_addr, host, sizeof(host));
      c->peer = std::string("ipv6:[") + host + "]:" + std::to_string(ntohs(in->sin6_port));
    }
    c->accepted_at = Now();
    c->last_activity = c->accepted_at;
    {
      std::lock_guard<std::mutex> lock(connections_mu_);
      c->id = next_id_++;
      connections_[c->id] = c;
    }
    counters_.connections_accepted++;
    epoll_event event{};
    event.events = EPOLLIN | EPOLLONESHOT;
    event.data.u64 = c->id;
    epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, fd, &event);
  }
}

void Server::Close(const std::shared_ptr<Connection>& c) {
  {
    std::lock_guard<std::mutex> lock(connections_mu_);
    connections_.erase(c->id);
  }
  {
    std::lock_guard<std::mutex> lock(c->write_mu);
    if (c->closed) return;
    epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, c->fd, nullptr);
    c->closed = true;
    close(c->fd);
  }
  std::map<uint64_t, Abandon> parked;  // (their answers would go nowhere: freed now)
  {
    std::lock_guard<std::mutex> lock(c->parked_mu);
    parked.swap(c->parked);
  }
  for (auto& [number, abandon] : parked) abandon();
}

void Server::Arm(Connection* c) {
  epoll_event event{};
  event.events = EPOLLIN | EPOLLONESHOT | (c->writing ? EPOLLOUT : 0);
  event.data.u64 = c->id;
  epoll_ctl(epoll_fd_, EPOLL_CTL_MOD, c->fd, &event);
}

void Server::Serve(uint64_t id, uint32_t events) {
  std::shared_ptr<Connection> c;
  {
    std::lock_guard<std::mutex> lock(connections_mu_);
    auto it = connections_.find(id);
    if (it == connections_.end()) return;
    c = it->second;
  }
  if (events & EPOLLOUT) {
    std::lock_guard<std::mutex> lock(c->write_mu);
    if (!c->closed) SendQueued(c.get());
  }
  std::vector<Frame> frames;
  {
    std::unique_lock<std::mutex> reading(c->read_mu, std::try_to_lock);
    if (!reading.owns_lock()) return;  // another thread reads it, and arms it once done
    if ((events & (EPOLLIN | EPOLLHUP | EPOLLERR)) && !Read(c, &frames)) return;  // closed
  }
  {
    // Armed only after `read_mu` is released: a thread that finds it held returns without
    // arming, so the holder must arm after (else an event taken meanwhile is lost).
    std::lock_guard<std::mutex> lock(c->write_mu);
    if (c->closed) return;
    Arm(c.get());
  }
  if (frames.empty()) return;
  for (size_t i = 0; i + 1 < frames.size(); ++i) {
    {
      std::lock_guard<std::mutex> lock(pool_mu_);
      tasks_.push_back(std::move(frames[i]));
    }
    uint64_t one = 1;
    (void)!write(tasks_fd_, &one, sizeof(one));
  }
  Run(std::move(frames.back()));
}

void Server::Run(Frame frame) {
  const int handled = Busy();
  if (handled == 0) {
    Reply(frame.connection, frame.header, Answer{kUnavailable, "data plane: the server stops"});
    frame.connection->in_flight--;
    return;
  }
  if (!RefuseOverloaded(frame, handled)) {
    const double start = Now();
    Handle(std::move(frame));
    // (a parked request counts its thread's time only: the load it puts on the threads)
    const double ms = (Now() - start) * 1e3;
    handle_ms_ = 0.9 * handle_ms_.load() + 0.1 * ms;
  }
  Idle();
}

bool Server::RefuseOverloaded(const Frame& frame, int handled) {
  const uint8_t method = frame.header.method;
  if (options_.max_active == 0 || handled <= options_.max_active || !Refusable(method)) {
    return false;
  }
  Reply(frame.connection, frame.header,
        Overloaded(std::to_string(handled - 1) + " requests being handled, its limit " +
                   std::to_string(options_.max_active)));
  Answered(frame.connection.get());
  return true;
}

Answer Server::Overloaded(const std::string& why) {
  counters_.refused_overloaded++;
  Answer answer{kResourceExhausted,
                "data plane: server overloaded (" + why + "): send it again later"};
  // As long as a request takes now, from a thread taking it to its answer: the requests
  // being handled share the cores, so that is about how long they take to be done. 1 ms
  // to 1 s.
  answer.retry_after_ms = static_cast<uint16_t>(std::clamp(handle_ms_.load(), 1.0, 1e3));
  return answer;
}

void Server::RunQueued() {
  uint64_t count = 0;
  if (read(tasks_fd_, &count, sizeof(count)) != sizeof(count)) return;  // taken by another
  Frame frame;
  {
    std::lock_guard<std::mutex> lock(pool_mu_);
    if (tasks_.empty()) return;
    frame = std::move(tasks_.front());
    tasks_.pop_front();
  }
  Run(std::move(frame));
}

bool Server::Read(const std::shared_ptr<Connection>& c, std::vector<Frame>* frames) {
  // Small: a body beyond it is read straight into place (one copy less), and a read of a
  // small request takes it whole.
  char buffer[4096];
  const double now = Now();
  // Makes room in the body for `more` bytes past those it has: at least doubled, at most to
  // the announced length, so that a connection holds about twice what its peer sent, never
  // what its header claims (a header costs 24 bytes to send; 1 GiB costs the server).
  auto grow_body = [&](size_t more) {
    const size_t need = c->body_have + more;
    if (c->body.size() >= need) return;
    // (a hello, before its peer is known, holds only what came)
    const size_t first = c->greeted ? size_t{64} << 10 : 0;
    const size_t grown = std::max({need, 2 * c->body.size(), first});
    c->body.resize(std::min<size_t>(grown, c->header.length));
  };
  auto refuse = [&](uint8_t status, const std::string& why) {
    counters_.frames_refused++;
    std::string message = "data plane: " + why;
    Reply(c, c->header, Answer{status, message});
    std::lock_guard<std::mutex> lock(c->write_mu);
    if (!c->closed) shutdown(c->fd, SHUT_WR);
    c->draining_until = now + 2.0;
  };
  while (true) {
    // Large bodies are read straight into place; everything else through `buffer`.
    char* target = buffer;
    size_t room = sizeof(buffer);
    if (c->in_body && c->header.length - c->body_have >= sizeof(buffer)) {
      grow_body(sizeof(buffer));
      target = &c->body[c->body_have];
      room = c->body.size() - c->body_have;
    }
    ssize_t got = Receive(c.get(), target, room);
    if (got < 0 && errno == EINTR) continue;
    if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return true;
    if (got <= 0) {
      Close(c);
      return false;
    }
    c->last_activity = now;
    // A short read emptied the socket: no need to ask again (the connection is re-armed
    // level-triggered, so bytes arriving meanwhile are not missed).
    // (With TLS a short read says nothing of the socket: it is read until EAGAIN.)
    const bool drained = c->tls == nullptr && static_cast<size_t>(got) < room;
    if (c->draining_until > 0) {  // refused: discard until closed
      if (drained) return true;
      continue;
    }
    if (target != buffer) {
      c->body_have += static_cast<size_t>(got);
    }
    const char* p = buffer;
    size_t left = target == buffer ? static_cast<size_t>(got) : 0;
    while (true) {
      if (!c->in_body) {
        size_t take = std::min(left, kHeaderBytes - c->header_have);
        std::memcpy(c->header_bytes + c->header_have, p, take);
        c->header_have += take;
        p += take;
        left -= take;
        if (c->header_have < kHeaderBytes) break;
        c->header = Header();
        if (!DecodeHeader(c->header_bytes, &c->header)) {
          refuse(kInvalidArgument,
                 "not a data-plane frame (wrong magic): is this a gRPC "
                 "client? The data plane speaks its own framing");
          return true;
        }
        if (c->header.method > kLastMethod) {
          refuse(kInvalidArgument, "unknown method " + std::to_string(c->header.method));
          return true;
        }
        if (c->header.length > options_.max_frame_bytes) {
          refuse(kResourceExhausted, "a frame of " + std::to_string(c->header.length) +
                                         " bytes is above this server's limit of " +
                                         std::to_string(options_.max_frame_bytes));
          return true;
        }
        // A hello first, alone; anything else only once it was accepted.
        const bool hello = c->header.method == kHello;
        if (hello ? (c->greeted || c->hello_pending) : !c->greeted) {
          refuse(kInvalidArgument, hello ? "a second hello on one connection"
                                         : "a request before the connection's hello was "
                                           "answered");
          return true;
        }
        // Nothing large is allocated for a peer not authenticated yet.
        if (hello && c->header.length > options_.max_hello_bytes) {
          refuse(kResourceExhausted, "a hello of " + std::to_string(c->header.length) +
                                         " bytes is above this server's limit of " +
                                         std::to_string(options_.max_hello_bytes) +
                                         " (a hello holds a token)");
          return true;
        }
        c->in_body = true;
        c->body = std::string();  // grown as its bytes come (grow_body), not to the length
        c->body_have = 0;
      }
      size_t take = std::min(left, c->header.length - c->body_have);
      if (take > 0) {
        grow_body(take);
        std::memcpy(&c->body[c->body_have], p, take);
      }
      c->body_have += take;
      p += take;
      left -= take;
      if (c->body_have < c->header.length) break;
      c->in_body = false;
      c->header_have = 0;
      if (c->header.method == kHello) c->hello_pending = true;
      counters_.requests++;
      if (options_.max_per_connection > 0 && Refusable(c->header.method) &&
          c->in_flight.load() >= options_.max_per_connection) {
        // Refused at once, its bytes freed: a connection queues no more than its limit.
        Reply(c, c->header,
              Overloaded(std::to_string(c->in_flight.load()) +
                         " requests in flight on this connection, its limit " +
                         std::to_string(options_.max_per_connection)));
        c->body = std::string();
        if (left == 0) break;
        continue;
      }
      c->in_flight++;
      frames->push_back(Frame{c, c->header, std::move(c->body), now});
      c->body = std::string();
      if (left == 0) break;
    }
    if (drained) return true;
  }
}

void Server::Handle(Frame frame) {
  const std::shared_ptr<Connection>& c = frame.connection;
  const Header& header = frame.header;
  Answer answer;
  if (header.method == kHello) {
    std::string caller_or_why;
    bool ok = authenticate_(frame.payload, c->peer, &caller_or_why);
    if (ok) {
      c->caller = caller_or_why;
    } else {
      answer = Answer{kUnauthenticated, caller_or_why};
    }
    c->greeted = ok;  // (the client sends nothing else before this answer)
    c->hello_pending = false;
  } else {
    double waited_ms = (Now() - frame.received) * 1000.0;
    if (header.deadline_ms > 0 && waited_ms >= header.deadline_ms) {
      answer = Answer{kDeadlineExceeded,
                      "data plane: the request's deadline passed "
                      "before a thread took it (server overloaded)"};
    } else {
      uint32_t left =
          header.deadline_ms == 0 ? 0 : static_cast<uint32_t>(header.deadline_ms - waited_ms);
      if (header.deadline_ms > 0 && left == 0) left = 1;
      std::shared_ptr<Life> life = life_;
      const Park park = [life, c, header](Abandon abandon) -> Respond {
        // (the request stays in flight on its connection until answered)
        uint64_t number = 0;
        {
          std::lock_guard<std::mutex> lock(c->parked_mu);
          number = ++c->next_parked;
          if (abandon) c->parked.emplace(number, std::move(abandon));
        }
        return [life, c, header, number](Answer later) {
          {
            std::lock_guard<std::mutex> lock(c->parked_mu);
            c->parked.erase(number);
          }
          std::lock_guard<std::mutex> lock(life->mu);
          if (life->server == nullptr) return;
          life->server->Reply(c, header, std::move(later));
          Answered(c.get());
        };
      };
      std::optional<Answer> now =
          handler_(header.method, std::move(frame.payload), left, c->caller, park);
      if (!now) return;  // parked
      answer = std::move(*now);
    }
  }
  const bool refused = header.method == kHello && answer.status != kOk;
  Reply(c, header, std::move(answer));
  Answered(c.get());
  if (refused) {
    std::lock_guard<std::mutex> lock(c->write_mu);
    if (!c->closed) shutdown(c->fd, SHUT_WR);
    c->draining_until = Now() + 2.0;
  }
}

void Server::Answered(Connection* c) {
  c->last_activity = Now();
  c->in_flight--;
}

void Server::Reply(const std::shared_ptr<Connection>& c, const Header& request, Answer answer) {
  if (answer.payload.size() > options_.max_frame_bytes) {  // (the length field has 32 bits)
    answer = Answer{kResourceExhausted, "data plane: an answer of " +
                                            std::to_string(answer.payload.size()) +
                                            " bytes is above this server's limit of " +
                                            std::to_string(options_.max_frame_bytes) +
                                            " bytes; ask for fewer keys per request"};
  }
  Header header;
  header.request_id = request.request_id;
  header.method = request.method;
  header.status = answer.status;
  header.retry_after_ms = answer.retry_after_ms;
  header.length = static_cast<uint32_t>(answer.payload.size());
  char encoded[kHeaderBytes];
  EncodeHeader(header, encoded);
  std::lock_guard<std::mutex> lock(c->write_mu);
  if (c->closed) return;
  if (c->tls != nullptr) {
    // Encrypted, then queued behind what waits (records leave in the order they were made).
    if (c->out.size() == c->out_sent) {
      c->out.clear();
      c->out_sent = 0;
    }
    try {
      if (answer.payload.size() < 16384) {
        answer.payload.insert(0, encoded, kHeaderBytes);  // one record
        c->tls->Write(answer.payload.data(), answer.payload.size());
      } else {
        c->tls->Write(encoded, kHeaderBytes);
        c->tls->Write(answer.payload.data(), answer.payload.size());
      }
    } catch (const std::runtime_error&) {
      return;  // the session broke: its reader closes the connection
    }
    c->tls->TakeOutput(&c->out);
    SendQueued(c.get());
    return;
  }
  size_t sent = 0;  // of the frame, written straight from here (nothing queued before it)
  if (c->out.size() == c->out_sent) {
    c->out.clear();
    c->out_sent = 0;
    sent = SendNow(c->fd, encoded, answer.payload);
  }
  const size_t total = kHeaderBytes + answer.payload.size();
  if (sent == total) return;
  if (sent < kHeaderBytes) c->out.append(encoded + sent, kHeaderBytes - sent);
  const size_t body_sent = sent > kHeaderBytes ? sent - kHeaderBytes : 0;
  c->out.append(answer.payload, body_sent, std::string::npos);
  SendQueued(c.get());
}

void Server::SendQueued(Connection* c) {
  while (c->out_sent < c->out.size()) {
    ssize_t sent = send(c->fd, c->out.data() + c->out_sent, c->out.size() - c->out_sent,
                        MSG_NOSIGNAL | MSG_DONTWAIT);
    if (sent < 0) {
      if (errno == EINTR) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK) {
        c->out.clear();  // broken: its reader sees it and closes the connection
        c->out_sent = 0;
      }
      break;
    }
    c->out_sent += static_cast<size_t>(sent);
  }
  bool more = c->out_sent < c->out.size();
  if (more != c->writing) {
    c->writing = more;
    if (more) Arm(c);  // (a reader arms it without EPOLLOUT once the queue is empty)
  }
}

// At the descriptor limit a pending connection cannot be accepted and the listening socket
// stays readable, so every thread would wake for it again at once: it is accepted on the
// spare descriptor and closed (its peer sees the connection end, and may try again).
bool Server::Shed() {
  std::lock_guard<std::mutex> lock(spare_mu_);
  if (spare_fd_ < 0) return false;
  close(spare_fd_);
  int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
  if (fd >= 0) {
    counters_.connections_refused++;
    close(fd);
  }
  spare_fd_ = open("/dev/null", O_RDONLY | O_CLOEXEC);
  return fd >= 0;
}

void Server::SweepIdle() {
  const double now = Now();
  std::vector<std::shared_ptr<Connection>> expired;
  {
    std::lock_guard<std::mutex> lock(connections_mu_);
    for (auto& entry : connections_) {
      auto& c = entry.second;
      bool idle = c->in_flight.load() == 0;
      bool unauthenticated = !c->greeted && !c->hello_pending;
      if ((c->draining_until > 0 && now > c->draining_until) ||
          (idle && now - c->last_activity > options_.idle_seconds) ||
          (unauthenticated && now - c->accepted_at > options_.hello_seconds)) {
        expired.push_back(c);
      }
    }
  }
  for (auto& c : expired) {
    // Not while a thread reads it: its fd could be closed and reused under that read.
    std::unique_lock<std::mutex> reading(c->read_mu, std::try_to_lock);
    if (!reading.owns_lock()) continue;  // (the next sweep)
    if (c->draining_until == 0) counters_.connections_closed_idle++;
    Close(c);
  }
}

// TLS on a server's connection: the socket's bytes go through its session.

ssize_t Server::Receive(Connection* c, char* out, size_t room) {
  if (c->tls == nullptr) return recv(c->fd, out, room, 0);
  // Input is fed a socket read at a time and decrypted before more is read: a peer not
  // authenticated yet holds at most a record's worth here.
  char raw[16384];
  while (true) {
    long got;
    try {
      got = c->tls->Read(out, room);
    } catch (const std::runtime_error&) {
      counters_.tls_refused++;
      if (c->plaintext_hello) {  // a plaintext client: told so in its own framing
        Header refusal;
        refusal.method = kHello;
        refusal.status = kUnauthenticated;
        const std::string why =
            "data plane: this server speaks TLS on its data port: connect with TLS (`tls_ca`)";
        refusal.length = static_cast<uint32_t>(why.size());
        const std::string frame = Encode(refusal, why);
        std::lock_guard<std::mutex> lock(c->write_mu);
        if (!c->closed) (void)!send(c->fd, frame.data(), frame.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
      } else {
        SendTlsOutput(c);  // the alert saying why
      }
      errno = EPROTO;
      return -1;
    }
    if (got > 0) return got;
    if (c->tls->HasOutput()) SendTlsOutput(c);  // the handshake's messages
    if (got < 0) return 0;                      // the peer ended the session
    if (c->tls_drained) {
      // A short read emptied the socket: no need to ask it again (the connection is
      // re-armed level-triggered, so bytes arriving meanwhile are not missed).
      c->tls_drained = false;
      errno = EAGAIN;
      return -1;
    }
    ssize_t n = recv(c->fd, raw, sizeof(raw), 0);
    if (n <= 0) return n;  // nothing more now, the end, or an error
    if (!c->tls_fed) {
      uint32_t magic = 0;
      std::memcpy(&magic, raw, std::min<size_t>(sizeof(magic), static_cast<size_t>(n)));
      c->plaintext_hello = magic == kMagic;
      c->tls_fed = true;
    }
    c->tls->Feed(raw, static_cast<size_t>(n));
    c->tls_drained = static_cast<size_t>(n) < sizeof(raw);
  }
}

void Server::SendTlsOutput(Connection* c) {
  std::lock_guard<std::mutex> lock(c->write_mu);
  if (c->closed) return;
  if (c->out.size() == c->out_sent) {
    c->out.clear();
    c->out_sent = 0;
  }
  c->tls->TakeOutput(&c->out);
  SendQueued(c);
}

// ---------------------------------------------------------------------------------------
// Client.

Connection::Connection(const std::string& host, int port, const std::string& token,
                       double connect_timeout_seconds, std::shared_ptr<tls::Context> tls)
    : where_(host + ":" + std::to_string(port)) {
  addrinfo* found = Resolve(host, port, false);
  std::string why = "no address";
  const int timeout_ms = static_cast<int>(connect_timeout_seconds * 1000);
  for (addrinfo* a = found; a != nullptr && fd_ < 0; a = a->ai_next) {
    int fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    SetNonBlocking(fd, true);
    int rc = connect(fd, a->ai_addr, a->ai_addrlen);
    if (rc < 0 && errno == EINPROGRESS) {
      pollfd wait{fd, POLLOUT, 0};
      rc = poll(&wait, 1, timeout_ms) == 1 ? 0 : -1;
      int error = rc == 0 ? 0 : ETIMEDOUT;
      socklen_t size = sizeof(error);
      if (rc == 0) getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &size);
      errno = error;
      rc = error == 0 ? 0 : -1;
    }
    if (rc == 0) {
      SetNonBlocking(fd, false);
      fd_ = fd;
    } else {
      why = std::strerror(errno);
      close(fd);
    }
  }
  freeaddrinfo(found);
  if (fd_ < 0)
    throw std::runtime_error("data plane: cannot connect to " + where_ + " (" + why + ")");
  SetNoDelay(fd_);
  timeval limit{timeout_ms / 1000, (timeout_ms % 1000) * 1000};
  setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &limit, sizeof(limit));
  if (tls != nullptr) Handshake(std::move(tls), host);
  Header hello;
  hello.method = kHello;
  hello.length = static_cast<uint32_t>(token.size());
  std::string frame = Encode(hello, token);
  char answer[kHeaderBytes] = {};
  Header header;
  std::string message;
  errno = 0;
  bool ok;
  {
    std::lock_guard<std::mutex> lock(write_mu_);
    ok = SendAll(frame.data(), frame.size()) == frame.size();  // (a hello is small)
  }
  ok = ok && Receive(answer, kHeaderBytes) && DecodeHeader(answer, &header);
  if (ok && header.length > 0 && header.length < (1u << 20)) {
    message.resize(header.length);
    ok = Receive(&message[0], header.length);
  }
  if (!ok || header.status != kOk) {
    close(fd_);
    fd_ = -1;
    // (a TLS record starts 0x15 (an alert) or 0x16 (a handshake))
    const bool speaks_tls = tls_ == nullptr && (answer[0] == 0x15 || answer[0] == 0x16);
    std::string why;
    if (ok) {
      why = message;
    } else if (speaks_tls) {
      why = "data plane: " + where_ + " speaks TLS: connect with TLS (`tls_ca`)";
    } else if (!tls_error_.empty()) {
      why = "data plane: " + where_ + " ended the TLS session: " + tls_error_;
    } else {
      why = "data plane: " + where_ + " did not answer the hello (" +
            (errno ? std::strerror(errno) : "closed") + ")";
    }
    throw std::runtime_error(why);
  }
  timeval forever{0, 0};
  setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &forever, sizeof(forever));
  reader_ = std::thread([this] { ReadLoop(); });
}

void Connection::Handshake(std::shared_ptr<tls::Context> context, const std::string& host) {
  std::string why;
  try {
    tls_ = std::make_unique<tls::Session>(std::move(context), host);
    char raw[16384];
    while (true) {
      const bool done = tls_->Handshake();
      std::string records;
      tls_->TakeOutput(&records);
      if (SendRaw(fd_, records.data(), records.size()) < records.size()) {
        why = std::string("cannot send: ") + std::strerror(errno);
        break;
      }
      if (done) return;
      ssize_t got = recv(fd_, raw, sizeof(raw), 0);
      if (got <= 0) {
        why = got == 0 ? "the server closed the connection (not TLS, or it refused this client)"
                       : std::string(errno == EAGAIN ? "timed out" : std::strerror(errno));
        break;
      }
      tls_->Feed(raw, static_cast<size_t>(got));
    }
  } catch (const std::exception& e) {
    why = e.what();
  }
  tls_.reset();
  close(fd_);
  fd_ = -1;
  throw std::runtime_error("data plane: no TLS session with " + where_ + ": " + why);
}

bool Connection::Receive(char* out, size_t size) {
  if (tls_ == nullptr) return RecvAll(fd_, out, size);
  char raw[16384];
  while (size > 0) {
    long got;
    try {
      got = tls_->Read(out, size);
    } catch (const std::runtime_error& e) {
      tls_error_ = e.what();  // a broken or forged record, or the server's alert
      return false;
    }
    if (got < 0) return false;
    if (got > 0) {
      out += got;
      size -= static_cast<size_t>(got);
      continue;
    }
    ssize_t n;
    do {
      n = recv(fd_, raw, sizeof(raw), 0);
    } while (n < 0 && errno == EINTR);
    if (n <= 0) return false;
    tls_->Feed(raw, static_cast<size_t>(n));
  }
  return true;
}

size_t Connection::SendAll(const char* data, size_t size) {
  if (tls_ == nullptr) return SendRaw(fd_, data, size);
  std::string records;
  try {
    tls_->Write(data, size);
  } catch (const std::runtime_error&) {
    errno = EPROTO;
    return 0;
  }
  tls_->TakeOutput(&records);
  const size_t sent = SendRaw(fd_, records.data(), records.size());
  return sent == records.size() ? size : sent == 0 ? 0 : 1;  // (1: some left, not all)
}

Connection::~Connection() {
  if (fd_ >= 0) shutdown(fd_, SHUT_RDWR);
  if (reader_.joinable()) reader_.join();
  if (fd_ >= 0) close(fd_);
}

void Connection::Fail(const std::string& why) {
  std::vector<std::shared_ptr<Pending>> failed;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (alive_.exchange(false)) failure_ = refusal_.empty() ? why : refusal_;
    for (auto& entry : pending_) {
      entry.second->done = true;
      entry.second->answer = Answer{kUnavailable, failure_};
      if (entry.second->on_done) failed.push_back(entry.second);
    }
    pending_.clear();
    cv_.notify_all();
  }
  for (const auto& p : failed) p->on_done(p->answer);
}

void Connection::ReadLoop() {
  char encoded[kHeaderBytes];
  while (true) {
    Header header;
    if (!Receive(encoded, kHeaderBytes) || !DecodeHeader(encoded, &header)) {
      Fail("data plane: the connection to " + where_ + " was closed");
      return;
    }
    std::string payload(header.length, '\0');
    if (!Receive(&payload[0], header.length)) {
      Fail("data plane: the connection to " + where_ + " broke in an answer");
      return;
    }
    std::shared_ptr<Pending> answered;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = pending_.find(header.request_id);
      if (it == pending_.end()) {
        // A refusal of the connection itself (request id 0), or a call given up.
        if (header.request_id == 0 && header.status != kOk) refusal_ = std::move(payload);
        continue;
      }
      it->second->done = true;
      it->second->answer = Answer{header.status, std::move(payload), header.retry_after_ms};
      if (it->second->on_done) answered = it->second;
      pending_.erase(it);
      cv_.notify_all();
    }
    if (answered) answered->on_done(answered->answer);
  }
}

Connection::Ticket Connection::Send(const std::shared_ptr<Connection>& c, uint8_t method,
                                    const std::string& payload, uint32_t deadline_ms,
                                    OnDone on_done) {
  Ticket ticket;
  ticket.connection = c;
  ticket.pending = std::make_shared<Pending>();
  ticket.pending->on_done = std::move(on_done);
  if (payload.size() > kMaxFrameBytes) {  // (the length field has 32 bits)
    ticket.pending->done = true;
    ticket.pending->answer = Answer{
        kResourceExhausted, "data plane: a request of " + std::to_string(payload.size()) +
                                " bytes is above the largest frame, " +
                                std::to_string(kMaxFrameBytes) + " bytes; send fewer keys at once"};
    if (ticket.pending->on_done) ticket.pending->on_done(ticket.pending->answer);
    return ticket;
  }
  Header header;
  header.method = method;
  header.deadline_ms = deadline_ms;
  header.length = static_cast<uint32_t>(payload.size());
  bool broken = false;
  {
    std::lock_guard<std::mutex> lock(c->mu_);
    broken = !c->alive_.load();
    if (broken) {
      ticket.pending->done = true;
      ticket.pending->answer = Answer{kUnavailable, c->failure_};
    } else {
      header.request_id = ticket.request_id = c->next_id_++;
      c->pending_[header.request_id] = ticket.pending;
    }
  }
  if (broken) {
    if (ticket.pending->on_done) ticket.pending->on_done(ticket.pending->answer);
    return ticket;
  }
  char encoded[kHeaderBytes];
  EncodeHeader(header, encoded);
  iovec parts[2] = {{encoded, kHeaderBytes}, {const_cast<char*>(payload.data()), payload.size()}};
  const size_t total = kHeaderBytes + payload.size();
  size_t written = 0;
  std::lock_guard<std::mutex> lock(c->write_mu_);
  if (c->tls_ != nullptr) {
    // Encrypted: a small frame in one record, a large one's header apart (no copy of it).
    std::string frame;
    if (payload.size() < 16384) frame = Encode(header, payload);
    const bool whole = !frame.empty();
    size_t sent =
        whole ? c->SendAll(frame.data(), frame.size()) : c->SendAll(encoded, kHeaderBytes);
    bool ok = sent == (whole ? frame.size() : kHeaderBytes);
    if (ok && !whole) ok = c->SendAll(payload.data(), payload.size()) == payload.size();
    ticket.sent = ok || sent > 0;  // (false: none of its records left)
    if (!ok) c->Fail("data plane: cannot send to " + c->where_ + ": " + std::strerror(errno));
    return ticket;
  }
  while (written < total) {
    iovec rest[2];
    int count = 0;
    size_t skip = written;
    for (auto& part : parts) {
      if (skip >= part.iov_len) {
        skip -= part.iov_len;
        continue;
      }
      rest[count].iov_base = static_cast<char*>(part.iov_base) + skip;
      rest[count].iov_len = part.iov_len - skip;
      skip = 0;
      count++;
    }
    msghdr message{};
    message.msg_iov = rest;
    message.msg_iovlen = count;
    ssize_t n = sendmsg(c->fd_, &message, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      ticket.sent = written > 0;
      c->Fail("data plane: cannot send to " + c->where_ + ": " + std::strerror(errno));
      return ticket;
    }
    written += static_cast<size_t>(n);
  }
  ticket.sent = true;
  return ticket;
}

bool Connection::Wait(const std::vector<Ticket>& tickets, Clock::time_point deadline) {
  for (const Ticket& t : tickets) {
    Connection* c = t.connection.get();
    std::unique_lock<std::mutex> lock(c->mu_);
    if (!c->cv_.wait_until(lock, deadline, [&] { return t.pending->done; })) return false;
  }
  return true;
}

bool Connection::Done(const Ticket& ticket) {
  std::lock_guard<std::mutex> lock(ticket.connection->mu_);
  return ticket.pending->done;
}

void Connection::Forget(const Ticket& ticket) {
  std::lock_guard<std::mutex> lock(ticket.connection->mu_);
  ticket.connection->pending_.erase(ticket.request_id);
}

}  // namespace data_plane
}  // namespace elastic_emb
