// The submission ring's native thread (addon/ring.h, docs/ring.md).
#include "addon/ring.h"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <new>

#include "addon/device.h"
#include "addon/shared_guard.h"
#include "core/errors.h"
#include "core/frame.h"
#include "core/parallel.h"
#include "tzip/format.h"

namespace tzip::addon {

namespace {

using ring::Check;
using ring::Cqe;
using ring::Resolved;
using ring::Sqe;

/// FUTEX_WAIT / FUTEX_WAKE on a word of the ring file: shared futexes (no FUTEX_PRIVATE_FLAG), since the client's
/// process maps the same page.
void futex_wait(uint32_t* addr, uint32_t expected, uint32_t ms) {
  timespec ts;
  ts.tv_sec = time_t(ms / 1000);
  ts.tv_nsec = long(ms % 1000) * 1000000L;
  syscall(SYS_futex, addr, FUTEX_WAIT, expected, &ts, nullptr, 0);
}

void futex_wake(uint32_t* addr) { syscall(SYS_futex, addr, FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0); }

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

/// Bytes of input per CPU item below which a batch's items run in parallel, one thread each, rather than one after
/// the other with all of cpu_threads each: an item of at most two chunks cannot use more than two threads itself.
constexpr uint64_t kSmallItemBytes = 2ull * kDefaultChunkBytes;

}  // namespace

RingCore::RingCore(const Options& o, std::unique_ptr<RingGpu> gpu, std::function<void()> notify,
                   std::function<void()> finished)
    : opt_(o), gpu_(std::move(gpu)), notify_(std::move(notify)), finished_(std::move(finished)), settings_(o.settings) {
  // The thread owns sq_tail and cq_head from now on: it starts from the file's values (zeros in a new file) and never
  // reads them back.
  sq_tail_ = load_word(ring::kOffSqTail);
  cq_head_ = load_word(ring::kOffCqHead);
}

RingCore::~RingCore() {
  if (thread_.joinable()) {
    request_stop();
    thread_.join();
  }
}

void RingCore::start() { thread_ = std::thread([this] { loop(); }); }

void RingCore::request_stop() {
  stop_.store(true, std::memory_order_release);
  futex_wake(reinterpret_cast<uint32_t*>(opt_.file + ring::kOffSqDoorbell));
}

void RingCore::join() {
  if (thread_.joinable()) thread_.join();
}

ring::State RingCore::state() const {
  if (broken_.load(std::memory_order_acquire)) return ring::State::Broken;
  return stop_.load(std::memory_order_acquire) ? ring::State::Closed : ring::State::Serving;
}

uint32_t RingCore::load_word(uint64_t off) const {
  return __atomic_load_n(reinterpret_cast<const uint32_t*>(opt_.file + off), __ATOMIC_ACQUIRE);
}

void RingCore::store_word(uint64_t off, uint32_t v) {
  __atomic_store_n(reinterpret_cast<uint32_t*>(opt_.file + off), v, __ATOMIC_RELEASE);
}

bool RingCore::wait_produced(uint64_t value) {
  // The client's GPU writes `produced` (cuStreamWriteValue64 into its mapping of this page) once the batch's inputs
  // are written; the thread polls it on the CPU instead of making its stream wait, which across two processes'
  // contexts costs far more per blocked hand-off (docs/ring.md, "GPU ordering flags").
  const auto* word = reinterpret_cast<const uint64_t*>(opt_.file + ring::kOffProduced);
  const Clock::time_point spin_until = Clock::now() + std::chrono::microseconds(gpu_spin_us());
  std::chrono::microseconds step(5);
  while (__atomic_load_n(word, __ATOMIC_ACQUIRE) < value) {
    if (stop_.load(std::memory_order_acquire)) return false;
    if (Clock::now() < spin_until) continue;
    std::this_thread::sleep_for(step);
    step = std::min(step * 2, std::chrono::microseconds(200));
  }
  return true;
}

void RingCore::signal_done(uint64_t value) {
  if (value <= done_) return;
  done_ = value;
  __atomic_store_n(reinterpret_cast<uint64_t*>(opt_.file + ring::kOffDone), value, __ATOMIC_RELEASE);
}

// ---------------------------------------------------------------- the thread

void RingCore::loop() {
  if (gpu_) gpu_->bind_thread();
  last_flush_ = Clock::now();
  try {
    serve();
  } catch (const std::exception& e) {
    // A bug (the checks and the codecs report their errors in CQEs): stop serving this ring, keep the daemon.
    broken(std::string("internal error in the ring thread: ") + e.what());
  }
  if (!broken_.load()) store_word(ring::kOffState, uint32_t(ring::State::Closed));
  // A client asleep on cq_doorbell wakes and sees the state.
  __atomic_fetch_add(reinterpret_cast<uint32_t*>(opt_.file + ring::kOffCqDoorbell), 1u, __ATOMIC_SEQ_CST);
  futex_wake(reinterpret_cast<uint32_t*>(opt_.file + ring::kOffCqDoorbell));
  flush_stats(true);
  gpu_.reset();  // the stream is destroyed on the thread that used it, after its last batch
  post([](Events& e) { e.stopped = true; });
  if (finished_) finished_();
}

void RingCore::serve() {
  const uint32_t entries = opt_.entries;
  const size_t limit = std::min<uint32_t>(ring::kMaxBatch, entries);
  while (!stop_.load(std::memory_order_acquire)) {
    if (guard_faulted(opt_.file)) return broken("the ring file shrank under its mapping");
    const uint32_t head = load_word(ring::kOffSqHead);
    const uint32_t avail = head - sq_tail_;
    if (avail > entries) {
      // A shrunk file reads zeros where the fault hit (shared_guard.h): say that, not what the zeros look like.
      if (guard_faulted(opt_.file)) return broken("the ring file shrank under its mapping");
      return broken("sq_head " + std::to_string(head) + " is more than " + std::to_string(entries) +
                    " SQEs past sq_tail " + std::to_string(sq_tail_));
    }
    if (avail == 0) {
      idle_wait();
      flush_stats(false);
      continue;
    }
    for (uint32_t k = 0; k < avail && !stop_.load(std::memory_order_acquire); ++k) {
      // Copied before anything looks at it; the slot is the client's again once sq_tail passes it.
      const Sqe s = ring::copy_sqe(opt_.file + ring::sqe_offset(entries, sq_tail_));
      ++sq_tail_;
      store_word(ring::kOffSqTail, sq_tail_);
      if (overlong_) {
        overlong_ = (s.flags & ring::kLink) != 0;
        std::vector<Sqe> one{s};
        std::vector<Cqe> cqe;
        fail_batch(one, 0, Check{ring::kInvalidArgument, "batch longer than " + std::to_string(limit) + " SQEs"}, &cqe);
        if (!write_cqes(cqe)) return;
        continue;
      }
      pending_.push_back(s);
      if (!(s.flags & ring::kLink)) {
        const bool ok = run_batch(pending_);
        pending_.clear();
        if (!ok) return;
      } else if (pending_.size() == limit) {
        // The chain is longer than a batch may be: all of it fails, these SQEs now and the rest as they come.
        std::vector<Cqe> cqes;
        fail_batch(pending_, pending_.size() - 1,
                   Check{ring::kInvalidArgument, "batch longer than " + std::to_string(limit) + " SQEs"}, &cqes);
        pending_.clear();
        overlong_ = true;
        if (!write_cqes(cqes)) return;
      }
      flush_stats(false);
    }
  }
}

void RingCore::idle_wait() {
  uint32_t* head = reinterpret_cast<uint32_t*>(opt_.file + ring::kOffSqHead);
  if (opt_.spin_us > 0) {
    const Clock::time_point until = Clock::now() + std::chrono::microseconds(opt_.spin_us);
    for (unsigned i = 0;; ++i) {
      if (__atomic_load_n(head, __ATOMIC_ACQUIRE) != sq_tail_ || stop_.load(std::memory_order_acquire)) return;
      cpu_relax();
      if ((i & 63) == 63 && Clock::now() >= until) break;
    }
  }
  flush_stats(false);
  uint32_t* doorbell = reinterpret_cast<uint32_t*>(opt_.file + ring::kOffSqDoorbell);
  uint32_t* sleeping = reinterpret_cast<uint32_t*>(opt_.file + ring::kOffSqSleeping);
  const uint32_t seen = __atomic_load_n(doorbell, __ATOMIC_SEQ_CST);
  // sq_sleeping = 1, then sq_head again: a client that published before this store sees nothing to wake, but its
  // SQE is seen here; one that publishes after it sees sq_sleeping = 1 and rings (both sides sequentially consistent).
  __atomic_store_n(sleeping, 1u, __ATOMIC_SEQ_CST);
  if (__atomic_load_n(head, __ATOMIC_SEQ_CST) == sq_tail_ && !stop_.load(std::memory_order_seq_cst))
    futex_wait(doorbell, seen, opt_.sleep_ms);
  __atomic_store_n(sleeping, 0u, __ATOMIC_SEQ_CST);
}

void RingCore::fail_batch(const std::vector<Sqe>& batch, size_t bad, const Check& c, std::vector<Cqe>* out) {
  out->assign(batch.size(), Cqe{});
  for (size_t i = 0; i < batch.size(); ++i) {
    Cqe& q = (*out)[i];
    q.user_data = batch[i].user_data;
    q.status = c.status;
    q.message = i == bad ? c.message : "SQE " + std::to_string(bad) + " of the batch failed";
  }
}

bool RingCore::run_batch(std::vector<Sqe>& batch) {
  const size_t n = batch.size();
  std::vector<Resolved> res(n);
  std::vector<Cqe> cqes;
  Check c;
  size_t bad = 0;
  const ring::RingCaps caps{gpu_ ? gpu_->device() : -1};
  const uint8_t op = batch[0].op;
  bool marked = false;
  Settings settings;
  // The batch's tensor bytes (compress: the tensors; decompress: the destinations), as the session's ZeroMQ requests
  // count theirs (src/daemon/session.ts, reserveBytes).
  // Given back before the CQEs, or by the destructor when the batch throws (the ring then breaks; the session's
  // ZeroMQ requests must not find its bytes still held).
  struct Reservation {
    RingCore* ring;
    int64_t bytes = 0;
    void give_back() {
      if (bytes > 0) ring->unreserve_inflight(bytes);
      bytes = 0;
    }
    ~Reservation() { give_back(); }
  } reserved{this};
  {
    std::lock_guard<std::mutex> lock(mu_);
    settings = settings_;
    for (size_t i = 0; i < n && c.ok(); ++i) {
      c = ring::check_sqe(batch[i], regions_, &res[i]);
      bad = i;
    }
    if (c.ok()) c = ring::check_batch(batch.data(), res.data(), n, caps, &bad);
    if (c.ok() && op != ring::kNop) {
      // Each SQE lies inside a registered region (checked above), so the sum cannot pass the address space.
      uint64_t bytes = 0;
      for (size_t i = 0; i < n; ++i) bytes += op == ring::kCompress ? batch[i].src_bytes : batch[i].dst_bytes;
      if (bytes > uint64_t(INT64_MAX) || !reserve_inflight(int64_t(bytes))) {
        c = Check{ring::kLimit, "bytes in flight over the session's limit"};
        bad = 0;
      } else {
        reserved.bytes = int64_t(bytes);
      }
    }
    if (c.ok() && op != ring::kNop) {
      for (size_t i = 0; i < n; ++i) {
        ++busy_[res[i].src_id];
        ++busy_[res[i].dst_id];
      }
      marked = true;
    }
  }
  // The job's settings, on the thread's copy of the SQEs that passed their checks as the client wrote them. A codec
  // replaced here can never need more room than the SQE's destination: check_sqe held dst_bytes to the frame bound
  // max_frame_bytes(src bytes, ndim), which is the size of a raw frame (the header, the chunk table and the bytes as
  // they are) and the most any codec writes (a chunk that would not shrink is stored raw: docs/format.md).
  if (c.ok() && op == ring::kCompress && settings.codec >= 0) {
    for (size_t i = 0; i < n; ++i) batch[i].codec = uint8_t(settings.codec);
  }
  // The SM budget of the batch (GPU batches run with it; the trace says it for every batch): the job's wins over the
  // SQE's; an SQE that gives 0 takes the ring's default.
  const int budget = settings.sm_override >= 0 ? settings.sm_override
                     : batch[0].sm_budget     ? int(batch[0].sm_budget)
                                              : settings.sm_budget;
  const Clock::time_point t0 = Clock::now();
  Clock::time_point t_ready = t0;
  const bool on_gpu = c.ok() && op != ring::kNop && res[0].kind == ring::RegionKind::Device;
  // WAIT and SIGNAL are valid on a batch that passed its checks (check_batch: a GPU ring; GPU or nop batches). SIGNAL
  // is also honoured on a batch that failed them (its flags byte aside), so that a client stream waiting on `done`
  // for it goes on; `done` then says only that the thread has finished with it.
  const Sqe& last = batch[n - 1];
  const bool signal = gpu_ && (last.flags & ring::kSignal) && !(last.flags & ~ring::kKnownFlags);
  if (!c.ok()) {
    fail_batch(batch, bad, c, &cqes);
  } else {
    cqes.assign(n, Cqe{});
    const bool waited = !(batch[0].flags & ring::kWait) || wait_produced(batch[0].wait_value);
    t_ready = Clock::now();
    if (!waited) {
      for (size_t i = 0; i < n; ++i) {
        cqes[i].user_data = batch[i].user_data;
        cqes[i].status = ring::kSession;
        cqes[i].message = "ring closed before the inputs were ready";
      }
    } else if (op == ring::kNop) {
      for (size_t i = 0; i < n; ++i) cqes[i].user_data = batch[i].user_data;
    } else if (on_gpu) {
      gpu_->run(batch.data(), res.data(), n, budget, cqes.data());
    } else {
      run_cpu(batch.data(), res.data(), n, cqes.data());
    }
  }
  const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  if (marked) {
    bool notify = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (size_t i = 0; i < n; ++i) {
        --busy_[res[i].src_id];
        --busy_[res[i].dst_id];
      }
      if (!on_gpu) {
        // A client that shrank a file under its mapping faulted only that region (shared_guard.h): every SQE of the
        // batch that used it fails TZIP_HANDLE, and so does every later SQE naming it.
        for (size_t i = 0; i < n; ++i) {
          for (const uint32_t id : {res[i].src_id, res[i].dst_id}) {
            ring::Region& r = regions_[id];
            if (!r.faulted && guard_faulted(reinterpret_cast<const void*>(static_cast<uintptr_t>(r.base)))) r.faulted = true;
            if (r.faulted) {
              cqes[i].status = ring::kHandle;
              cqes[i].message = "region " + std::to_string(id) + ": its file shrank";
              cqes[i].result = 0;
              cqes[i].codec = 0;
            }
          }
        }
      }
      notify = releasing_ > 0;
    }
    if (notify) post([](Events& e) { e.regions_idle = true; });
  }
  // Before the CQEs: a client that goes on at its CQE finds the bytes given back.
  reserved.give_back();
  if (op == ring::kCompress || op == ring::kDecompress) {
    for (size_t i = 0; i < n; ++i) count(batch[i], cqes[i], on_gpu, i == 0 ? seconds : 0);
  }
  const Clock::time_point t_ran = Clock::now();
  const bool ok = write_cqes(cqes);
  if (signal) signal_done(last.signal_value);
  if (trace_on()) {
    auto us = [](Clock::time_point a, Clock::time_point b) {
      return std::chrono::duration<double, std::micro>(b - a).count();
    };
    std::fprintf(stderr, "tzip ring trace: op %u, %zu SQEs, %s, codec %u, SM budget %d: waiting for produced %.1f us, "
                 "running %.1f us (GPU enqueue %.1f us, GPU wait %.1f us, codec call %.1f us), CQEs %.1f us\n", unsigned(op),
                 n, on_gpu ? "GPU" : "CPU", unsigned(batch[0].codec), budget, us(t0, t_ready), us(t_ready, t_ran),
                 on_gpu ? gpu_->last_enqueue_us() : 0.0, on_gpu ? gpu_->last_wait_us() : 0.0,
                 on_gpu ? gpu_->last_codec_us() : 0.0, us(t_ran, Clock::now()));
  }
  return ok;
}

void RingCore::run_cpu(const Sqe* s, const Resolved* r, size_t n, Cqe* out) {
  auto one = [&](size_t i, uint32_t threads) {
    Cqe& c = out[i];
    c.user_data = s[i].user_data;
    const uint8_t* src = reinterpret_cast<const uint8_t*>(static_cast<uintptr_t>(r[i].src));
    uint8_t* dst = reinterpret_cast<uint8_t*>(static_cast<uintptr_t>(r[i].dst));
    try {
      if (s[i].op == ring::kCompress) {
        const Dtype dtype = Dtype(s[i].dtype);
        EncodeOptions eo;
        eo.codec = s[i].codec == ring::kCodecAuto ? resolve_auto(src, s[i].src_bytes, dtype, kDefaultChunkBytes, threads)
                                                  : Codec(s[i].codec);
        eo.chunk_bytes = kDefaultChunkBytes;
        eo.threads = threads;
        const std::vector<uint64_t> shape(s[i].shape, s[i].shape + s[i].ndim);
        c.result = encode_frame(src, s[i].src_bytes, dtype, shape, eo, dst);
        c.codec = ring::known_frame_codec(uint8_t(eo.codec), s[i].dtype, s[i].src_bytes);
      } else {
        decode_frame(src, s[i].src_bytes, dst, s[i].dst_bytes, (s[i].flags & ring::kVerify) != 0, threads);
        c.result = s[i].dst_bytes;
      }
    } catch (const tzip::Error& e) {
      c.status = int32_t(e.code());
      c.message = e.what();
      c.result = 0;
    } catch (const std::bad_alloc&) {
      c.status = ring::kOutOfMemory;
      c.message = "out of memory";
      c.result = 0;
    } catch (const std::exception& e) {
      c.status = ring::kInternal;
      c.message = std::string("internal: ") + e.what();
      c.result = 0;
    }
  };
  bool small = n > 1 && opt_.cpu_threads > 1;
  for (size_t i = 0; i < n && small; ++i)
    small = (s[i].op == ring::kCompress ? s[i].src_bytes : s[i].dst_bytes) <= kSmallItemBytes;
  if (small) {
    parallel_for(n, opt_.cpu_threads, [&](uint64_t i, uint32_t) { one(size_t(i), 1); });
  } else {
    for (size_t i = 0; i < n; ++i) one(i, opt_.cpu_threads);
  }
}

bool RingCore::write_cqes(const std::vector<Cqe>& cqes) {
  const uint32_t entries = opt_.entries;
  size_t i = 0;
  std::chrono::microseconds step(20);
  while (i < cqes.size()) {
    const uint32_t tail = load_word(ring::kOffCqTail);
    const uint32_t used = cq_head_ - tail;
    if (used > entries) {
      if (guard_faulted(opt_.file)) {
        broken("the ring file shrank under its mapping");
        return false;
      }
      broken("cq_tail " + std::to_string(tail) + " is not within " + std::to_string(entries) + " CQEs of cq_head " +
             std::to_string(cq_head_));
      return false;
    }
    if (used == entries) {
      // The client has not reaped: only its ring waits. A close drops the CQEs that do not fit.
      if (stop_.load(std::memory_order_acquire)) return true;
      if (guard_faulted(opt_.file)) {
        broken("the ring file shrank under its mapping");
        return false;
      }
      std::this_thread::sleep_for(step);
      step = std::min(step * 2, std::chrono::microseconds(1000));
      continue;
    }
    for (uint32_t room = entries - used; room > 0 && i < cqes.size(); --room, ++i) {
      uint8_t raw[ring::kCqeBytes];
      ring::encode_cqe(cqes[i], raw);
      uint64_t words[ring::kCqeBytes / 8];
      std::memcpy(words, raw, sizeof raw);
      uint64_t* slot = reinterpret_cast<uint64_t*>(opt_.file + ring::cqe_offset(entries, cq_head_));
      for (size_t w = 0; w < ring::kCqeBytes / 8; ++w) __atomic_store_n(slot + w, words[w], __ATOMIC_RELAXED);
      ++cq_head_;
    }
    store_word(ring::kOffCqHead, cq_head_);
    // cq_head published, then cq_waiting read (sequentially consistent, as the client's cq_waiting = 1 then cq_head).
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    if (load_word(ring::kOffCqWaiting) != 0) {
      uint32_t* doorbell = reinterpret_cast<uint32_t*>(opt_.file + ring::kOffCqDoorbell);
      __atomic_fetch_add(doorbell, 1u, __ATOMIC_SEQ_CST);
      futex_wake(doorbell);
    }
  }
  return true;
}

// ---------------------------------------------------------------- stats, events

void RingCore::count(const Sqe& s, const Cqe& c, bool gpu, double seconds) {
  const uint8_t stream = s.stream <= ring::kMaxStreamTag ? s.stream : 0;
  StatsEntry* e = nullptr;
  for (StatsEntry& x : stats_)
    if (x.op == s.op && x.stream == stream && x.gpu == gpu) e = &x;
  if (!e) {
    stats_.push_back(StatsEntry{});
    e = &stats_.back();
    e->op = s.op;
    e->stream = stream;
    e->gpu = gpu;
  }
  ++e->items;
  e->in_bytes += s.src_bytes;
  if (c.status == ring::kOk) e->out_bytes += c.result;
  else ++e->errors;
  e->seconds += seconds;
  ++stats_cqes_;
}

void RingCore::flush_stats(bool force) {
  if (stats_.empty()) return;
  const Clock::time_point now = Clock::now();
  if (!force && stats_cqes_ < 256 && now - last_flush_ < std::chrono::milliseconds(10)) return;
  std::vector<StatsEntry> batch;
  batch.swap(stats_);
  stats_cqes_ = 0;
  last_flush_ = now;
  post([&batch](Events& e) { e.stats.insert(e.stats.end(), batch.begin(), batch.end()); });
}

void RingCore::broken(const std::string& why) {
  broken_.store(true, std::memory_order_release);
  store_word(ring::kOffState, uint32_t(ring::State::Broken));
  post([&why](Events& e) { e.broken = why; });
}

void RingCore::post(const std::function<void(Events&)>& f) {
  bool first = false;
  {
    std::lock_guard<std::mutex> lock(ev_mu_);
    f(events_);
    first = !notified_;
    notified_ = true;
  }
  if (first && notify_) notify_();
}

RingCore::Events RingCore::take_events() {
  std::lock_guard<std::mutex> lock(ev_mu_);
  Events e = std::move(events_);
  events_ = Events{};
  notified_ = false;
  return e;
}

bool RingCore::reserve_inflight(int64_t bytes) {
  if (opt_.inflight == nullptr || bytes == 0) return true;
  // The daemon's JavaScript reserves in the same word (Atomics.compareExchange on a SharedArrayBuffer): both sides
  // add only what keeps the sum within the limit.
  int64_t cur = __atomic_load_n(opt_.inflight, __ATOMIC_ACQUIRE);
  for (;;) {
    if (cur < 0 || bytes > opt_.max_inflight - std::min(cur, opt_.max_inflight)) return false;
    if (__atomic_compare_exchange_n(opt_.inflight, &cur, cur + bytes, false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
      return true;
  }
}

void RingCore::unreserve_inflight(int64_t bytes) {
  if (opt_.inflight != nullptr) __atomic_fetch_sub(opt_.inflight, bytes, __ATOMIC_ACQ_REL);
}

// ---------------------------------------------------------------- settings, regions (JavaScript thread)

void RingCore::set_settings(const Settings& s) {
  std::lock_guard<std::mutex> lock(mu_);
  settings_ = s;
}

RingCore::RegionInfo RingCore::add_region(const ring::Region& r) {
  std::lock_guard<std::mutex> lock(mu_);
  uint32_t id = 1;
  while (id < regions_.size() && regions_[id].registered) ++id;
  if (id == regions_.size()) {
    if (id > kMaxRegions)
      throw tzip::Error(tzip::ErrorCode::InvalidArgument, "at most " + std::to_string(kMaxRegions) + " regions per ring");
    regions_.push_back(ring::Region{});
    busy_.push_back(0);
  }
  ring::Region& e = regions_[id];
  const uint32_t generation = e.generation + 1;  // never 0: a zeroed SQE names no live region
  e = r;
  e.registered = true;
  e.released = false;
  e.faulted = false;
  e.generation = generation;
  busy_[id] = 0;
  return RegionInfo{id, generation, r.bytes};
}

std::string RingCore::release(const std::vector<uint32_t>& ids) {
  std::lock_guard<std::mutex> lock(mu_);
  for (const uint32_t id : ids) {
    if (id == 0 || id >= regions_.size() || !regions_[id].registered)
      return "region " + std::to_string(id) + " is not registered to this ring";
    if (regions_[id].released) return "region " + std::to_string(id) + " is already being released";
  }
  for (const uint32_t id : ids) {
    regions_[id].released = true;
    ++releasing_;
  }
  return "";
}

bool RingCore::idle(const std::vector<uint32_t>& ids) {
  std::lock_guard<std::mutex> lock(mu_);
  for (const uint32_t id : ids)
    if (id < busy_.size() && busy_[id] != 0) return false;
  return true;
}

void RingCore::forget(const std::vector<uint32_t>& ids) {
  std::lock_guard<std::mutex> lock(mu_);
  for (const uint32_t id : ids) {
    if (id == 0 || id >= regions_.size() || !regions_[id].registered) continue;
    const uint32_t generation = regions_[id].generation;
    if (regions_[id].released && releasing_ > 0) --releasing_;
    regions_[id] = ring::Region{};
    regions_[id].generation = generation;  // the id's next registration gets the next one
  }
}

}  // namespace tzip::addon
