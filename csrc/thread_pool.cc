#include "thread_pool.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace elastic_emb {
namespace {

struct Job {
  const std::function<void(int64_t)>* fn;
  int64_t n;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::mutex mu;
  std::condition_variable finished;
  std::exception_ptr error;

  // Claims and runs tasks until none are left.
  void Work() {
    for (int64_t i; (i = next.fetch_add(1)) < n;) {
      try {
        (*fn)(i);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mu);
        if (!error) error = std::current_exception();
      }
      if (done.fetch_add(1) + 1 == n) {
        std::lock_guard<std::mutex> lock(mu);
        finished.notify_all();
      }
    }
  }
};

class ThreadPool {
 public:
  explicit ThreadPool(int threads) {
    for (int i = 0; i < threads; ++i) workers_.emplace_back([this] { Loop(); });
  }

  ~ThreadPool() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    wake_.notify_all();
    for (auto& t : workers_) t.join();
  }

  int Threads() const { return static_cast<int>(workers_.size()) + 1; }

  void Run(int64_t n, const std::function<void(int64_t)>& fn) {
    auto job = std::make_shared<Job>();
    job->fn = &fn;
    job->n = n;
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.push_back(job);
    }
    wake_.notify_all();
    job->Work();
    {
      std::unique_lock<std::mutex> lock(job->mu);
      job->finished.wait(lock, [&] { return job->done.load() == n; });
    }
    if (job->error) std::rethrow_exception(job->error);
  }

 private:
  void Loop() {
    for (;;) {
      std::shared_ptr<Job> job;
      {
        std::unique_lock<std::mutex> lock(mu_);
        wake_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        if (stop_) return;
        job = queue_.front();
        // A job whose tasks are all claimed leaves the queue.
        if (job->next.load() >= job->n) {
          queue_.pop_front();
          continue;
        }
      }
      job->Work();
    }
  }

  std::mutex mu_;
  std::condition_variable wake_;
  std::deque<std::shared_ptr<Job>> queue_;
  std::vector<std::thread> workers_;
  bool stop_ = false;
};

ThreadPool& Pool() {
  // Leaked on purpose: joining threads during interpreter shutdown deadlocks.
  static ThreadPool* pool =
      new ThreadPool(std::max(1, static_cast<int>(std::thread::hardware_concurrency())) - 1);
  return *pool;
}

}  // namespace

void ParallelFor(int64_t n, const std::function<void(int64_t)>& fn) {
  if (n <= 0) return;
  if (n == 1 || Pool().Threads() == 1) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  Pool().Run(n, fn);
}

int PoolThreads() { return Pool().Threads(); }

}  // namespace elastic_emb
