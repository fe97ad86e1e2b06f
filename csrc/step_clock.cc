#include "step_clock.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <sstream>

#include "table.h"

namespace elastic_emb {
namespace {

// The messages read as the Python server's did (its ints, lists, dicts and tuples).
const char* const kNotJoined = "is not an elastic worker of this shard";  // protocol.NOT_JOINED
const char* const kOtherJob = "this shard runs";                          // protocol.OTHER_JOB

Refusal Invalid(const std::string& message) { return Refusal("INVALID_ARGUMENT", message); }

std::string ModeName(int mode) { return mode == kSync ? "SYNC" : "ASYNC"; }

std::string BoolText(bool b) { return b ? "True" : "False"; }

std::string ListText(const std::vector<int64_t>& values) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < values.size(); ++i) os << (i ? ", " : "") << values[i];
  os << "]";
  return os.str();
}

// Python's f"{seconds:g}".
std::string SecondsText(double seconds) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", seconds);
  return buf;
}

using Clock = std::chrono::steady_clock;

Clock::time_point DeadlineAfter(double seconds) {
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(
                            std::chrono::duration<double>(std::min(seconds, 1e8)));
}

}  // namespace

int64_t StepClock::Join(int64_t worker, int64_t num_workers, int mode, int64_t staleness,
                        bool elastic, bool again) {
  if (num_workers < 1 || worker < 0 || worker >= (elastic ? (int64_t{1} << 30) : num_workers)) {
    throw Invalid("worker " + std::to_string(worker) + " of " + std::to_string(num_workers) +
                  ": need 0 <= worker < num_workers");
  }
  if (mode != kAsync && mode != kSync) throw Invalid("Unknown mode " + std::to_string(mode));
  Lock lock(mu_);
  ClockState& s = state_;
  const bool same =
      elastic ? (s.staleness == staleness && s.elastic == elastic)
              : (s.num_workers == num_workers && s.staleness == staleness && s.elastic == elastic);
  if (s.mode != kNoMode && (s.mode != mode || !same)) {
    std::string what, current, asked;
    if (s.elastic != elastic) {
      what = "elastic";
      current = "(" + BoolText(s.elastic) + ",)";
      asked = "(" + BoolText(elastic) + ",)";
    } else if (elastic) {
      what = "(mode, staleness, elastic)";
      current = "('" + ModeName(s.mode) + "', " + std::to_string(s.staleness) + ", True)";
      asked = "('" + ModeName(mode) + "', " + std::to_string(staleness) + ", True)";
    } else {
      what = "(mode, num_workers, staleness)";
      current = "('" + ModeName(s.mode) + "', " + std::to_string(s.num_workers) + ", " +
                std::to_string(s.staleness) + ")";
      asked = "('" + ModeName(mode) + "', " + std::to_string(num_workers) + ", " +
              std::to_string(staleness) + ")";
    }
    throw Refusal("FAILED_PRECONDITION", "worker " + std::to_string(worker) + " joined with " +
                                             what + " = " + asked + "; " + kOtherJob + " " +
                                             current);
  }
  s.mode = mode;
  s.num_workers = num_workers;
  s.staleness = staleness;
  s.elastic = elastic;
  const int64_t step = s.mode == kSync ? s.applied : Pushed(worker);
  if (!(again && elastic && s.pushed.count(worker))) {
    SetPushed(worker, std::max(Pushed(worker), step));
  }
  if (elastic) s.live.insert(worker);
  Fired fired = Settle();
  lock.unlock();
  Fire(fired);
  return step;
}

int64_t StepClock::Leave(int64_t worker) {
  Lock lock(mu_);
  if (!state_.elastic) {
    throw Refusal("FAILED_PRECONDITION", "only elastic workers leave (this shard has fixed ones)");
  }
  state_.live.erase(worker);
  if (state_.mode == kSync) ApplyCompleteSteps();
  WakeAll();
  const int64_t step = Step();
  Fired fired = Settle();
  lock.unlock();
  Fire(fired);
  return step;
}

void StepClock::Retire(const std::string& why) {
  Lock lock(mu_);
  gone_ = why;
  WakeAll();
  Fired fired = Settle();
  lock.unlock();
  Fire(fired);
}

void StepClock::CheckWorker(int64_t worker, int64_t step) {
  Lock lock(mu_);
  if (gone_) throw Refusal("ABORTED", *gone_);
  if (state_.elastic && !state_.live.count(worker)) {
    throw Refusal("FAILED_PRECONDITION", "worker " + std::to_string(worker) + " " + kNotJoined +
                                             " (it left, or its lease expired): it must join "
                                             "again");
  }
  if (!state_.elastic && state_.mode != kNoMode && !(0 <= worker && worker < state_.num_workers)) {
    throw Invalid("worker " + std::to_string(worker) + " is not one of the " +
                  std::to_string(state_.num_workers) + " workers that joined");
  }
  if (step < 1) throw Invalid("wrong step " + std::to_string(step) + ": steps start at 1");
}

void StepClock::CheckPullStep(int64_t worker, int64_t step) {
  Lock lock(mu_);
  const int64_t last = Pushed(worker);
  if (step > last + 1 + kMaxPushesInFlight) {
    throw Invalid("wrong step " + std::to_string(step) + ": worker " + std::to_string(worker) +
                  " has pushed step " + std::to_string(last) + ", so it can pull step " +
                  std::to_string(last + 1 + kMaxPushesInFlight) + " at most");
  }
}

bool StepClock::ReadyToPull(int64_t worker, int64_t step) {
  Lock lock(mu_);
  if (gone_) throw Refusal("ABORTED", *gone_);
  return !LateFor(worker, step, false).waits;
}

double StepClock::WaitToPull(int64_t worker, int64_t step, double timeout) {
  Lock lock(mu_);
  auto ready = [&] {
    if (gone_) throw Refusal("ABORTED", *gone_);
    return !LateFor(worker, step, false).waits;
  };
  if (ready()) return 0.0;
  const auto began = Clock::now();
  const auto deadline = DeadlineAfter(timeout);
  // Only its own push to wait for: woken by that push alone.
  const bool own = state_.mode == kAsync && state_.staleness < 0;
  std::condition_variable_any& cond = own ? OwnPush(worker) : changed_;
  while (!ready()) {
    if (Clock::now() >= deadline) throw TimedOut(worker, step, timeout);
    cond.wait_until(lock, deadline);
  }
  return std::chrono::duration<double>(Clock::now() - began).count();
}

uint64_t StepClock::Park(int64_t worker, int64_t step, double timeout, Parked then) {
  Lock lock(mu_);
  if (gone_) throw Refusal("ABORTED", *gone_);
  if (!LateFor(worker, step, false).waits) return 0;
  const auto now = Clock::now();
  const uint64_t ticket = next_ticket_++;
  parked_.push_back({worker, step, timeout, now, DeadlineAfter(timeout), std::move(then), ticket});
  return ticket;
}

void StepClock::Unpark(uint64_t ticket) {
  Parked dropped;  // (freed without the lock)
  Lock lock(mu_);
  auto it = std::find_if(parked_.begin(), parked_.end(),
                         [ticket](const Waiter& w) { return w.ticket == ticket; });
  if (it == parked_.end()) return;
  dropped = std::move(it->then);
  parked_.erase(it);
}

std::optional<std::chrono::steady_clock::time_point> StepClock::Expire() {
  Fired fired;
  std::optional<Clock::time_point> next;
  {
    Lock lock(mu_);
    const auto now = Clock::now();
    for (auto it = parked_.begin(); it != parked_.end();) {
      if (it->deadline > now) {
        next = next ? std::min(*next, it->deadline) : it->deadline;
        ++it;
        continue;
      }
      const double waited = std::chrono::duration<double>(now - it->began).count();
      fired.push_back([then = std::move(it->then),
                       refusal = TimedOut(it->worker, it->step, it->timeout),
                       waited] { then(&refusal, waited); });
      it = parked_.erase(it);
    }
  }
  Fire(fired);
  return next;
}

int64_t StepClock::Push(int64_t worker, int64_t step, const std::function<StepParts()>& queue,
                        const std::function<void()>& apply) {
  Fired fired;
  {
    Lock lock(mu_);
    const int64_t last = Pushed(worker);
    const bool applying = applying_.count(worker) > 0;
    if (step <= last && !applying) return Step();  // sent again after a failover
    if (step != last + 1 || applying) {
      throw Invalid("wrong step " + std::to_string(step) + ": worker " + std::to_string(worker) +
                    " pushed step " + std::to_string(last) + " last, so its next push is step " +
                    std::to_string(last + 1) + (applying ? " (once that one is applied)" : ""));
    }
    if (state_.mode == kSync) {
      SetPushed(worker, step);
      if (step <= state_.applied) {
        ApplyLate(worker, step, queue());
        changed_.notify_all();  // its own pull of step + 1 may wait for it
      } else {
        pending_[step][worker] = queue();
        ApplyCompleteSteps();
      }
      const int64_t applied = state_.applied;
      fired = Settle();
      lock.unlock();
      Fire(fired);
      return applied;
    }
    applying_.insert(worker);
  }
  // ASYNC: the step counts as pushed once applied, so the worker's next pull reads its
  // own update.
  auto done = [&] {
    Lock lock(mu_);
    applying_.erase(worker);
    SetPushed(worker, step);
    auto own = own_push_.find(worker);
    if (own != own_push_.end()) own->second->notify_all();
    if (state_.staleness >= 0) changed_.notify_all();  // the bound's waits see every push
    fired = Settle();
  };
  try {
    apply();
  } catch (...) {
    done();
    Fire(fired);
    throw;
  }
  done();
  Fire(fired);
  Lock lock(mu_);
  return Step();
}

bool StepClock::HoldAt(int64_t after_step) {
  Lock lock(mu_);
  if (!(after_step && state_.mode == kSync)) return false;
  if (state_.applied > after_step || hold_) {
    const std::string other =
        hold_ ? " and another save holds step " + std::to_string(*hold_) : std::string();
    throw Refusal("FAILED_PRECONDITION", "cannot hold at step " + std::to_string(after_step) +
                                             ": step " + std::to_string(state_.applied) +
                                             " is applied" + other);
  }
  hold_ = after_step;
  return true;
}

void StepClock::ReleaseHold() {
  Lock lock(mu_);
  hold_.reset();
  std::vector<PendingPush> late = std::move(held_late_);
  held_late_.clear();
  for (const PendingPush& p : late) ApplyOne(p.step, p.parts);
  ApplyCompleteSteps();
  WakeAll();
  Fired fired = Settle();
  lock.unlock();
  Fire(fired);
}

std::pair<int64_t, std::map<int64_t, int64_t>> StepClock::WaitApplied(int64_t after_step,
                                                                      double timeout) {
  Lock lock(mu_);
  if (after_step && state_.mode == kSync) {
    const auto deadline = DeadlineAfter(timeout);
    while (state_.applied < after_step) {
      if (Clock::now() >= deadline) {
        std::vector<int64_t> late;
        for (int64_t w : Workers()) {
          if (Pushed(w) < after_step) late.push_back(w);
        }
        throw Refusal("DEADLINE_EXCEEDED",
                      "waited " + SecondsText(timeout) + " s to save after step " +
                          std::to_string(after_step) + ": workers " + ListText(late) +
                          " have not pushed it (stopped or dead?)");
      }
      changed_.wait_until(lock, deadline);
    }
  }
  return {Step(), state_.pushed};
}

std::map<int64_t, int64_t> StepClock::WorkerSteps() {
  Lock lock(mu_);
  std::map<int64_t, int64_t> out;
  if (state_.mode == kNoMode) return out;
  for (int64_t w : Workers()) out[w] = Pushed(w);
  return out;
}

int StepClock::mode() {
  Lock lock(mu_);
  return state_.mode;
}

int64_t StepClock::step() {
  Lock lock(mu_);
  return Step();
}

std::pair<ClockState, std::vector<PendingPush>> StepClock::Export() {
  Lock lock(mu_);
  std::vector<PendingPush> pending = held_late_;
  for (const auto& [step, workers] : pending_) {
    for (const auto& [worker, parts] : workers) pending.push_back({worker, step, parts});
  }
  return {state_, std::move(pending)};
}

void StepClock::Install(const ClockState& state, std::vector<PendingPush> pending) {
  Lock lock(mu_);
  state_ = state;
  furthest_ = 0;
  for (const auto& [worker, step] : state_.pushed) furthest_ = std::max(furthest_, step);
  pending_.clear();
  held_late_.clear();
  for (PendingPush& p : pending) {
    if (p.step <= state_.applied) {
      // A late push a save held back there: applied now, before any later step, as the
      // holder applies it when the save ends.
      ApplyOne(p.step, p.parts);
    } else {
      pending_[p.step][p.worker] = std::move(p.parts);
    }
  }
  applying_.clear();
  WakeAll();
  Fired fired = Settle();
  lock.unlock();
  Fire(fired);
}

void StepClock::KeepPending(int64_t num_slots, int64_t begin, int64_t end,
                            const std::function<void()>& first) {
  Lock lock(mu_);
  first();
  auto keep = [&](StepParts& parts) {
    for (StepPart& part : parts) {
      size_t kept = 0;
      const size_t dim = static_cast<size_t>(part.dim);
      for (size_t i = 0; i < part.keys.size(); ++i) {
        const int64_t slot = VirtualSlot(part.keys[i], num_slots);
        if (slot < begin || slot >= end) continue;
        part.keys[kept] = part.keys[i];
        std::copy_n(part.gradients.begin() + i * dim, dim, part.gradients.begin() + kept * dim);
        ++kept;
      }
      part.keys.resize(kept);
      part.gradients.resize(kept * dim);
    }
  };
  for (auto& [step, workers] : pending_) {
    for (auto& [worker, parts] : workers) keep(parts);
  }
  for (PendingPush& p : held_late_) keep(p.parts);
}

// Under mu_.

void StepClock::SetPushed(int64_t worker, int64_t step) {
  state_.pushed[worker] = step;
  furthest_ = std::max(furthest_, step);
}

int64_t StepClock::Pushed(int64_t worker) const {
  auto it = state_.pushed.find(worker);
  return it == state_.pushed.end() ? 0 : it->second;
}

void StepClock::WakeAll() {
  changed_.notify_all();
  for (auto& [worker, cond] : own_push_) cond->notify_all();
}

std::condition_variable_any& StepClock::OwnPush(int64_t worker) {
  auto& cond = own_push_[worker];
  if (!cond) cond = std::make_unique<std::condition_variable_any>();
  return *cond;
}

// Whether a pull of `step` by `worker` must wait; the workers it waits for (with `who`:
// a check without is O(1) in SYNC); why. SYNC waits until step - 1 is applied, even once
// every worker pushed it (a save may hold it back).
StepClock::Late StepClock::LateFor(int64_t worker, int64_t step, bool who) const {
  if (Pushed(worker) < step - 1) {
    return {
        true, {worker}, "its own push of step " + std::to_string(step - 1) + " has not arrived"};
  }
  int64_t needed;
  std::string what;
  if (state_.mode == kSync) {
    needed = step - 1;
    what = "step " + std::to_string(step - 1) + " must be applied";
  } else if (state_.mode == kAsync && state_.staleness >= 0) {
    needed = step - 1 - state_.staleness;
    what = "staleness " + std::to_string(state_.staleness) +
           ": every worker must have pushed step " + std::to_string(needed);
  } else {
    return {};
  }
  if (needed <= 0 || (state_.mode == kSync && state_.applied >= needed)) return {};
  Late late{false, {}, what};
  if (who) {
    for (int64_t w : Workers()) {
      if (Pushed(w) < needed) late.workers.push_back(w);
    }
    late.waits = state_.mode == kSync || !late.workers.empty();
    return late;
  }
  late.waits = state_.mode == kSync;
  if (!late.waits) {
    if (state_.elastic) {
      for (int64_t w : state_.live) late.waits = late.waits || Pushed(w) < needed;
    } else {
      for (int64_t w = 0; w < state_.num_workers && !late.waits; ++w)
        late.waits = Pushed(w) < needed;
    }
  }
  return late;
}

std::vector<int64_t> StepClock::Workers() const {
  if (state_.elastic) return {state_.live.begin(), state_.live.end()};
  std::vector<int64_t> workers(static_cast<size_t>(state_.num_workers));
  for (int64_t w = 0; w < state_.num_workers; ++w) workers[static_cast<size_t>(w)] = w;
  return workers;
}

bool StepClock::StepComplete(const std::map<int64_t, StepParts>& pushed_by) const {
  if (state_.elastic) {
    if (pushed_by.empty() || pushed_by.size() < state_.live.size()) return false;
    return std::all_of(state_.live.begin(), state_.live.end(),
                       [&](int64_t w) { return pushed_by.count(w) > 0; });
  }
  return static_cast<int64_t>(pushed_by.size()) >= state_.num_workers;
}

// SYNC: `worker`'s push of `step`, applied without it (the worker was gone), is applied on
// its own now: nothing acknowledged is lost. While a save holds the steps, it waits.
void StepClock::ApplyLate(int64_t worker, int64_t step, StepParts parts) {
  if (hold_) {
    held_late_.push_back({worker, step, std::move(parts)});
  } else {
    ApplyOne(step, parts);
  }
}

void StepClock::ApplyOne(int64_t step, const StepParts& parts) { apply_step_(step, {&parts}); }

// SYNC: applies, in order, every step all workers have pushed (up to a held one).
void StepClock::ApplyCompleteSteps() {
  while (!hold_ || state_.applied < *hold_) {
    auto entry = pending_.find(state_.applied + 1);
    if (entry == pending_.end() || !StepComplete(entry->second)) return;
    const std::map<int64_t, StepParts> pushes = std::move(entry->second);
    pending_.erase(entry);
    std::vector<const StepParts*> ordered;
    for (const auto& [worker, parts] : pushes) ordered.push_back(&parts);
    apply_step_(state_.applied + 1, ordered);
    ++state_.applied;
    changed_.notify_all();
  }
}

Refusal StepClock::TimedOut(int64_t worker, int64_t step, double timeout) const {
  const Late late = LateFor(worker, step, true);
  const std::string why =
      !late.workers.empty()
          ? "workers " + ListText(late.workers) + " have not pushed it (stopped or dead?)"
          : "a checkpoint holds step " + (hold_ ? std::to_string(*hold_) : "None") + " back";
  return Refusal("DEADLINE_EXCEEDED", "worker " + std::to_string(worker) + " waited " +
                                          SecondsText(timeout) + " s to pull step " +
                                          std::to_string(step) + ": " + late.what + "; " + why +
                                          ". Steps pushed: " + PushedText());
}

StepClock::Fired StepClock::Settle() {
  Fired fired;
  if (parked_.empty()) return fired;
  const auto now = Clock::now();
  for (auto it = parked_.begin(); it != parked_.end();) {
    std::optional<Refusal> refusal;
    if (gone_) {
      refusal.emplace("ABORTED", *gone_);
    } else if (LateFor(it->worker, it->step, false).waits) {
      ++it;
      continue;
    }
    const double waited = std::chrono::duration<double>(now - it->began).count();
    fired.push_back([then = std::move(it->then), refusal, waited] {
      then(refusal ? &*refusal : nullptr, waited);
    });
    it = parked_.erase(it);
  }
  return fired;
}

void StepClock::Fire(Fired& fired) {
  for (auto& f : fired) f();
  fired.clear();
}

std::string StepClock::PushedText() const {
  std::ostringstream os;
  os << "{";
  bool first = true;
  for (const auto& [worker, step] : state_.pushed) {
    os << (first ? "" : ", ") << worker << ": " << step;
    first = false;
  }
  os << "}";
  return os.str();
}

}  // namespace elastic_emb
