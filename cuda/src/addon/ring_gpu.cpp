// The GPU side of a submission ring (addon/ring_gpu.h).
#include "addon/ring_gpu.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <optional>
#include <thread>
#include <vector>

#include "addon/coded_error.h"
#include "addon/device.h"
#include "gpu/codec.h"
#include "gpu/gather.h"
#include "gpu/graph.h"
#include "gpu/scratch.h"
#include "tzip/format.h"

namespace tzip::addon {

namespace {

using ring::Cqe;
using ring::Resolved;
using ring::Sqe;

using Clock = std::chrono::steady_clock;

/// A CUDA failure as a CQE's status and message.
void cuda_failure(cudaError_t e, const char* what, int32_t* status, std::string* message) {
  cudaGetLastError();
  *status = e == cudaErrorMemoryAllocation ? ring::kOutOfMemory : ring::kCuda;
  *message = std::string(what) + ": " + cudaGetErrorName(e);
}

void gpu_failure(const gpu::Status& st, int32_t* status, std::string* message) {
  const std::string name = cuda_error_name_of_text(st.message);
  if (st.code == gpu::kCudaError || st.code == gpu::kOutOfMemory) {
    *status = st.code == gpu::kOutOfMemory || name == "cudaErrorMemoryAllocation" ? ring::kOutOfMemory : ring::kCuda;
    *message = "GPU codec: " + (name.empty() ? st.message : name);
  } else {
    *status = int32_t(from_gpu(st.code));
    *message = "GPU codec: " + st.message;
  }
}

}  // namespace

/// Result bytes of the batches whose results go into the ring's own page-locked buffer (8 compress results are 72).
constexpr size_t kOwnResultBytes = 4096;

struct RingGpu::Impl {
  cudaStream_t stream = nullptr;
  cudaEvent_t done = nullptr;  // recorded after a batch's work
  // The results of small batches: one mapped page-locked buffer of the ring's own, so that their CUDA graphs
  // (gpu/graph.h), keyed by the result pointer among others, see the same one every time (the pool's buffers
  // rotate). Null when it could not be made, or after a failed batch (a write into it may still be pending).
  void* own_results = nullptr;
  void* own_results_dev = nullptr;

  /// Waits for `done`: polls for gpu_spin_us() (device.h), then sleeps in growing steps (at most 1 ms). The batch's
  /// work must finish (it reads and writes the client's regions) before its regions may be released, so a stop does
  /// not cut it short.
  cudaError_t wait_done() {
    const Clock::time_point spin_until = Clock::now() + std::chrono::microseconds(gpu_spin_us());
    std::chrono::microseconds step(20);
    for (;;) {
      const cudaError_t e = cudaEventQuery(done);
      if (e != cudaErrorNotReady) return e;
      if (Clock::now() < spin_until) continue;
      std::this_thread::sleep_for(step);
      step = std::min(step * 2, std::chrono::microseconds(1000));
    }
  }
};

RingGpu::RingGpu(int device) : device_(device) {
  require_gpu();
  check_device(device);
  DeviceScope scope(device);
  auto* impl = new Impl;
  try {
    cuda_check(cudaStreamCreateWithFlags(&impl->stream, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
    gpu::keep_scratch(impl->stream);
    cuda_check(cudaEventCreateWithFlags(&impl->done, cudaEventDisableTiming), "cudaEventCreateWithFlags");
    if (cudaHostAlloc(&impl->own_results, kOwnResultBytes, cudaHostAllocPortable | cudaHostAllocMapped) != cudaSuccess ||
        cudaHostGetDevicePointer(&impl->own_results_dev, impl->own_results, 0) != cudaSuccess) {
      cudaGetLastError();  // (the pool's buffers then, as for larger batches)
      if (impl->own_results) cudaFreeHost(impl->own_results);
      impl->own_results = impl->own_results_dev = nullptr;
    }
  } catch (...) {
    if (impl->done) cudaEventDestroy(impl->done);
    if (impl->stream) {
      gpu::release_scratch(impl->stream);
      cudaStreamDestroy(impl->stream);
    }
    delete impl;
    throw;
  }
  impl_ = impl;
}

RingGpu::~RingGpu() {
  try {
    DeviceScope scope(device_);
    cudaStreamSynchronize(impl_->stream);
    gpu::release_graphs(impl_->stream);
    gpu::release_scratch(impl_->stream);
    cudaStreamSynchronize(impl_->stream);
    if (impl_->own_results) cudaFreeHost(impl_->own_results);
    cudaEventDestroy(impl_->done);
    cudaStreamDestroy(impl_->stream);
    cudaGetLastError();
  } catch (...) {
    // Teardown: nothing to report to.
  }
  delete impl_;
}

void RingGpu::bind_thread() {
  if (cudaSetDevice(device_) != cudaSuccess) cudaGetLastError();
}

void RingGpu::run(const Sqe* sqes, const Resolved* res, size_t n, int sm_budget, Cqe* out) {
  Impl& g = *impl_;
  const Clock::time_point t_start = Clock::now();
  const bool encode = sqes[0].op == ring::kCompress;
  int32_t status = ring::kOk;  // a failure of the whole batch
  std::string message;

  std::vector<gpu::EncodeItem> enc;
  std::vector<gpu::DecodeItem> dec;
  std::vector<size_t> on_device;  // compress items whose codec the device picks
  std::vector<gpu::FrameSpan> spans;
  bool verify = false;
  if (encode) {
    enc.resize(n);
    for (size_t i = 0; i < n; ++i) {
      const Sqe& s = sqes[i];
      gpu::EncodeItem& it = enc[i];
      it.data = reinterpret_cast<const void*>(static_cast<uintptr_t>(res[i].src));
      it.nbytes = s.src_bytes;
      it.dtype = s.dtype;
      it.codec = s.codec;
      it.ndim = s.ndim;
      it.shape = s.shape;
      it.frame = reinterpret_cast<void*>(static_cast<uintptr_t>(res[i].dst));
      out[i].codec = ring::known_frame_codec(s.codec, s.dtype, s.src_bytes);
      if (out[i].codec == ring::kCodecAuto) {
        on_device.push_back(i);
        spans.push_back(gpu::FrameSpan{it.frame, s.dst_bytes});  // dst_bytes >= the 48-byte fixed header
      }
    }
  } else {
    dec.resize(n);
    for (size_t i = 0; i < n; ++i) {
      gpu::DecodeItem& it = dec[i];
      it.frame = reinterpret_cast<const void*>(static_cast<uintptr_t>(res[i].src));
      it.frame_bytes = sqes[i].src_bytes;
      it.out = reinterpret_cast<void*>(static_cast<uintptr_t>(res[i].dst));
      it.out_bytes = sqes[i].dst_bytes;
      verify = verify || (sqes[i].flags & ring::kVerify);
    }
  }
  // Results: n frame sizes (u64) and a codec byte per on_device item, or n error codes (i32). The kernels write them
  // straight into the page-locked buffer through its device address (plain stores, read here once `done` is
  // reached): no device scratch and no copy back, two stream operations and an allocation fewer per batch. Where the
  // buffer has no device address, into device scratch and copied back, as before.
  const size_t result_bytes = encode ? 8 * n + on_device.size() : 4 * n;
  const bool own = g.own_results && result_bytes <= kOwnResultBytes;
  std::optional<PinnedBuffer> pooled;
  if (!own) pooled.emplace(result_bytes);
  void* const host_results = own ? g.own_results : pooled->data();
  void* d_results = own ? g.own_results_dev : nullptr;
  bool copy_queued = false;
  bool mapped = own || cudaHostGetDevicePointer(&d_results, host_results, 0) == cudaSuccess;
  if (!mapped) {
    cudaGetLastError();
    d_results = nullptr;
    const gpu::Status st = gpu::scratch_alloc(&d_results, result_bytes, g.stream);
    if (!st.ok()) gpu_failure(st, &status, &message);
  }
  const Clock::time_point t_codec = Clock::now();
  if (status == ring::kOk) {
    gpu::Status st;
    if (encode) {
      gpu::EncodeOptions eo;
      eo.chunk_bytes = kDefaultChunkBytes;
      eo.sm_budget = sm_budget;
      eo.stream = g.stream;
      eo.device = device_;  // the regions were checked to be device memory of the ring's device when registered
      eo.graphs = ring_graphs();  // this thread waits for each batch before it takes the next (gpu/graph.h)
      st = gpu::encode(enc.data(), n, eo, static_cast<uint64_t*>(d_results));
      if (st.ok() && !spans.empty())
        st = gpu::gather_frame_bytes(spans.data(), spans.size(), kOffCodec, 1,
                                     static_cast<uint8_t*>(d_results) + 8 * n, sm_budget, g.stream);
    } else {
      gpu::DecodeOptions dopt;
      dopt.sm_budget = sm_budget;
      dopt.verify = verify;
      dopt.stream = g.stream;
      dopt.device = device_;  // as for encode
      dopt.graphs = ring_graphs();
      st = gpu::decode(dec.data(), n, dopt, static_cast<int32_t*>(d_results));
    }
    if (!st.ok()) gpu_failure(st, &status, &message);
  }
  codec_us_ = std::chrono::duration<double, std::micro>(Clock::now() - t_codec).count();
  if (status == ring::kOk && mapped) {
    copy_queued = true;  // written in place by the kernels
  } else if (status == ring::kOk) {
    const cudaError_t e = cudaMemcpyAsync(host_results, d_results, result_bytes, cudaMemcpyDeviceToHost, g.stream);
    copy_queued = e == cudaSuccess;
    if (!copy_queued) cuda_failure(e, "cudaMemcpyAsync", &status, &message);
  }
  if (d_results && !mapped) gpu::scratch_free(d_results, g.stream);
  // Wait for everything queued (the codec may have launched some kernels before one failed): the regions must not be
  // released, nor the pinned buffer reused, while it runs.
  cudaError_t e = cudaEventRecord(g.done, g.stream);
  const Clock::time_point t_queued = Clock::now();
  if (e == cudaSuccess) e = g.wait_done();
  else e = cudaStreamSynchronize(g.stream);
  const Clock::time_point t_done = Clock::now();
  enqueue_us_ = std::chrono::duration<double, std::micro>(t_queued - t_start).count();
  wait_us_ = std::chrono::duration<double, std::micro>(t_done - t_queued).count();
  if (e != cudaSuccess) {
    if (own) g.own_results = g.own_results_dev = nullptr;  // never reused (nor freed: a write may still be pending)
    else pooled->poison();
    if (status == ring::kOk) cuda_failure(e, "GPU batch", &status, &message);
  }
  for (size_t i = 0; i < n; ++i) {
    out[i].user_data = sqes[i].user_data;
    out[i].status = status;
    out[i].message = message;
    out[i].result = 0;
  }
  if (status != ring::kOk || !copy_queued) {
    for (size_t i = 0; i < n; ++i) out[i].codec = 0;
    return;
  }
  const auto* bytes = static_cast<const uint8_t*>(host_results);
  if (encode) {
    for (size_t i = 0; i < n; ++i) {
      uint64_t sz = 0;
      std::memcpy(&sz, bytes + 8 * i, 8);
      out[i].result = sz;
    }
    for (size_t k = 0; k < on_device.size(); ++k) {
      const size_t i = on_device[k];
      const uint8_t c = bytes[8 * n + k];
      if (c != uint8_t(Codec::FAST) && c != uint8_t(Codec::MAX)) {
        // The encoder resolves auto on a float tensor to fast or max: the frame's memory was changed meanwhile.
        out[i].status = ring::kCorrupt;
        out[i].message = "frame memory changed during the encode";
        out[i].result = 0;
        out[i].codec = 0;
      } else {
        out[i].codec = c;
      }
    }
  } else {
    for (size_t i = 0; i < n; ++i) {
      int32_t code = 0;
      std::memcpy(&code, bytes + 4 * i, 4);
      out[i].codec = 0;
      if (code == gpu::kOk) {
        out[i].result = sqes[i].dst_bytes;
      } else {
        out[i].status = int32_t(from_gpu(code));
        out[i].message = std::string("GPU decode: ") + tzip::error_code_name(tzip::ErrorCode(out[i].status));
      }
    }
  }
}

}  // namespace tzip::addon
