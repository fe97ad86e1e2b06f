// A thread that acts on deadlines: told of each (`Watch`), it calls `expire` once the
// earliest passes; `expire` acts on what is due and returns the earliest deadline still
// ahead, if any. Started by the first Watch.
#pragma once

#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>

namespace elastic_emb {

class DeadlineTimer {
 public:
  using Clock = std::chrono::steady_clock;
  using Expire = std::function<std::optional<Clock::time_point>()>;

  explicit DeadlineTimer(Expire expire);
  // Stops the thread: joins it, or, destroyed by `expire` on the thread itself, lets it end.
  ~DeadlineTimer();
  DeadlineTimer(const DeadlineTimer&) = delete;
  DeadlineTimer& operator=(const DeadlineTimer&) = delete;

  void Watch(Clock::time_point deadline);

 private:
  struct State {    // (the thread's own reference keeps it past the timer)
    std::mutex mu;  // guards the fields below
    std::condition_variable cv;
    std::optional<Clock::time_point> next;  // the earliest deadline not yet acted on
    bool stopping = false;
    std::thread thread;
    Expire expire;
  };
  static void Run(const std::shared_ptr<State>& state);

  const std::shared_ptr<State> state_;
};

}  // namespace elastic_emb
