// Work shared out at run time: the threads take items one at a time from one counter, so a thread
// whose core is slowed down (another process, the hypervisor) takes fewer, where a static split
// leaves the other thread waiting at the region's end: on a shared 2-core machine whichever core
// is slowed holds the other back at every barrier (docs/performance.md has the figures).
#pragma once
#include <ATen/Parallel.h>
#include <algorithm>
#include <atomic>
#include <cstdint>

// body(next) runs once per thread that takes part; next(i) gives it its next item of [0, n)
// and returns false when none is left. Per-thread buffers go at the top of body. `serial`
// (work too small to wake the pool for) runs body on this thread alone.
template <typename Body>
static inline void parallel_items(int64_t n, bool serial, Body&& body) {
  std::atomic<int64_t> counter{0};
  auto next = [&](int64_t& i) { return (i = counter.fetch_add(1, std::memory_order_relaxed)) < n; };
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), n);
  if (serial || threads <= 1 || at::in_parallel_region()) {
    body(next);
    return;
  }
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) { body(next); });
}
