// What the GPU encoder's kernels share (encode.cu: the general encoder and the launch sequence; encode_fast.cu: the
// fast/raw encoder): the batch descriptors, chunk tickets and the decoupled look-back that places each chunk.
//
// A batch's chunks are split between two encoders by tensor: a tensor whose codec is fast (a split float) or raw and
// whose input and frame are 16-byte aligned goes to the fast encoder (encode_fast.cu: fast_plan_kernel, then
// fast_code_kernel), every other tensor to encode_kernel. Each kernel draws chunk tickets from the same global
// numbering (each its own counter) and skips the rest of a tensor it does not take at once (atomicMax past it), so
// every chunk is planned and coded once, and a tensor's chunks are drawn in order: the look-back of chunk i only ever
// waits for chunk i - 1, drawn earlier by a running block.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "gpu/codec.h"
#include "tzip/format.h"
#include "tzip/warp.h"

namespace tzip {
namespace gpu {
namespace enc {

struct EncTensor {
  const uint8_t* in;
  uint8_t* out;              // frame
  uint64_t nbytes;
  uint64_t chunk_base;       // global index of the tensor's first chunk
  uint64_t header_bytes;
  uint64_t shape_off;        // index of shape[0] in EncArgs::shapes
  uint32_t n_chunks;
  uint32_t auto_slot;        // index into the auto histograms (auto tensors only)
  uint8_t dtype, codec, ndim, is_auto;
  uint8_t aligned;           // input and frame 16-byte aligned (the fast encoder may take the tensor)
  uint8_t pad[3];
};

/// Ticket counters (EncArgs::tickets).
enum Ticket : uint32_t { kTicketEncode = 0, kTicketAutoHist = 1, kTicketPlan = 2, kTicketCode = 3 };  // + CodeKind

/// The fast encoder's coding kernels, one per kind of tensor (each its own register budget and ticket counter):
/// raw tensors of any dtype, and `fast` tensors by float family.
enum CodeKind : uint32_t { kCodeRaw = 0, kCodeBF16 = 1, kCodeF16 = 2, kCodeF32 = 3, kNumCodeKinds = 4 };
constexpr uint32_t kNumTickets = kTicketCode + kNumCodeKinds;  // EncArgs::tickets holds this many counters
__host__ __device__ inline uint32_t code_kind(uint8_t dtype, uint8_t codec) {
  if (codec == uint8_t(Codec::RAW)) return kCodeRaw;
  return Dtype(dtype) == Dtype::BF16 ? kCodeBF16 : Dtype(dtype) == Dtype::F16 ? kCodeF16 : kCodeF32;
}

/// What fast_plan_kernel decided for one chunk of a `fast` tensor, for fast_code_kernel (EncArgs::plans): the stored
/// size, whether it is stored raw, and per stream the mode, param, section bytes and section offset (docs/format.md,
/// sections 6-8); for a LUT exponent stream the code width k, the exceptions and the LUT (the first n_lut ranked
/// symbols, then zeros). 192 bytes, read by one warp as 12 16-byte loads.
struct __align__(16) FastPlan {
  uint32_t size, n_exc;
  uint8_t raw, k, n_lut, pad0;
  uint8_t mode[4], param[4];
  uint32_t bytes[4], sec[4];
  uint8_t pad1[12];
  uint8_t lut[128];
};
static_assert(sizeof(FastPlan) == 192, "FastPlan is 12 16-byte vectors");

struct EncArgs {
  EncTensor* tensors;
  const uint64_t* shapes;
  uint32_t n_tensors;
  uint32_t chunk_bytes;
  uint64_t total_chunks;
  unsigned long long* tickets;    // kNumTickets counters: Ticket (+ CodeKind for kTicketCode)
  unsigned long long* status;     // look-back words, one per chunk
  unsigned long long* offsets;    // final payload offset of each chunk
  uint32_t* sizes;                // stored size of each chunk
  uint32_t* digests;              // chunk digest of each chunk's input (format version 2)
  unsigned long long* auto_hist;  // 256 per auto tensor
  uint64_t* frame_bytes;          // caller's array
  FastPlan* plans;                // one per chunk when the batch has `fast` tensors for the fast encoder
  uint32_t use_fast;              // Tuning::fast_encoder: the fast encoder takes its tensors
};

/// Whether the fast encoder codes this tensor (once "auto" is resolved on the device).
__device__ __forceinline__ bool fast_kernel_takes(const EncArgs& a, const EncTensor& t) {
  return a.use_fast && t.aligned && (t.codec == uint8_t(Codec::FAST) || t.codec == uint8_t(Codec::RAW));
}

/// Which chunks a kernel draws: encode_kernel's (kGeneral), those of the fast encoder's `fast` tensors (kFastCoded:
/// fast_plan_kernel; raw tensors need no plan), or the fast encoder's of one CodeKind (kCode + kind:
/// fast_code_kernel).
enum class Share : uint32_t { kGeneral = 0, kFastCoded = 1, kCode = 2 };
__device__ __forceinline__ bool share_takes(const EncArgs& a, const EncTensor& t, uint32_t s) {
  const bool fast = fast_kernel_takes(a, t);
  if (s == uint32_t(Share::kGeneral)) return !fast;
  if (s == uint32_t(Share::kFastCoded)) return fast && t.codec == uint8_t(Codec::FAST);
  return fast && code_kind(t.dtype, t.codec) == s - uint32_t(Share::kCode);
}

/// Chunk g of tensor T: its index in the tensor, the offset of its first byte in the tensor, its length in bytes
/// (chunk_bytes, or fewer for the tensor's last chunk).
struct ChunkSpan {
  uint32_t index, len;
  uint64_t begin;
};
__device__ __forceinline__ ChunkSpan chunk_span(const EncArgs& a, const EncTensor& T, uint64_t g) {
  const uint32_t index = uint32_t(g - T.chunk_base);
  const uint64_t begin = uint64_t(index) * a.chunk_bytes;
  return ChunkSpan{index, uint32_t(tzip::dev::umin64(a.chunk_bytes, T.nbytes - begin)), begin};
}

__device__ __forceinline__ uint32_t find_tensor(const EncTensor* t, uint32_t n, uint64_t g) {
  uint32_t lo = 0, hi = n;  // last tensor with chunk_base <= g and g < base + n_chunks
  while (hi - lo > 1) {
    const uint32_t mid = (lo + hi) >> 1;
    if (t[mid].chunk_base <= g) lo = mid;
    else hi = mid;
  }
  return lo;  // empty tensors share the base of the next one, so the last base <= g is the owner
}

/// Draws the next chunk of share S (a Share, plus the CodeKind for kCode), skipping the tensors it does not take.
/// Returns a value >= total_chunks when none is left; *tensor is the chunk's tensor.
template <uint32_t S>
__device__ uint64_t draw_chunk(const EncArgs& a, unsigned long long* ticket, uint32_t* tensor) {
  for (;;) {
    const unsigned long long g = atomicAdd(ticket, 1ull);
    if (g >= a.total_chunks) return g;
    const uint32_t t = find_tensor(a.tensors, a.n_tensors, g);
    const EncTensor& T = a.tensors[t];
    if (share_takes(a, T, S)) {
      *tensor = t;
      return g;
    }
    atomicMax(ticket, static_cast<unsigned long long>(T.chunk_base + T.n_chunks));
  }
}

/// Decoupled look-back, one warp (every lane calls it; every lane gets the result): publishes the chunk's stored size
/// and returns its payload offset (the sum of the 16-aligned sizes of the tensor's earlier chunks). `i` is the chunk's
/// index in its tensor, `g` the global one. The predecessors' status words are read 32 at a time, so a walk past
/// chunks that have only published their own size costs one round trip to L2 per 32 of them, not one per chunk.
__device__ inline uint64_t warp_look_back(const EncArgs& a, uint64_t g, uint32_t i, uint32_t size) {
  using namespace tzip::dev;
  constexpr unsigned long long kAgg = 1ull << 62, kIncl = 2ull << 62, kMask = (1ull << 62) - 1;
  const uint32_t lane = lane_id();
  const unsigned long long agg = align16(size);
  if (i == 0) {
    if (lane == 0) st_relaxed(a.status + g, kIncl | agg);
    return 0;
  }
  if (lane == 0) st_relaxed(a.status + g, kAgg | agg);
  const uint64_t first = g - i;  // the tensor's chunk 0, which always publishes an inclusive prefix
  uint64_t excl = 0;
  uint64_t top = g - 1;
  for (;;) {
    const bool in = top >= first + lane;  // lane l looks at chunk top - l
    const uint64_t idx = in ? top - lane : first;
    unsigned long long s = in ? ld_relaxed(a.status + idx) : kIncl;
    while (__any_sync(kFull, (s >> 62) == 0)) {
      __nanosleep(32);
      if ((s >> 62) == 0) s = ld_relaxed(a.status + idx);
    }
    const uint32_t incl = __ballot_sync(kFull, in && (s >> 62) == 2);
    if (incl) {
      const uint32_t upto = __ffs(incl) - 1;  // the nearest predecessor that knows its inclusive prefix
      excl += warp_sum(lane <= upto ? (s & kMask) : 0ull);
      break;
    }
    excl += warp_sum(in ? (s & kMask) : 0ull);
    top -= 32;
  }
  if (lane == 0) st_relaxed(a.status + g, kIncl | (excl + agg));
  return excl;
}

/// Writes a coded chunk's 8-byte header at dst: kind, stream count, element count (docs/format.md, section 6).
__device__ __forceinline__ void put_chunk_header(uint8_t* dst, uint32_t n_streams, uint32_t n) {
  dst[0] = kChunkKindCoded;
  dst[1] = uint8_t(n_streams);
  dst[2] = 0;
  dst[3] = 0;
  tzip::dev::st_bytes(dst + 4, n, 4);
}
/// Writes stream j's 8-byte descriptor (mode, param, section bytes) after the header of the coded chunk at dst.
__device__ __forceinline__ void put_descriptor(uint8_t* dst, uint32_t j, uint32_t mode, uint32_t param, uint32_t bytes) {
  uint8_t* d = dst + kChunkHeaderBytes + kStreamDescriptorBytes * j;
  d[0] = uint8_t(mode);
  d[1] = uint8_t(param);
  d[2] = 0;
  d[3] = 0;
  tzip::dev::st_bytes(d + 4, bytes, 4);
}

/// Named barrier over `threads` threads (a multiple of 32) of the block.
__device__ __forceinline__ void named_sync(uint32_t bar, uint32_t threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(bar), "r"(threads) : "memory");
}

/// Copies `n` bytes with THREADS threads (tid in [0, THREADS)): 16-byte vectors when both sides are 16-byte aligned,
/// bytes otherwise.
template <uint32_t THREADS>
__device__ inline void threads_copy(uint8_t* dst, const uint8_t* src, uint32_t n, uint32_t tid) {
  if (tzip::dev::aligned16(dst) && tzip::dev::aligned16(src)) {
    const uint32_t nv = n / 16;
    for (uint32_t v = tid; v < nv; v += THREADS)
      reinterpret_cast<uint4*>(dst)[v] = reinterpret_cast<const uint4*>(src)[v];
    for (uint32_t b = nv * 16 + tid; b < n; b += THREADS) dst[b] = src[b];
  } else {
    for (uint32_t b = tid; b < n; b += THREADS) dst[b] = src[b];
  }
}

/// Launches the fast encoder (encode_fast.cu: fast_plan_kernel, then fast_code_kernel for each CodeKind whose bit is
/// set in `kinds`) on the batch: grids sized by the SM budget.
Status launch_fast_encode(const EncArgs& a, uint32_t kinds, int sm_budget, int sm_count, cudaStream_t s);

}  // namespace enc
}  // namespace gpu
}  // namespace tzip
