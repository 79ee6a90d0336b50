// Splitting a native kernel's work among XLA:CPU's intra-op threads (jvllm/native/__init__.py
// builds the kernels that include it).

#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace jvllm {

// Runs part(i) for every i in [0, num_parts): the calling thread and the tasks it schedules on
// the pool take the parts in turn, and it returns once all are done. A task that starts after
// every part is taken touches only the shared counters, which it keeps alive.
template <typename Part>
void parallel_for(xla::ffi::ThreadPool& pool, int64_t num_parts, const Part& part) {
  struct Progress {
    std::atomic<int64_t> next{0}, done{0};
  };
  auto progress = std::make_shared<Progress>();
  auto work = [progress, num_parts, &part] {
    for (int64_t i; (i = progress->next.fetch_add(1)) < num_parts;) {
      part(i);
      progress->done.fetch_add(1, std::memory_order_release);
    }
  };
  const int64_t num_threads = std::max<int64_t>(1, pool.num_threads());
  for (int64_t i = 1; i < std::min(num_threads, num_parts); ++i) pool.Schedule([work] { work(); });
  work();
  while (progress->done.load(std::memory_order_acquire) < num_parts) std::this_thread::yield();
}

// Runs range(first, last) over [0, count) cut into num_parts equal runs: parts_per_thread a
// thread of the pool, at most max_parts, at least one.
template <typename Range>
void parallel_ranges(xla::ffi::ThreadPool& pool, int64_t count, int64_t parts_per_thread,
                     int64_t max_parts, const Range& range) {
  const int64_t num_threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t num_parts =
      std::max<int64_t>(1, std::min(parts_per_thread * num_threads, max_parts));
  parallel_for(pool, num_parts, [&](int64_t i) {
    range(count * i / num_parts, count * (i + 1) / num_parts);
  });
}

}  // namespace jvllm
