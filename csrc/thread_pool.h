// A process-wide pool of worker threads for batch calls.
#pragma once

#include <cstdint>
#include <functional>

namespace elastic_emb {

// Runs fn(i) for every i in [0, n) on the pool's threads and the calling
// thread; blocks until all are done and rethrows the first exception thrown by
// fn. Safe to call from many threads at once. Tasks must not call it again.
void ParallelFor(int64_t n, const std::function<void(int64_t)>& fn);

// Number of threads that ParallelFor may use, the caller included.
int PoolThreads();

}  // namespace elastic_emb
