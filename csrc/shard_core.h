// The data plane's side of a parameter server (Python configures, C++ serves).
//
// A `ShardCore` is the part of one slot range's shard (elastic_emb.ps.server.shard.Shard)
// that requests read and change: its step clock, its slot bounds and, as Python last
// published them, its tables. A `ServerCore` holds a server's ShardCores by range and
// answers Pull, Push and their *Ranges form from the data plane's threads without Python,
// when it can: every table a C++ table with a constant learning rate, gradients finite,
// keys within the range's slots; on a coordinated server while Python's last snapshot says
// this server serves the range, its changes sent to the backups' data planes and applied
// there in order (csrc/replication.h). Anything else goes to Python (`Serve` returns kPython before
// anything changed), which answers as it always did; a refusal of the step clock (the same clock,
// the same messages) is answered here. A pull that must wait is parked, holding no thread.
#pragma once

#include <array>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "data_plane.h"
#include "deadline_timer.h"
#include "replication.h"
#include "step_clock.h"
#include "wire.h"

namespace elastic_emb {

class Table;

// A table as the data plane sees it.
struct PlaneTable {
  std::shared_ptr<Table> table;  // null: a table only Python pulls and pushes (tiered)
  float learning_rate = 0.0f;
  bool constant_rate = false;  // false: a schedule, computed by Python for each step

  bool native() const { return table != nullptr && constant_rate; }
};
using PlaneTables = std::map<std::string, PlaneTable>;

// A range's virtual slots: [begin, end) of num_slots.
struct SlotBounds {
  int64_t num_slots = 0, begin = 0, end = 0;
  bool operator==(const SlotBounds& o) const {
    return num_slots == o.num_slots && begin == o.begin && end == o.end;
  }
};

// Where a coordinated server may serve a range's workers (Python's check_primary): as the
// primary of its group, or (reads that insert nothing) as a member, until `until`
// (steady-clock seconds: the lease renewed last, plus its TTL). Past it, Python decides.
struct RangeServing {
  bool primary = false;
  bool member = false;
  double until = 0.0;
};

// What a pull reads: its tables (kept while it is answered, or waits) and their sources.
struct PlanePull {
  std::shared_ptr<const PlaneTables> tables;
  std::vector<wire::RowSource> sources;
};

// Applies one table's parts of sync step `step` in Python (a table the plane does not
// push itself, or parts whose sum is not finite: Python skips and logs it).
using ApplyInPython = std::function<void(int64_t step, const std::string& table,
                                         const std::vector<const StepPart*>&)>;

class ShardCore {
 public:
  explicit ShardCore(ApplyInPython apply_in_python);

  StepClock& clock() { return clock_; }
  // The shard's tables now (replaced whole, atomically).
  void SetTables(PlaneTables tables);
  // The virtual slots [begin, end) (of num_slots) whose keys the range takes; none: all.
  void SetSlots(std::optional<SlotBounds> slots);
  std::optional<SlotBounds> slots() const;

  // A pull the plane answers: parsed, its tables found. False: Python answers it.
  bool PreparePull(const wire::PullRequest& request, PlanePull* pull);
  // Its answer, or nullopt when it must wait (Python waits). Throws Refusal.
  std::optional<std::string> AnswerPull(const wire::PullRequest& request, const PlanePull& pull);
  // The rows, once the pull may read (throws OUT_OF_RANGE when its keys' slots moved away
  // meanwhile: the rows it inserted there are erased, as Python's Shard.pull does).
  std::string Rows(const wire::PullRequest& request, const PlanePull& pull);
  // A push the plane applies: its tables found, gradients decoded and finite.
  bool PreparePush(wire::PushRequest& request, std::vector<PlaneTable>* tables);
  // Whether some of its keys' slots are not this range's now (a cutover shrank it after
  // PreparePush).
  bool Moved(const wire::PushRequest& request) const;
  // Applies it (SYNC: queues it); the PushResponse. Throws Refusal.
  std::string ApplyPush(wire::PushRequest& request, const std::vector<PlaneTable>& tables);

 private:
  std::shared_ptr<const PlaneTables> tables() const;
  void ApplyStep(int64_t step, const std::vector<const StepPart*>& parts, const std::string& name);

  const ApplyInPython apply_in_python_;
  StepClock clock_;
  mutable std::mutex mu_;  // guards the two below
  std::shared_ptr<const PlaneTables> tables_;
  std::optional<SlotBounds> slots_;
};

// One method's calls answered by the plane (Python's servicer._MethodStats).
constexpr int kLatencyBounds = 13;  // servicer.LATENCY_BUCKETS
struct MethodCounts {
  int64_t calls = 0, errors = 0, request_bytes = 0, response_bytes = 0;
  double seconds = 0.0, max_seconds = 0.0;
  std::array<int64_t, kLatencyBounds + 1> latency{};
  std::map<std::string, int64_t> codes;
};

// How the plane took a request.
enum class Served { kAnswered, kParked, kPython };

class ServerCore : public std::enable_shared_from_this<ServerCore> {
 public:
  ServerCore() = default;
  ServerCore(const ServerCore&) = delete;
  ServerCore& operator=(const ServerCore&) = delete;

  // The plane answers nothing until enabled. `pushes`: applied here alone (a server without
  // a coordinator); false: a coordinated server's, replicated when its role allows.
  void SetEnabled(bool enabled, bool pushes);
  // The largest answer (the message limit): a pull whose rows alone would be larger is
  // refused RESOURCE_EXHAUSTED before anything is read or inserted.
  void SetMaxAnswerBytes(uint64_t bytes);
  // A coordinated server: where it serves now, by range (replaced whole). Before the
  // first call, every range is served (a server without a coordinator).
  void SetServing(std::map<int32_t, RangeServing> serving);
  std::optional<std::map<int32_t, RangeServing>> serving() const;
  // Meters the load of the requests answered here, per virtual slot of `num_slots`
  // (elastic_emb.ps.coord.balance.LoadMeter: keys, bytes, CPU seconds, each request's
  // bytes and CPU shared among its slots in proportion to their keys).
  void MeterLoad(int64_t num_slots);
  // The load metered so far: (3, num_slots) totals, row-major.
  std::vector<double> load() const;
  void PutRange(int32_t range, std::shared_ptr<ShardCore> shard);
  void DropRange(int32_t range);

  // Takes a data-plane request (data_plane::Method): kAnswered with `status` (a gRPC
  // code) and `out` (the answer, or the refusal's message); kParked: answered through
  // `park` later, holding no thread (a pull that waits for its step, a change that waits
  // for the backups, or on a backup for the change before it); kPython: Python answers it
  // (nothing changed). `from_peer`: the caller may send changes (Replicate).
  Served Serve(uint8_t method, const std::string& payload, const data_plane::Park& park,
               bool from_peer, uint8_t* status, std::string* out);
  // The group's changes: their order, sequence and forwarding (a coordinated server).
  const std::shared_ptr<Replication>& replication() const { return replication_; }

  std::map<std::string, MethodCounts> counts() const;
  int64_t changes() const;
  // Pulls answered after waiting for other workers, and their seconds in all.
  std::pair<int64_t, double> waits() const;

 private:
  using TimePoint = std::chrono::steady_clock::time_point;
  std::shared_ptr<ShardCore> Find(int32_t range) const;
  class ParkedPull;
  // Refuses a pull whose rows take `bytes`, if above the limit.
  void CheckAnswerBytes(uint64_t bytes) const;
  // Whether this server serves `range`'s pulls now (`train`: only as the primary).
  bool Serves(int32_t range, bool train) const;
  template <class Request>
  void CountLoad(const Request& request, size_t bytes, double cpu_seconds);
  // A single Pull: answered now, or parked until its step may be read.
  Served Pull(std::string_view payload, const data_plane::Park& park, TimePoint start,
              uint8_t* status, std::string* out);
  // Refuses (DEADLINE_EXCEEDED) the parked pulls whose deadline passed; the next deadline.
  std::optional<TimePoint> ExpirePulls();
  // A PullRanges: answered now, or parked until each part may be read.
  Served PullRanges(const std::string& payload, const data_plane::Park& park, TimePoint start,
                    uint8_t* status, std::string* out);
  struct PreparedPushes;
  // The pushes of `parts` parsed and checked; false: Python answers them. `train`: only
  // where this server serves the range's workers now.
  bool Prepare(const std::vector<std::string_view>& parts, bool train, PreparedPushes* p) const;
  std::optional<std::string> Pushes(const std::vector<std::string_view>& parts, bool ranges,
                                    int64_t* pushes);
  // A coordinated primary's Push or PushRanges: applied, numbered, sent to the backups and
  // answered once they applied it.
  Served ReplicatedPushes(uint8_t method, const std::string& payload, const data_plane::Park& park,
                          TimePoint start, uint8_t* status, std::string* out);
  // A backup's Replicate: a change applied in its turn.
  Served Change(const std::string& payload, const data_plane::Park& park, TimePoint start,
                uint8_t* status, std::string* out);
  void Record(uint8_t method, double seconds, const std::string& code, size_t received, size_t sent,
              int64_t changes);

  mutable std::mutex mu_;  // guards the fields below
  bool enabled_ = false;
  bool pushes_ = false;
  uint64_t max_answer_bytes_ = uint64_t{1} << 30;
  std::optional<std::map<int32_t, RangeServing>> serving_;
  int64_t load_slots_ = 0;
  std::vector<double> load_;  // (3, load_slots_)
  std::map<int32_t, std::shared_ptr<ShardCore>> ranges_;
  std::map<std::string, MethodCounts> counts_;
  const std::shared_ptr<Replication> replication_ = std::make_shared<Replication>();
  int64_t changes_ = 0;
  int64_t waits_ = 0;
  double wait_seconds_ = 0.0;

  DeadlineTimer timer_{[this] { return ExpirePulls(); }};  // the parked pulls' deadlines
};

}  // namespace elastic_emb
