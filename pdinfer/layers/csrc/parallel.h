// Work shared out at run time: the threads take chunks of items from one counter, so a thread
// whose core is slowed down (another process, the hypervisor) takes fewer, where a static split
// leaves the other thread waiting at the region's end. On the 2-core Xeon (12-02) each thread
// spent 2-9 % of a decode-heavy run waiting at barriers, by turns; chunks handed out made the
// batch-64 4-bit GEMMs 5 % faster and the vocabulary projection 10 % (benchmarks/RESULTS.md).
#pragma once
#include <ATen/Parallel.h>
#include <algorithm>
#include <atomic>
#include <cstdint>

// body(next) runs once per thread; next(i0, i1) gives the thread its next chunk [i0, i1) of
// [0, n), at most `chunk` items, and returns false when none is left. Per-thread buffers go at
// the top of body.
template <typename Body>
static inline void parallel_chunks(int64_t n, int64_t chunk, Body&& body) {
  const int64_t chunks = (n + chunk - 1) / chunk, threads = std::min<int64_t>(at::get_num_threads(), chunks);
  if (threads <= 1 || at::in_parallel_region()) {
    int64_t taken = 0;  // the same chunks, in order, on this thread
    body([&](int64_t& i0, int64_t& i1) {
      i0 = taken, i1 = std::min(n, taken + chunk), taken = i1;
      return i0 < n;
    });
    return;
  }
  std::atomic<int64_t> counter{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    body([&](int64_t& i0, int64_t& i1) {
      i0 = counter.fetch_add(chunk, std::memory_order_relaxed);
      i1 = std::min(n, i0 + chunk);
      return i0 < n;
    });
  });
}
