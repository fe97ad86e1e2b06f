#include "deadline_timer.h"

#include <utility>

namespace elastic_emb {

DeadlineTimer::DeadlineTimer(Expire expire) : state_(std::make_shared<State>()) {
  state_->expire = std::move(expire);
}

DeadlineTimer::~DeadlineTimer() {
  std::thread thread;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->stopping = true;
    state_->cv.notify_all();
    thread = std::move(state_->thread);
  }
  if (!thread.joinable()) return;
  if (thread.get_id() == std::this_thread::get_id()) {
    thread.detach();  // (destroyed by `expire`: the thread ends when it returns)
  } else {
    thread.join();
  }
}

void DeadlineTimer::Watch(Clock::time_point deadline) {
  std::lock_guard<std::mutex> lock(state_->mu);
  if (state_->stopping) return;
  if (!state_->thread.joinable()) state_->thread = std::thread(Run, state_);
  if (!state_->next || deadline < *state_->next) {
    state_->next = deadline;
    state_->cv.notify_one();
  }
}

void DeadlineTimer::Run(const std::shared_ptr<State>& state) {
  std::unique_lock<std::mutex> lock(state->mu);
  while (!state->stopping) {
    if (!state->next) {
      state->cv.wait(lock);
      continue;
    }
    if (Clock::now() < *state->next) {
      state->cv.wait_until(lock, *state->next);
      continue;
    }
    state->next.reset();
    lock.unlock();
    const std::optional<Clock::time_point> next = state->expire();
    lock.lock();
    if (next && (!state->next || *next < *state->next)) state->next = next;
  }
}

}  // namespace elastic_emb
