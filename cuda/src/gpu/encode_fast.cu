// fast_encode_kernel: the GPU encoder of `fast` (bf16, fp16, fp32) and `raw` tensors whose input and frame are 16-byte
// aligned. The same bytes as the CPU's encode_chunk (chunk_codec.cpp) and as encode_kernel; one read of the input
// from device memory, no second kernel for digests, chunks written straight to their final offsets.
//
// A block is kGroups independent groups, each coding one chunk at a time (persistent, atomic tickets), so that one
// group's serial steps (planning, the look-back) overlap with the other's streaming. Per chunk, a group:
//   1. has the chunk copied into its shared memory by the copy engine (one bulk copy, completing on an mbarrier);
//   2. hashes it (the chunk digest, format version 2) in its digest warp while its 12 worker warps build the exponent
//      histogram (32 lane-private replicas of each bin: atomics of one warp never collide) and test the other streams
//      for a constant value;
//   3. takes the CPU's decisions for the exponent stream (CONST / RAW / LUT with the (count desc, symbol asc) ranking,
//      computed as each present symbol's rank among the present ones, and the best code width k), lays out the chunk,
//      and places it with the decoupled look-back;
//   4. writes it: per 8 elements, one lane codes the exponents (a table lookup each, packed to k bits, staged per warp
//      so that every store to device memory is 16 bytes wide and coalesced) and stores the other streams' bytes;
//      escapes are flagged per 8 elements and, after a scan of the flags, written in element order into shared memory
//      and copied out in one coalesced pass.
#include <cuda_runtime.h>

#include <cstdint>

#include "gpu/codec.h"
#include "gpu/encode_args.cuh"
#include "tzip/async_copy.h"
#include "tzip/bitpack.h"
#include "tzip/format.h"
#include "tzip/warp.h"
#include "tzip/xxhash32.h"

namespace tzip {
namespace gpu {
namespace enc {
namespace {

using namespace tzip::dev;

constexpr uint32_t kGroups = 2;
constexpr uint32_t kWorkers = 12;                      // worker warps of a group (14: no faster, 16: over 1024 threads)
constexpr uint32_t kWorkerThreads = 32 * kWorkers;     // 384, at least one thread per exponent bin when planning
constexpr uint32_t kGroupThreads = kWorkerThreads + 32;  // and the digest warp
constexpr uint32_t kBlockThreads = kGroups * kGroupThreads;
constexpr uint32_t kReplicas = 32;                     // histogram replicas: one per lane
constexpr uint32_t kLaneElems = 8;                     // elements per lane step (8 k-bit codes = k bytes)

struct StreamPlan {
  uint32_t mode, param, bytes, sec;
};

struct __align__(16) GroupSmem {
  uint8_t chunk[kMaxChunkBytes];             // the chunk's input
  uint8_t escmask[kMaxChunkBytes / 16];      // per 8 elements: which are escapes (bit i: element 8 q + i)
  uint32_t keys[256];                        // present symbols' (count << 8 | 255 - symbol), compacted
  uint32_t sorted[128];                      // counts of the present symbols by rank (the first 128 ranks)
  uint8_t code_of[256];                      // exponent -> LUT code
  uint8_t lut[128];                          // rank -> exponent
  uint8_t stage[kWorkers][256];              // per worker warp: packed output of one warp step
  uint32_t wsum[kWorkers];
  StreamPlan plan[4];
  unsigned long long offset;                 // payload offset of the chunk
  unsigned long long g;                      // global chunk index (>= total: no more work)
  uint32_t tensor, index, raw_len, diff, raw, size, k, n_exc;
  uint64_t bar;                              // mbarrier of the bulk copy
};

constexpr uint32_t kHistWords = 256 * kReplicas;   // 32 KiB per group: bin e, replica r at word 32 e + r
constexpr uint32_t kHistGroupShift = 15;           // group g's histogram at byte g << 15 of BlockSmem::hist

/// The block's shared memory. Both groups' histograms come first, 32 KiB apart, so that a bin's byte offset (bits
/// 7..14), a lane's replica (bits 2..6) and the group (bit 15) combine with one OR and the base folds into the
/// instruction's immediate: one LOP3 per atomic or lookup address instead of a LOP3 and an add.
struct __align__(128) BlockSmem {
  uint32_t hist[kGroups][kHistWords];        // per group: the histogram; then the code table; then exception staging
  GroupSmem grp[kGroups];
};
static_assert(sizeof(uint32_t) * kHistWords == (1u << kHistGroupShift), "group histograms 32 KiB apart");

extern __shared__ __align__(128) unsigned char smem_raw[];
/// Bytes of both groups' histograms (a constant address: its offsets fold into shared-memory instructions).
__device__ __forceinline__ uint8_t* hist_bytes() { return reinterpret_cast<uint8_t*>(reinterpret_cast<BlockSmem*>(smem_raw)->hist); }

__device__ __forceinline__ uint32_t warp_id_in_group(uint32_t tid) { return tid / 32; }

/// Bytes of a family's element, streams and symbol widths (fast codec).
template <uint32_t FID> struct Fast;
template <> struct Fast<kFamBF16> {
  static constexpr uint32_t kEsize = 2, kStreams = 2, kEBits = 8, kBins = 256;
  __host__ __device__ static constexpr uint32_t width(uint32_t) { return 8; }
};
template <> struct Fast<kFamF16> {
  static constexpr uint32_t kEsize = 2, kStreams = 3, kEBits = 5, kBins = 32;
  __host__ __device__ static constexpr uint32_t width(uint32_t j) { return j == 0 ? 5 : j == 1 ? 8 : 3; }
};
template <> struct Fast<kFamF32> {
  static constexpr uint32_t kEsize = 4, kStreams = 4, kEBits = 8, kBins = 256;
  __host__ __device__ static constexpr uint32_t width(uint32_t) { return 8; }
};

/// Byte offset in a group's histogram (bits 7..14) of bin e, for the exponent of the low / high element of a word.
template <uint32_t FID> __device__ __forceinline__ uint32_t bin_lo(uint32_t w) {
  if constexpr (FID == kFamBF16) return w & 0x7F80u;               // ((w >> 7) & 0xFF) << 7
  else if constexpr (FID == kFamF16) return (w >> 3) & 0xF80u;     // ((w >> 10) & 0x1F) << 7
  else return (w >> 16) & 0x7F80u;                                 // ((w >> 23) & 0xFF) << 7
}
template <uint32_t FID> __device__ __forceinline__ uint32_t bin_hi(uint32_t w) {
  if constexpr (FID == kFamBF16) return (w >> 16) & 0x7F80u;
  else return (w >> 19) & 0xF80u;  // F16 (F32 has one element per word)
}
/// Exponent symbol of element e of the chunk.
template <uint32_t FID> __device__ __forceinline__ uint32_t exponent_at(const uint8_t* chunk, uint32_t e) {
  if constexpr (FID == kFamF32) return (reinterpret_cast<const uint32_t*>(chunk)[e] >> 23) & 0xFFu;
  const uint32_t v = reinterpret_cast<const uint16_t*>(chunk)[e];
  if constexpr (FID == kFamBF16) return (v >> 7) & 0xFFu;
  else return (v >> 10) & 0x1Fu;
}
/// Bits of a word (holding 4 / esize elements) that belong to the residual streams R0.. (CONST test).
template <uint32_t FID> __host__ __device__ constexpr uint32_t residual_mask(uint32_t j) {
  if constexpr (FID == kFamBF16) return 0x807F807Fu;                       // s | m
  else if constexpr (FID == kFamF16) return j == 1 ? 0x00FF00FFu : 0x83008300u;  // m[7:0]; s | m[9:8]
  else return j == 1 ? 0xFFu : j == 2 ? 0xFF00u : 0x807F0000u;              // m[7:0]; m[15:8]; s | m[22:16]
}

/// Packs the 8 symbols held as the bytes of lo (elements 0..3) and hi (4..7), each < 2^bits, LSB-first.
__device__ __forceinline__ uint64_t pack8_bytes(uint32_t lo, uint32_t hi, uint32_t bits) {
  uint32_t a = 0, b = 0;
#pragma unroll
  for (uint32_t i = 0; i < 4; ++i) {
    a |= ((lo >> (8 * i)) & 0xFFu) << (bits * i);
    b |= ((hi >> (8 * i)) & 0xFFu) << (bits * i);
  }
  return uint64_t(a) | (uint64_t(b) << (4 * bits));
}

/// One warp step of a packed stream: lane l's `nb` bytes go to dst[nb * l ...]; the warp's 32 * nb bytes (of which
/// `avail` are written: the stream may end inside the step) leave through the warp's staging buffer in 16-byte stores.
/// dst is 16-byte aligned. Every lane of the warp calls it.
__device__ __forceinline__ void put_packed(uint8_t* stage, uint8_t* dst, uint64_t piece, uint32_t nb, uint32_t avail) {
  const uint32_t lane = lane_id();
  for (uint32_t b = 0; b < nb; ++b) stage[lane * nb + b] = uint8_t(piece >> (8 * b));
  __syncwarp();
  const uint32_t total = 32 * nb;
  if (avail >= total) {
    if (lane < 2 * nb) reinterpret_cast<uint4*>(dst)[lane] = reinterpret_cast<const uint4*>(stage)[lane];
  } else {
    for (uint32_t b = lane; b < avail; b += 32) dst[b] = stage[b];
  }
  __syncwarp();
}

/// Stores the low `valid` (<= 8) bytes of (lo, hi) at dst (8-byte aligned): one 8-byte store when all are valid.
__device__ __forceinline__ void put8(uint8_t* dst, uint32_t lo, uint32_t hi, uint32_t valid) {
  if (valid == 8) {
    *reinterpret_cast<uint2*>(dst) = make_uint2(lo, hi);
  } else {
    for (uint32_t b = 0; b < valid; ++b) dst[b] = uint8_t((b < 4 ? lo : hi) >> (8 * (b & 3)));
  }
}

__device__ __forceinline__ void zero_range(uint8_t* p, uint32_t n, uint32_t lane) {
  for (uint32_t b = lane; b < n; b += 32) p[b] = 0;
}

// ---------------------------------------------------------------- coding of whole warp steps

/// Residual stream j's 8 symbols of a lane step (as the bytes of two words) from its 2 * esize input words.
template <uint32_t FID, uint32_t NS>
__device__ __forceinline__ void residuals(const uint32_t* w, uint32_t (&r)[NS][2]) {
  using Split = Fam<FID>;
  constexpr uint32_t E = Fast<FID>::kEsize;
  uint32_t t[NS];
  Split::split4(w, t);
#pragma unroll
  for (uint32_t j = 1; j < NS; ++j) r[j][0] = t[j];
  Split::split4(w + E, t);
#pragma unroll
  for (uint32_t j = 1; j < NS; ++j) r[j][1] = t[j];
}

/// Code table entry: the LUT code, and bit kEscBit set when it is the escape. The bit rides along the packing of the
/// codes (where it lands above the bytes stored, see pack8_entries) and gives a lane step's 8 escape flags in one
/// shift-add chain (esc_flags) instead of a compare per element.
constexpr uint32_t kEscBit = 24;

/// Table entries of a lane step's 8 exponents, from the lane-replicated table in the group's histogram space: lane
/// l reads word 32 e + l, so every load of the warp hits a different bank. `lg` is 4 * lane | group << 15.
template <uint32_t FID>
__device__ __forceinline__ void lookup8(uint32_t lg, const uint32_t* w, uint32_t (&c)[8]) {
  const uint8_t* tab = hist_bytes();
  if constexpr (FID == kFamF32) {
#pragma unroll
    for (uint32_t i = 0; i < 8; ++i) c[i] = *reinterpret_cast<const uint32_t*>(tab + (bin_lo<FID>(w[i]) | lg));
  } else {
#pragma unroll
    for (uint32_t i = 0; i < 4; ++i) {
      c[2 * i] = *reinterpret_cast<const uint32_t*>(tab + (bin_lo<FID>(w[i]) | lg));
      c[2 * i + 1] = *reinterpret_cast<const uint32_t*>(tab + (bin_hi<FID>(w[i]) | lg));
    }
  }
}

/// The escape flags (bit i: entry i is the escape) of 8 table entries: sum of c[i] << i, whose code parts stay
/// below 2^15 and whose escape bits land at kEscBit + i.
__device__ __forceinline__ uint32_t esc_flags(const uint32_t (&c)[8]) {
  uint32_t f = c[7];
#pragma unroll
  for (int i = 6; i >= 0; --i) f = (f << 1) + c[i];
  return f >> kEscBit;
}

/// 8 codes of B bits (B compile-time) packed LSB-first into the low 8 * B bits, from table entries whose escape
/// bit (kEscBit) is set or not: every bit at or above 8 * B of the result is undefined (the callers store 8 * B bits).
/// Why the bits below are exact: in a sum of four entries shifted by 0, B, 2B, 3B the escape bits land at 24 + iB,
/// above the 4B code bits for B <= 6 (B = 7 clears them first), and the halves are joined so that no escape bit of the
/// low half reaches the high half's codes.
template <uint32_t B>
__device__ __forceinline__ uint64_t pack8_entries(const uint32_t (&e)[8]) {
  uint32_t c[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) c[i] = B == 7 ? (e[i] & 0xFFu) : e[i];
  const uint32_t lo = c[0] + (c[1] << B) + (c[2] << (2 * B)) + (c[3] << (3 * B));
  const uint32_t hi = c[4] + (c[5] << B) + (c[6] << (2 * B)) + (c[7] << (3 * B));
  if constexpr (B == 4) return prmt(lo, hi, 0x5410);                 // lo's escape bits are in its upper half
  else if constexpr (8 * B < 32) return uint64_t(lo + (hi << (4 * B)));  // hi's escape bits shift out
  else return uint64_t(lo & (B >= 8 ? 0xFFFFFFFFu : (1u << (4 * B % 32)) - 1u)) | (uint64_t(hi) << (4 * B));
}
/// The bytes of two words (8 symbols) as 8 values.
__device__ __forceinline__ void unbytes(uint32_t a, uint32_t b, uint32_t (&c)[8]) {
#pragma unroll
  for (uint32_t i = 0; i < 4; ++i) {
    c[i] = (a >> (8 * i)) & 0xFFu;
    c[4 + i] = (b >> (8 * i)) & 0xFFu;
  }
}

/// One warp step of a packed stream with B (compile-time) bytes per lane, all 32 * B bytes written at dst (16-byte
/// aligned): B = 1, 2, 4 or 8 bytes go straight from each lane (the warp's stores are contiguous, so coalesced); other
/// widths through the warp's staging buffer, as 16-byte stores.
template <uint32_t B>
__device__ __forceinline__ void put_packed_whole(uint8_t* stage, uint8_t* dst, uint64_t piece) {
  const uint32_t lane = lane_id();
  if constexpr (B == 1) {
    dst[lane] = uint8_t(piece);
  } else if constexpr (B == 2) {
    reinterpret_cast<uint16_t*>(dst)[lane] = uint16_t(piece);
  } else if constexpr (B == 4) {
    reinterpret_cast<uint32_t*>(dst)[lane] = uint32_t(piece);
  } else if constexpr (B == 8) {
    reinterpret_cast<uint2*>(dst)[lane] = make_uint2(uint32_t(piece), uint32_t(piece >> 32));
  } else {
#pragma unroll
    for (uint32_t b = 0; b < B; ++b) stage[lane * B + b] = uint8_t(piece >> (8 * b));
    __syncwarp();
    if (lane < 2 * B) reinterpret_cast<uint4*>(dst)[lane] = reinterpret_cast<const uint4*>(stage)[lane];
    __syncwarp();
  }
}

/// The whole warp steps J = warp, warp + kWorkers, ... < whole of a chunk. EB: bits per exponent in the output (the
/// LUT code width, or the symbol width when RAW, 0 when CONST); LUT: codes rather than symbols, and the lane steps'
/// escape flags into S.escmask when the chunk has exceptions (EXC). lg = 4 * lane | group << 15 (lookup8).
template <uint32_t FID, uint32_t EB, bool LUT>
__device__ void sweep_whole(GroupSmem& S, uint8_t* dst, uint32_t lg, bool exc, uint32_t warp, uint32_t whole) {
  using F = Fast<FID>;
  constexpr uint32_t E = F::kEsize, NS = F::kStreams;
  constexpr uint32_t kStep = 32 * kWorkers;  // lane steps from one of a warp's steps to its next
  const uint32_t lane = lane_id();
  uint8_t* stage = S.stage[warp];
  uint32_t rmode[NS];
  uint8_t* rp[NS];  // this lane's (w = 8) or this warp's (packed) place in each residual stream at step J
#pragma unroll
  for (uint32_t j = 0; j < NS; ++j) {
    rmode[j] = S.plan[j].mode;
    rp[j] = dst + S.plan[j].sec + (F::width(j) == 8 ? 8 * (32 * warp + lane) : 32 * warp * F::width(j));
  }
  uint8_t* ep = dst + S.plan[0].sec + (LUT ? lut_codes_offset(EB) : 0u) + (EB == 8 ? 8 * (32 * warp + lane) : 32 * warp * EB);
  const uint4* in = reinterpret_cast<const uint4*>(S.chunk) + (E / 2) * (32 * warp + lane);
  for (uint32_t J = warp; J < whole; J += kWorkers) {
    const uint32_t q = 32 * J + lane;
    uint32_t w[2 * E];
#pragma unroll
    for (uint32_t h = 0; h < E / 2; ++h) {
      const uint4 v = in[h];
      w[4 * h] = v.x; w[4 * h + 1] = v.y; w[4 * h + 2] = v.z; w[4 * h + 3] = v.w;
    }
    in += (E / 2) * kStep;
    uint32_t r[NS][2];
    residuals<FID, NS>(w, r);
#pragma unroll
    for (uint32_t j = 1; j < NS; ++j) {
      if (rmode[j] == uint32_t(StreamMode::RAW)) {
        if (F::width(j) == 8) {
          *reinterpret_cast<uint2*>(rp[j]) = make_uint2(r[j][0], r[j][1]);
        } else {
          uint32_t c[8];
          unbytes(r[j][0], r[j][1], c);
          put_packed_whole<F::width(2)>(stage, rp[j], pack8_entries<F::width(2)>(c));
        }
      }
      rp[j] += F::width(j) * kStep;
    }
    if constexpr (LUT) {
      uint32_t c[8];
      lookup8<FID>(lg, w, c);
      if (exc) S.escmask[q] = uint8_t(esc_flags(c));
      put_packed_whole<EB>(stage, ep, pack8_entries<EB>(c));
    } else if constexpr (EB == 8) {
      uint32_t t[NS];
      Fam<FID>::split4(w, t);
      const uint32_t e0 = t[0];
      Fam<FID>::split4(w + E, t);
      *reinterpret_cast<uint2*>(ep) = make_uint2(e0, t[0]);
    } else if constexpr (EB != 0) {
      uint32_t t[NS], c[8];
      Fam<FID>::split4(w, t);
      const uint32_t e0 = t[0];
      Fam<FID>::split4(w + E, t);
      unbytes(e0, t[0], c);
      put_packed_whole<EB>(stage, ep, pack8_entries<EB>(c));
    }
    ep += EB * kStep;
  }
}

/// sweep_whole for the chunk's exponent stream: k (the LUT code width) or 0 when the stream is RAW or CONST.
template <uint32_t FID>
__device__ void sweep_whole_dispatch(GroupSmem& S, uint8_t* dst, const StreamPlan& pe, uint32_t k, uint32_t lg, bool exc,
                                     uint32_t warp, uint32_t whole) {
  constexpr uint32_t W = Fast<FID>::kEBits;
  if (pe.mode == uint32_t(StreamMode::CONST)) return sweep_whole<FID, 0, false>(S, dst, lg, exc, warp, whole);
  if (pe.mode == uint32_t(StreamMode::RAW)) return sweep_whole<FID, W, false>(S, dst, lg, exc, warp, whole);
  switch (k) {
    case 1: return sweep_whole<FID, 1, true>(S, dst, lg, exc, warp, whole);
    case 2: return sweep_whole<FID, 2, true>(S, dst, lg, exc, warp, whole);
    case 3: return sweep_whole<FID, 3, true>(S, dst, lg, exc, warp, whole);
    case 4: return sweep_whole<FID, 4, true>(S, dst, lg, exc, warp, whole);
  }
  if constexpr (W == 8) {
    switch (k) {
      case 5: return sweep_whole<FID, 5, true>(S, dst, lg, exc, warp, whole);
      case 6: return sweep_whole<FID, 6, true>(S, dst, lg, exc, warp, whole);
      default: return sweep_whole<FID, 7, true>(S, dst, lg, exc, warp, whole);
    }
  }
}

// ---------------------------------------------------------------- one fast chunk, worker threads

template <uint32_t FID>
__device__ void fast_chunk(GroupSmem& S, uint32_t* H, uint32_t grp, const EncArgs& a, const EncTensor& T, uint32_t tid,
                           uint32_t wbar) {
  using F = Fast<FID>;
  using Split = Fam<FID>;
  constexpr uint32_t E = F::kEsize, NS = F::kStreams, W = F::kEBits;
  const uint32_t lane = tid & 31, warp = warp_id_in_group(tid);
  const uint32_t raw_len = S.raw_len, n = raw_len / E;
  const uint64_t g = S.g;
  // The frame's address now, so that its global load is not waited for after the placement barrier.
  uint8_t* const frame_payload = T.out + T.header_bytes;

  // ---- 1. histogram of the exponents; residual streams: does any symbol differ from the first element's?
  const uint32_t first = E == 2 ? uint32_t(reinterpret_cast<const uint16_t*>(S.chunk)[0]) * 0x10001u
                                : reinterpret_cast<const uint32_t*>(S.chunk)[0];
  const uint32_t lg = lane * 4 | grp << kHistGroupShift;  // this lane's replica in this group's histogram
  uint8_t* hist_b = hist_bytes();
  uint32_t diff = 0;
  {
    const uint32_t units = raw_len / 16;  // whole 16-byte units
#pragma unroll 2
    for (uint32_t u = tid; u < units; u += kWorkerThreads) {
      const uint4 v = reinterpret_cast<const uint4*>(S.chunk)[u];
      const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        atomicAdd(reinterpret_cast<uint32_t*>(hist_b + (bin_lo<FID>(w[i]) | lg)), 1u);
        if constexpr (E == 2) atomicAdd(reinterpret_cast<uint32_t*>(hist_b + (bin_hi<FID>(w[i]) | lg)), 1u);
        diff |= w[i] ^ first;
      }
    }
    // The tail (< 16 bytes, last chunk of a tensor only): element by element.
    const uint32_t e0 = units * 16 / E;
    if (tid < n - e0) {
      const uint32_t e = e0 + tid;
      const uint32_t v = E == 2 ? uint32_t(reinterpret_cast<const uint16_t*>(S.chunk)[e]) * 0x10001u
                                : reinterpret_cast<const uint32_t*>(S.chunk)[e];
      atomicAdd(reinterpret_cast<uint32_t*>(hist_b + (bin_lo<FID>(v) | lg)), 1u);
      diff |= v ^ first;
    }
  }
  diff = warp_or(diff);
  if (lane == 0 && diff) atomicOr(&S.diff, diff);
  named_sync(wbar, kWorkerThreads);

  // ---- 2. ranking of the present exponents
  // Bin tid's 32 replicas are 8 vectors; thread t starts at vector t mod 8, so a quarter warp's loads hit 8 banks apart.
  uint32_t cnt = 0;
  uint4* const bin4 = reinterpret_cast<uint4*>(H + tid * kReplicas);
  if (tid < F::kBins) {
#pragma unroll
    for (uint32_t r = 0; r < kReplicas / 4; ++r) {
      const uint4 v = bin4[(r + tid) & (kReplicas / 4 - 1)];
      cnt += v.x + v.y + v.z + v.w;
    }
  }
  const bool present = cnt != 0;
  const uint32_t ballot = __ballot_sync(kFull, present);
  if (lane == 0) S.wsum[warp] = __popc(ballot);
  if (tid < 128) S.sorted[tid] = 0;
  named_sync(wbar, kWorkerThreads);
  uint32_t m = 0, before = 0;
#pragma unroll
  for (uint32_t q = 0; q < kWorkers; ++q) {
    const uint32_t v = S.wsum[q];
    before += q < warp ? v : 0;
    m += v;
  }
  const uint32_t key = (cnt << 8) | (255u - tid);
  if (present) S.keys[before + __popc(ballot & lanemask_lt())] = key;
  named_sync(wbar, kWorkerThreads);
  uint32_t rank = 0;
  if (present) {
    for (uint32_t i = 0; i < m; ++i) rank += S.keys[i] > key;
    if (rank < 128) {
      S.sorted[rank] = cnt;
      S.lut[rank] = uint8_t(tid);
    }
  }
  named_sync(wbar, kWorkerThreads);

  // ---- 3. decisions (warp 0), layout and look-back (thread 0)
  if (warp == 0) {
    StreamPlan p{};
    p.mode = uint32_t(StreamMode::RAW);
    p.bytes = uint32_t(packed_bytes(n, W));
    uint32_t k = 0, n_exc = 0;
    if (m == 1) {
      p.mode = uint32_t(StreamMode::CONST);
      p.param = S.lut[0];
      p.bytes = 0;
    } else {
      // covered(k): the counts of the first 2^k - 1 ranks, from an inclusive scan of sorted[0..127] (4 per lane).
      const uint4 c4 = reinterpret_cast<const uint4*>(S.sorted)[lane];
      const uint32_t s0 = c4.x, s1 = s0 + c4.y, s2 = s1 + c4.z, s3 = s2 + c4.w;
      const uint32_t base = warp_inclusive_sum(s3) - s3;
      uint64_t best = ~0ull;
      for (uint32_t kk = 1; kk < W; ++kk) {
        const uint32_t idx = (1u << kk) - 2;  // rank of the last LUT entry
        const uint32_t r = idx & 3;
        const uint32_t v = base + (r == 0 ? s0 : r == 1 ? s1 : r == 2 ? s2 : s3);
        const uint32_t covered = __shfl_sync(kFull, v, idx >> 2);
        const uint64_t bytes = lut_exceptions_offset(kk, n) + (n - covered);
        if (bytes < best) { best = bytes; k = kk; n_exc = n - covered; }
      }
      if (best < p.bytes) {
        p.mode = uint32_t(StreamMode::LUT);
        p.param = k;
        p.bytes = uint32_t(best);
      } else {
        k = 0;
        n_exc = 0;
      }
    }
    if (lane == 0) {
      S.plan[0] = p;
      S.k = k;
      S.n_exc = n_exc;
      const uint32_t d = S.diff;
#pragma unroll
      for (uint32_t j = 1; j < NS; ++j) {
        StreamPlan r{};
        if (d & residual_mask<FID>(j)) {
          r.mode = uint32_t(StreamMode::RAW);
          r.bytes = uint32_t(packed_bytes(n, F::width(j)));
        } else {
          uint8_t sym[4];
          split_element(FID == kFamBF16 ? Dtype::BF16 : FID == kFamF16 ? Dtype::F16 : Dtype::F32, Codec::FAST,
                        S.chunk, sym);
          r.mode = uint32_t(StreamMode::CONST);
          r.param = sym[j];
        }
        S.plan[j] = r;
      }
      uint64_t off = chunk_sections_offset(NS);
#pragma unroll
      for (uint32_t j = 0; j < NS; ++j) {
        off = align16(off);
        S.plan[j].sec = uint32_t(off);
        off += S.plan[j].bytes;
      }
      const bool raw = align16(off) >= raw_len;
      S.raw = raw;
      S.size = raw ? raw_len : uint32_t(off);
    }
    __syncwarp();
    const uint32_t size = S.size;
    const uint64_t o = warp_look_back(a, g, S.index, size);
    if (lane == 0) {
      S.offset = o;
      a.offsets[g] = o;
      a.sizes[g] = size;
    }
  }
  named_sync(wbar, kWorkerThreads);
  uint8_t* dst = frame_payload + S.offset;
  if (S.raw) {
    threads_copy<kWorkerThreads>(dst, S.chunk, raw_len, tid);
    return;
  }
  const uint32_t size = S.size, k = S.k;
  const StreamPlan pe = S.plan[0];
  const bool lut = pe.mode == uint32_t(StreamMode::LUT);
  const uint32_t cap = lut ? (1u << k) - 1 : 0, esc = cap;
  const uint32_t my_code = present && rank < cap ? rank : esc;
  if (tid < F::kBins) S.code_of[tid] = uint8_t(my_code);
  if (lut && tid < cap && tid >= m) S.lut[tid] = 0;
  if (lut && present) {
    // The code table, once per lane (bin e, lane l at word 32 e + l, over the histogram bin it was counted in), so
    // that a lane's lookup is one mask of the element's bits and one conflict-free load. Only the exponents present
    // are ever looked up, so only their bins are written, each by the thread that summed it.
    const uint32_t entry = my_code | uint32_t(my_code == esc) << kEscBit;
    const uint4 e4 = make_uint4(entry, entry, entry, entry);
#pragma unroll
    for (uint32_t r = 0; r < kReplicas / 4; ++r) bin4[(r + tid) & (kReplicas / 4 - 1)] = e4;
  }
  named_sync(wbar, kWorkerThreads);

  // ---- 4a. chunk header, descriptors, LUT table and every zero gap (warp 0's lanes)
  if (warp == 0) {
    if (lane == 0) {
      dst[0] = kChunkKindCoded;
      dst[1] = uint8_t(NS);
      dst[2] = 0;
      dst[3] = 0;
      st_bytes(dst + 4, n, 4);
    }
    uint32_t end = kChunkHeaderBytes;
#pragma unroll
    for (uint32_t j = 0; j < NS; ++j) {
      const StreamPlan& p = S.plan[j];
      if (lane == 0) {
        uint8_t* d = dst + kChunkHeaderBytes + kStreamDescriptorBytes * j;
        d[0] = uint8_t(p.mode);
        d[1] = uint8_t(p.param);
        d[2] = 0;
        d[3] = 0;
        st_bytes(d + 4, p.bytes, 4);
      }
      end += kStreamDescriptorBytes;
    }
#pragma unroll
    for (uint32_t j = 0; j < NS; ++j) {
      const StreamPlan& p = S.plan[j];
      zero_range(dst + end, p.sec - end, lane);
      end = p.sec + p.bytes;
      if (j == 0 && lut) {
        uint8_t* sec = dst + p.sec;
        if (lane == 0) st_bytes(sec, S.n_exc, 4);
        for (uint32_t i = lane; i < cap; i += 32) sec[4 + i] = S.lut[i];
        zero_range(sec + 4 + cap, lut_codes_offset(k) - 4 - cap, lane);
        const uint32_t codes_end = uint32_t(lut_codes_offset(k) + packed_bytes(n, k));
        zero_range(sec + codes_end, uint32_t(lut_exceptions_offset(k, n)) - codes_end, lane);
      }
    }
    if (S.index + 1 != T.n_chunks) zero_range(dst + size, uint32_t(align16(size)) - size, lane);
  }

  // ---- 4b. the streams, one lane step (8 elements) per lane and warp step: the whole warp steps (all 256 elements
  // there) through a sweep specialised on the exponent stream's mode and code width, the last, partial one below.
  const uint32_t nls = (n + kLaneElems - 1) / kLaneElems, nws = (nls + 31) / 32;
  const uint32_t whole = n / (32 * kLaneElems);
  uint8_t* stage = S.stage[warp];
  const uint32_t codes_bytes = uint32_t(packed_bytes(n, k));
  sweep_whole_dispatch<FID>(S, dst, pe, lut ? k : 0u, lg, lut && S.n_exc != 0, warp, whole);
  for (uint32_t J = whole + warp; J < nws; J += kWorkers) {
    const uint32_t q = 32 * J + lane;
    const bool active = q < nls;
    const uint32_t valid = active ? umin32(kLaneElems, n - kLaneElems * q) : 0u;
    uint32_t s[NS][2];
    {
      uint32_t w[2 * E];
      if (active) {
#pragma unroll
        for (uint32_t h = 0; h < E / 2; ++h) {
          const uint4 v = reinterpret_cast<const uint4*>(S.chunk)[(E / 2) * q + h];
          w[4 * h] = v.x; w[4 * h + 1] = v.y; w[4 * h + 2] = v.z; w[4 * h + 3] = v.w;
        }
      } else {
#pragma unroll
        for (uint32_t i = 0; i < 2 * E; ++i) w[i] = 0;
      }
      uint32_t t4[NS];
      Split::split4(w, t4);
#pragma unroll
      for (uint32_t j = 0; j < NS; ++j) s[j][0] = t4[j];
      Split::split4(w + E, t4);
#pragma unroll
      for (uint32_t j = 0; j < NS; ++j) s[j][1] = t4[j];
    }
    // Symbols past the end of the chunk (last lane step of a tensor) are 0 and never escapes.
    if (valid < 8) {
#pragma unroll
      for (uint32_t j = 0; j < NS; ++j) {
        s[j][0] &= valid >= 4 ? 0xFFFFFFFFu : (1u << (8 * valid)) - 1u;
        s[j][1] &= valid >= 8 ? 0xFFFFFFFFu : valid <= 4 ? 0u : (1u << (8 * (valid - 4))) - 1u;
      }
    }
#pragma unroll
    for (uint32_t j = 0; j < NS; ++j) {
      const StreamPlan& p = S.plan[j];
      const uint32_t wj = F::width(j);
      if (j == 0 && lut) {
        uint32_t c[2] = {0, 0}, flags = 0;
#pragma unroll
        for (uint32_t i = 0; i < 8; ++i) {
          const uint32_t code = S.code_of[(s[0][i >> 2] >> (8 * (i & 3))) & 0xFFu];
          const bool e = i < valid && code == esc;
          flags |= uint32_t(e) << i;
          c[i >> 2] |= (i < valid ? code : 0u) << (8 * (i & 3));
        }
        if (active) S.escmask[q] = uint8_t(flags);
        const uint32_t done = 32 * J * k;
        put_packed(stage, dst + p.sec + lut_codes_offset(k) + done, pack8_bytes(c[0], c[1], k), k,
                   codes_bytes > done ? codes_bytes - done : 0u);
      } else if (p.mode == uint32_t(StreamMode::RAW)) {
        if (wj == 8) {
          if (active) put8(dst + p.sec + 8 * q, s[j][0], s[j][1], valid);
        } else {
          const uint32_t bytes = uint32_t(packed_bytes(n, wj)), done = 32 * J * wj;
          put_packed(stage, dst + p.sec + done, pack8_bytes(s[j][0], s[j][1], wj), wj, bytes > done ? bytes - done : 0u);
        }
      }
    }
  }
  if (!lut || S.n_exc == 0) return;

  // ---- 4c. exceptions in element order: per thread a contiguous run of escape-mask words (32 elements each), a scan
  // of their counts, the symbols into shared memory (the histogram's space), then one coalesced copy.
  named_sync(wbar, kWorkerThreads);
  const uint32_t nw = (nls + 3) / 4;  // mask words; the last one's bytes past nls are stale
  const uint32_t per = (nw + kWorkerThreads - 1) / kWorkerThreads;
  const uint32_t w0 = umin32(nw, tid * per), w1 = umin32(nw, w0 + per);
  const uint32_t* mask = reinterpret_cast<const uint32_t*>(S.escmask);
  const uint32_t last_bytes = nls - 4 * (nw - 1);  // 1..4
  const uint32_t last_mask = last_bytes == 4 ? 0xFFFFFFFFu : (1u << (8 * last_bytes)) - 1u;
  auto word = [&](uint32_t i) { return mask[i] & (i + 1 == nw ? last_mask : 0xFFFFFFFFu); };
  uint32_t c = 0;
  for (uint32_t i = w0; i < w1; ++i) c += __popc(word(i));
  const uint32_t incl = warp_inclusive_sum(c);
  if (lane == 31) S.wsum[warp] = incl;
  named_sync(wbar, kWorkerThreads);
  uint32_t pos = incl - c;
#pragma unroll
  for (uint32_t w = 0; w < kWorkers; ++w) pos += w < warp ? S.wsum[w] : 0;
  uint8_t* exc = reinterpret_cast<uint8_t*>(H);
  for (uint32_t i = w0; i < w1 && c; ++i) {
    uint32_t f = word(i);
    while (f) {
      const uint32_t b = __ffs(f) - 1;
      f &= f - 1;
      exc[pos++] = uint8_t(exponent_at<FID>(S.chunk, 32 * i + b));
    }
  }
  named_sync(wbar, kWorkerThreads);
  threads_copy<kWorkerThreads>(dst + pe.sec + uint32_t(lut_exceptions_offset(k, n)), exc, S.n_exc, tid);
}

// ---------------------------------------------------------------- the kernel

__global__ void __launch_bounds__(kBlockThreads, 1) fast_encode_kernel(EncArgs a) {
  const uint32_t grp = threadIdx.x / kGroupThreads, tid = threadIdx.x % kGroupThreads;
  BlockSmem& blk = *reinterpret_cast<BlockSmem*>(smem_raw);
  GroupSmem& S = blk.grp[grp];
  uint32_t* const H = blk.hist[grp];
  const uint32_t wbar = 1 + 2 * grp, gbar = 2 + 2 * grp;
  const bool digest_warp = tid >= kWorkerThreads;
  if (tid == 0) {
    mbar_init(&S.bar);
    mbar_init_fence();
  }
  uint32_t parity = 0;
  for (;;) {
    if (tid == 0) {
      fence_proxy_async();  // the previous chunk's reads of S.chunk before the bulk copy that overwrites it
      uint32_t t = 0;
      const uint64_t g = draw_chunk<true>(a, a.tickets + kTicketFast, &t);
      S.g = g;
      if (g < a.total_chunks) {
        const EncTensor& T = a.tensors[t];
        const uint32_t i = uint32_t(g - T.chunk_base);
        const uint64_t begin = uint64_t(i) * a.chunk_bytes;
        const uint32_t len = uint32_t(umin64(a.chunk_bytes, T.nbytes - begin));
        S.tensor = t;
        S.index = i;
        S.raw_len = len;
        S.diff = 0;
        const uint8_t* src = T.in + begin;
        const uint32_t bulk = len & ~15u;
        mbar_arrive_expect_tx(&S.bar, bulk);
        if (bulk) bulk_copy(S.chunk, src, bulk, &S.bar);
        for (uint32_t b = bulk; b < len; ++b) S.chunk[b] = src[b];
      }
    }
    named_sync(gbar, kGroupThreads);
    const uint64_t g = S.g;
    if (g >= a.total_chunks) break;
    const EncTensor& T = a.tensors[S.tensor];
    const Codec codec = Codec(T.codec);
    const uint32_t fam = family_of(Dtype(T.dtype), codec);
    if (!digest_warp && codec != Codec::RAW) {
      // Clear the histogram while the copy is in flight (the space held the last chunk's exceptions).
      const uint32_t words = (fam == kFamF16 ? 32u : 256u) * kReplicas;
      for (uint32_t w = tid; w < words / 4; w += kWorkerThreads) reinterpret_cast<uint4*>(H)[w] = make_uint4(0, 0, 0, 0);
      named_sync(wbar, kWorkerThreads);
    }
    mbar_wait(&S.bar, parity);
    parity ^= 1u;
    if (digest_warp) {
      Xxh32 st;
      digest_stripes(st, S.chunk, S.raw_len, 0);
      const uint32_t d = digest_finish(st, S.chunk, S.raw_len);
      if (lane_id() == 0) a.digests[g] = d;
    } else if (codec == Codec::RAW) {
      if (tid < 32) {
        const uint64_t o = warp_look_back(a, g, S.index, S.raw_len);
        if (tid == 0) {
          S.offset = o;
          a.offsets[g] = o;
          a.sizes[g] = S.raw_len;
        }
      }
      named_sync(wbar, kWorkerThreads);
      threads_copy<kWorkerThreads>(T.out + T.header_bytes + S.offset, S.chunk, S.raw_len, tid);
    } else if (fam == kFamBF16) {
      fast_chunk<kFamBF16>(S, H, grp, a, T, tid, wbar);
    } else if (fam == kFamF16) {
      fast_chunk<kFamF16>(S, H, grp, a, T, tid, wbar);
    } else {
      fast_chunk<kFamF32>(S, H, grp, a, T, tid, wbar);
    }
    named_sync(gbar, kGroupThreads);  // S.chunk and the staging space are free again
  }
}

}  // namespace

Status launch_fast_encode(const EncArgs& a, int sm_budget, int sm_count, cudaStream_t s) {
  size_t smem = sizeof(BlockSmem);
  int grid = 0;
  Status st = detail::persistent_grid(reinterpret_cast<const void*>(fast_encode_kernel), kBlockThreads, &smem,
                                      sm_budget, sm_count, a.total_chunks, &grid);
  if (!st.ok()) return st;
  fast_encode_kernel<<<grid, kBlockThreads, smem, s>>>(a);
  return detail::check_launch("fast_encode_kernel");
}

}  // namespace enc
}  // namespace gpu
}  // namespace tzip
