// One shard's training mode and step protocol (elastic_emb.ps.server.shard). Workers
// join with a mode (sync, async, bounded staleness) and push their steps in order; the
// clock says when a pull may read a step, queues a sync step's pushes until every worker
// pushed it and then has it applied in worker order (the same sums on every replica),
// holds steps back while a save writes, and hands its state to another replica or range.
// It keeps no tables: a sync step is applied by the callback it is given.
//
// Thread-safe: one lock guards the state. Callers that hold the GIL release it before
// calling in; the callbacks (ApplyStep, a push's queue and apply) may take it.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace elastic_emb {

// A request the shard refuses, before anything changes: the name of the gRPC status it
// is answered with, and why (Python's elastic_emb.ps.server.request_error.RequestError).
class Refusal : public std::runtime_error {
 public:
  Refusal(std::string code, const std::string& message)
      : std::runtime_error(message), code_(std::move(code)) {}
  const std::string& code() const { return code_; }

 private:
  std::string code_;
};

// Training modes (the wire's Mode values); kNoMode until the first Join.
enum ClockMode : int { kNoMode = -1, kAsync = 0, kSync = 1 };

// A worker's pushes leave in the background: its pull may overtake this many.
constexpr int64_t kMaxPushesInFlight = 4;

// One table's part of a worker's push.
struct StepPart {
  std::string table;
  std::vector<int64_t> keys;
  std::vector<float> gradients;  // (keys.size(), dim)
  int dim = 0;
};
using StepParts = std::vector<StepPart>;

// A push of a sync step not applied yet (`StepClock::Export`).
struct PendingPush {
  int64_t worker = 0, step = 0;
  StepParts parts;
};

// The clock's state without its pending pushes (`StepClock::Export`).
struct ClockState {
  int mode = kNoMode;
  int64_t num_workers = 1;
  bool elastic = false;
  std::set<int64_t> live;
  int64_t staleness = -1;
  std::map<int64_t, int64_t> pushed;  // worker -> last step pushed
  int64_t applied = 0;
};

// Applies sync step `step`: the parts of its pushes, in worker order.
using ApplyStep = std::function<void(int64_t step, const std::vector<const StepParts*>& pushes)>;

class StepClock {
 public:
  explicit StepClock(ApplyStep apply_step) : apply_step_(std::move(apply_step)) {}

  // Registers a worker; returns the step it continues from. Fixed workers (not
  // `elastic`) join with the same (mode, num_workers, staleness) and steps wait for
  // workers 0..num_workers-1. Elastic ones agree on (mode, staleness), join at the
  // current step and Leave at any time; one that joins `again` (its lease lapsed) goes
  // on from its own step: its pushes of steps applied without it apply on their own.
  int64_t Join(int64_t worker, int64_t num_workers, int mode, int64_t staleness, bool elastic,
               bool again);
  // An elastic worker leaves: no step waits for it any more. Returns the shard's step.
  int64_t Leave(int64_t worker);
  // Waiting and later requests are refused (ABORTED) with `why` (the range moved away).
  void Retire(const std::string& why);

  // Refuses a request of `worker` for `step` that the shard does not take.
  void CheckWorker(int64_t worker, int64_t step);
  // Refuses a pull of a step beyond the pushes `worker` may have in flight.
  void CheckPullStep(int64_t worker, int64_t step);
  // Whether a pull of `step` may read now (ABORTED once retired).
  bool ReadyToPull(int64_t worker, int64_t step);
  // Blocks a pull for `step` until the mode allows it; the seconds it waited. Always:
  // the worker's own push of step - 1 has arrived. SYNC: step - 1 is applied. Bounded
  // staleness s: every worker has pushed step - 1 - s.
  double WaitToPull(int64_t worker, int64_t step, double timeout);

  // A pull that waits holding no thread (the data plane's): `then(nullptr, seconds
  // waited)` once it may read, or `then(&refusal, seconds)` (ABORTED, DEADLINE_EXCEEDED),
  // called once, without the lock, by the thread whose change decided it (or Expire's).
  using Parked = std::function<void(const Refusal* refusal, double waited)>;
  // Parks a pull of `step` for up to `timeout` s: its ticket, or 0 (nothing parked) when it
  // may read now. Throws ABORTED once retired.
  uint64_t Park(int64_t worker, int64_t step, double timeout, Parked then);
  // Drops a parked pull whose caller went away: its `then` is never called (nothing once
  // it was decided).
  void Unpark(uint64_t ticket);
  // Refuses the parked pulls whose deadline passed; the earliest deadline left, if any.
  std::optional<std::chrono::steady_clock::time_point> Expire();

  // Takes `worker`'s push of `step` once; returns the shard's step. SYNC: `queue()`
  // (called under the lock) gives its parts, applied with the other workers' once every
  // worker pushed the step. ASYNC: `apply()` applies it at once, outside the lock. A step
  // pushed again (after a failover) is taken once.
  int64_t Push(int64_t worker, int64_t step, const std::function<StepParts()>& queue,
               const std::function<void()>& apply);

  // Saves. SYNC with `after_step`: no later step is applied until ReleaseHold; whether
  // it holds. Refuses once a later step is applied or another save holds one.
  bool HoldAt(int64_t after_step);
  void ReleaseHold();
  // SYNC with `after_step`: waits until it is applied. The shard's step and each
  // worker's last step pushed.
  std::pair<int64_t, std::map<int64_t, int64_t>> WaitApplied(int64_t after_step, double timeout);

  // The last step each worker that steps wait for pushed.
  std::map<int64_t, int64_t> WorkerSteps();
  int mode();
  // Steps applied (SYNC) or the furthest step pushed (ASYNC).
  int64_t step();

  // Copies: the state and the pushes of sync steps not applied yet; and the whole
  // state replaced by an exported one (late pushes a save held back are applied).
  std::pair<ClockState, std::vector<PendingPush>> Export();
  void Install(const ClockState& state, std::vector<PendingPush> pending);
  // Runs `first()`, then keeps of each pending push's parts the keys whose virtual slot
  // (of num_slots) is in [begin, end): both under the lock.
  void KeepPending(int64_t num_slots, int64_t begin, int64_t end,
                   const std::function<void()>& first);

 private:
  using Lock = std::unique_lock<std::recursive_mutex>;
  using Fired = std::vector<std::function<void()>>;  // parked pulls decided, to call
  struct Waiter {
    int64_t worker = 0, step = 0;
    double timeout = 0.0;
    std::chrono::steady_clock::time_point began, deadline;
    Parked then;
    uint64_t ticket = 0;
  };
  struct Late {
    bool waits = false;
    std::vector<int64_t> workers;  // with `who`
    std::string what;
  };

  // Under mu_.
  int64_t Step() const { return state_.mode == kSync ? state_.applied : furthest_; }
  void SetPushed(int64_t worker, int64_t step);
  int64_t Pushed(int64_t worker) const;
  void WakeAll();
  Late LateFor(int64_t worker, int64_t step, bool who) const;
  std::vector<int64_t> Workers() const;
  bool StepComplete(const std::map<int64_t, StepParts>& pushed_by) const;
  void ApplyLate(int64_t worker, int64_t step, StepParts parts);
  void ApplyOne(int64_t step, const StepParts& parts);
  void ApplyCompleteSteps();
  std::condition_variable_any& OwnPush(int64_t worker);
  std::string PushedText() const;
  Refusal TimedOut(int64_t worker, int64_t step, double timeout) const;
  // The parked pulls that may read now, or are refused (the shard retired): taken out.
  Fired Settle();
  static void Fire(Fired& fired);  // without the lock

  const ApplyStep apply_step_;  // called under mu_, one sync step at a time, in order
  std::recursive_mutex mu_;
  std::condition_variable_any changed_;  // a step applied, a worker came or went
  // Guarded by mu_:
  ClockState state_;
  // ASYNC without a staleness bound: worker -> what its pulls wait on (its own push).
  std::map<int64_t, std::unique_ptr<std::condition_variable_any>> own_push_;
  int64_t furthest_ = 0;         // the furthest step pushed
  std::set<int64_t> applying_;   // ASYNC: workers whose push is being applied
  std::optional<int64_t> hold_;  // SYNC: apply no step after this one (a save)
  // SYNC: step -> worker -> its parts, applied in worker order once every worker pushed.
  std::map<int64_t, std::map<int64_t, StepParts>> pending_;
  // SYNC: late pushes that came while a save held the steps, applied when it ends.
  std::vector<PendingPush> held_late_;
  std::optional<std::string> gone_;  // why the shard serves no more
  std::vector<Waiter> parked_;       // pulls parked, in arrival order
  uint64_t next_ticket_ = 1;
};

}  // namespace elastic_emb
