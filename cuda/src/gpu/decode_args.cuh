// The decoder's descriptors, arguments and error keys, shared by decode.cu (parse, scan, errors kernels and the host
// side) and the decode kernels (decode_kernel.cuh, instantiated by decode_k0.cu to decode_k4.cu).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "gpu/codec.h"
#include "tzip/async_copy.h"
#include "tzip/bitpack.h"
#include "tzip/format.h"
#include "tzip/rans.h"
#include "tzip/warp.h"
#include "tzip/xxhash32.h"

namespace tzip {
namespace gpu {
namespace dec {

using namespace tzip::dev;

// ---------------------------------------------------------------- descriptors and errors

struct DecTensor {
  const uint8_t* frame;
  uint64_t frame_len;
  uint8_t* out;
  uint64_t out_len;
  // filled by parse_kernel
  uint64_t nbytes, header_bytes, payload_bytes;
  uint32_t n_chunks, chunk_bytes, n_dec, checksum;
  uint8_t dtype, codec, ndim, header_ok, cls, pad[3];
};

// 0 all chunks, 1 fast/raw, 2 max/bytes, 3 bf16 fast, 4 bf16 max (3 and 4: Tuning::bf16_kernel)
constexpr uint32_t kClasses = 5;
/// A batch's error keys (8 bytes a frame) up to this size go up with its descriptors instead of a memset (decode()).
constexpr size_t kInitUploadBytes = size_t(64) << 10;
constexpr uint32_t kVerifyTasks = 2;  // per frame, in its class: header digest, frame checksum (verify_task)
/// Ticket counter of a decode kernel (MODE = its class; 0 the fallback queue); [3] is the queue length.
__host__ __device__ constexpr uint32_t ticket_of(int mode) {
  return mode == 0 ? 2 : mode == 3 ? 4 : mode == 4 ? 5 : uint32_t(mode - 1);
}

struct DecArgs {
  DecTensor* t;
  uint32_t n;
  uint32_t verify;
  unsigned long long* err;      // per frame: lowest error key, ~0 when none
  uint64_t* base[kClasses];     // per class: n + 1 prefix sums of task counts (class 0: chunk counts)
  unsigned long long* tickets;  // ticket_of(class); [3] queue length
  unsigned long long* queue;    // deferred chunks: frame << 32 | chunk
  unsigned long long* queue_len;
  uint64_t queue_cap;
  int32_t* errors;              // caller's array
  uint32_t debug;               // Tuning::debug: print each rejected chunk
  uint32_t bf16_class;          // Tuning::bf16_kernel: bf16 fast frames go to class 3, bf16 max frames to class 4
  uint32_t ring_pairs;          // Tuning::ring_pairs: class 3 fills its ring two tiles at a time
  uint32_t warps;               // Tuning::decode_warps: warps per block of the class kernels (0: the class's own)
};

/// The decode kernels of classes 0 to 4, each in its own translation unit (decode_k0.cu to decode_k4.cu, instances of
/// decode_kernel.cuh) so that they compile in parallel. Each launches its kernel on the stream.
Status run_part0(const DecArgs& a, int sm_budget, int sm_count, cudaStream_t s, uint32_t tile_ok, uint32_t defer_all);
Status run_part1(const DecArgs& a, int sm_budget, int sm_count, cudaStream_t s, uint32_t tile_ok, uint32_t defer_all);
Status run_part2(const DecArgs& a, int sm_budget, int sm_count, cudaStream_t s, uint32_t tile_ok, uint32_t defer_all);
Status run_part3(const DecArgs& a, int sm_budget, int sm_count, cudaStream_t s, uint32_t tile_ok, uint32_t defer_all);
Status run_part4(const DecArgs& a, int sm_budget, int sm_count, cudaStream_t s, uint32_t tile_ok, uint32_t defer_all);

namespace {


// Error keys: the CPU's order of checks (rank), then the chunk index, then decode-before-checksum.
enum Rank : uint32_t {
  kRTruncFixed = 1, kRMagic, kRVersion0, kRVersionNew, kRDtype, kRCodec, kRNormalize, kRNdim, kRReserved,
  kRChunkSize, kRNumChunks, kRTruncShape, kRShapePad, kRShape, kRPayload, kRTruncTable, kRHeaderDigest, kRTable, kRPayloadSum,
  kRChecksum, kRTruncFrame, kRTrailing, kROutLen, kRChunk = 100
};
__host__ __device__ constexpr unsigned long long err_key(uint32_t rank, uint64_t chunk, uint32_t sub, int32_t code) {
  return (static_cast<unsigned long long>(rank) << 56) | (static_cast<unsigned long long>(chunk) << 16) |
         (static_cast<unsigned long long>(sub) << 8) | static_cast<unsigned long long>(code);
}
__device__ __forceinline__ void report(const DecArgs& a, uint32_t t, unsigned long long key) { atomicMin(a.err + t, key); }

__device__ __forceinline__ uint64_t ld_le64u(const uint8_t* p) {
  if ((reinterpret_cast<uintptr_t>(p) & 7) == 0) return *reinterpret_cast<const uint64_t*>(p);
  return uint64_t(ld_bytes_le(p, 4)) | (uint64_t(ld_bytes_le(p + 4, 4)) << 32);
}
__device__ __forceinline__ uint32_t ld_le32u(const uint8_t* p) {
  if ((reinterpret_cast<uintptr_t>(p) & 3) == 0) return *reinterpret_cast<const uint32_t*>(p);
  return ld_bytes_le(p, 4);
}
__device__ __forceinline__ uint32_t ld_le16u(const uint8_t* p) {
  if ((reinterpret_cast<uintptr_t>(p) & 1) == 0) return *reinterpret_cast<const uint16_t*>(p);
  return uint32_t(p[0]) | (uint32_t(p[1]) << 8);
}

__device__ __forceinline__ uint32_t find_frame(const uint64_t* base, uint32_t n, uint64_t c) {
  uint32_t lo = 0, hi = n;  // last frame with base <= c (frames without chunks share the next base)
  while (hi - lo > 1) {
    const uint32_t mid = (lo + hi) >> 1;
    if (base[mid] <= c) lo = mid;
    else hi = mid;
  }
  return lo;
}

}  // namespace
}  // namespace dec
}  // namespace gpu
}  // namespace tzip
