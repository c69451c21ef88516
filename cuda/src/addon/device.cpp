// CUDA runtime plumbing of the addon's GPU entry points (see addon/device.h).
#include "addon/device.h"

#include <algorithm>
#include <cstdlib>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <vector>

#include "addon/coded_error.h"
#include "gpu/scratch.h"

namespace tzip::addon {

namespace {

/// Per-device state, sized to the probe's device count on first use.
struct Devices {
  std::mutex mu;
  std::vector<cudaStream_t> streams;
  std::vector<std::unique_ptr<std::mutex>> enqueue;
  std::vector<std::vector<cudaEvent_t>> idle_events;
};

// Set once devices() has made the table (hold_scratch_cache / drop_scratch_cache must not probe the GPUs themselves).
std::atomic<Devices*> g_devices{nullptr};
// Node environments holding the scratch cache (hold_scratch_cache / drop_scratch_cache).
std::atomic<int> g_scratch_holders{0};

Devices& devices() {
  static Devices* d = [] {
    auto* t = new Devices;  // never destroyed: worker threads may still use it while the process exits
    const size_t n = gpu_probe().devices.size();
    t->streams.assign(n, nullptr);
    t->idle_events.resize(n);
    for (size_t i = 0; i < n; ++i) t->enqueue.push_back(std::make_unique<std::mutex>());
    g_devices.store(t);
    return t;
  }();
  return *d;
}

std::mutex g_pinned_mu;
std::multimap<size_t, void*>* g_pinned_idle = new std::multimap<size_t, void*>;
constexpr size_t kMaxIdlePinned = 32;

const char* memory_type_name(cudaMemoryType t) {
  switch (t) {
    case cudaMemoryTypeUnregistered: return "not memory CUDA knows of (unregistered host memory or no allocation)";
    case cudaMemoryTypeHost: return "page-locked host memory";
    case cudaMemoryTypeDevice: return "device memory";
    case cudaMemoryTypeManaged: return "managed memory";
  }
  return "memory of an unknown kind";
}

}  // namespace

const gpu::Probe& gpu_probe() {
  static const gpu::Probe* p = new gpu::Probe(gpu::probe());
  return *p;
}

void require_gpu() {
  const gpu::Probe& p = gpu_probe();
  if (!p.available) throw CodedError(tzip::ErrorCode::Unsupported, "no GPU can be used: " + p.reason);
}

void check_device(int64_t device) {
  const size_t n = gpu_probe().devices.size();
  if (device < 0 || uint64_t(device) >= n)
    throw_invalid("device " + std::to_string(device) + " does not exist: " + std::to_string(n) +
                  " GPU(s) visible, ordinals 0.." + std::to_string(int64_t(n) - 1));
}

void cuda_check(cudaError_t e, const std::string& what) {
  if (e == cudaSuccess) return;
  cudaGetLastError();  // clear a non-sticky error so that later calls start clean
  // A failed device or pinned allocation is out-of-memory, not a CUDA fault: the same call may succeed later.
  throw CodedError(e == cudaErrorMemoryAllocation ? tzip::ErrorCode::OutOfMemory : tzip::ErrorCode::Cuda,
                   what + ": " + cudaGetErrorName(e) + ": " + cudaGetErrorString(e));
}

std::string cuda_error_name_of_text(const std::string& message) {
  std::string best, best_text;
  for (int i = 1; i < 1000; ++i) {
    const cudaError_t e = cudaError_t(i);
    const std::string name = cudaGetErrorName(e);
    if (name.rfind("cudaError", 0) != 0) continue;
    const std::string text = cudaGetErrorString(e);
    if (text.size() <= best_text.size() || text.size() > message.size()) continue;
    if (message.compare(message.size() - text.size(), text.size(), text) == 0) {
      best = name;
      best_text = text;
    }
  }
  return best;
}

namespace {

/// cuCtxGetCurrent / cuCtxSetCurrent through the runtime's driver entry points (no link-time libcuda dependency), so
/// that DeviceScope restores exactly the context that was current, none included, instead of making the previous
/// device current again (which would create a context on device 0 for a thread that never used it).
struct ContextApi {
  int (*get)(void** ctx) = nullptr;
  int (*set)(void* ctx) = nullptr;
};

const ContextApi& context_api() {
  static const ContextApi api = [] {
    ContextApi a;
    void* get = nullptr;
    void* set = nullptr;
    cudaDriverEntryPointQueryResult qg = cudaDriverEntryPointSymbolNotFound, qs = cudaDriverEntryPointSymbolNotFound;
    const bool ok = cudaGetDriverEntryPointByVersion("cuCtxGetCurrent", &get, 4000, cudaEnableDefault, &qg) == cudaSuccess &&
                    cudaGetDriverEntryPointByVersion("cuCtxSetCurrent", &set, 4000, cudaEnableDefault, &qs) == cudaSuccess &&
                    qg == cudaDriverEntryPointSuccess && qs == cudaDriverEntryPointSuccess && get && set;
    cudaGetLastError();
    if (ok) {
      a.get = reinterpret_cast<int (*)(void**)>(get);
      a.set = reinterpret_cast<int (*)(void*)>(set);
    }
    return a;
  }();
  return api;
}

}  // namespace

DeviceScope::DeviceScope(int device) : dev_(device) {
  const ContextApi& api = context_api();
  if (api.get && api.get(&saved_ctx_) == 0) {
    exact_ = true;
  } else {
    cuda_check(cudaGetDevice(&prev_), "cudaGetDevice");
  }
  cuda_check(cudaSetDevice(dev_), "cudaSetDevice(" + std::to_string(dev_) + ")");
}

DeviceScope::~DeviceScope() {
  if (exact_) context_api().set(saved_ctx_);
  else if (prev_ >= 0 && prev_ != dev_) cudaSetDevice(prev_);
}

cudaStream_t device_stream(int device) {
  Devices& d = devices();
  std::lock_guard<std::mutex> lock(d.mu);
  cudaStream_t& s = d.streams.at(size_t(device));
  if (!s) {
    cuda_check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
    if (g_scratch_holders.load() > 0) gpu::keep_scratch(s);
  }
  return s;
}

void hold_scratch_cache() {
  if (g_scratch_holders.fetch_add(1) > 0) return;
  Devices* d = g_devices.load();
  if (!d) return;  // no stream yet (device_stream registers the ones it creates)
  std::lock_guard<std::mutex> lock(d->mu);
  for (cudaStream_t s : d->streams)
    if (s) gpu::keep_scratch(s);
}

void drop_scratch_cache() {
  int n = g_scratch_holders.load();
  do {
    if (n <= 0) return;
  } while (!g_scratch_holders.compare_exchange_weak(n, n - 1));
  if (n > 1) return;
  Devices* d = g_devices.load();
  if (!d) return;
  std::vector<cudaStream_t> streams;
  {
    std::lock_guard<std::mutex> lock(d->mu);
    streams = d->streams;
  }
  for (size_t i = 0; i < streams.size(); ++i) {
    if (!streams[i]) continue;
    try {
      DeviceScope scope(static_cast<int>(i));
      gpu::release_scratch(streams[i]);
    } catch (...) {
      // Teardown: nothing to report to; the process's memory goes with it.
    }
  }
}

std::mutex& enqueue_mutex(int device) { return *devices().enqueue.at(size_t(device)); }

PinnedBuffer::PinnedBuffer(size_t bytes) {
  if (bytes == 0) bytes = 1;
  {
    std::lock_guard<std::mutex> lock(g_pinned_mu);
    auto it = g_pinned_idle->lower_bound(bytes);
    if (it != g_pinned_idle->end() && it->first <= 4 * bytes + 4096) {
      bytes_ = it->first;
      ptr_ = it->second;
      g_pinned_idle->erase(it);
      return;
    }
  }
  size_t size = 4096;
  while (size < bytes) size *= 2;
  // Mapped: the ring's GPU batches let kernels write their results straight into it (ring_gpu.cpp).
  cuda_check(cudaHostAlloc(&ptr_, size, cudaHostAllocPortable | cudaHostAllocMapped),
             "cudaHostAlloc(" + std::to_string(size) + " bytes)");
  bytes_ = size;
}

PinnedBuffer::~PinnedBuffer() {
  if (!ptr_ || poisoned_) return;
  {
    std::lock_guard<std::mutex> lock(g_pinned_mu);
    if (g_pinned_idle->size() < kMaxIdlePinned) {
      g_pinned_idle->emplace(bytes_, ptr_);
      return;
    }
  }
  cudaFreeHost(ptr_);
}

CompletionEvent::CompletionEvent(int device) : device_(device) {
  Devices& d = devices();
  {
    std::lock_guard<std::mutex> lock(d.mu);
    std::vector<cudaEvent_t>& idle = d.idle_events.at(size_t(device));
    if (!idle.empty()) {
      ev_ = idle.back();
      idle.pop_back();
      return;
    }
  }
  cuda_check(cudaEventCreateWithFlags(&ev_, cudaEventBlockingSync | cudaEventDisableTiming), "cudaEventCreateWithFlags");
}

CompletionEvent::~CompletionEvent() {
  if (!ev_) return;
  Devices& d = devices();
  std::lock_guard<std::mutex> lock(d.mu);
  d.idle_events.at(size_t(device_)).push_back(ev_);
}

std::string hex_ptr(uint64_t ptr) {
  char s[32];
  std::snprintf(s, sizeof s, "0x%llx", static_cast<unsigned long long>(ptr));
  return s;
}

namespace {

/// cuMemGetAddressRange through the runtime's driver entry points (as context_api); null when unavailable.
using AddressRangeFn = int (*)(unsigned long long* base, size_t* size, unsigned long long ptr);
AddressRangeFn address_range_fn() {
  static const AddressRangeFn fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
    const bool ok = cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &f, 3020, cudaEnableDefault, &q) == cudaSuccess &&
                    q == cudaDriverEntryPointSuccess && f;
    cudaGetLastError();
    return ok ? reinterpret_cast<AddressRangeFn>(f) : nullptr;
  }();
  return fn;
}

}  // namespace

void check_device_range(uint64_t ptr, uint64_t nbytes, int device, const std::string& what) {
  const std::string span = what + " (" + (nbytes ? std::to_string(nbytes) + " bytes at " : std::string("pointer ")) +
                           hex_ptr(ptr) + ")";
  if (ptr == 0) throw_invalid(span + " is a null pointer");
  if (nbytes && ptr + (nbytes - 1) < ptr) throw_invalid(span + " wraps around the address space");
  auto check_one = [&](uint64_t p) {
    cudaPointerAttributes a{};
    const cudaError_t e = cudaPointerGetAttributes(&a, reinterpret_cast<const void*>(static_cast<uintptr_t>(p)));
    const std::string where = p == ptr ? span : span + ": its last byte " + hex_ptr(p);
    if (e == cudaErrorInvalidValue) {
      cudaGetLastError();
      throw_invalid(where + " is not device memory of device " + std::to_string(device));
    }
    cuda_check(e, "cudaPointerGetAttributes");
    if (a.type != cudaMemoryTypeDevice && a.type != cudaMemoryTypeManaged)
      throw_invalid(where + " is " + memory_type_name(a.type) + ", not device memory of device " + std::to_string(device));
    if (a.device != device)
      throw_invalid(where + " is memory of device " + std::to_string(a.device) + ", not of device " +
                    std::to_string(device) + " (options.device)");
  };
  check_one(ptr);
  if (nbytes <= 1) return;
  // The whole range in the allocation holding its first byte: an IPC mapping of a client's allocation may lie next to
  // other device memory of the daemon (another client's mapping, its own scratch), so the last byte being device
  // memory is not enough. Without the driver entry point, fall back to checking the last byte.
  const AddressRangeFn range = address_range_fn();
  unsigned long long base = 0;
  size_t size = 0;
  if (range && range(&base, &size, ptr) == 0) {  // CUDA_SUCCESS is 0
    if (ptr - base + nbytes > size)
      throw_invalid(span + " runs " + std::to_string(ptr - base + nbytes - size) + " bytes past the end of its allocation (" +
                    std::to_string(size) + " bytes at " + hex_ptr(base) + ")");
    return;
  }
  check_one(ptr + nbytes - 1);
}

namespace {

/// Allocations a checker remembers at most (a batch over more of them checks the rest pointer by pointer).
constexpr size_t kMaxKnownAllocations = 64;

}  // namespace

void DeviceRangeChecker::check(uint64_t ptr, uint64_t nbytes, const std::string& who, const char* field) {
  const uint64_t end = ptr + (nbytes ? nbytes : 1);
  if (ptr != 0 && end > ptr) {
    for (const auto& [base, stop] : known_)
      if (base <= ptr && end <= stop) return;
  }
  check_device_range(ptr, nbytes, device_, who + field);  // throws unless the range passes
  const AddressRangeFn range = address_range_fn();
  if (!range || known_.size() >= kMaxKnownAllocations) return;
  unsigned long long base = 0;
  size_t size = 0;
  if (range(&base, &size, ptr) != 0) return;  // CUDA_SUCCESS is 0; anything else: nothing remembered
  if (base <= ptr && end <= base + size) known_.emplace_back(base, base + size);
}

bool trace_on() {
  static const bool on = std::getenv("TZIP_TRACE") != nullptr;
  return on;
}

long gpu_spin_us() {
  static const long us = [] {
    const char* v = std::getenv("TZIP_GPU_SPIN_US");
    return v ? std::max(0L, std::strtol(v, nullptr, 10)) : 2000L;
  }();
  return us;
}

bool ring_graphs() {
  static const bool on = [] {
    const char* v = std::getenv("TZIP_RING_GRAPHS");
    return !(v && (std::strcmp(v, "0") == 0 || std::strcmp(v, "false") == 0 || std::strcmp(v, "off") == 0));
  }();
  return on;
}

}  // namespace tzip::addon
