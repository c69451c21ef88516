// The submission ring's native thread (docs/ring.md): one std::thread per ring that takes SQEs out of a client's ring
// file (shared memory), checks them against the ring's regions (ring_sqe.h) and runs each batch on the CPU codec
// (frame.h) or on the ring's GPU stream (addon/ring_gpu.h), then writes the CQEs. No JavaScript per request: the N-API
// binding (addon/ring_napi.cpp, ringOpen) only registers and removes regions, opens and closes the ring, and takes the
// thread's events (stats, "broken", regions no longer in use, stopped) in batches through a thread-safe function.
//
// Threads: the region table is shared by the JavaScript thread (add, release, forget) and the ring thread (checks a
// batch against it and marks its regions in use while it runs) under one mutex; everything else of the ring thread is
// its own.
#pragma once
#include <atomic>
#include <chrono>
#include <climits>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "addon/ring_gpu.h"
#include "ring_sqe.h"

namespace tzip::addon {

class RingCore {
 public:
  /// What the ring applies to every SQE it runs (the daemon's job settings, docs/ring.md "Who applies the job's
  /// settings"): set at the start and by set_settings, read once per batch.
  struct Settings {
    int sm_budget = kDefaultSmBudget;  // SQEs with sm_budget 0 (when sm_override is 0)
    int codec = -1;           // -1: each compress SQE's own codec; else the codec byte (0..3, 255 auto) of every one
    int sm_override = -1;     // -1: each SQE's own sm_budget; else the SM budget of every SQE (0: all SMs)
  };
  struct Options {
    uint8_t* file = nullptr;  // the ring file's mapping (ring::ring_bytes(entries) bytes, 64-byte aligned)
    uint32_t entries = 0;
    Settings settings;
    uint32_t cpu_threads = 1;
    long spin_us = 0;         // the thread polls this long before it sleeps on sq_doorbell
    uint32_t sleep_ms = 10;   // futex timeout while asleep
    // The session's tensor bytes in flight (a 64-bit word the daemon's JavaScript also reserves in, with Atomics),
    // and its limit: a batch reserves its bytes there while it runs, or fails TZIP_LIMIT. Null: not counted.
    int64_t* inflight = nullptr;
    int64_t max_inflight = INT64_MAX;
  };
  /// Completions of one kind (op, stream tag, CPU or GPU) since the last hand-over.
  struct StatsEntry {
    uint8_t op = 0;
    uint8_t stream = 0;
    bool gpu = false;
    uint64_t items = 0, in_bytes = 0, out_bytes = 0, errors = 0;
    double seconds = 0;  // wall time of the batches these completions came from
  };
  struct Events {
    std::vector<StatsEntry> stats;
    std::string broken;     // why the ring broke ("" if it did not)
    bool regions_idle = false;  // a batch ended while regions were being removed
    bool stopped = false;   // the thread has stopped (join() returns at once)
  };
  struct RegionInfo {
    uint32_t id = 0, generation = 0;
    uint64_t bytes = 0;
  };

  /// `notify` is called from the ring thread whenever events are waiting (take_events), `finished` as the thread's
  /// last act; `gpu` is null for a CPU-only ring. Does not start the thread.
  RingCore(const Options& o, std::unique_ptr<RingGpu> gpu, std::function<void()> notify, std::function<void()> finished);
  ~RingCore();
  RingCore(const RingCore&) = delete;
  RingCore& operator=(const RingCore&) = delete;

  void start();
  /// Asks the thread to stop after the batch in flight; never blocks.
  void request_stop();
  /// Waits for the thread to end (after request_stop or a broken ring).
  void join();
  bool stopping() const { return stop_.load(std::memory_order_acquire); }

  /// State: serving, closed (stop requested) or broken.
  ring::State state() const;

  /// Replaces the settings (JavaScript thread): every batch whose checks start after this returns runs with them.
  void set_settings(const Settings& s);

  /// Registers a region (JavaScript thread). Throws tzip::Error InvalidArgument when the table is full.
  RegionInfo add_region(const ring::Region& r);
  /// Marks `ids` released (later SQEs naming them fail TZIP_HANDLE). Returns "" or why not (an id not registered or
  /// already released: nothing is marked then).
  std::string release(const std::vector<uint32_t>& ids);
  /// Whether no batch uses any of `ids` now.
  bool idle(const std::vector<uint32_t>& ids);
  /// Frees released, idle ids for reuse (their next registration gets the next generation).
  void forget(const std::vector<uint32_t>& ids);

  Events take_events();

  static constexpr uint32_t kMaxRegions = 65535;

 private:
  using Clock = std::chrono::steady_clock;

  void loop();
  void serve();
  void idle_wait();
  bool run_batch(std::vector<ring::Sqe>& batch);
  void run_cpu(const ring::Sqe* s, const ring::Resolved* r, size_t n, ring::Cqe* out);
  void fail_batch(const std::vector<ring::Sqe>& batch, size_t bad, const ring::Check& c, std::vector<ring::Cqe>* out);
  bool write_cqes(const std::vector<ring::Cqe>& cqes);
  void count(const ring::Sqe& s, const ring::Cqe& c, bool gpu, double seconds);
  void flush_stats(bool force);
  void broken(const std::string& why);
  void post(const std::function<void(Events&)>& f);

  uint32_t load_word(uint64_t off) const;
  void store_word(uint64_t off, uint32_t v);
  /// WAIT: polls the header's `produced` word until it is >= `value` (gpu_spin_us(), then sleeps of growing length, at most
  /// 200 us); false when the ring stops first.
  bool wait_produced(uint64_t value);
  /// SIGNAL: stores `value` to the header's `done` word (after the batch's CQEs), never lowering it.
  void signal_done(uint64_t value);

  Options opt_;
  std::unique_ptr<RingGpu> gpu_;
  std::function<void()> notify_, finished_;
  std::thread thread_;
  std::atomic<bool> stop_{false};
  std::atomic<bool> broken_{false};

  // Ring thread only.
  uint32_t sq_tail_ = 0, cq_head_ = 0;
  uint64_t done_ = 0;  // the last value stored to `done`
  bool overlong_ = false;  // inside a LINK chain longer than the batch limit: its SQEs fail until the chain ends
  std::vector<ring::Sqe> pending_;  // SQEs of a batch whose last SQE is not published yet
  std::vector<StatsEntry> stats_;
  uint64_t stats_cqes_ = 0;
  Clock::time_point last_flush_;

  /// Reserves `bytes` in the session's bytes in flight (Options::inflight); false when that would pass its limit.
  bool reserve_inflight(int64_t bytes);
  void unreserve_inflight(int64_t bytes);

  // Region table and settings, under mu_.
  std::mutex mu_;
  Settings settings_;
  ring::RegionTable regions_{1};  // entry 0 is never registered
  std::vector<uint32_t> busy_{0};   // batches using each region now
  uint32_t releasing_ = 0;          // regions released but not forgotten

  // Events for the JavaScript thread, under ev_mu_.
  std::mutex ev_mu_;
  Events events_;
  bool notified_ = false;
};

}  // namespace tzip::addon
