// A replica group's changes on the data plane (elastic_emb.ps.server.replicator, the same
// rules without Python per change).
//
// A `Replication` is one server's part: the lock that orders a primary's changes (Python's
// `ReplicaState.order`), the sequence of the last change applied (`applied`), the role
// Python last published, and
//  - as a primary: connections to its backups' data planes, the changes sent on them and
//    who still has to apply each. A change is answered to its worker once every backup
//    applied it, or was removed from the group: a backup that fails to apply one (or
//    takes longer than kForwardSeconds) is dropped through Python, which changes the map
//    (if it cannot, no longer the primary, the change is not acknowledged: ABORTED);
//  - as a backup: the changes that came before their turn, parked (holding no thread)
//    until the one before is applied, or refused after kGapSeconds.
// Python makes the changes the plane does not (other methods, other tables) in the same
// sequence, under the same lock, and sends them over gRPC; a backup applies each in turn
// whichever way it came.
#pragma once

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
#include "step_clock.h"
#include "wire.h"

namespace elastic_emb {

constexpr double kForwardSeconds = 30.0;  // replicator.FORWARD_TIMEOUT
constexpr double kGapSeconds = 10.0;      // replicator.GAP_TIMEOUT

// A backup's data plane.
struct Backup {
  std::string address;  // its gRPC address, as the cluster map names it
  std::string host;
  int port = 0;
};

// This server's place in its group, as Python last published it (ReplicaState).
struct ReplicaRole {
  std::string address;  // this server
  int32_t group = -1;   // -1: a spare
  int64_t epoch = 0;
  std::string primary;             // the group's primary
  std::vector<std::string> holds;  // the group's members and joining servers
  // A backup taking over: the primary it deposes, whose changes at `epoch` it refuses
  // from the moment it decides, before etcd names it ("": none).
  std::string deposed;
  // A primary whose changes the plane may make itself: its backups' data planes (every
  // member's), none of them being caught up from a snapshot.
  bool changes = false;
  std::vector<Backup> backups;
};

// The changes a primary acknowledged in one epoch of its group: how many, their first and
// last sequence, and when (seconds since the Unix epoch) the first and last were answered.
// The history checker compares epochs from the servers' audit logs (tests/_history.py).
struct AcknowledgedChanges {
  int64_t changes = 0;
  int64_t first_sequence = 0;
  int64_t last_sequence = 0;
  double first_time = 0;
  double last_time = 0;
};

// What to do with a change that came to a backup.
enum class Turn {
  kApply,     // it is next: apply it, then SetApplied()
  kDone,      // applied already (sent again)
  kWait,      // an earlier change is missing: parked until its turn
  kRefuse,    // not from this backup's primary (ABORTED)
  kDiverged,  // its sequence was applied here as another change, or (WaitTurn) the change
              // before it never came (DATA_LOSS)
  kPython,    // Python decides (it waits for a map it has not seen, or a diverged replica)
};

// What tells changes of one sequence apart (their method and request bytes).
uint64_t ChangeDigest(std::string_view method, std::string_view request);

class Replication : public std::enable_shared_from_this<Replication> {
 public:
  // Removes a backup from this primary's group (Python: Replica._drop); may block. False:
  // it could not (this server is no longer the primary, etcd cannot be reached).
  using Drop = std::function<bool(const std::string& backup, const std::string& why)>;
  // A parked change at its turn (refusal null) or its deadline.
  using Later = std::function<void(const Refusal* refusal)>;
  using Clock = std::chrono::steady_clock;

  Replication() = default;
  Replication(const Replication&) = delete;
  Replication& operator=(const Replication&) = delete;

  // How to drop a backup, and the token this server's connections to the others give.
  void Configure(Drop drop, std::string token);
  // The TLS (a client context: the peer CA, this server's certificate) of this server's
  // connections to the others' data planes; null: plaintext. Thread-safe.
  void SetTls(std::shared_ptr<tls::Context> tls);
  std::mutex& order() { return order_; }

  std::shared_ptr<const ReplicaRole> role() const;
  // Replaces the role; a primary stops waiting for the backups it no longer holds.
  void SetRole(ReplicaRole role);

  // The sequence of the last change applied (none: no snapshot yet), and its epoch.
  std::optional<int64_t> applied() const;
  int64_t applied_epoch() const;
  // Sets them (a change applied, here or by Python, or a snapshot installed); runs the
  // parked change that is next, if any. `digest`: the change's (ChangeDigest), 0 when not
  // one change.
  void SetApplied(std::optional<int64_t> sequence, int64_t epoch, uint64_t digest = 0);
  // False when change `sequence` of epoch `epoch` was applied here as another change
  // (remembered for the last kDigestsKept changes applied).
  bool SameChange(int64_t sequence, int64_t epoch, uint64_t digest) const;
  // Waits until `applied` differs from `seen`, the role changes or `seconds` pass.
  void WaitApplied(std::optional<int64_t> seen, double seconds);

  // The primary's side. Connections to `role`'s backups (made now where none stands);
  // nullopt when one cannot be made (Python replicates meanwhile).
  std::optional<std::vector<std::shared_ptr<data_plane::Connection>>> Connect(
      const ReplicaRole& role);
  // The next change's sequence, numbered now (the caller holds order()).
  int64_t Number(int64_t epoch);
  // What waits for a change's backups: its `done` runs once each of them applied it (or
  // was dropped) and Release() was called, with why it may not be acknowledged ("": it
  // may).
  class Waiter;
  // Sends a change to `role`'s backups (the caller holds order()).
  void Forward(const ReplicaRole& role,
               const std::vector<std::shared_ptr<data_plane::Connection>>& backups,
               const std::string& change, int64_t sequence, const std::shared_ptr<Waiter>& waiter);

  // Counts a change acknowledged (answered OK) at `epoch` of `group`; the sequences of the
  // changes an answer acknowledges run from `first` to `last`.
  void CountAcknowledged(int32_t group, int64_t epoch, int64_t first, int64_t last);
  // What CountAcknowledged counted, by (group, epoch).
  std::map<std::pair<int32_t, int64_t>, AcknowledgedChanges> acknowledged() const;

  // The backup's side: whether `change` is applied now, later (`later` is kept) or not.
  Turn TakeTurn(const wire::ReplicateRequest& change, Later later, std::string* refusal);
  // The same for a caller that waits on its thread (a change TakeTurn left to Python): up to
  // `seconds` for this server to see the change's epoch and the changes before it; kApply,
  // kDone, kRefuse or kDiverged (with why: also when the earlier change did not come).
  Turn WaitTurn(const wire::ReplicateRequest& change, double seconds, std::string* refusal);
  // Why a change (or a snapshot) from `primary` at `epoch` of group `group` is refused by
  // this backup ("": it is not).
  std::string CheckSender(int32_t group, int64_t epoch, const std::string& primary) const;

 private:
  struct Sent {  // a change sent to one backup, not yet applied there
    std::shared_ptr<Waiter> waiter;
    Clock::time_point deadline;
  };
  struct Parked {
    int64_t epoch;
    Later later;
    Clock::time_point deadline;
  };
  // Whether a change comes from this backup's primary (kApply), as check_sender: kRefuse
  // (and why) when it does not, kPython for an epoch this server has not seen yet.
  Turn Check(const wire::ReplicateRequest& change, std::string* refusal) const;  // mu_ held
  void Acknowledged(int64_t sequence, const std::string& backup, const data_plane::Answer& answer);
  void Finish(int64_t sequence, const std::string& backup);
  void DropThenFinish(int64_t sequence, const std::string& backup, const std::string& why);
  void RunParked();  // runs the parked changes that are next
  // The timer thread's: drops the backups that did not answer a change in kForwardSeconds,
  // and refuses the parked changes whose earlier change did not come in kGapSeconds.
  std::optional<Clock::time_point> Expire();

  std::mutex order_;  // orders a primary's changes (ReplicaState.order)

  mutable std::mutex mu_;  // guards the fields below
  std::condition_variable applied_cv_;
  Drop drop_;
  std::string token_;
  std::shared_ptr<tls::Context> tls_;
  std::shared_ptr<const ReplicaRole> role_ = std::make_shared<const ReplicaRole>();
  std::optional<int64_t> applied_ = 0;
  int64_t applied_epoch_ = 0;
  // The digests of the last changes applied, by sequence, all of applied_epoch_: a change
  // sent again must be the same change (an outsider's Replicate taking its sequence first
  // shows at the primary's, not as a change silently skipped).
  std::map<int64_t, uint64_t> digests_;
  uint64_t notified_ = 0;
  std::map<std::string, std::shared_ptr<data_plane::Connection>> connections_;  // by address
  std::map<std::pair<int64_t, std::string>, Sent> sent_;  // by (sequence, backup)
  std::map<int64_t, Parked> parked_;                      // by sequence
  std::map<std::string, std::vector<int64_t>> dropping_;  // backup -> changes it holds up
  std::map<std::string, Clock::time_point> unreachable_;  // backup -> when to try again
  bool running_parked_ = false;
  std::map<std::pair<int32_t, int64_t>, AcknowledgedChanges> acknowledged_;  // by (group, epoch)

  DeadlineTimer timer_{[this] { return Expire(); }};  // (destroyed first)
};

class Replication::Waiter {
 public:
  using Done = std::function<void(const std::string& unacknowledged)>;
  explicit Waiter(Done done) : done_(std::move(done)) {}
  // The caller sent every change it waits for: `done` may run.
  void Release() { Put(-1); }

 private:
  friend class Replication;
  void Put(int change) {
    Done done;
    std::string why;
    {
      std::lock_guard<std::mutex> lock(mu_);
      left_ += change;
      if (left_ == 0) {
        done = std::move(done_);
        why = unacknowledged_;
      }
    }
    if (done) done(why);
  }
  void Unacknowledged(const std::string& why) {
    std::lock_guard<std::mutex> lock(mu_);
    if (unacknowledged_.empty()) unacknowledged_ = why;
  }
  std::mutex mu_;
  int left_ = 1;  // backups' applies awaited, +1 until Release()
  std::string unacknowledged_;
  Done done_;
};

}  // namespace elastic_emb
