// Host-side plumbing shared by the GPU encoder and decoder: device binding, persistent-grid sizing under an SM budget,
// pinned staging for descriptor uploads, error names, and a copy kernel used as the bandwidth ceiling in benchmarks.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "gpu/codec.h"

namespace tzip {
namespace gpu {

namespace detail {

Status cuda_status(int e, const char* what) {
  Status s;
  if (e != cudaSuccess) {
    s.code = e == cudaErrorMemoryAllocation ? kOutOfMemory : kCudaError;
    s.message = std::string(what) + ": " + cudaGetErrorString(cudaError_t(e));
  }
  return s;
}

}  // namespace detail

namespace {

using detail::cuda_status;

Tuning g_tuning;
std::mutex g_tuning_mu;

// Pinned staging buffers, reused once the copy that last read them has completed.
struct Staging {
  void* host = nullptr;
  size_t bytes = 0;
  cudaEvent_t done = nullptr;
  int device = -1;
  bool busy = false;
  // Whether `done` was recorded after the copy of the current use. Until then the buffer is its user's whatever the
  // event says: queried between the take and the record, it still answers for the previous use (or, never recorded,
  // cudaSuccess), and a second thread (another ring's, another stream's) would overwrite descriptors not yet copied.
  bool recorded = false;
};
std::mutex g_staging_mu;
std::vector<Staging*> g_staging;

// persistent_grid's results, per kernel, device, block size and requested dynamic shared memory: the occupancy query
// and attribute calls are made once, not at every launch.
struct GridKey {
  const void* kernel;
  int device, threads;
  size_t dyn_smem;
  bool operator<(const GridKey& o) const {
    return std::tie(kernel, device, threads, dyn_smem) < std::tie(o.kernel, o.device, o.threads, o.dyn_smem);
  }
};
struct GridFit {
  int per_sm;       // blocks per SM at dyn_smem (1 unless a kernel cannot be kept to one)
  size_t dyn_smem;  // dynamic shared memory to launch with
};
std::mutex g_grid_mu;
// Never destroyed: worker threads may launch while the process exits.
auto* g_grid_fits = new std::map<GridKey, GridFit>;
// cudaFuncAttributeMaxDynamicSharedMemorySize as last set per (kernel, device).
auto* g_smem_attr = new std::map<std::pair<const void*, int>, size_t>;

}  // namespace

const char* error_code_name(int32_t code) { return status_code_name(code); }

void set_tuning(const Tuning& t) {
  std::lock_guard<std::mutex> lock(g_tuning_mu);
  g_tuning = t;
}
Tuning get_tuning() {
  std::lock_guard<std::mutex> lock(g_tuning_mu);
  return g_tuning;
}

namespace detail {

DeviceGuard::~DeviceGuard() {
  if (prev_ >= 0 && prev_ != dev_) cudaSetDevice(prev_);
}

Status DeviceGuard::bind(const void* const* ptrs, size_t n) {
  Status st;
  int dev = -1;
  for (size_t i = 0; i < n; ++i) {
    if (!ptrs[i]) continue;
    cudaPointerAttributes attr{};
    cudaError_t e = cudaPointerGetAttributes(&attr, ptrs[i]);
    if (e != cudaSuccess) {
      cudaGetLastError();
      return cuda_status(e, "cudaPointerGetAttributes");
    }
    if (attr.type != cudaMemoryTypeDevice && attr.type != cudaMemoryTypeManaged) {
      st.code = kInvalidArgument;
      st.message = "pointer " + std::to_string(i) + " is not device memory";
      return st;
    }
    if (dev < 0) dev = attr.device;
    else if (attr.device != dev) {
      st.code = kInvalidArgument;
      st.message = "pointers of one call must all be on one device (found devices " + std::to_string(dev) + " and " +
                   std::to_string(attr.device) + ")";
      return st;
    }
  }
  return bind_device(dev);
}

Status DeviceGuard::bind_device(int device) {
  cudaError_t e = cudaGetDevice(&prev_);
  if (e != cudaSuccess) return cuda_status(e, "cudaGetDevice");
  dev_ = device < 0 ? prev_ : device;
  if (dev_ != prev_) {
    e = cudaSetDevice(dev_);
    if (e != cudaSuccess) return cuda_status(e, "cudaSetDevice");
  }
  e = cudaDeviceGetAttribute(&sms_, cudaDevAttrMultiProcessorCount, dev_);
  if (e != cudaSuccess) return cuda_status(e, "cudaDeviceGetAttribute");
  return Status{};
}

Status persistent_grid(const void* kernel, int threads, size_t* dyn_smem, int sm_budget, int sm_count, uint64_t want,
                       int* grid) {
  int dev = 0;
  cudaGetDevice(&dev);
  const GridKey key{kernel, dev, threads, *dyn_smem};
  std::lock_guard<std::mutex> lock(g_grid_mu);
  auto found = g_grid_fits->find(key);
  if (found == g_grid_fits->end()) {
    int smem_per_sm = 0, smem_optin = 0;
    cudaDeviceGetAttribute(&smem_per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, dev);
    cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
    int per_sm = 0;
    for (int attempt = 0; attempt < 2; ++attempt) {
      cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(*dyn_smem));
      if (e != cudaSuccess) return cuda_status(e, "cudaFuncSetAttribute");
      (*g_smem_attr)[{kernel, dev}] = *dyn_smem;
      e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, *dyn_smem);
      if (e != cudaSuccess) return cuda_status(e, "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
      if (per_sm <= 1) break;
      // A second block would fit: take more than half of the SM's shared memory so that it cannot.
      cudaFuncAttributes fa{};
      cudaFuncGetAttributes(&fa, kernel);
      const size_t need = size_t(smem_per_sm) / 2 + 1 - std::min<size_t>(size_t(smem_per_sm) / 2, fa.sharedSizeBytes);
      *dyn_smem = std::min<size_t>(std::max(*dyn_smem, need), size_t(smem_optin) - fa.sharedSizeBytes);
    }
    if (per_sm < 1) {
      Status st;
      st.code = kCudaError;
      st.message = "kernel does not fit on an SM";
      return st;
    }
    found = g_grid_fits->emplace(key, GridFit{per_sm, *dyn_smem}).first;
  }
  const GridFit fit = found->second;
  // The kernel's dynamic shared memory limit is per device; another size may have been set for it since.
  size_t& attr = (*g_smem_attr)[{kernel, dev}];
  if (attr != fit.dyn_smem) {
    const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(fit.dyn_smem));
    if (e != cudaSuccess) return cuda_status(e, "cudaFuncSetAttribute");
    attr = fit.dyn_smem;
  }
  *dyn_smem = fit.dyn_smem;
  const int budget = sm_budget <= 0 ? sm_count : std::min(sm_budget, sm_count);
  const uint64_t cap = uint64_t(budget) * uint64_t(fit.per_sm);
  *grid = int(std::max<uint64_t>(1, std::min<uint64_t>(cap, want)));
  return Status{};
}

Status upload(void* d_dst, const void* h_src, size_t bytes, void* stream) {
  if (bytes == 0) return Status{};
  int dev = 0;
  cudaGetDevice(&dev);
  Staging* s = nullptr;
  {
    std::lock_guard<std::mutex> lock(g_staging_mu);
    for (Staging* c : g_staging) {
      if (c->device != dev || c->bytes < bytes) continue;
      if (c->busy) {
        if (!c->recorded || cudaEventQuery(c->done) != cudaSuccess) continue;
        c->busy = false;
      }
      s = c;
      break;
    }
    if (!s) {
      // Grow: drop one idle buffer of this device that is too small, then allocate.
      s = new Staging;
      s->device = dev;
      s->bytes = std::max<size_t>(bytes, 1 << 16);
      cudaError_t e = cudaMallocHost(&s->host, s->bytes);
      if (e == cudaSuccess) e = cudaEventCreateWithFlags(&s->done, cudaEventDisableTiming);
      if (e != cudaSuccess) {
        if (s->host) cudaFreeHost(s->host);
        delete s;
        return cuda_status(e, "pinned staging buffer");
      }
      g_staging.push_back(s);
    }
    s->busy = true;
    s->recorded = false;
  }
  std::memcpy(s->host, h_src, bytes);
  cudaError_t e = cudaMemcpyAsync(d_dst, s->host, bytes, cudaMemcpyHostToDevice, cudaStream_t(stream));
  const bool queued = e == cudaSuccess;
  if (queued) e = cudaEventRecord(s->done, cudaStream_t(stream));
  {
    std::lock_guard<std::mutex> lock(g_staging_mu);
    if (!queued) s->busy = false;  // nothing reads it
    else if (e == cudaSuccess) s->recorded = true;
    // (a copy queued but no event recorded: the buffer stays busy for good, never handed out while it may be read)
  }
  return cuda_status(e, "upload of descriptors");
}

// alloc_async / free_async: scratch.cu (cached per stream, gpu/scratch.h).
Status memset_async(void* p, int value, size_t bytes, void* stream) {
  if (bytes == 0) return Status{};
  return cuda_status(cudaMemsetAsync(p, value, bytes, cudaStream_t(stream)), "cudaMemsetAsync");
}
Status check_launch(const char* what) { return cuda_status(cudaGetLastError(), what); }

}  // namespace detail

// ---------------------------------------------------------------- copy kernel (benchmark ceiling)

namespace {

__global__ void __launch_bounds__(1024, 1) copy_kernel(uint8_t* dst, const uint8_t* src, uint64_t n) {
  const uint64_t nvec = n / 16;
  const uint64_t stride = uint64_t(gridDim.x) * blockDim.x;
  const uint4* s = reinterpret_cast<const uint4*>(src);
  uint4* d = reinterpret_cast<uint4*>(dst);
  uint64_t i = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  // Four independent 16-byte loads in flight per thread.
  for (; i + 3 * stride < nvec; i += 4 * stride) {
    const uint4 a = s[i], b = s[i + stride], c = s[i + 2 * stride], e = s[i + 3 * stride];
    d[i] = a;
    d[i + stride] = b;
    d[i + 2 * stride] = c;
    d[i + 3 * stride] = e;
  }
  for (; i < nvec; i += stride) d[i] = s[i];
  for (uint64_t j = nvec * 16 + uint64_t(blockIdx.x) * blockDim.x + threadIdx.x; j < n; j += stride) dst[j] = src[j];
}

}  // namespace

Status copy_bytes(void* dst, const void* src, uint64_t nbytes, int sm_budget, void* stream) {
  detail::DeviceGuard guard;
  const void* ptrs[2] = {dst, src};
  Status st = guard.bind(ptrs, 2);
  if (!st.ok()) return st;
  if ((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src)) & 15) {
    st.code = kInvalidArgument;
    st.message = "copy_bytes needs 16-byte aligned pointers";
    return st;
  }
  size_t smem = 0;
  int grid = 0;
  st = detail::persistent_grid(reinterpret_cast<const void*>(copy_kernel), 1024, &smem, sm_budget, guard.sm_count(),
                               ~0ull, &grid);
  if (!st.ok()) return st;
  copy_kernel<<<grid, 1024, smem, cudaStream_t(stream)>>>(static_cast<uint8_t*>(dst), static_cast<const uint8_t*>(src),
                                                           nbytes);
  return detail::check_launch("copy kernel");
}

}  // namespace gpu
}  // namespace tzip
