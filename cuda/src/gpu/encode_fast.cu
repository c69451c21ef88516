// The GPU encoder of `fast` (bf16, fp16, fp32) and `raw` tensors whose input and frame are 16-byte aligned: the same
// bytes as the CPU's encode_chunk (chunk_codec.cpp) and as encode_kernel, in two kernels that each stream the input
// from device memory once and wait on nothing but the look-back:
//
//   fast_plan_kernel (encode_fast_plan.cuh; chunks of `fast` tensors, drawn in order): a group of 8 warps reads a chunk with 16-byte loads
//     into a histogram of its exponents (32 lane-private replicas of each bin: a warp's atomics never collide) and a
//     test of the other streams for a constant value, ranks the present exponents, takes the CPU's decisions (CONST /
//     RAW / LUT and the code width k, format.md 11.3-11.4), lays the chunk out and places it with the decoupled
//     look-back; its plan (FastPlan: modes, sections, the LUT) and payload offset go to device memory.
//   fast_code_kernel<K> (every chunk of the fast encoder's tensors of one CodeKind: raw, bf16, fp16 or fp32, each a
//     kernel of its own so that each gets the registers it needs): one warp codes one chunk in element order, from
//     16-byte loads a few warp steps ahead: per 8 elements one lane looks its exponents up in the warp's code table,
//     packs them to k bits, stores the sign and mantissa bytes, and writes its escapes' exponents straight after the
//     earlier ones (their offsets from four ballots per step); the chunk digest (format version 2) is computed from
//     the same loads, since lane l of warp step J holds exactly stripe 32 J + l (fp32: two stripes, passed to their
//     lanes by shuffles). A raw tensor's chunks (or a chunk stored raw) are copied, digested on the way.
//
// Why two kernels rather than one that keeps the chunk in shared memory between its histogram and its coding: a
// 64 KiB chunk per group left room for two groups per SM, each alternating a load, its barriers and its coding, and
// that structure ran `raw` (no coding at all) at 190-194 GB/s on 10 H200 SMs against the copy kernel's 480
// (docs/benchmarks.md, fifth round). Here no warp waits for another warp except at a plan group's barriers, and every
// warp keeps several loads in flight; the price is a second read of each chunk, which an SM-budgeted call can afford
// (10 SMs draw a small share of the GPU's memory bandwidth; on all 132 SMs it costs 2-11%).
#include <cuda_runtime.h>

#include <cstdint>

#include "gpu/codec.h"
#include "gpu/encode_args.cuh"
#include "gpu/encode_fast_plan.cuh"
#include "tzip/bitpack.h"
#include "tzip/format.h"
#include "tzip/warp.h"
#include "tzip/xxhash32.h"

namespace tzip {
namespace gpu {
namespace enc {
namespace {

using namespace tzip::dev;

// ================================================================ fast_code_kernel

/// Warps per block of the coding kernel of CodeKind K, each coding its own chunks: as many as fit without spilling
/// (ptxas -v: fp32 needs 96 registers, fp16 more).
template <uint32_t K> constexpr uint32_t kCodeWarps = K == kCodeRaw ? 32 : K == kCodeBF16 ? 24 : K == kCodeF32 ? 20 : 16;

struct __align__(16) CodeWarpSmem {
  FastPlan plan;
  uint32_t table[256];                   // exponent -> LUT code | escape << kEscBit
  uint8_t stage[256];                    // packed output of one warp step
};

/// Code table entry: the LUT code, and bit kEscBit set when it is the escape. The bit rides along the packing of the
/// codes (where it lands above the bytes stored, see pack8_entries) and gives a lane step's 8 escape flags in one
/// shift-add chain (esc_flags) instead of a compare per element.
constexpr uint32_t kEscBit = 24;

/// Bytes of the whole stripes of a `len`-byte chunk that lane `lane` hashes (stripes s with s mod 32 == lane): the
/// lane state's `total` once its stripes went through Xxh32::rounds.
__device__ __forceinline__ uint64_t lane_stripe_bytes(uint32_t len, uint32_t lane) {
  const uint32_t whole = len / 16;
  return 16ull * (whole / 32 + (lane < whole % 32 ? 1u : 0u));
}

/// Copies a chunk stored raw (`len` bytes, src and dst 16-byte aligned) with one warp and returns its chunk digest.
__device__ uint32_t copy_raw_chunk(const uint8_t* src, uint8_t* dst, uint32_t len) {
  const uint32_t lane = lane_id(), whole = len / 16;
  const uint4* in = reinterpret_cast<const uint4*>(src);
  uint4* out = reinterpret_cast<uint4*>(dst);
  Xxh32 st;
  uint32_t s = lane;
  constexpr uint32_t U = 8;
  for (; s + 32 * (U - 1) < whole; s += 32 * U) {
    uint4 v[U];
#pragma unroll
    for (uint32_t u = 0; u < U; ++u) v[u] = __ldg(in + s + 32 * u);
#pragma unroll
    for (uint32_t u = 0; u < U; ++u) {
      st.rounds(v[u].x, v[u].y, v[u].z, v[u].w);
      out[s + 32 * u] = v[u];
    }
  }
  for (; s < whole; s += 32) {
    const uint4 v = __ldg(in + s);
    st.rounds(v.x, v.y, v.z, v.w);
    out[s] = v;
  }
  if (16 * whole + lane < len) dst[16 * whole + lane] = src[16 * whole + lane];
  st.total = lane_stripe_bytes(len, lane);
  return digest_finish(st, src, len);
}

/// The last, partial warp step of a packed stream: lane l's `nb` bytes go to dst[nb * l ...], of which the first
/// `avail` bytes of the step are written (the stream ends inside the step: avail < 32 * nb), through the warp's
/// staging buffer. Every lane of the warp calls it.
__device__ __forceinline__ void put_packed(uint8_t* stage, uint8_t* dst, uint64_t piece, uint32_t nb, uint32_t avail) {
  const uint32_t lane = lane_id();
  for (uint32_t b = 0; b < nb; ++b) stage[lane * nb + b] = uint8_t(piece >> (8 * b));
  __syncwarp();
  for (uint32_t b = lane; b < avail; b += 32) dst[b] = stage[b];
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

/// Table entries of 8 exponent symbols (the bytes of s0 and s1, each < 256) from the warp's code table: per symbol a
/// byte select (PRMT) and the table address (one IMAD) before the load, where a shift, a mask and an add cost one
/// instruction more (1.51 against 1.54 ms of fast_code_kernel for 256 MiB of bf16 weights on 10 H200 SMs).
__device__ __forceinline__ void lookup8(const uint32_t* table, uint32_t s0, uint32_t s1, uint32_t (&c)[8]) {
#pragma unroll
  for (uint32_t i = 0; i < 4; ++i) {
    c[i] = table[prmt(s0, 0, 0x4440 | i)];
    c[4 + i] = table[prmt(s1, 0, 0x4440 | i)];
  }
}

/// A chunk's coding state in one warp: section pointers, the exceptions written so far, the digest.
template <uint32_t NS>
struct Coder {
  uint8_t* rsec[NS];  // section of each stream (stream 0: the codes, after the LUT's table, when it is LUT)
  uint8_t* xsec;      // the exceptions
  uint32_t rmode[NS];
  uint32_t run;       // exceptions written so far
  Xxh32 st;
};

/// One warp step J of a chunk (lane step q = 32 J + lane: elements 8 q .. 8 q + 7, words w). EB: bits per exponent
/// in the output (the LUT code width, or the symbol width when RAW, 0 when CONST); LUT: codes rather than symbols;
/// EXC: the chunk has exceptions; PART: the chunk's last step, which may be partial (`valid` elements of this lane,
/// `len` the chunk's bytes); otherwise all 256 elements are there.
template <uint32_t FID, uint32_t EB, bool LUT, bool EXC, bool PART>
__device__ __forceinline__ void code_step(Coder<Fast<FID>::kStreams>& C, const uint32_t* table, uint8_t* stage,
                                          const uint32_t (&w)[2 * Fast<FID>::kEsize], uint32_t J, uint32_t valid,
                                          uint32_t n, uint32_t len) {
  using F = Fast<FID>;
  constexpr uint32_t E = F::kEsize, NS = F::kStreams;
  const uint32_t lane = lane_id(), q = 32 * J + lane;
  // ---- the digest: stripe 32 J + lane (2-byte elements), or stripes 64 J + lane and 64 J + 32 + lane (fp32), whose
  // bytes lanes lane / 2 and 16 + lane / 2 hold (as their first or second 16 bytes: lane parity).
  if constexpr (E == 2) {
    if (!PART || 16 * q + 16 <= len) C.st.rounds(w[0], w[1], w[2], w[3]);
  } else {
    const bool odd = lane & 1;
    uint32_t x[4], y[4];
#pragma unroll
    for (uint32_t i = 0; i < 4; ++i) {
      const uint32_t a0 = __shfl_sync(kFull, w[i], lane >> 1), a1 = __shfl_sync(kFull, w[4 + i], lane >> 1);
      const uint32_t b0 = __shfl_sync(kFull, w[i], 16 + (lane >> 1)), b1 = __shfl_sync(kFull, w[4 + i], 16 + (lane >> 1));
      x[i] = odd ? a1 : a0;
      y[i] = odd ? b1 : b0;
    }
    if (!PART || 16 * (64 * J + lane) + 16 <= len) C.st.rounds(x[0], x[1], x[2], x[3]);
    if (!PART || 16 * (64 * J + 32 + lane) + 16 <= len) C.st.rounds(y[0], y[1], y[2], y[3]);
  }
  // ---- the streams' 8 symbols each, as the bytes of two words
  uint32_t s[NS][2];
  {
    uint32_t t[NS];
    Fam<FID>::split4(w, t);
#pragma unroll
    for (uint32_t j = 0; j < NS; ++j) s[j][0] = t[j];
    Fam<FID>::split4(w + E, t);
#pragma unroll
    for (uint32_t j = 0; j < NS; ++j) s[j][1] = t[j];
  }
  if constexpr (PART) {  // symbols past the end are 0 and never escapes
#pragma unroll
    for (uint32_t j = 0; j < NS; ++j) {
      s[j][0] &= valid >= 4 ? 0xFFFFFFFFu : (1u << (8 * valid)) - 1u;
      s[j][1] &= valid >= 8 ? 0xFFFFFFFFu : valid <= 4 ? 0u : (1u << (8 * (valid - 4))) - 1u;
    }
  }
  // ---- residual streams
#pragma unroll
  for (uint32_t j = 1; j < NS; ++j) {
    if (C.rmode[j] != uint32_t(StreamMode::RAW)) continue;
    constexpr uint32_t kW2 = F::width(2);
    if (F::width(j) == 8) {
      uint8_t* d = C.rsec[j] + 8 * q;
      if (PART) {
        if (valid) put8(d, s[j][0], s[j][1], valid);
      } else {
        *reinterpret_cast<uint2*>(d) = make_uint2(s[j][0], s[j][1]);
      }
    } else {
      uint32_t c[8];
      unbytes(s[j][0], s[j][1], c);
      const uint64_t piece = pack8_entries<kW2>(c);
      const uint32_t done = 32 * J * kW2;
      if (PART) {
        const uint32_t bytes = uint32_t(packed_bytes(n, kW2));
        put_packed(stage, C.rsec[j] + done, piece, kW2, bytes > done ? bytes - done : 0u);
      } else {
        put_packed_whole<kW2>(stage, C.rsec[j] + done, piece);
      }
    }
  }
  // ---- exponent stream
  if constexpr (EB == 0) {
    return;
  } else {
    uint64_t piece;
    uint32_t flags = 0;
    if constexpr (LUT) {
      uint32_t c[8];
      lookup8(table, s[0][0], s[0][1], c);
      if (PART) {
#pragma unroll
        for (uint32_t i = 0; i < 8; ++i) c[i] = i < valid ? c[i] : 0u;
      }
      if (EXC) flags = esc_flags(c);
      piece = pack8_entries<EB>(c);
    } else if constexpr (EB == 8) {
      piece = uint64_t(s[0][0]) | (uint64_t(s[0][1]) << 32);
    } else {
      uint32_t c[8];
      unbytes(s[0][0], s[0][1], c);
      piece = pack8_entries<EB>(c);
    }
    uint8_t* d = C.rsec[0] + 32 * J * EB;
    if (PART) {
      const uint32_t bytes = uint32_t(packed_bytes(n, EB)), done = 32 * J * EB;
      put_packed(stage, d, piece, EB, bytes > done ? bytes - done : 0u);
    } else {
      put_packed_whole<EB>(stage, d, piece);
    }
    if constexpr (LUT && EXC) {
      // Exceptions in element order: this step's go after the earlier steps' (C.run), lane by lane. The lanes before
      // this one hold sum over b of 2^b * popc(ballot(bit b of count) & lanes below): four independent ballots instead
      // of a scan of dependent shuffles.
      const uint32_t cnt = __popc(flags);  // 0..8
      const uint32_t lt = lanemask_lt();
      uint32_t before = 0, total = 0;
#pragma unroll
      for (uint32_t b = 0; b < 4; ++b) {
        const uint32_t v = __ballot_sync(kFull, (cnt >> b) & 1u);
        before += __popc(v & lt) << b;
        total += __popc(v) << b;
      }
      if (total) {
        uint32_t pos = C.run + before;
        for (uint32_t f = flags; f; f &= f - 1) {
          const uint32_t b = __ffs(f) - 1;
          C.xsec[pos++] = uint8_t((b < 4 ? s[0][0] : s[0][1]) >> (8 * (b & 3)));
        }
        C.run += total;
      }
    }
  }
}

/// Codes every step of a chunk of n elements (`len` bytes at src): the whole warp steps from 16-byte loads AHEAD
/// steps ahead, then the last, partial one.
template <uint32_t FID, uint32_t EB, bool LUT, bool EXC>
__device__ __forceinline__ void code_steps(Coder<Fast<FID>::kStreams>& C, const uint32_t* table, uint8_t* stage, const uint8_t* src,
                           uint32_t n, uint32_t len) {
  using F = Fast<FID>;
  constexpr uint32_t E = F::kEsize, V = E / 2;  // 16-byte loads per lane step
  constexpr uint32_t AHEAD = E == 2 ? 4 : 2;
  const uint32_t lane = lane_id();
  const uint4* in = reinterpret_cast<const uint4*>(src);
  const uint32_t whole = n / (32 * kLaneElems);
  uint4 buf[AHEAD][V];
#pragma unroll
  for (uint32_t d = 0; d < AHEAD; ++d)
#pragma unroll
    for (uint32_t h = 0; h < V; ++h) buf[d][h] = d < whole ? __ldg(in + V * (32 * d + lane) + h) : make_uint4(0, 0, 0, 0);
  for (uint32_t J0 = 0; J0 < whole; J0 += AHEAD) {
#pragma unroll
    for (uint32_t d = 0; d < AHEAD; ++d) {
      const uint32_t J = J0 + d;
      if (J < whole) {
        uint32_t w[2 * E];
#pragma unroll
        for (uint32_t h = 0; h < V; ++h) {
          w[4 * h] = buf[d][h].x; w[4 * h + 1] = buf[d][h].y; w[4 * h + 2] = buf[d][h].z; w[4 * h + 3] = buf[d][h].w;
        }
        // Predicated: loading the last step again instead (no predicate, fewer register copies) made this kernel 22%
        // slower on the H200 (docs/benchmarks.md).
        if (J + AHEAD < whole) {
#pragma unroll
          for (uint32_t h = 0; h < V; ++h) buf[d][h] = __ldg(in + V * (32 * (J + AHEAD) + lane) + h);
        }
        code_step<FID, EB, LUT, EXC, false>(C, table, stage, w, J, 0, n, len);
      }
    }
  }
  const uint32_t nls = (n + kLaneElems - 1) / kLaneElems;  // lane steps
  if (whole * 32 < nls) {
    const uint32_t q = 32 * whole + lane;
    const uint32_t valid = q < nls ? umin32(kLaneElems, n - kLaneElems * q) : 0u;
    uint32_t w[2 * E];
#pragma unroll
    for (uint32_t i = 0; i < 2 * E; ++i) w[i] = 0;
    const uint32_t b0 = E * kLaneElems * q, have = valid * E;  // this lane's bytes: [b0, b0 + have) of the chunk
    if (have == E * kLaneElems) {
#pragma unroll
      for (uint32_t h = 0; h < V; ++h) {
        const uint4 v = __ldg(in + V * q + h);
        w[4 * h] = v.x; w[4 * h + 1] = v.y; w[4 * h + 2] = v.z; w[4 * h + 3] = v.w;
      }
    } else {
      for (uint32_t b = 0; b < have; ++b) {
        const uint32_t byte = src[b0 + b];
#pragma unroll
        for (uint32_t i = 0; i < 2 * E; ++i) w[i] |= i == b / 4 ? byte << (8 * (b % 4)) : 0u;
      }
    }
    code_step<FID, EB, LUT, EXC, true>(C, table, stage, w, whole, valid, n, len);
  }
}

/// code_steps for the chunk's exponent stream: k (the LUT code width) or 0 when the stream is RAW or CONST.
template <uint32_t FID>
__device__ __forceinline__ void code_dispatch(Coder<Fast<FID>::kStreams>& C, const uint32_t* table, uint8_t* stage, const uint8_t* src,
                              uint32_t n, uint32_t len, uint32_t mode0, uint32_t k, bool exc) {
  constexpr uint32_t W = Fast<FID>::kEBits;
  if (mode0 == uint32_t(StreamMode::CONST)) return code_steps<FID, 0, false, false>(C, table, stage, src, n, len);
  if (mode0 == uint32_t(StreamMode::RAW)) return code_steps<FID, W, false, false>(C, table, stage, src, n, len);
#define TZIP_K(KK)                                                                      \
  return exc ? code_steps<FID, KK, true, true>(C, table, stage, src, n, len)           \
             : code_steps<FID, KK, true, false>(C, table, stage, src, n, len)
  switch (k) {
    case 1: TZIP_K(1);
    case 2: TZIP_K(2);
    case 3: TZIP_K(3);
    case 4: TZIP_K(4);
  }
  if constexpr (W == 8) {
    switch (k) {
      case 5: TZIP_K(5);
      case 6: TZIP_K(6);
      default: TZIP_K(7);
    }
  }
#undef TZIP_K
}

/// Codes chunk `index` of T (planned: Ws.plan) at dst with one warp; returns its chunk digest.
template <uint32_t FID>
__device__ __forceinline__ uint32_t code_chunk(CodeWarpSmem& Ws, const EncTensor& T, uint32_t index, const uint8_t* src, uint8_t* dst,
                               uint32_t len) {
  using F = Fast<FID>;
  constexpr uint32_t NS = F::kStreams;
  const uint32_t lane = lane_id(), n = len / F::kEsize;
  const FastPlan& P = Ws.plan;
  const uint32_t size = P.size, k = P.k, mode0 = P.mode[0];
  const bool lut = mode0 == uint32_t(StreamMode::LUT);
  const uint32_t cap = lut ? (1u << k) - 1 : 0;
  if (lut) {
    // The code table: every symbol the escape, then the LUT's present symbols their rank.
    for (uint32_t e = lane; e < F::kBins; e += 32) Ws.table[e] = cap | 1u << kEscBit;
    __syncwarp();
    for (uint32_t r = lane; r < P.n_lut; r += 32) Ws.table[P.lut[r]] = r;
  }

  // ---- chunk header, descriptors, LUT table and every zero gap
  if (lane == 0) {
    put_chunk_header(dst, NS, n);
#pragma unroll
    for (uint32_t j = 0; j < NS; ++j) put_descriptor(dst, j, P.mode[j], P.param[j], P.bytes[j]);
  }
  uint32_t end = kChunkHeaderBytes + kStreamDescriptorBytes * NS;
#pragma unroll
  for (uint32_t j = 0; j < NS; ++j) {
    zero_range(dst + end, P.sec[j] - end, lane);
    end = P.sec[j] + P.bytes[j];
    if (j == 0 && lut) {
      uint8_t* sec = dst + P.sec[0];
      if (lane == 0) st_bytes(sec, P.n_exc, 4);
      for (uint32_t i = lane; i < cap; i += 32) sec[4 + i] = P.lut[i];
      zero_range(sec + 4 + cap, lut_codes_offset(k) - 4 - cap, lane);
      const uint32_t codes_end = uint32_t(lut_codes_offset(k) + packed_bytes(n, k));
      zero_range(sec + codes_end, uint32_t(lut_exceptions_offset(k, n)) - codes_end, lane);
    }
  }
  if (index + 1 != T.n_chunks) zero_range(dst + size, uint32_t(align16(size)) - size, lane);
  __syncwarp();  // the code table

  // ---- the streams, then the digest
  Coder<NS> C;
#pragma unroll
  for (uint32_t j = 0; j < NS; ++j) {
    C.rsec[j] = dst + P.sec[j];
    C.rmode[j] = P.mode[j];
  }
  if (lut) C.rsec[0] += lut_codes_offset(k);
  C.xsec = dst + P.sec[0] + (lut ? uint32_t(lut_exceptions_offset(k, n)) : 0u);
  C.run = 0;
  code_dispatch<FID>(C, Ws.table, Ws.stage, src, n, len, mode0, k, lut && P.n_exc != 0);
  C.st.total = lane_stripe_bytes(len, lane);
  return digest_finish(C.st, src, len);
}

/// Codes the chunks of CodeKind K, one warp per chunk.
template <uint32_t K>
__global__ void __launch_bounds__(32 * kCodeWarps<K>, 1) fast_code_kernel(EncArgs a) {
  const uint32_t lane = lane_id(), warp = threadIdx.x / 32;
  CodeWarpSmem& Ws = reinterpret_cast<CodeWarpSmem*>(smem_raw)[warp];
  for (;;) {
    unsigned long long g = 0;
    uint32_t t = 0;
    if (lane == 0) g = draw_chunk<uint32_t(Share::kCode) + K>(a, a.tickets + kTicketCode + K, &t);
    g = __shfl_sync(kFull, g, 0);
    t = __shfl_sync(kFull, t, 0);
    if (g >= a.total_chunks) break;
    const EncTensor& T = a.tensors[t];
    const ChunkSpan c = chunk_span(a, T, g);
    const uint32_t index = c.index, len = c.len;
    const uint64_t begin = c.begin;
    const uint8_t* src = T.in + begin;
    uint8_t* const payload = T.out + T.header_bytes;
    uint32_t d;
    if constexpr (K == kCodeRaw) {
      // Every chunk stored raw: chunk i at i * chunk_bytes (chunk_bytes is a multiple of 256, so already aligned).
      d = copy_raw_chunk(src, payload + begin, len);
      if (lane == 0) {
        a.offsets[g] = begin;
        a.sizes[g] = len;
      }
    } else {
      if (lane < sizeof(FastPlan) / 16)
        reinterpret_cast<uint4*>(&Ws.plan)[lane] = reinterpret_cast<const uint4*>(a.plans + g)[lane];
      __syncwarp();
      uint8_t* dst = payload + a.offsets[g];
      constexpr uint32_t FID = K == kCodeBF16 ? kFamBF16 : K == kCodeF16 ? kFamF16 : kFamF32;
      d = Ws.plan.raw ? copy_raw_chunk(src, dst, len) : code_chunk<FID>(Ws, T, index, src, dst, len);
    }
    if (lane == 0) a.digests[g] = d;
    __syncwarp();  // Ws is free again
  }
}

template <uint32_t K>
Status launch_code(const EncArgs& a, int sm_budget, int sm_count, cudaStream_t s) {
  constexpr uint32_t W = kCodeWarps<K>;
  size_t smem = sizeof(CodeWarpSmem) * W;
  int grid = 0;
  const Status st = detail::persistent_grid(reinterpret_cast<const void*>(fast_code_kernel<K>), 32 * W, &smem,
                                            sm_budget, sm_count, (a.total_chunks + W - 1) / W, &grid);
  if (!st.ok()) return st;
  fast_code_kernel<K><<<grid, 32 * W, smem, s>>>(a);
  return detail::check_launch("fast_code_kernel");
}

}  // namespace

Status launch_fast_encode(const EncArgs& a, uint32_t kinds, int sm_budget, int sm_count, cudaStream_t s) {
  Status st;
  if (kinds & ~(1u << kCodeRaw)) {
    size_t smem = sizeof(PlanSmem);
    int grid = 0;
    st = detail::persistent_grid(reinterpret_cast<const void*>(fast_plan_kernel), kPlanThreads, &smem, sm_budget,
                                 sm_count, (a.total_chunks + kPlanGroups - 1) / kPlanGroups, &grid);
    if (!st.ok()) return st;
    fast_plan_kernel<<<grid, kPlanThreads, smem, s>>>(a);
    if (!(st = detail::check_launch("fast_plan_kernel")).ok()) return st;
  }
  if ((kinds & 1u << kCodeRaw) && !(st = launch_code<kCodeRaw>(a, sm_budget, sm_count, s)).ok()) return st;
  if ((kinds & 1u << kCodeBF16) && !(st = launch_code<kCodeBF16>(a, sm_budget, sm_count, s)).ok()) return st;
  if ((kinds & 1u << kCodeF16) && !(st = launch_code<kCodeF16>(a, sm_budget, sm_count, s)).ok()) return st;
  if ((kinds & 1u << kCodeF32) && !(st = launch_code<kCodeF32>(a, sm_budget, sm_count, s)).ok()) return st;
  return st;
}

}  // namespace enc
}  // namespace gpu
}  // namespace tzip
