#include "replication.h"

#include <algorithm>
#include <sstream>
#include <stdexcept>
#include <utility>

namespace elastic_emb {
namespace {

using Clock = std::chrono::steady_clock;

Clock::time_point After(double seconds) {
  return Clock::now() +
         std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

// How long a primary leaves a backup it could not connect to before trying again (its
// changes go through Python meanwhile, which drops it if it cannot reach it either).
constexpr double kReconnectSeconds = 1.0;
constexpr double kConnectSeconds = 1.0;

std::string Seconds(double s) {
  std::string text = std::to_string(s);
  text.erase(text.find_last_not_of('0') + 1);
  if (!text.empty() && text.back() == '.') text.pop_back();
  return text;
}

}  // namespace

void Replication::Configure(Drop drop, std::string token) {
  std::lock_guard<std::mutex> lock(mu_);
  drop_ = std::move(drop);
  token_ = std::move(token);
}

void Replication::SetTls(std::shared_ptr<tls::Context> tls) {
  std::lock_guard<std::mutex> lock(mu_);
  tls_ = std::move(tls);
}

std::shared_ptr<const ReplicaRole> Replication::role() const {
  std::lock_guard<std::mutex> lock(mu_);
  return role_;
}

void Replication::SetRole(ReplicaRole role) {
  auto shared = std::make_shared<const ReplicaRole>(std::move(role));
  std::vector<std::pair<int64_t, std::string>> unheld;
  std::vector<Later> aborted;
  std::vector<std::shared_ptr<data_plane::Connection>> closed;
  {
    std::lock_guard<std::mutex> lock(mu_);
    role_ = shared;
    const ReplicaRole& r = *shared;
    if (r.group >= 0 && r.primary == r.address) {
      for (const auto& [key, sent] : sent_) {
        if (std::find(r.holds.begin(), r.holds.end(), key.second) == r.holds.end()) {
          unheld.push_back(key);
        }
      }
    }
    for (auto it = connections_.begin(); it != connections_.end();) {
      const bool backup = std::any_of(r.backups.begin(), r.backups.end(),
                                      [&](const Backup& b) { return b.address == it->first; });
      if (backup) {
        ++it;
      } else {
        closed.push_back(std::move(it->second));
        it = connections_.erase(it);
      }
    }
    for (auto it = parked_.begin(); it != parked_.end();) {
      if (r.group < 0 || it->second.epoch < r.epoch) {
        aborted.push_back(std::move(it->second.later));
        it = parked_.erase(it);
      } else {
        ++it;
      }
    }
    ++notified_;
    applied_cv_.notify_all();
  }
  for (const auto& [sequence, backup] : unheld) Finish(sequence, backup);
  const Refusal refusal("ABORTED", shared->address + " is no longer a backup of that epoch");
  for (const Later& later : aborted) later(&refusal);
}

std::optional<int64_t> Replication::applied() const {
  std::lock_guard<std::mutex> lock(mu_);
  return applied_;
}

int64_t Replication::applied_epoch() const {
  std::lock_guard<std::mutex> lock(mu_);
  return applied_epoch_;
}

uint64_t ChangeDigest(std::string_view method, std::string_view request) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a, 64 bits
  for (std::string_view part : {method, std::string_view("\0", 1), request}) {
    for (char c : part) h = (h ^ static_cast<uint8_t>(c)) * 1099511628211ull;
  }
  return h == 0 ? 1 : h;
}

void Replication::SetApplied(std::optional<int64_t> sequence, int64_t epoch, uint64_t digest) {
  constexpr size_t kDigestsKept = 4096;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!sequence || epoch != applied_epoch_ || digest == 0) digests_.clear();
    if (sequence && digest != 0) {
      digests_[*sequence] = digest;
      if (digests_.size() > kDigestsKept) digests_.erase(digests_.begin());
    }
    applied_ = sequence;
    applied_epoch_ = epoch;
    applied_cv_.notify_all();
  }
  RunParked();
}

bool Replication::SameChange(int64_t sequence, int64_t epoch, uint64_t digest) const {
  std::lock_guard<std::mutex> lock(mu_);
  if (epoch != applied_epoch_) return true;
  auto it = digests_.find(sequence);
  return it == digests_.end() || it->second == digest;
}

void Replication::WaitApplied(std::optional<int64_t> seen, double seconds) {
  std::unique_lock<std::mutex> lock(mu_);
  const uint64_t notified = notified_;
  applied_cv_.wait_until(lock, After(std::max(seconds, 0.0)),
                         [&] { return applied_ != seen || notified_ != notified; });
}

std::optional<std::vector<std::shared_ptr<data_plane::Connection>>> Replication::Connect(
    const ReplicaRole& role) {
  std::vector<std::shared_ptr<data_plane::Connection>> out;
  for (const Backup& b : role.backups) {
    std::string token;
    std::shared_ptr<tls::Context> tls;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = connections_.find(b.address);
      if (it != connections_.end() && it->second->alive()) {
        out.push_back(it->second);
        continue;
      }
      auto down = unreachable_.find(b.address);
      if (down != unreachable_.end() && Clock::now() < down->second) return std::nullopt;
      token = token_;
      tls = tls_;
    }
    std::shared_ptr<data_plane::Connection> made;
    try {
      made = std::make_shared<data_plane::Connection>(b.host, b.port, token, kConnectSeconds, tls);
    } catch (const std::runtime_error&) {
      std::lock_guard<std::mutex> lock(mu_);
      unreachable_[b.address] = After(kReconnectSeconds);
      return std::nullopt;
    }
    std::shared_ptr<data_plane::Connection> replaced;  // (closed outside the lock)
    std::lock_guard<std::mutex> lock(mu_);
    unreachable_.erase(b.address);
    auto& kept = connections_[b.address];
    if (kept != nullptr && kept->alive()) {
      replaced = std::move(made);  // another thread connected meanwhile
    } else {
      replaced = std::move(kept);
      kept = made;
    }
    out.push_back(kept);
  }
  return out;
}

int64_t Replication::Number(int64_t epoch) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!applied_) throw std::logic_error("a change numbered before the replica's snapshot");
  ++*applied_;
  applied_epoch_ = epoch;
  applied_cv_.notify_all();
  return *applied_;
}

void Replication::Forward(const ReplicaRole& role,
                          const std::vector<std::shared_ptr<data_plane::Connection>>& backups,
                          const std::string& change, int64_t sequence,
                          const std::shared_ptr<Waiter>& waiter) {
  const auto deadline = After(kForwardSeconds);
  const auto deadline_ms = static_cast<uint32_t>(kForwardSeconds * 1000);
  std::weak_ptr<Replication> self = weak_from_this();
  for (size_t i = 0; i < backups.size(); ++i) {
    const std::string& address = role.backups[i].address;
    {
      std::lock_guard<std::mutex> lock(mu_);
      sent_[{sequence, address}] = Sent{waiter, deadline};
      timer_.Watch(deadline);
    }
    waiter->Put(+1);
    data_plane::Connection::Send(backups[i], data_plane::kReplicate, change, deadline_ms,
                                 [self, sequence, address](const data_plane::Answer& answer) {
                                   if (auto r = self.lock())
                                     r->Acknowledged(sequence, address, answer);
                                 });
  }
}

void Replication::Acknowledged(int64_t sequence, const std::string& backup,
                               const data_plane::Answer& answer) {
  if (answer.status == data_plane::kOk) {
    Finish(sequence, backup);
  } else {
    DropThenFinish(sequence, backup,
                   "it did not apply change " + std::to_string(sequence) + ": " + answer.payload);
  }
}

void Replication::Finish(int64_t sequence, const std::string& backup) {
  std::shared_ptr<Waiter> waiter;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = sent_.find({sequence, backup});
    if (it == sent_.end()) return;
    waiter = std::move(it->second.waiter);
    sent_.erase(it);
  }
  waiter->Put(-1);
}

// Drops the backup through Python (once for all the changes it holds up meanwhile), then
// stops waiting for it.
void Replication::DropThenFinish(int64_t sequence, const std::string& backup,
                                 const std::string& why) {
  Drop drop;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (sent_.count({sequence, backup}) == 0) return;
    auto [it, first] = dropping_.try_emplace(backup);
    it->second.push_back(sequence);
    if (!first) return;
    drop = drop_;
  }
  std::thread([self = shared_from_this(), backup, why, drop] {
    bool dropped = false;
    try {
      dropped = drop && drop(backup, why);
    } catch (...) {  // (Python logs why it could not)
    }
    std::vector<int64_t> held;
    {
      std::lock_guard<std::mutex> lock(self->mu_);
      held = std::move(self->dropping_[backup]);
      self->dropping_.erase(backup);
      if (!dropped) {
        // Not on every replica, and the group still lists the backup: not acknowledged
        // (the worker sends it again, to the group's primary).
        for (int64_t s : held) {
          auto it = self->sent_.find({s, backup});
          if (it == self->sent_.end()) continue;
          it->second.waiter->Unacknowledged(self->role_->address + " could not remove " + backup +
                                            ", which did not apply change " + std::to_string(s) +
                                            ", from its group (it may no longer be its primary)");
        }
      }
    }
    for (int64_t s : held) self->Finish(s, backup);
  }).detach();
}

void Replication::CountAcknowledged(int32_t group, int64_t epoch, int64_t first, int64_t last) {
  const double now =
      std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  std::lock_guard<std::mutex> lock(mu_);
  AcknowledgedChanges& a = acknowledged_[{group, epoch}];
  if (a.changes == 0) {
    a.first_sequence = first;
    a.first_time = now;
  }
  a.changes += last - first + 1;
  a.first_sequence = std::min(a.first_sequence, first);
  a.last_sequence = std::max(a.last_sequence, last);
  a.last_time = now;
}

std::map<std::pair<int32_t, int64_t>, AcknowledgedChanges> Replication::acknowledged() const {
  std::lock_guard<std::mutex> lock(mu_);
  return acknowledged_;
}

Turn Replication::Check(const wire::ReplicateRequest& change, std::string* refusal) const {
  const ReplicaRole& r = *role_;
  if (r.group < 0 || r.group != change.group || r.address == r.primary) {
    *refusal = r.address + " is not a backup of group " + std::to_string(change.group);
    return Turn::kRefuse;
  }
  if (change.epoch < r.epoch || (change.epoch == r.epoch && change.primary != r.primary)) {
    *refusal = change.primary + " sent epoch " + std::to_string(change.epoch) + "; group " +
               std::to_string(change.group) + " is at epoch " + std::to_string(r.epoch) +
               " with primary " + r.primary;
    return Turn::kRefuse;
  }
  if (change.epoch == r.epoch && change.primary == r.deposed) {
    *refusal = r.address + " is taking over group " + std::to_string(change.group) + " from " +
               r.deposed + " (its epoch " + std::to_string(r.epoch) + " is over)";
    return Turn::kRefuse;
  }
  return change.epoch == r.epoch ? Turn::kApply : Turn::kPython;
}

Turn Replication::WaitTurn(const wire::ReplicateRequest& change, double seconds,
                           std::string* refusal) {
  const auto deadline = After(seconds);
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    if (Check(change, refusal) == Turn::kRefuse) return Turn::kRefuse;
    const bool current = change.epoch == role_->epoch;  // (newer: a map not seen yet)
    if (current && applied_) {
      if (change.sequence == *applied_ + 1) return Turn::kApply;
      if (change.sequence <= *applied_) {
        if (change.epoch == applied_epoch_) {
          auto it = digests_.find(change.sequence);
          if (it == digests_.end() || it->second == ChangeDigest(change.method, change.request)) {
            return Turn::kDone;
          }
          *refusal = role_->address + " applied another change " + std::to_string(change.sequence) +
                     " of epoch " + std::to_string(change.epoch) + ": this replica has diverged";
          return Turn::kDiverged;
        }
        *refusal = role_->address + " applied change " + std::to_string(*applied_) + " of epoch " +
                   std::to_string(applied_epoch_) + "; epoch " + std::to_string(change.epoch) +
                   " sends " + std::to_string(change.sequence) + ": this replica has diverged";
        return Turn::kDiverged;
      }
    }
    if (Clock::now() >= deadline) {
      std::ostringstream waited;
      waited << seconds;
      *refusal = role_->address + " waited " + waited.str() + " s for change " +
                 std::to_string(applied_.value_or(0) + 1) + " before " +
                 std::to_string(change.sequence);
      return Turn::kDiverged;
    }
    applied_cv_.wait_until(lock, deadline);  // (woken when a change is applied or the role
                                             // changes)
  }
}

std::string Replication::CheckSender(int32_t group, int64_t epoch,
                                     const std::string& primary) const {
  wire::ReplicateRequest change;
  change.group = group;
  change.epoch = epoch;
  change.primary = primary;
  std::string refusal;
  std::lock_guard<std::mutex> lock(mu_);
  return Check(change, &refusal) == Turn::kRefuse ? refusal : "";
}

Turn Replication::TakeTurn(const wire::ReplicateRequest& change, Later later,
                           std::string* refusal) {
  std::lock_guard<std::mutex> lock(mu_);
  const Turn sender = Check(change, refusal);
  if (sender != Turn::kApply || !applied_) return sender == Turn::kApply ? Turn::kPython : sender;
  if (change.sequence == *applied_ + 1) return Turn::kApply;
  if (change.sequence <= *applied_) {
    // The same change sent again; or, from another epoch, a replica that diverged (Python
    // says so).
    if (change.epoch != applied_epoch_) return Turn::kPython;
    auto it = digests_.find(change.sequence);
    if (it != digests_.end() && it->second != ChangeDigest(change.method, change.request)) {
      *refusal = role_->address + " applied another change " + std::to_string(change.sequence) +
                 " of epoch " + std::to_string(change.epoch) + ": this replica has diverged";
      return Turn::kDiverged;
    }
    return Turn::kDone;
  }
  if (parked_.count(change.sequence) > 0) return Turn::kPython;
  const auto deadline = After(kGapSeconds);
  parked_[change.sequence] = Parked{change.epoch, std::move(later), deadline};
  timer_.Watch(deadline);
  return Turn::kWait;
}

void Replication::RunParked() {
  std::unique_lock<std::mutex> lock(mu_);
  if (running_parked_) return;  // (the thread running one runs the next too)
  running_parked_ = true;
  while (applied_) {
    auto it = parked_.find(*applied_ + 1);
    if (it == parked_.end()) break;
    Later later = std::move(it->second.later);
    parked_.erase(it);
    lock.unlock();
    later(nullptr);  // applies it and calls SetApplied()
    lock.lock();
  }
  running_parked_ = false;
}

std::optional<Clock::time_point> Replication::Expire() {
  const auto now = Clock::now();
  std::optional<Clock::time_point> next;
  std::vector<std::pair<int64_t, std::string>> late;
  std::vector<std::pair<Later, std::string>> gaps;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [key, sent] : sent_) {
      if (sent.deadline <= now) {
        late.push_back(key);
      } else if (!next || sent.deadline < *next) {
        next = sent.deadline;
      }
    }
    for (auto it = parked_.begin(); it != parked_.end();) {
      if (it->second.deadline <= now) {
        gaps.emplace_back(std::move(it->second.later),
                          role_->address + " waited " + Seconds(kGapSeconds) + " s for change " +
                              std::to_string(applied_.value_or(0) + 1) + " before " +
                              std::to_string(it->first));
        it = parked_.erase(it);
      } else {
        if (!next || it->second.deadline < *next) next = it->second.deadline;
        ++it;
      }
    }
  }
  for (const auto& [sequence, backup] : late) {
    DropThenFinish(sequence, backup,
                   "it did not apply change " + std::to_string(sequence) + ": no answer in " +
                       Seconds(kForwardSeconds) + " s");
  }
  for (const auto& [later, why] : gaps) {
    const Refusal refusal("DATA_LOSS", why);
    later(&refusal);
  }
  return next;
}

}  // namespace elastic_emb
