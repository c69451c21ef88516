// gather_frame_bytes (gpu/gather.h): one small kernel; each thread gathers bytes j, j + stride, ... of the output
// (a grid-stride loop, eight independent loads in flight), so a batch of frames costs one launch and no host wait.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "gpu/gather.h"
#include "gpu/scratch.h"

namespace tzip {
namespace gpu {

namespace {

static_assert(sizeof(FrameSpan) == 16, "FrameSpan is copied to the device as is");

constexpr int kThreads = 1024;
constexpr int kUnroll = 8;  // independent loads in flight per thread: the grid is small (at most sm_budget blocks)

/// out[j] for j < total: byte offset + j % width of frame j / width, or 0 past the end of that frame.
__global__ void __launch_bounds__(kThreads) gather_kernel(const FrameSpan* spans, uint32_t total, uint64_t offset,
                                                          uint32_t width, uint8_t* out) {
  const uint64_t stride = uint64_t(gridDim.x) * blockDim.x;
  for (uint64_t base = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x; base < total; base += stride * kUnroll) {
    uint8_t v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint64_t j = base + u * stride;
      v[u] = 0;
      if (j < total) {
        const uint32_t i = uint32_t(j) / width, k = uint32_t(j) - i * width;
        const FrameSpan s = spans[i];
        // offset + k < s.bytes, written so that it cannot wrap.
        if (k < s.bytes && offset < s.bytes - k) v[u] = static_cast<const uint8_t*>(s.frame)[offset + k];
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint64_t j = base + u * stride;
      if (j < total) out[j] = v[u];
    }
  }
}

Status fail(int32_t code, const std::string& message) {
  Status s;
  s.code = code;
  s.message = message;
  return s;
}

}  // namespace

Status gather_frame_bytes(const FrameSpan* frames, size_t count, uint64_t offset, uint32_t width, uint8_t* d_out,
                          int sm_budget, void* stream) {
  if (count == 0) return Status{};
  if (width == 0) return fail(kInvalidArgument, "gather_frame_bytes: width 0");
  if (!frames || !d_out) return fail(kInvalidArgument, "gather_frame_bytes: null spans or output");
  if (count > UINT32_MAX / width) return fail(kInvalidArgument, "gather_frame_bytes: more than 2^32 - 1 bytes to gather");
  for (size_t i = 0; i < count; ++i)
    if (!frames[i].frame && frames[i].bytes)
      return fail(kInvalidArgument, "gather_frame_bytes: span " + std::to_string(i) + " is a null pointer with bytes");

  int dev = 0, sms = 1;
  cudaError_t e = cudaGetDevice(&dev);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return fail(kCudaError, std::string("gather_frame_bytes: ") + cudaGetErrorString(e));
  }
  // At most `budget` blocks: however they are placed, they cannot occupy more SMs than the budget.
  const int budget = sm_budget <= 0 ? sms : std::min(sm_budget, sms);
  const uint32_t total = uint32_t(count * width);
  const uint64_t per_block = uint64_t(kThreads) * kUnroll;
  const int grid = int(std::max<uint64_t>(1, std::min<uint64_t>(uint64_t(budget), (total + per_block - 1) / per_block)));

  void* d_spans = nullptr;
  Status st = scratch_alloc(&d_spans, sizeof(FrameSpan) * count, stream);
  if (!st.ok()) return st;
  st = detail::upload(d_spans, frames, sizeof(FrameSpan) * count, stream);
  if (st.ok()) {
    gather_kernel<<<grid, kThreads, 0, cudaStream_t(stream)>>>(static_cast<const FrameSpan*>(d_spans), total, offset,
                                                               width, d_out);
    st = detail::check_launch("gather_kernel");
  }
  scratch_free(d_spans, stream);
  return st;
}

}  // namespace gpu
}  // namespace tzip
