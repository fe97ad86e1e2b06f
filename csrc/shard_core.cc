#include "shard_core.h"

#include <time.h>

#include <algorithm>
#include <chrono>
#include <utility>

#include "check.h"
#include "table.h"

namespace elastic_emb {
namespace {

// The data plane's methods (data_plane::Method).
enum : uint8_t { kPull = 1, kPush = 2, kPullRanges = 3, kPushRanges = 4, kReplicate = 5 };
const char* const kMethodNames[] = {"", "Pull", "Push", "PullRanges", "PushRanges", "Replicate"};

constexpr double kLatencyBucketSeconds[kLatencyBounds] = {
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0};

// gRPC's status codes by name.
uint8_t StatusNumber(const std::string& code) {
  static const std::map<std::string, uint8_t> numbers = {{"OK", 0},
                                                         {"CANCELLED", 1},
                                                         {"UNKNOWN", 2},
                                                         {"INVALID_ARGUMENT", 3},
                                                         {"DEADLINE_EXCEEDED", 4},
                                                         {"NOT_FOUND", 5},
                                                         {"ALREADY_EXISTS", 6},
                                                         {"PERMISSION_DENIED", 7},
                                                         {"RESOURCE_EXHAUSTED", 8},
                                                         {"FAILED_PRECONDITION", 9},
                                                         {"ABORTED", 10},
                                                         {"OUT_OF_RANGE", 11},
                                                         {"UNIMPLEMENTED", 12},
                                                         {"INTERNAL", 13},
                                                         {"UNAVAILABLE", 14},
                                                         {"DATA_LOSS", 15},
                                                         {"UNAUTHENTICATED", 16}};
  auto it = numbers.find(code);
  return it == numbers.end() ? 2 : it->second;
}

// The calling thread's CPU seconds.
double ThreadSeconds() {
  timespec t{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

// The parts of a *Ranges request, or the request alone; false: malformed (Python refuses it).
bool Parts(bool ranges, std::string_view payload, std::vector<std::string_view>* parts) {
  if (!ranges) {
    parts->push_back(payload);
    return true;
  }
  try {
    *parts = wire::ParseParts(payload);
  } catch (const InvalidArgument&) {
    return false;
  }
  return true;
}

// One optimizer step of `table` (its step lock held): numbered next, at its constant rate.
void PushLocked(const PlaneTable& t, int64_t n, const int64_t* keys, const float* grads) {
  StepState& steps = t.table->step_state();
  ++steps.iterations;
  t.table->Push(n, keys, grads, t.learning_rate, steps.iterations);
}

}  // namespace

ShardCore::ShardCore(ApplyInPython apply_in_python)
    : apply_in_python_(std::move(apply_in_python)),
      clock_([this](int64_t step, const std::vector<const StepParts*>& pushes) {
        // Each table's parts, in worker order; tables by name.
        std::map<std::string, std::vector<const StepPart*>> by_table;
        for (const StepParts* parts : pushes) {
          for (const StepPart& part : *parts) by_table[part.table].push_back(&part);
        }
        for (const auto& [name, parts] : by_table) ApplyStep(step, parts, name);
      }),
      tables_(std::make_shared<const PlaneTables>()) {}

void ShardCore::SetTables(PlaneTables tables) {
  auto shared = std::make_shared<const PlaneTables>(std::move(tables));
  std::lock_guard<std::mutex> lock(mu_);
  tables_ = std::move(shared);
}

void ShardCore::SetSlots(std::optional<SlotBounds> slots) {
  std::lock_guard<std::mutex> lock(mu_);
  slots_ = slots;
}

std::optional<SlotBounds> ShardCore::slots() const {
  std::lock_guard<std::mutex> lock(mu_);
  return slots_;
}

std::shared_ptr<const PlaneTables> ShardCore::tables() const {
  std::lock_guard<std::mutex> lock(mu_);
  return tables_;
}

namespace {

template <typename Request>  // a PullRequest or a PushRequest
bool Outside(const Request& request, const std::optional<SlotBounds>& slots) {
  if (!slots) return false;
  return std::any_of(request.tables.begin(), request.tables.end(), [&](const auto& t) {
    return wire::KeysOutside(t.keys, slots->num_slots, slots->begin, slots->end);
  });
}

Refusal KeysMoved(const SlotBounds& slots) {
  return Refusal("OUT_OF_RANGE", "keys outside this range's slots [" + std::to_string(slots.begin) +
                                     ", " + std::to_string(slots.end) +
                                     "): the range was split or moved; read the cluster map again");
}

}  // namespace

// A sync step's parts of one table: summed by one push, as Python's
// TableSet.apply_sync_step does (each part was checked finite; a sum of several that is
// not goes to Python, which skips the step and logs it).
void ShardCore::ApplyStep(int64_t step, const std::vector<const StepPart*>& parts,
                          const std::string& name) {
  const auto all = tables();
  auto it = all->find(name);
  if (it == all->end() || !it->second.native()) {
    apply_in_python_(step, name, parts);
    return;
  }
  const PlaneTable& t = it->second;
  if (parts.size() == 1) {
    std::lock_guard<std::mutex> lock(t.table->step_state().mu);
    PushLocked(t, static_cast<int64_t>(parts[0]->keys.size()), parts[0]->keys.data(),
               parts[0]->gradients.data());
    return;
  }
  std::vector<int64_t> keys;
  std::vector<float> grads;
  for (const StepPart* p : parts) {
    keys.insert(keys.end(), p->keys.begin(), p->keys.end());
    grads.insert(grads.end(), p->gradients.begin(), p->gradients.end());
  }
  if (!wire::NonfiniteProblem(keys, grads, t.table->dim()).empty()) {
    apply_in_python_(step, name, parts);
    return;
  }
  std::lock_guard<std::mutex> lock(t.table->step_state().mu);
  PushLocked(t, static_cast<int64_t>(keys.size()), keys.data(), grads.data());
}

bool ShardCore::PreparePull(const wire::PullRequest& request, PlanePull* pull) {
  if (request.encoding < wire::kFloat32 || request.encoding > wire::kBfloat16) return false;
  if (Outside(request, slots())) return false;  // Python refuses it
  pull->tables = tables();
  pull->sources.assign(request.tables.size(), wire::RowSource{});
  for (size_t i = 0; i < request.tables.size(); ++i) {
    auto it = pull->tables->find(request.tables[i].name);
    if (it == pull->tables->end() || it->second.table == nullptr) return false;
    pull->sources[i].table = it->second.table.get();
    pull->sources[i].dim = it->second.table->dim();
  }
  return true;
}

std::optional<std::string> ShardCore::AnswerPull(const wire::PullRequest& request,
                                                 const PlanePull& pull) {
  clock_.CheckWorker(request.worker, request.step);
  clock_.CheckPullStep(request.worker, request.step);
  if (!clock_.ReadyToPull(request.worker, request.step)) return std::nullopt;
  return Rows(request, pull);
}

std::string ShardCore::Rows(const wire::PullRequest& request, const PlanePull& pull) {
  const std::optional<SlotBounds> before = slots();
  if (before && Outside(request, before)) throw KeysMoved(*before);  // (moved while it waited)
  std::string rows = wire::AnswerPull(request, pull.sources);
  const std::optional<SlotBounds> after = slots();
  if (before && after && !(*before == *after)) {
    // They moved while it was answered: the rows it inserted there are not this range's
    // (the move's own erase may have run before they were inserted).
    for (const wire::RowSource& source : pull.sources) {
      source.table->EraseSlots(after->num_slots, after->end, before->end);
    }
    if (Outside(request, after)) throw KeysMoved(*after);
  }
  return rows;
}

bool ShardCore::PreparePush(wire::PushRequest& request, std::vector<PlaneTable>* tables_out) {
  if (Moved(request)) return false;  // Python refuses it
  const auto all = tables();
  std::vector<int> dims;
  for (const auto& part : request.tables) {
    auto it = all->find(part.name);
    if (it == all->end() || !it->second.native()) return false;
    tables_out->push_back(it->second);
    dims.push_back(it->second.table->dim());
  }
  try {
    wire::DecodeGradients(request, dims);
  } catch (const InvalidArgument&) {
    return false;  // Python refuses it, naming the problem
  }
  for (size_t i = 0; i < request.tables.size(); ++i) {
    const auto& part = request.tables[i];
    if (!wire::NonfiniteProblem(part.keys, part.gradients, dims[i]).empty()) return false;
  }
  return true;
}

bool ShardCore::Moved(const wire::PushRequest& request) const { return Outside(request, slots()); }

std::string ShardCore::ApplyPush(wire::PushRequest& request,
                                 const std::vector<PlaneTable>& tables) {
  clock_.CheckWorker(request.worker, request.step);
  auto queue = [&] {
    StepParts parts;
    for (size_t i = 0; i < request.tables.size(); ++i) {
      auto& part = request.tables[i];
      parts.push_back(
          {part.name, std::move(part.keys), std::move(part.gradients), tables[i].table->dim()});
    }
    return parts;
  };
  auto apply = [&] {
    // Every table's step lock, taken in one order (LocalTable._step_order), then each
    // table's step in request order (as Python's push_parsed).
    std::vector<Table*> order;
    for (const PlaneTable& t : tables) order.push_back(t.table.get());
    std::sort(order.begin(), order.end());
    std::vector<std::unique_lock<std::mutex>> locks;
    for (Table* t : order) locks.emplace_back(t->step_state().mu);
    for (size_t i = 0; i < tables.size(); ++i) {
      const auto& part = request.tables[i];
      PushLocked(tables[i], static_cast<int64_t>(part.keys.size()), part.keys.data(),
                 part.gradients.data());
    }
  };
  return wire::EncodePushResponse(clock_.Push(request.worker, request.step, queue, apply));
}

void ServerCore::SetEnabled(bool enabled, bool pushes) {
  std::lock_guard<std::mutex> lock(mu_);
  enabled_ = enabled;
  pushes_ = pushes;
}

void ServerCore::SetServing(std::map<int32_t, RangeServing> serving) {
  std::lock_guard<std::mutex> lock(mu_);
  serving_ = std::move(serving);
}

std::optional<std::map<int32_t, RangeServing>> ServerCore::serving() const {
  std::lock_guard<std::mutex> lock(mu_);
  return serving_;
}

void ServerCore::MeterLoad(int64_t num_slots) {
  EE_CHECK(num_slots > 0, "`num_slots` must be positive, got " << num_slots);
  std::lock_guard<std::mutex> lock(mu_);
  load_slots_ = num_slots;
  load_.assign(static_cast<size_t>(3 * num_slots), 0.0);
}

std::vector<double> ServerCore::load() const {
  std::lock_guard<std::mutex> lock(mu_);
  return load_;
}

bool ServerCore::Serves(int32_t range, bool train) const {
  std::lock_guard<std::mutex> lock(mu_);
  if (!serving_) return true;
  auto it = serving_->find(range);
  if (it == serving_->end()) return false;
  const RangeServing& s = it->second;
  const double now =
      std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
  return (s.primary || (!train && s.member)) && now < s.until;
}

template <class Request>
void ServerCore::CountLoad(const Request& request, size_t bytes, double cpu_seconds) {
  std::lock_guard<std::mutex> lock(mu_);
  if (load_slots_ == 0) return;
  size_t n = 0;
  for (const auto& t : request.tables) n += t.keys.size();
  if (n == 0) return;
  const double byte_share = static_cast<double>(bytes) / static_cast<double>(n);
  const double cpu_share = cpu_seconds / static_cast<double>(n);
  const size_t width = static_cast<size_t>(load_slots_);
  for (const auto& t : request.tables) {
    for (int64_t key : t.keys) {
      const auto slot = static_cast<size_t>(VirtualSlot(key, load_slots_));
      load_[slot] += 1.0;
      load_[width + slot] += byte_share;
      load_[2 * width + slot] += cpu_share;
    }
  }
}

void ServerCore::PutRange(int32_t range, std::shared_ptr<ShardCore> shard) {
  std::lock_guard<std::mutex> lock(mu_);
  ranges_[range] = std::move(shard);
}

void ServerCore::DropRange(int32_t range) {
  std::shared_ptr<ShardCore> dropped;  // released outside the lock
  std::lock_guard<std::mutex> lock(mu_);
  auto it = ranges_.find(range);
  if (it == ranges_.end()) return;
  dropped = std::move(it->second);
  ranges_.erase(it);
}

void ServerCore::SetMaxAnswerBytes(uint64_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  max_answer_bytes_ = bytes;
}

void ServerCore::CheckAnswerBytes(uint64_t bytes) const {
  uint64_t limit = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    limit = max_answer_bytes_;
  }
  if (bytes > limit) {
    throw Refusal("RESOURCE_EXHAUSTED", "a pull answering " + std::to_string(bytes) +
                                            " bytes of rows is above this server's limit of " +
                                            std::to_string(limit) +
                                            " bytes a message; pull fewer keys per request");
  }
}

// A parked pull's tickets on its shards' clocks, unparked when its caller goes away.
class ServerCore::ParkedPull {
 public:
  void Add(std::shared_ptr<ShardCore> shard, uint64_t ticket) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!abandoned_) {
        tickets_.emplace_back(std::move(shard), ticket);
        return;
      }
    }
    shard->clock().Unpark(ticket);  // (its caller went away while it was being parked)
  }
  void Abandon() {
    std::vector<std::pair<std::shared_ptr<ShardCore>, uint64_t>> tickets;
    {
      std::lock_guard<std::mutex> lock(mu_);
      abandoned_ = true;
      tickets.swap(tickets_);
    }
    for (auto& [shard, ticket] : tickets) shard->clock().Unpark(ticket);
  }

 private:
  std::mutex mu_;
  bool abandoned_ = false;
  std::vector<std::pair<std::shared_ptr<ShardCore>, uint64_t>> tickets_;
};

namespace {

// The bytes of the rows a pull answers (its answer is at least this large).
uint64_t RowBytes(const wire::PullRequest& request, const PlanePull& pull) {
  const uint64_t item = request.encoding == wire::kFloat32 ? 4 : 2;
  uint64_t bytes = 0;
  for (size_t i = 0; i < request.tables.size(); ++i) {
    bytes += request.tables[i].keys.size() * static_cast<uint64_t>(pull.sources[i].dim) * item;
  }
  return bytes;
}

}  // namespace

std::shared_ptr<ShardCore> ServerCore::Find(int32_t range) const {
  std::lock_guard<std::mutex> lock(mu_);
  if (!enabled_) return nullptr;
  auto it = ranges_.find(range);
  return it == ranges_.end() ? nullptr : it->second;
}

Served ServerCore::Serve(uint8_t method, const std::string& payload, const data_plane::Park& park,
                         bool from_peer, uint8_t* status, std::string* out) {
  if (method < kPull || method > kReplicate) return Served::kPython;
  const bool ranges = method == kPullRanges || method == kPushRanges;
  const bool pull = method == kPull || method == kPullRanges;
  bool replicated = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!enabled_) return Served::kPython;
    replicated = !pull && !pushes_;
  }
  const auto start = std::chrono::steady_clock::now();
  if (method == kReplicate) {
    return from_peer ? Change(payload, park, start, status, out) : Served::kPython;
  }
  if (replicated) {
    try {
      return ReplicatedPushes(method, payload, park, start, status, out);
    } catch (const std::exception& e) {  // (before anything changed: memory)
      *status = StatusNumber("INTERNAL");
      *out = e.what();
      return Served::kAnswered;
    }
  }
  std::string code;
  std::optional<std::string> answer;
  int64_t pushes = 0;  // pushes taken (Python's `changes` counts the refused ones too)
  try {
    if (method == kPull) return Pull(payload, park, start, status, out);
    if (method == kPullRanges) return PullRanges(payload, park, start, status, out);
    std::vector<std::string_view> parts;
    if (!Parts(ranges, payload, &parts)) return Served::kPython;
    answer = Pushes(parts, ranges, &pushes);
    if (!answer) return Served::kPython;
  } catch (const Refusal& e) {
    code = e.code();
    *out = e.what();
  } catch (const InvalidArgument& e) {  // (a table refused an argument: Python's ValueError)
    code = "INVALID_ARGUMENT";
    *out = e.what();
  } catch (const std::exception& e) {
    code = "INTERNAL";
    *out = e.what();
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (code.empty()) {
    *status = 0;
    *out = std::move(*answer);
    Record(method, seconds, code, payload.size(), out->size(), pushes);
  } else {
    *status = StatusNumber(code);
    Record(method, seconds, code, payload.size(), 0, pushes);
  }
  return Served::kAnswered;
}

Served ServerCore::Pull(std::string_view payload, const data_plane::Park& park, TimePoint start,
                        uint8_t* status, std::string* out) {
  auto request = std::make_shared<wire::PullRequest>();
  try {
    *request = wire::ParsePullRequest(payload);
  } catch (const InvalidArgument&) {
    return Served::kPython;
  }
  auto shard = Find(request->range);
  auto pull = std::make_shared<PlanePull>();
  if (shard == nullptr || !Serves(request->range, request->train) ||
      !shard->PreparePull(*request, pull.get())) {
    return Served::kPython;
  }
  CheckAnswerBytes(RowBytes(*request, *pull));
  const size_t received = payload.size();
  // Answers it: with the rows, or the refusal (Refusal is caught by Serve before it parks).
  auto finish = [request, pull, shard, received, start](ServerCore* core, const Refusal* refusal,
                                                        uint8_t* status, std::string* out) {
    const double cpu = ThreadSeconds();
    std::string code;
    if (refusal != nullptr) {
      code = refusal->code();
      *out = refusal->what();
    } else {
      try {
        *out = shard->Rows(*request, *pull);
      } catch (const Refusal& e) {
        code = e.code();
        *out = e.what();
      } catch (const std::exception& e) {
        code = "INTERNAL";
        *out = e.what();
      }
    }
    *status = code.empty() ? 0 : StatusNumber(code);
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (core != nullptr) {
      const size_t sent = code.empty() ? out->size() : 0;
      if (code.empty()) core->CountLoad(*request, received + sent, ThreadSeconds() - cpu);
      core->Record(kPull, seconds, code, received, sent, 0);
    }
  };
  StepClock& clock = shard->clock();
  clock.CheckWorker(request->worker, request->step);
  clock.CheckPullStep(request->worker, request->step);
  const double timeout = request->timeout_ms > 0 ? request->timeout_ms / 1000.0 : 3600.0;
  auto tickets = std::make_shared<ParkedPull>();
  data_plane::Respond respond = park([tickets] { tickets->Abandon(); });
  std::weak_ptr<ServerCore> self = weak_from_this();
  const uint64_t parked =
      clock.Park(request->worker, request->step, timeout,
                 [self, respond, finish](const Refusal* refusal, double waited) {
                   auto core = self.lock();
                   data_plane::Answer answer;
                   finish(core.get(), refusal, &answer.status, &answer.payload);
                   if (core != nullptr && refusal == nullptr) {
                     std::lock_guard<std::mutex> lock(core->mu_);
                     ++core->waits_;
                     core->wait_seconds_ += waited;
                   }
                   respond(std::move(answer));
                 });
  if (parked != 0) {
    tickets->Add(shard, parked);
    timer_.Watch(std::chrono::steady_clock::now() +
                 std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                     std::chrono::duration<double>(std::min(timeout, 1e8))));
    return Served::kParked;
  }
  finish(this, nullptr, status, out);
  return Served::kAnswered;
}

// The timer thread's: refuses each parked pull whose deadline passed.
std::optional<ServerCore::TimePoint> ServerCore::ExpirePulls() {
  std::vector<std::shared_ptr<ShardCore>> shards;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [range, shard] : ranges_) shards.push_back(shard);
  }
  std::optional<TimePoint> next;
  for (const auto& shard : shards) {
    auto deadline = shard->clock().Expire();
    if (deadline && (!next || *deadline < *next)) next = deadline;
  }
  return next;
}

// A PullRanges: the parts that may be read are read now, the others wait (parked, as a
// Pull) and the whole is answered when the last may be read, or refused as soon as one is
// (Python's answer: its parts read in turn).
Served ServerCore::PullRanges(const std::string& payload, const data_plane::Park& park,
                              TimePoint start, uint8_t* status, std::string* out) {
  struct Part {
    wire::PullRequest request;
    std::shared_ptr<ShardCore> shard;
    PlanePull pull;
    size_t bytes = 0;
  };
  struct State {
    std::mutex mu;  // guards the fields below
    std::vector<Part> parts;
    std::vector<std::string> answers;
    size_t left = 1;  // parts waiting, +1 until all are parked
    bool done = false;
    std::string code, message;  // a refusal; code "": none
  };
  auto s = std::make_shared<State>();
  std::vector<std::string_view> bytes;
  try {
    bytes = wire::ParseParts(payload);
    s->parts.resize(bytes.size());
    for (size_t i = 0; i < bytes.size(); ++i)
      s->parts[i].request = wire::ParsePullRequest(bytes[i]);
  } catch (const InvalidArgument&) {
    return Served::kPython;
  }
  s->answers.resize(bytes.size());
  for (size_t i = 0; i < bytes.size(); ++i) {
    Part& p = s->parts[i];
    p.bytes = bytes[i].size();
    p.shard = Find(p.request.range);
    if (p.shard == nullptr || !Serves(p.request.range, p.request.train) ||
        !p.shard->PreparePull(p.request, &p.pull)) {
      return Served::kPython;
    }
  }
  uint64_t row_bytes = 0;
  for (const Part& p : s->parts) row_bytes += RowBytes(p.request, p.pull);
  CheckAnswerBytes(row_bytes);
  const size_t received = payload.size();
  std::weak_ptr<ServerCore> self = weak_from_this();
  // Reads part i (with s->mu held); false: refused.
  auto read = [self, s](size_t i) {
    Part& p = s->parts[i];
    const double cpu = ThreadSeconds();
    try {
      s->answers[i] = p.shard->Rows(p.request, p.pull);
    } catch (const Refusal& e) {
      s->code = e.code();
      s->message = e.what();
      return false;
    } catch (const std::exception& e) {
      s->code = "INTERNAL";
      s->message = e.what();
      return false;
    }
    if (auto core = self.lock()) {
      core->CountLoad(p.request, p.bytes + s->answers[i].size(), ThreadSeconds() - cpu);
    }
    return true;
  };
  // The answer, once every part is read or one is refused (with s->mu held).
  auto answer = [self, s, received, start]() {
    data_plane::Answer a;
    if (s->code.empty()) {
      a.payload =
          wire::JoinParts(std::vector<std::string_view>(s->answers.begin(), s->answers.end()));
    } else {
      a.status = StatusNumber(s->code);
      a.payload = s->message;
    }
    if (auto core = self.lock()) {
      const double seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      core->Record(kPullRanges, seconds, s->code, received, s->code.empty() ? a.payload.size() : 0,
                   0);
    }
    return a;
  };
  std::vector<size_t> waiting;
  {
    std::lock_guard<std::mutex> lock(s->mu);
    for (size_t i = 0; i < s->parts.size() && s->code.empty(); ++i) {
      Part& p = s->parts[i];
      StepClock& clock = p.shard->clock();
      try {
        clock.CheckWorker(p.request.worker, p.request.step);
        clock.CheckPullStep(p.request.worker, p.request.step);
        if (!clock.ReadyToPull(p.request.worker, p.request.step)) {
          waiting.push_back(i);
          continue;
        }
      } catch (const Refusal& e) {
        s->code = e.code();
        s->message = e.what();
        break;
      }
      read(i);
    }
    if (waiting.empty() || !s->code.empty()) {
      data_plane::Answer a = answer();
      *status = a.status;
      *out = std::move(a.payload);
      return Served::kAnswered;
    }
    s->left = waiting.size() + 1;
  }
  auto tickets = std::make_shared<ParkedPull>();
  const data_plane::Respond respond = park([tickets] { tickets->Abandon(); });
  // Part i may be read (refused: not); the request is answered with the last part, or the
  // first refusal.
  auto ready = [self, s, read, answer, respond](size_t i, const Refusal* refusal, double waited) {
    std::optional<data_plane::Answer> a;
    {
      std::lock_guard<std::mutex> lock(s->mu);
      if (s->done) return;
      if (i < s->parts.size()) {
        if (refusal != nullptr) {
          s->code = refusal->code();
          s->message = refusal->what();
        } else if (read(i) && waited > 0) {
          if (auto core = self.lock()) {
            std::lock_guard<std::mutex> core_lock(core->mu_);
            ++core->waits_;
            core->wait_seconds_ += waited;
          }
        }
      }
      if (!s->code.empty() || --s->left == 0) {
        s->done = true;
        a = answer();
      }
    }
    if (a) respond(std::move(*a));
  };
  for (size_t i : waiting) {
    const wire::PullRequest& request = s->parts[i].request;
    const double timeout = request.timeout_ms > 0 ? request.timeout_ms / 1000.0 : 3600.0;
    const uint64_t parked = s->parts[i].shard->clock().Park(
        request.worker, request.step, timeout,
        [ready, i](const Refusal* refusal, double waited) { ready(i, refusal, waited); });
    if (parked != 0) {
      tickets->Add(s->parts[i].shard, parked);
      timer_.Watch(std::chrono::steady_clock::now() +
                   std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                       std::chrono::duration<double>(std::min(timeout, 1e8))));
    } else {
      ready(i, nullptr, 0.0);  // (it may be read already)
    }
  }
  ready(s->parts.size(), nullptr, 0.0);  // every waiting part parked
  return Served::kParked;
}

// Pushes parsed, their shards found and their gradients decoded; false: Python answers them.
struct ServerCore::PreparedPushes {
  std::vector<wire::PushRequest> requests;
  std::vector<std::shared_ptr<ShardCore>> shards;
  std::vector<std::vector<PlaneTable>> tables;
};

bool ServerCore::Prepare(const std::vector<std::string_view>& parts, bool train,
                         PreparedPushes* p) const {
  p->requests.resize(parts.size());
  p->shards.resize(parts.size());
  p->tables.resize(parts.size());
  for (size_t i = 0; i < parts.size(); ++i) {
    try {
      p->requests[i] = wire::ParsePushRequest(parts[i]);
    } catch (const InvalidArgument&) {
      return false;
    }
    p->shards[i] = Find(p->requests[i].range);
    if (p->shards[i] == nullptr || (train && !Serves(p->requests[i].range, true)) ||
        !p->shards[i]->PreparePush(p->requests[i], &p->tables[i])) {
      return false;
    }
  }
  return true;
}

std::optional<std::string> ServerCore::Pushes(const std::vector<std::string_view>& parts,
                                              bool ranges, int64_t* pushes) {
  PreparedPushes p;
  if (!Prepare(parts, false, &p)) return std::nullopt;
  // Applied in order; a refusal answers the whole request (those before it applied, as
  // in Python).
  std::vector<std::string> answers(parts.size());
  for (size_t i = 0; i < parts.size(); ++i) {
    ++*pushes;
    answers[i] = p.shards[i]->ApplyPush(p.requests[i], p.tables[i]);
  }
  if (!ranges) return std::move(answers[0]);
  return wire::JoinParts(std::vector<std::string_view>(answers.begin(), answers.end()));
}

namespace {

// What a request's answer will be: its parts' responses, or a refusal.
struct Outcome {
  std::vector<std::string> answers;
  std::string code, message;                      // code "": OK
  int64_t pushes = 0;                             // pushes taken
  int64_t first_sequence = 0, last_sequence = 0;  // of the changes made (0: none)
};

void Refuse(Outcome* outcome, const std::string& code, const std::string& message) {
  outcome->code = code;
  outcome->message = message;
}

}  // namespace

Served ServerCore::ReplicatedPushes(uint8_t method, const std::string& payload,
                                    const data_plane::Park& park, TimePoint start, uint8_t* status,
                                    std::string* out) {
  const bool ranges = method == kPushRanges;
  std::vector<std::string_view> parts;
  if (!Parts(ranges, payload, &parts)) return Served::kPython;
  const double cpu = ThreadSeconds();
  PreparedPushes p;
  if (!Prepare(parts, true, &p)) return Served::kPython;
  Replication& replication = *replication_;
  const std::shared_ptr<const ReplicaRole> role = replication.role();
  if (!role->changes) return Served::kPython;
  const auto backups = replication.Connect(*role);
  if (!backups) return Served::kPython;
  std::unique_lock<std::mutex> order(replication.order());
  if (replication.role() != role || !replication.applied()) return Served::kPython;
  for (size_t i = 0; i < parts.size(); ++i) {
    // A cutover (which holds the order) shrank the range since it was prepared: Python
    // refuses it, and the worker sends those keys to their new group.
    if (p.shards[i]->Moved(p.requests[i])) return Served::kPython;
  }

  // From here the plane answers: once every backup applied the changes made.
  auto outcome = std::make_shared<Outcome>();
  outcome->answers.resize(parts.size());
  const size_t received = payload.size();
  std::weak_ptr<ServerCore> self = weak_from_this();
  const int32_t group = role->group;
  const int64_t epoch = role->epoch;
  auto answer = [self, outcome, ranges, method, received, start, group,
                 epoch](data_plane::Answer* a) {
    auto core = self.lock();
    if (outcome->code.empty()) {
      if (core && outcome->last_sequence > 0) {
        core->replication_->CountAcknowledged(group, epoch, outcome->first_sequence,
                                              outcome->last_sequence);
      }
      a->status = 0;
      a->payload = ranges ? wire::JoinParts(std::vector<std::string_view>(outcome->answers.begin(),
                                                                          outcome->answers.end()))
                          : std::move(outcome->answers[0]);
    } else {
      a->status = StatusNumber(outcome->code);
      a->payload = outcome->message;
    }
    if (core) {
      const double seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      core->Record(method, seconds, outcome->code, received,
                   outcome->code.empty() ? a->payload.size() : 0, outcome->pushes);
    }
  };
  data_plane::Respond respond;
  if (!role->backups.empty()) respond = park(nullptr);  // (it must finish: no Abandon)
  auto waiter = std::make_shared<Replication::Waiter>(
      [answer, respond, outcome](const std::string& unacknowledged) {
        if (!unacknowledged.empty()) Refuse(outcome.get(), "ABORTED", unacknowledged);
        data_plane::Answer a;
        answer(&a);
        respond(std::move(a));
      });
  for (size_t i = 0; i < parts.size(); ++i) {
    try {
      ++outcome->pushes;
      outcome->answers[i] = p.shards[i]->ApplyPush(p.requests[i], p.tables[i]);
    } catch (const Refusal& e) {
      Refuse(outcome.get(), e.code(), e.what());
    } catch (const InvalidArgument& e) {  // (a table refused an argument: Python's ValueError)
      Refuse(outcome.get(), "INVALID_ARGUMENT", e.what());
    } catch (const std::exception& e) {
      Refuse(outcome.get(), "INTERNAL", e.what());
    }
    if (!outcome->code.empty()) break;
    wire::ReplicateRequest change;
    change.group = role->group;
    change.epoch = role->epoch;
    change.sequence = replication.Number(role->epoch);
    if (outcome->first_sequence == 0) outcome->first_sequence = change.sequence;
    outcome->last_sequence = change.sequence;
    change.method = "Push";
    change.request = parts[i];
    change.primary = role->address;
    replication.Forward(*role, *backups, wire::EncodeReplicateRequest(change), change.sequence,
                        waiter);
  }
  order.unlock();
  if (outcome->code.empty()) {
    for (size_t i = 0; i < parts.size(); ++i) {
      CountLoad(p.requests[i], parts[i].size() + outcome->answers[i].size(),
                (ThreadSeconds() - cpu) / static_cast<double>(parts.size()));
    }
  }
  if (role->backups.empty()) {
    data_plane::Answer a;
    answer(&a);
    *status = a.status;
    *out = std::move(a.payload);
    return Served::kAnswered;
  }
  waiter->Release();
  return Served::kParked;
}

Served ServerCore::Change(const std::string& payload, const data_plane::Park& park, TimePoint start,
                          uint8_t* status, std::string* out) {
  wire::ReplicateRequest change;
  PreparedPushes p;
  try {
    change = wire::ParseReplicateRequest(payload);
  } catch (const InvalidArgument&) {
    return Served::kPython;
  }
  if (change.method != "Push" || !Prepare({change.request}, false, &p)) return Served::kPython;
  auto prepared = std::make_shared<PreparedPushes>(std::move(p));
  const int64_t sequence = change.sequence, epoch = change.epoch;
  const size_t received = payload.size();
  std::weak_ptr<ServerCore> self = weak_from_this();
  const std::string address = replication_->role()->address;
  // Applies it, in its turn; the answer.
  const uint64_t digest = ChangeDigest(change.method, change.request);
  auto apply = [self, prepared, sequence, epoch, received, start, address, digest] {
    data_plane::Answer a;
    std::string code;
    try {
      prepared->shards[0]->ApplyPush(prepared->requests[0], prepared->tables[0]);
      a.payload = wire::EncodeReplicateResponse(sequence);
    } catch (const std::exception& e) {
      code = "DATA_LOSS";
      a.status = StatusNumber(code);
      a.payload = address + " could not apply change " + std::to_string(sequence) + ": " + e.what();
    }
    if (auto core = self.lock()) {
      // (a change not applied leaves the sequence: the next waits, and the primary drops
      // this backup, never taking its answer for the change)
      if (code.empty()) core->replication_->SetApplied(sequence, epoch, digest);
      const double seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      core->Record(kReplicate, seconds, code, received, code.empty() ? a.payload.size() : 0, 1);
    }
    return a;
  };
  const data_plane::Respond respond = park(nullptr);  // (used only if it waits)
  std::string refusal;
  const Turn turn = replication_->TakeTurn(
      change,
      [apply, respond](const Refusal* refused) {
        respond(refused == nullptr
                    ? apply()
                    : data_plane::Answer{StatusNumber(refused->code()), refused->what()});
      },
      &refusal);
  data_plane::Answer a;
  switch (turn) {
    case Turn::kApply:
      a = apply();
      break;
    case Turn::kDone:
    case Turn::kRefuse:
    case Turn::kDiverged: {
      const std::string code = turn == Turn::kDone     ? ""
                               : turn == Turn::kRefuse ? "ABORTED"
                                                       : "DATA_LOSS";
      a = code.empty() ? data_plane::Answer{0, wire::EncodeReplicateResponse(sequence)}
                       : data_plane::Answer{StatusNumber(code), refusal};
      const double seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      Record(kReplicate, seconds, code, received, code.empty() ? a.payload.size() : 0, 0);
      break;
    }
    case Turn::kWait:
      return Served::kParked;
    case Turn::kPython:
      return Served::kPython;
  }
  *status = a.status;
  *out = std::move(a.payload);
  return Served::kAnswered;
}

void ServerCore::Record(uint8_t method, double seconds, const std::string& code, size_t received,
                        size_t sent, int64_t changes) {
  const int bucket = static_cast<int>(std::lower_bound(std::begin(kLatencyBucketSeconds),
                                                       std::end(kLatencyBucketSeconds), seconds) -
                                      std::begin(kLatencyBucketSeconds));
  std::lock_guard<std::mutex> lock(mu_);
  MethodCounts& c = counts_[kMethodNames[method]];
  ++c.calls;
  c.request_bytes += static_cast<int64_t>(received);
  c.response_bytes += static_cast<int64_t>(sent);
  c.seconds += seconds;
  c.max_seconds = std::max(c.max_seconds, seconds);
  ++c.latency[static_cast<size_t>(bucket)];
  if (!code.empty()) {
    ++c.errors;
    ++c.codes[code];
  }
  changes_ += changes;
}

std::map<std::string, MethodCounts> ServerCore::counts() const {
  std::lock_guard<std::mutex> lock(mu_);
  return counts_;
}

std::pair<int64_t, double> ServerCore::waits() const {
  std::lock_guard<std::mutex> lock(mu_);
  return {waits_, wait_seconds_};
}

int64_t ServerCore::changes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return changes_;
}

}  // namespace elastic_emb
