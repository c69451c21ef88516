// CUDA runtime plumbing of the addon's GPU entry points: whether a GPU can be used (and why not), device ordinals,
// making a device current for a call, one non-blocking stream per device, pinned host buffers and completion events
// for worker threads, pointer ownership checks, and CUDA errors as TZIP_CUDA.
//
// The CUDA runtime is linked statically and loads the driver lazily, so everything here works (and says why no GPU is
// used) on machines without a driver.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "gpu/probe.h"

namespace tzip::addon {

/// The device probe, taken once per process (device ordinals and UUIDs do not change while it runs).
const gpu::Probe& gpu_probe();

/// Throws TZIP_UNSUPPORTED with the probe's reason when no GPU can be used.
void require_gpu();

/// Throws TZIP_INVALID_ARGUMENT unless `device` is an ordinal of a visible GPU (call require_gpu() first).
void check_device(int64_t device);

/// Throws TZIP_CUDA ("<what>: cudaErrorX: text") when e is not cudaSuccess, TZIP_OUT_OF_MEMORY for
/// cudaErrorMemoryAllocation; clears the runtime's last error.
void cuda_check(cudaError_t e, const std::string& what);

/// "cudaErrorX" for a CUDA runtime error text (as in a tzip::gpu::Status message), or "" when none matches.
std::string cuda_error_name_of_text(const std::string& message);

/// Makes `device` current for the calling thread (cudaSetDevice) and, when destroyed, restores the context that was
/// current before, or none: a thread that had no context gets none back, rather than a new one on device 0.
class DeviceScope {
 public:
  explicit DeviceScope(int device);
  ~DeviceScope();
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  void* saved_ctx_ = nullptr;  // CUcontext current before (exact_), else prev_ is the device to restore
  bool exact_ = false;
  int prev_ = -1, dev_ = -1;
};

/// The addon's stream of `device` (cudaStreamNonBlocking), created on first use; `device` must be current. The codec's
/// scratch memory on it is cached (gpu/scratch.h) while a Node environment holds the addon (hold_scratch_cache).
cudaStream_t device_stream(int device);

/// Called once per Node environment that loads the addon (at registration): while at least one holds it, the scratch
/// memory of the addon's streams is kept between calls (gpu::keep_scratch).
void hold_scratch_cache();

/// Called when such an environment is torn down: when the last one goes, the cached scratch memory of every stream of
/// the addon is freed (stream-ordered, after the work queued on it) and calls still running free theirs when they end.
/// Never throws.
void drop_scratch_cache();

/// Held while one call enqueues its work on device_stream(device), so that calls do not interleave.
std::mutex& enqueue_mutex(int device);

/// Page-locked host memory from a pool, returned to the pool when destroyed (or dropped when `poisoned`).
class PinnedBuffer {
 public:
  explicit PinnedBuffer(size_t bytes);
  ~PinnedBuffer();
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  void* data() const { return ptr_; }
  /// Never reuse this memory (a copy into it may still be pending after a CUDA failure).
  void poison() { poisoned_ = true; }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
  bool poisoned_ = false;
};

/// An event of the addon (cudaEventBlockingSync | cudaEventDisableTiming) on `device`, from a pool.
class CompletionEvent {
 public:
  explicit CompletionEvent(int device);
  ~CompletionEvent();
  CompletionEvent(const CompletionEvent&) = delete;
  CompletionEvent& operator=(const CompletionEvent&) = delete;
  cudaEvent_t get() const { return ev_; }

 private:
  int device_;
  cudaEvent_t ev_ = nullptr;
};

/// Throws TZIP_INVALID_ARGUMENT unless [ptr, ptr + nbytes) is device memory of `device` (device or managed memory,
/// CUDA IPC mappings included) and lies in the one allocation holding `ptr` (cuMemGetAddressRange; where the driver
/// entry point is missing, its last byte must be device memory of `device`). `what` names the pointer in the message
/// ("item 3: data"). nbytes == 0 checks only ptr.
void check_device_range(uint64_t ptr, uint64_t nbytes, int device, const std::string& what);

/// check_device_range for the items of one batched call, on the calling thread with `device` current. Once a range
/// has passed, the allocation holding its first byte (cuMemGetAddressRange) is remembered, and later ranges lying
/// wholly inside a remembered allocation pass without asking CUDA again: a batch staged in one buffer costs three
/// driver calls instead of two per pointer. The message ("item 3: data ...") is built only for a failure.
class DeviceRangeChecker {
 public:
  explicit DeviceRangeChecker(int device) : device_(device) {}
  /// Throws as check_device_range(ptr, nbytes, device, who + field).
  void check(uint64_t ptr, uint64_t nbytes, const std::string& who, const char* field);

 private:
  int device_;
  std::vector<std::pair<uint64_t, uint64_t>> known_;  // [base, end) of allocations whose ranges passed
};

/// Microseconds a thread polls for GPU work it waits on (an event, a ring's `produced` word) before it sleeps:
/// TZIP_GPU_SPIN_US in the environment (read once; 0: sleep at once), default 2000. A thread asleep on a blocking-sync
/// event wakes through the driver's interrupt: on an H200 (VM) a one-element compress through the daemon saw its GPU
/// stage at 199 us sleeping and 129 us polling (TZIP_TRACE medians, docs/benchmarks.md). 2 ms covers the calls where
/// that matters (small ones and 25 MB buckets); longer calls sleep, so a thread spins at most 2 ms per wait.
long gpu_spin_us();

/// Whether the ring's GPU batches of a few tensors are replayed from CUDA graphs (gpu/graph.h): yes unless
/// TZIP_RING_GRAPHS is 0, false or off in the environment (read once; for comparing the two in one benchmark run).
bool ring_graphs();

/// TZIP_TRACE in the environment (read once): GPU calls and ring batches print where their time went to stderr.
bool trace_on();

/// "0x7f12..." for messages.
std::string hex_ptr(uint64_t ptr);

}  // namespace tzip::addon
