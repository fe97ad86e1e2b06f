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

#include <cerrno>
#include <cstring>
#include <deque>
#include <stdexcept>

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

std::string Frame(const Header& header, const std::string& payload) {
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

}  // namespace

void EncodeHeader(const Header& header, char* out) {
  Put<uint32_t>(out, kMagic);
  Put<uint32_t>(out, header.length);
  Put<uint64_t>(out, header.request_id);
  Put<uint32_t>(out, header.deadline_ms);
  Put<uint8_t>(out, header.method);
  Put<uint8_t>(out, header.status);
  Put<uint16_t>(out, 0);
}

bool DecodeHeader(const char* in, Header* header) {
  if (Get<uint32_t>(in) != kMagic) return false;
  header->length = Get<uint32_t>(in);
  header->request_id = Get<uint64_t>(in);
  header->deadline_ms = Get<uint32_t>(in);
  header->method = Get<uint8_t>(in);
  header->status = Get<uint8_t>(in);
  return true;
}

// ---------------------------------------------------------------------------------------
// Server.

// A connection the server accepted. The read state belongs to the I/O thread; the write
// state is guarded by write_mu (answers are written by handler threads).
struct Server::Connection {
  int fd = -1;
  std::string peer;
  // Read state (the I/O thread's).
  char header_bytes[kHeaderBytes];
  size_t header_have = 0;
  bool in_body = false;
  Header header;
  std::string body;
  size_t body_have = 0;
  std::atomic<double> last_activity{0};    // a read, or its last request answered
  std::atomic<bool> greeted{false};        // its kHello was accepted
  std::atomic<bool> hello_pending{false};  // its kHello is being decided
  std::atomic<double> draining_until{0};   // refused: input discarded until then, then closed
  std::string caller;                      // written before `greeted`, read after
  std::atomic<int> in_flight{0};
  // Write state.
  std::mutex write_mu;
  std::string out;
  size_t out_sent = 0;
  bool closed = false;
  bool writing = false;  // EPOLLOUT armed
};

Server::Server(const ServerOptions& options, Handler handler, Authenticate authenticate)
    : options_(options), handler_(std::move(handler)), authenticate_(std::move(authenticate)) {
  if (options_.max_connections < 1 || options_.max_threads < 1 || options_.idle_seconds <= 0 ||
      options_.max_frame_bytes < 1) {
    throw std::invalid_argument(
        "data plane: max_connections, max_threads, idle_seconds "
        "and max_frame_bytes must be positive");
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
  epoll_fd_ = epoll_create1(EPOLL_CLOEXEC);
  wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  epoll_event event{};
  event.events = EPOLLIN;
  event.data.fd = listen_fd_;
  epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, listen_fd_, &event);
  event.data.fd = wake_fd_;
  epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, wake_fd_, &event);
  loop_ = std::thread([this] { Loop(); });
}

Server::~Server() { Stop(0.0); }

int Server::connections() const {
  std::lock_guard<std::mutex> lock(connections_mu_);
  return static_cast<int>(connections_.size());
}

int Server::threads() const {
  std::lock_guard<std::mutex> lock(pool_mu_);
  return static_cast<int>(workers_.size());
}

void Server::Stop(double grace_seconds) {
  if (stopping_.exchange(true)) return;
  uint64_t one = 1;
  (void)!write(wake_fd_, &one, sizeof(one));
  if (loop_.joinable()) loop_.join();  // no new request is read from here on
  {
    std::unique_lock<std::mutex> lock(pool_mu_);
    idle_cv_.wait_for(lock, std::chrono::duration<double>(grace_seconds),
                      [this] { return in_flight_ == 0; });
    pool_closed_ = true;
  }
  pool_cv_.notify_all();
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
  // answer goes nowhere. Its thread is left to end: the pool outlives no Python object.
  std::vector<std::thread> workers;
  {
    std::lock_guard<std::mutex> lock(pool_mu_);
    workers.swap(workers_);
    finished_ = in_flight_ == 0;
  }
  for (auto& w : workers) {
    if (finished_) {
      w.join();
    } else {
      w.detach();  // the caller must then keep this object (see `finished`)
    }
  }
  close(listen_fd_);
  close(epoll_fd_);
  close(wake_fd_);
}

void Server::Loop() {
  epoll_event events[64];
  double last_sweep = Now();
  while (!stopping_.load()) {
    int n = epoll_wait(epoll_fd_, events, 64, 500);
    for (int i = 0; i < n && !stopping_.load(); ++i) {
      int fd = events[i].data.fd;
      if (fd == listen_fd_) {
        Accept();
        continue;
      }
      if (fd == wake_fd_) continue;
      std::shared_ptr<Connection> c;
      {
        std::lock_guard<std::mutex> lock(connections_mu_);
        auto it = connections_.find(fd);
        if (it == connections_.end()) continue;
        c = it->second;
      }
      if (events[i].events & EPOLLOUT) Flush(c);
      if (events[i].events & (EPOLLIN | EPOLLHUP | EPOLLERR)) Read(c);
    }
    if (Now() - last_sweep >= 0.5) {
      SweepIdle();
      last_sweep = Now();
    }
  }
}

void Server::Accept() {
  while (true) {
    sockaddr_storage address{};
    socklen_t size = sizeof(address);
    int fd = accept4(listen_fd_, reinterpret_cast<sockaddr*>(&address), &size,
                     SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) return;  // EAGAIN, or a connection that went away meanwhile
    if (connections() >= options_.max_connections) {
      counters_.connections_refused++;
      Header refusal;
      refusal.status = kResourceExhausted;
      std::string why = "data plane: this server has its maximum of " +
                        std::to_string(options_.max_connections) + " connections";
      refusal.length = static_cast<uint32_t>(why.size());
      std::string frame = Frame(refusal, why);
      (void)!send(fd, frame.data(), frame.size(), MSG_NOSIGNAL);
      close(fd);
      continue;
    }
    SetNoDelay(fd);
    auto c = std::make_shared<Connection>();
    c->fd = fd;
    char host[INET6_ADDRSTRLEN] = "?";
    int port = 0;
    if (address.ss_family == AF_INET) {
      auto* in = reinterpret_cast<sockaddr_in*>(&address);
      inet_ntop(AF_INET, &in->sin_addr, host, sizeof(host));
      port = ntohs(in->sin_port);
      c->peer = std::string("ipv4:") + host + ":" + std::to_string(port);
    } else {
      auto* in = reinterpret_cast<sockaddr_in6*>(&address);
      inet_ntop(AF_INET6, &in->sin6_addr, host, sizeof(host));
      port = ntohs(in->sin6_port);
      c->peer = std::string("ipv6:[") + host + "]:" + std::to_string(port);
    }
    c->last_activity = Now();
    {
      std::lock_guard<std::mutex> lock(connections_mu_);
      connections_[fd] = c;
    }
    counters_.connections_accepted++;
    epoll_event event{};
    event.events = EPOLLIN;
    event.data.fd = fd;
    epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, fd, &event);
  }
}

void Server::Close(const std::shared_ptr<Connection>& c) {
  {
    std::lock_guard<std::mutex> lock(connections_mu_);
    connections_.erase(c->fd);
  }
  std::lock_guard<std::mutex> lock(c->write_mu);
  if (c->closed) return;
  epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, c->fd, nullptr);
  c->closed = true;
  close(c->fd);
}

void Server::Read(const std::shared_ptr<Connection>& c) {
  char buffer[65536];
  const double now = Now();
  auto refuse = [&](uint8_t status, const std::string& why) {
    counters_.frames_refused++;
    Header answer;
    answer.request_id = c->header.request_id;
    answer.status = status;
    std::string message = "data plane: " + why;
    answer.length = static_cast<uint32_t>(message.size());
    Reply(c, answer, Answer{status, message});
    std::lock_guard<std::mutex> lock(c->write_mu);
    if (!c->closed) shutdown(c->fd, SHUT_WR);
    c->draining_until = now + 2.0;
  };
  // Large bodies are read straight into place; everything else through `buffer`.
  char* target = buffer;
  size_t room = sizeof(buffer);
  if (c->in_body && c->header.length - c->body_have >= sizeof(buffer)) {
    target = &c->body[c->body_have];
    room = c->header.length - c->body_have;
  }
  ssize_t got = recv(c->fd, target, room, 0);
  if (got == 0 || (got < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
    Close(c);
    return;
  }
  if (got < 0) return;
  c->last_activity = now;
  if (c->draining_until > 0) return;  // refused: discard until closed
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
      if (c->header_have < kHeaderBytes) return;
      c->header = Header();
      if (!DecodeHeader(c->header_bytes, &c->header)) {
        refuse(kInvalidArgument,
               "not a data-plane frame (wrong magic): is this a gRPC "
               "client? The data plane speaks its own framing");
        return;
      }
      if (c->header.method > kLastMethod) {
        refuse(kInvalidArgument, "unknown method " + std::to_string(c->header.method));
        return;
      }
      if (c->header.length > options_.max_frame_bytes) {
        refuse(kResourceExhausted, "a frame of " + std::to_string(c->header.length) +
                                       " bytes is above this server's limit of " +
                                       std::to_string(options_.max_frame_bytes));
        return;
      }
      // A hello first, alone; anything else only once it was accepted.
      const bool hello = c->header.method == kHello;
      if (hello ? (c->greeted || c->hello_pending) : !c->greeted) {
        refuse(kInvalidArgument, hello ? "a second hello on one connection"
                                       : "a request before the connection's hello was "
                                         "answered");
        return;
      }
      c->in_body = true;
      c->body.assign(c->header.length, '\0');  // allocated only once the length passed
      c->body_have = 0;
    }
    size_t take = std::min(left, c->header.length - c->body_have);
    if (take > 0) std::memcpy(&c->body[c->body_have], p, take);
    c->body_have += take;
    p += take;
    left -= take;
    if (c->body_have < c->header.length) return;
    c->in_body = false;
    c->header_have = 0;
    if (c->header.method == kHello) c->hello_pending = true;
    Dispatch(c, c->header, std::move(c->body));
    c->body = std::string();
    if (left == 0) return;
  }
}

void Server::Dispatch(const std::shared_ptr<Connection>& c, Header header, std::string payload) {
  counters_.requests++;
  c->in_flight++;
  const double received = Now();
  auto task = [this, c, header, received, payload = std::move(payload)]() mutable {
    Answer answer;
    if (header.method == kHello) {
      std::string caller_or_why;
      bool ok = authenticate_(payload, c->peer, &caller_or_why);
      if (ok) {
        c->caller = caller_or_why;
      } else {
        answer = Answer{kUnauthenticated, caller_or_why};
      }
      // The I/O thread reads the connection's next frame only after this answer (the
      // client waits for it), so these fields are not read meanwhile.
      c->greeted = ok;
      c->hello_pending = false;
    } else {
      double waited_ms = (Now() - received) * 1000.0;
      if (header.deadline_ms > 0 && waited_ms >= header.deadline_ms) {
        answer = Answer{kDeadlineExceeded,
                        "data plane: the request's deadline passed "
                        "before a thread took it (server overloaded)"};
      } else {
        uint32_t left =
            header.deadline_ms == 0 ? 0 : static_cast<uint32_t>(header.deadline_ms - waited_ms);
        if (header.deadline_ms > 0 && left == 0) left = 1;
        answer = handler_(header.method, std::move(payload), left, c->caller);
      }
    }
    const bool refused = header.method == kHello && answer.status != kOk;
    Reply(c, header, std::move(answer));
    c->last_activity = Now();
    c->in_flight--;
    if (refused) {
      std::lock_guard<std::mutex> lock(c->write_mu);
      if (!c->closed) shutdown(c->fd, SHUT_WR);
      c->draining_until = Now() + 2.0;
    }
  };
  Submit(std::move(task));
}

void Server::Reply(const std::shared_ptr<Connection>& c, const Header& request, Answer answer) {
  Header header;
  header.request_id = request.request_id;
  header.method = request.method;
  header.status = answer.status;
  header.length = static_cast<uint32_t>(answer.payload.size());
  char encoded[kHeaderBytes];
  EncodeHeader(header, encoded);
  std::lock_guard<std::mutex> lock(c->write_mu);
  if (c->closed) return;
  if (c->out.size() == c->out_sent) {
    c->out.clear();
    c->out_sent = 0;
  }
  c->out.append(encoded, kHeaderBytes);
  c->out.append(answer.payload);
  SendQueued(c.get());
}

void Server::Flush(const std::shared_ptr<Connection>& c) {
  std::lock_guard<std::mutex> lock(c->write_mu);
  if (!c->closed) SendQueued(c.get());
}

void Server::SendQueued(Connection* c) {
  while (c->out_sent < c->out.size()) {
    ssize_t sent = send(c->fd, c->out.data() + c->out_sent, c->out.size() - c->out_sent,
                        MSG_NOSIGNAL | MSG_DONTWAIT);
    if (sent < 0) {
      if (errno == EINTR) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK) {
        c->out.clear();  // broken: the I/O thread sees it and closes the connection
        c->out_sent = 0;
      }
      break;
    }
    c->out_sent += static_cast<size_t>(sent);
  }
  bool more = c->out_sent < c->out.size();
  if (more != c->writing) {
    c->writing = more;
    epoll_event event{};
    event.events = EPOLLIN | (more ? EPOLLOUT : 0);
    event.data.fd = c->fd;
    epoll_ctl(epoll_fd_, EPOLL_CTL_MOD, c->fd, &event);
  }
}

void Server::SweepIdle() {
  const double now = Now();
  std::vector<std::shared_ptr<Connection>> expired;
  {
    std::lock_guard<std::mutex> lock(connections_mu_);
    for (auto& entry : connections_) {
      auto& c = entry.second;
      bool partial = c->in_body || c->header_have > 0;
      bool idle = c->in_flight.load() == 0 || partial;
      if ((c->draining_until > 0 && now > c->draining_until) ||
          (idle && now - c->last_activity > options_.idle_seconds)) {
        expired.push_back(c);
      }
    }
  }
  for (auto& c : expired) {
    if (c->draining_until == 0) counters_.connections_closed_idle++;
    Close(c);
  }
}

void Server::Submit(std::function<void()> task) {
  std::lock_guard<std::mutex> lock(pool_mu_);
  in_flight_++;
  tasks_.push_back(std::move(task));
  // A thread for each task no idle thread will take (a task may wait for long).
  if (static_cast<int>(tasks_.size()) > idle_workers_ &&
      static_cast<int>(workers_.size()) < options_.max_threads) {
    workers_.emplace_back([this] { Work(); });
  } else {
    pool_cv_.notify_one();
  }
}

void Server::Work() {
  std::unique_lock<std::mutex> lock(pool_mu_);
  while (true) {
    idle_workers_++;
    pool_cv_.wait(lock, [this] { return pool_closed_ || !tasks_.empty(); });
    idle_workers_--;
    if (tasks_.empty()) return;  // closed
    std::function<void()> task = std::move(tasks_.front());
    tasks_.pop_front();
    lock.unlock();
    task();
    lock.lock();
    in_flight_--;
    if (in_flight_ == 0) idle_cv_.notify_all();
  }
}

// ---------------------------------------------------------------------------------------
// Client.

Connection::Connection(const std::string& host, int port, const std::string& token,
                       double connect_timeout_seconds)
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
  Header hello;
  hello.method = kHello;
  hello.length = static_cast<uint32_t>(token.size());
  std::string frame = Frame(hello, token);
  char answer[kHeaderBytes];
  Header header;
  std::string message;
  bool ok =
      send(fd_, frame.data(), frame.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(frame.size()) &&
      RecvAll(fd_, answer, kHeaderBytes) && DecodeHeader(answer, &header);
  if (ok && header.length > 0 && header.length < (1u << 20)) {
    message.resize(header.length);
    ok = RecvAll(fd_, &message[0], header.length);
  }
  if (!ok || header.status != kOk) {
    close(fd_);
    fd_ = -1;
    throw std::runtime_error(ok ? message
                                : "data plane: " + where_ + " did not answer the hello (" +
                                      (errno ? std::strerror(errno) : "closed") + ")");
  }
  timeval forever{0, 0};
  setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &forever, sizeof(forever));
  reader_ = std::thread([this] { ReadLoop(); });
}

Connection::~Connection() {
  if (fd_ >= 0) shutdown(fd_, SHUT_RDWR);
  if (reader_.joinable()) reader_.join();
  if (fd_ >= 0) close(fd_);
}

void Connection::Fail(const std::string& why) {
  std::lock_guard<std::mutex> lock(mu_);
  if (alive_.exchange(false)) failure_ = refusal_.empty() ? why : refusal_;
  for (auto& entry : pending_) {
    entry.second->done = true;
    entry.second->answer = Answer{kUnavailable, failure_};
  }
  pending_.clear();
  cv_.notify_all();
}

void Connection::ReadLoop() {
  char encoded[kHeaderBytes];
  while (true) {
    Header header;
    if (!RecvAll(fd_, encoded, kHeaderBytes) || !DecodeHeader(encoded, &header)) {
      Fail("data plane: the connection to " + where_ + " was closed");
      return;
    }
    std::string payload(header.length, '\0');
    if (!RecvAll(fd_, &payload[0], header.length)) {
      Fail("data plane: the connection to " + where_ + " broke in an answer");
      return;
    }
    std::lock_guard<std::mutex> lock(mu_);
    auto it = pending_.find(header.request_id);
    if (it == pending_.end()) {
      // A refusal of the connection itself (request id 0), or a call given up.
      if (header.request_id == 0 && header.status != kOk) refusal_ = std::move(payload);
      continue;
    }
    it->second->done = true;
    it->second->answer = Answer{header.status, std::move(payload)};
    pending_.erase(it);
    cv_.notify_all();
  }
}

Connection::Ticket Connection::Send(const std::shared_ptr<Connection>& c, uint8_t method,
                                    const std::string& payload, uint32_t deadline_ms) {
  Ticket ticket;
  ticket.connection = c;
  ticket.pending = std::make_shared<Pending>();
  Header header;
  header.method = method;
  header.deadline_ms = deadline_ms;
  header.length = static_cast<uint32_t>(payload.size());
  {
    std::lock_guard<std::mutex> lock(c->mu_);
    if (!c->alive_.load()) {
      ticket.pending->done = true;
      ticket.pending->answer = Answer{kUnavailable, c->failure_};
      return ticket;
    }
    header.request_id = ticket.request_id = c->next_id_++;
    c->pending_[header.request_id] = ticket.pending;
  }
  char encoded[kHeaderBytes];
  EncodeHeader(header, encoded);
  iovec parts[2] = {{encoded, kHeaderBytes}, {const_cast<char*>(payload.data()), payload.size()}};
  const size_t total = kHeaderBytes + payload.size();
  size_t written = 0;
  std::lock_guard<std::mutex> lock(c->write_mu_);
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
