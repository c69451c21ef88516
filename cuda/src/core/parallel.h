// Runs independent tasks (chunks) on up to `threads` threads, the caller included. Output never depends on the
// thread count because every task writes only its own slot. The first failing task by index is rethrown.
#pragma once
#include <atomic>
#include <cstdint>
#include <exception>
#include <mutex>
#include <system_error>
#include <thread>
#include <vector>

namespace tzip {

/// Workers parallel_for runs `n_tasks` on with up to `threads`: between 1 and min(threads, n_tasks). Size per-worker
/// scratch with it.
inline uint32_t worker_count(uint64_t n_tasks, uint32_t threads) {
  const uint64_t w = threads < n_tasks ? threads : n_tasks;
  return w < 1 ? 1 : uint32_t(w);
}

template <typename Fn>  // Fn(uint64_t task, uint32_t worker)
void parallel_for(uint64_t n_tasks, uint32_t threads, Fn fn) {
  threads = worker_count(n_tasks, threads);
  std::atomic<uint64_t> next{0};
  std::mutex mu;
  uint64_t failed_task = UINT64_MAX;
  std::exception_ptr failure;
  auto work = [&](uint32_t worker) {
    for (;;) {
      const uint64_t t = next.fetch_add(1, std::memory_order_relaxed);
      if (t >= n_tasks) return;
      try {
        fn(t, worker);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mu);
        if (t < failed_task) { failed_task = t; failure = std::current_exception(); }
        next.store(n_tasks, std::memory_order_relaxed);  // stop handing out work
      }
    }
  };
  std::vector<std::thread> pool;
  pool.reserve(threads - 1);
  for (uint32_t w = 1; w < threads; ++w) {
    try {
      pool.emplace_back(work, w);
    } catch (const std::system_error&) {
      break;  // no more threads (pids/nproc limit): the tasks run on those started, the caller included
    }
  }
  work(0);
  for (auto& th : pool) th.join();
  if (failure) std::rethrow_exception(failure);
}

}  // namespace tzip
