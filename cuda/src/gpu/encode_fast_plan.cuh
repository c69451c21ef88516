// The fast encoder (encode_fast.cu), part 1: the fast codec's figures per family and fast_plan_kernel, which plans
// every chunk of the `fast` tensors (exponent histogram, the CPU's decisions, layout, payload offset by look-back).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "gpu/codec.h"
#include "gpu/encode_args.cuh"
#include "tzip/bitpack.h"
#include "tzip/format.h"
#include "tzip/warp.h"
#include "tzip/xxhash32.h"

namespace tzip {
namespace gpu {
namespace enc {
namespace {

using namespace tzip::dev;

constexpr uint32_t kLaneElems = 8;  // elements per lane step (8 k-bit codes = k bytes)

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

/// Bits of a word (holding 4 / esize elements) that belong to the residual streams R0.. (CONST test).
template <uint32_t FID> __host__ __device__ constexpr uint32_t residual_mask(uint32_t j) {
  if constexpr (FID == kFamBF16) return 0x807F807Fu;                       // s | m
  else if constexpr (FID == kFamF16) return j == 1 ? 0x00FF00FFu : 0x83008300u;  // m[7:0]; s | m[9:8]
  else return j == 1 ? 0xFFu : j == 2 ? 0xFF00u : 0x807F0000u;              // m[7:0]; m[15:8]; s | m[22:16]
}

// ================================================================ fast_plan_kernel

constexpr uint32_t kPlanGroups = 4;
constexpr uint32_t kPlanWarps = 8;                    // warps of a group
constexpr uint32_t kPlanGroupThreads = 32 * kPlanWarps;  // 256: one thread per exponent bin when ranking
constexpr uint32_t kPlanThreads = kPlanGroups * kPlanGroupThreads;
constexpr uint32_t kReplicas = 32;                    // histogram replicas: one per lane
constexpr uint32_t kHistWords = 256 * kReplicas;      // 32 KiB per group: bin e, replica r at word 32 e + r
constexpr uint32_t kHistGroupShift = 15;              // group g's histogram at byte g << 15 of PlanSmem::hist
constexpr uint32_t kPlanAhead = 8;                    // 16-byte loads in flight per thread

/// A group's shared state. What warp 0 reads while it decides chunk c (the counts by rank, the LUT, m, diff, the
/// ticket) is kept twice, so that warps 1-7 can already count chunk c + 1 into the other copy; the keys and per-warp
/// sums are written only after the first barrier of chunk c + 1, which warp 0 reaches once it has decided, and the
/// histogram (PlanSmem::hist) is cleared by its bins' owners before warp 0 decides and not read by it.
struct __align__(16) PlanGroupSmem {
  uint32_t keys[256];    // present symbols' (count << 8 | 255 - symbol), compacted
  uint32_t sorted[2][128];  // counts of the present symbols by rank (the first 128 ranks)
  uint8_t lut[2][128];      // rank -> exponent
  uint32_t wsum[kPlanWarps];
  uint32_t m[2];            // present symbols
  unsigned long long g[2];  // global chunk index (>= total: no more work)
  uint32_t tensor[2], diff[2];
};

/// The plan kernel's shared memory. The groups' histograms come first, 32 KiB apart, so that a bin's byte offset
/// (bits 7..14), a lane's replica (bits 2..6) and the group (bits 15..16) combine with one OR and the base folds into
/// the instruction's immediate: one LOP3 per atomic address.
struct __align__(128) PlanSmem {
  uint32_t hist[kPlanGroups][kHistWords];
  PlanGroupSmem grp[kPlanGroups];
};
static_assert(sizeof(uint32_t) * kHistWords == (1u << kHistGroupShift), "group histograms 32 KiB apart");

extern __shared__ __align__(128) unsigned char smem_raw[];
__device__ __forceinline__ uint8_t* hist_bytes() { return reinterpret_cast<uint8_t*>(reinterpret_cast<PlanSmem*>(smem_raw)->hist); }

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

/// Counts the exponents of the 16 bytes v (whole elements) into this lane's replica and ORs their differences from
/// `first` into diff.
template <uint32_t FID>
__device__ __forceinline__ void count16(const uint4& v, uint32_t lg, uint32_t first, uint32_t& diff) {
  uint8_t* hist_b = hist_bytes();
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    atomicAdd(reinterpret_cast<uint32_t*>(hist_b + (bin_lo<FID>(w[i]) | lg)), 1u);
    if constexpr (Fast<FID>::kEsize == 2) atomicAdd(reinterpret_cast<uint32_t*>(hist_b + (bin_hi<FID>(w[i]) | lg)), 1u);
    diff |= w[i] ^ first;
  }
}

/// Counts and ranks the exponents of chunk g (a `fast` chunk) with the group's 256 threads into copy p of the group's
/// state; H (the group's histogram) is zero on entry and on exit. Returns with the group's barrier passed, so that
/// warp 0 can decide (decide_chunk) while the others go on.
template <uint32_t FID>
__device__ __forceinline__ void count_chunk(PlanGroupSmem& S, uint32_t* H, uint32_t grp, const EncArgs& a,
                                            const EncTensor& T, uint64_t g, uint32_t p, uint32_t tid, uint32_t bar) {
  using F = Fast<FID>;
  constexpr uint32_t E = F::kEsize;
  const uint32_t lane = tid & 31, warp = tid / 32;
  const ChunkSpan c = chunk_span(a, T, g);
  const uint32_t raw_len = c.len, n = raw_len / E;
  const uint8_t* src = T.in + c.begin;

  // ---- 1. histogram of the exponents; residual streams: does any symbol differ from the first element's?
  const uint32_t first = E == 2 ? uint32_t(*reinterpret_cast<const uint16_t*>(src)) * 0x10001u
                                : *reinterpret_cast<const uint32_t*>(src);
  const uint32_t lg = lane * 4 | grp << kHistGroupShift;
  uint32_t diff = 0;
  {
    const uint4* in = reinterpret_cast<const uint4*>(src);
    const uint32_t units = raw_len / 16;  // whole 16-byte units
    uint32_t u = tid;
    for (; u + (kPlanAhead - 1) * kPlanGroupThreads < units; u += kPlanAhead * kPlanGroupThreads) {
      uint4 v[kPlanAhead];
#pragma unroll
      for (uint32_t k = 0; k < kPlanAhead; ++k) v[k] = __ldg(in + u + k * kPlanGroupThreads);
#pragma unroll
      for (uint32_t k = 0; k < kPlanAhead; ++k) count16<FID>(v[k], lg, first, diff);
    }
    for (; u < units; u += kPlanGroupThreads) count16<FID>(__ldg(in + u), lg, first, diff);
    // The tail (< 16 bytes, last chunk of a tensor only): element by element.
    const uint32_t e0 = units * 16 / E;
    if (tid < n - e0) {
      const uint32_t e = e0 + tid;
      const uint32_t v = E == 2 ? uint32_t(reinterpret_cast<const uint16_t*>(src)[e]) * 0x10001u
                                : reinterpret_cast<const uint32_t*>(src)[e];
      atomicAdd(reinterpret_cast<uint32_t*>(hist_bytes() + (bin_lo<FID>(v) | lg)), 1u);
      diff |= v ^ first;
    }
  }
  diff = warp_or(diff);
  if (lane == 0 && diff) atomicOr(&S.diff[p], diff);
  named_sync(bar, kPlanGroupThreads);

  // ---- 2. ranking of the present exponents; each bin's owner clears its replicas for the next chunk
  // Bin tid's 32 replicas are 8 vectors; thread t starts at vector t mod 8, so a quarter warp's loads hit 8 banks apart.
  uint32_t cnt = 0;
  if (tid < F::kBins) {
    uint4* const bin4 = reinterpret_cast<uint4*>(H + tid * kReplicas);
#pragma unroll
    for (uint32_t r = 0; r < kReplicas / 4; ++r) {
      const uint4 v = bin4[(r + tid) & (kReplicas / 4 - 1)];
      cnt += v.x + v.y + v.z + v.w;
    }
#pragma unroll
    for (uint32_t r = 0; r < kReplicas / 4; ++r) bin4[(r + tid) & (kReplicas / 4 - 1)] = make_uint4(0, 0, 0, 0);
  }
  const bool present = cnt != 0;
  const uint32_t ballot = __ballot_sync(kFull, present);
  if (lane == 0) S.wsum[warp] = __popc(ballot);
  if (tid < 128) S.sorted[p][tid] = 0;
  named_sync(bar, kPlanGroupThreads);
  uint32_t m = 0, before = 0;
#pragma unroll
  for (uint32_t q = 0; q < kPlanWarps; ++q) {
    const uint32_t v = S.wsum[q];
    before += q < warp ? v : 0;
    m += v;
  }
  const uint32_t key = (cnt << 8) | (255u - tid);
  if (present) S.keys[before + __popc(ballot & lanemask_lt())] = key;
  if (tid == 0) S.m[p] = m;
  named_sync(bar, kPlanGroupThreads);
  if (present) {
    uint32_t rank = 0;
    for (uint32_t i = 0; i < m; ++i) rank += S.keys[i] > key;
    if (rank < 128) {
      S.sorted[p][rank] = cnt;
      S.lut[p][rank] = uint8_t(tid);
    }
  }
  named_sync(bar, kPlanGroupThreads);
}

/// Warp 0 of a group: the CPU's decisions for chunk g from copy p of the group's state (counted by count_chunk), its
/// layout and look-back; writes a.plans[g], a.offsets[g] and a.sizes[g].
template <uint32_t FID>
__device__ __forceinline__ void decide_chunk(const PlanGroupSmem& S, const EncArgs& a, const EncTensor& T, uint64_t g,
                                             uint32_t p) {
  using F = Fast<FID>;
  constexpr uint32_t E = F::kEsize, NS = F::kStreams, W = F::kEBits;
  const uint32_t lane = lane_id();
  const ChunkSpan c = chunk_span(a, T, g);
  const uint32_t raw_len = c.len, n = raw_len / E;
  const uint32_t m = S.m[p];
  uint32_t mode0 = uint32_t(StreamMode::RAW), param0 = 0, bytes0 = uint32_t(packed_bytes(n, W)), k = 0, n_exc = 0;
  if (m == 1) {
    mode0 = uint32_t(StreamMode::CONST);
    param0 = S.lut[p][0];
    bytes0 = 0;
  } else {
    // covered(k): the counts of the first 2^k - 1 ranks, from an inclusive scan of sorted[0..127] (4 per lane).
    const uint4 c4 = reinterpret_cast<const uint4*>(S.sorted[p])[lane];
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
    if (best < bytes0) {
      mode0 = uint32_t(StreamMode::LUT);
      param0 = k;
      bytes0 = uint32_t(best);
    } else {
      k = 0;
      n_exc = 0;
    }
  }
  uint32_t mode[NS], param[NS], bytes[NS], sec[NS];
  mode[0] = mode0;
  param[0] = param0;
  bytes[0] = bytes0;
  {
    const uint32_t d = S.diff[p];
    uint8_t sym[4];
    split_element(FID == kFamBF16 ? Dtype::BF16 : FID == kFamF16 ? Dtype::F16 : Dtype::F32, Codec::FAST, T.in + c.begin, sym);
#pragma unroll
    for (uint32_t j = 1; j < NS; ++j) {
      const bool raw = (d & residual_mask<FID>(j)) != 0;
      mode[j] = uint32_t(raw ? StreamMode::RAW : StreamMode::CONST);
      param[j] = raw ? 0u : sym[j];
      bytes[j] = raw ? uint32_t(packed_bytes(n, F::width(j))) : 0u;
    }
  }
  uint64_t off = chunk_sections_offset(NS);
#pragma unroll
  for (uint32_t j = 0; j < NS; ++j) {
    off = align16(off);
    sec[j] = uint32_t(off);
    off += bytes[j];
  }
  const bool raw = align16(off) >= raw_len;
  const uint32_t size = raw ? raw_len : uint32_t(off);
  const uint64_t o = warp_look_back(a, g, c.index, size);
  FastPlan* P = a.plans + g;
  if (lane == 0) {
    a.offsets[g] = o;
    a.sizes[g] = size;
    P->size = size;
    P->n_exc = n_exc;
    P->raw = raw;
    P->k = uint8_t(k);
    P->n_lut = uint8_t(mode0 == uint32_t(StreamMode::LUT) ? umin32((1u << k) - 1, m) : 0u);
#pragma unroll
    for (uint32_t j = 0; j < NS; ++j) {
      P->mode[j] = uint8_t(mode[j]);
      P->param[j] = uint8_t(param[j]);
      P->bytes[j] = bytes[j];
      P->sec[j] = sec[j];
    }
  }
  // The LUT: ranks 4 lane .. 4 lane + 3, zero past the present symbols (format.md 11.4).
  uint32_t l4 = 0;
#pragma unroll
  for (uint32_t q = 0; q < 4; ++q) l4 |= (4 * lane + q < m ? uint32_t(S.lut[p][4 * lane + q]) : 0u) << (8 * q);
  reinterpret_cast<uint32_t*>(P->lut)[lane] = l4;
}

/// Chunk g with the group: counted by all its warps, then decided by warp 0 (which returns after the look-back, the
/// others at once).
template <uint32_t FID>
__device__ __forceinline__ void plan_chunk(PlanGroupSmem& S, uint32_t* H, uint32_t grp, const EncArgs& a,
                                           const EncTensor& T, uint64_t g, uint32_t p, uint32_t tid, uint32_t bar) {
  count_chunk<FID>(S, H, grp, a, T, g, p, tid, bar);
  if (tid < 32) decide_chunk<FID>(S, a, T, g, p);
}

/// The plan kernel: kPlanGroups groups of 8 warps, each planning chunks one after another. A chunk is counted by the
/// whole group; then warp 0 decides it while warps 1-7 start counting the next chunk (copy p ^ 1 of the group's
/// state; thread 32 draws its ticket), so that the decisions and the look-back's wait are off the group's path. Named
/// barriers per group: `bar` (all 256 threads), `bar + kPlanGroups` (warps 1-7), `bar + 2 kPlanGroups` (warp 1
/// arrives with the next ticket, warp 0 waits for it).
__global__ void __launch_bounds__(kPlanThreads, 1) fast_plan_kernel(EncArgs a) {
  const uint32_t grp = threadIdx.x / kPlanGroupThreads, tid = threadIdx.x % kPlanGroupThreads, warp = tid / 32;
  PlanSmem& blk = *reinterpret_cast<PlanSmem*>(smem_raw);
  PlanGroupSmem& S = blk.grp[grp];
  uint32_t* const H = blk.hist[grp];
  const uint32_t bar = 1 + grp, bar_rest = bar + kPlanGroups, bar_ticket = bar + 2 * kPlanGroups;
  for (uint32_t w = tid; w < kHistWords / 4; w += kPlanGroupThreads) reinterpret_cast<uint4*>(H)[w] = make_uint4(0, 0, 0, 0);
  auto draw = [&](uint32_t q) {
    uint32_t t = 0;
    S.g[q] = draw_chunk<uint32_t(Share::kFastCoded)>(a, a.tickets + kTicketPlan, &t);
    S.tensor[q] = t;
    S.diff[q] = 0;
  };
  if (tid == 0) draw(0);
  named_sync(bar, kPlanGroupThreads);
  for (uint32_t p = 0;; p ^= 1) {
    const uint64_t g = S.g[p];
    if (g >= a.total_chunks) break;
    const EncTensor& T = a.tensors[S.tensor[p]];
    const uint32_t fam = family_of(Dtype(T.dtype), Codec::FAST);
    if (fam == kFamBF16) plan_chunk<kFamBF16>(S, H, grp, a, T, g, p, tid, bar);
    else if (fam == kFamF16) plan_chunk<kFamF16>(S, H, grp, a, T, g, p, tid, bar);
    else plan_chunk<kFamF32>(S, H, grp, a, T, g, p, tid, bar);
    if (warp == 0) {
      named_sync(bar_ticket, 64);  // warp 1 has drawn the next ticket
    } else {
      if (tid == 32) draw(p ^ 1);
      if (warp == 1) asm volatile("bar.arrive %0, %1;" ::"r"(bar_ticket), "r"(64) : "memory");
      named_sync(bar_rest, kPlanGroupThreads - 32);
    }
  }
}

}  // namespace
}  // namespace enc
}  // namespace gpu
}  // namespace tzip
