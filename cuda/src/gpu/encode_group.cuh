// Encoder (encode.cu, step 4), what one coding group of 256 threads works with: its shared memory, bit writing, RANS
// on one warp, and the per-stream planning that takes the CPU's decisions (cuda/src/core/chunk_codec.cpp).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "gpu/encode_args.cuh"
#include "tzip/bitpack.h"
#include "tzip/format.h"
#include "tzip/rans.h"
#include "tzip/warp.h"
#include "tzip/xxhash32.h"

namespace tzip {
namespace gpu {
namespace {

using namespace tzip::dev;
using namespace tzip::gpu::enc;

// ---------------------------------------------------------------- shared memory of one coding group

constexpr uint32_t kGroupThreads = 256;
constexpr uint32_t kGroupWarps = kGroupThreads / 32;
constexpr uint32_t kGroups = 3;
constexpr uint32_t kHistWords = 8192;  // 32 KiB: replicated counters in pass 1, then the tables below
// Word offsets of the tables that overlay the counters once these are reduced.
constexpr uint32_t kCountsOff = 0;       // u32 [8][256]
constexpr uint32_t kFcOff = 2048;        // u32 [8][256]: freq | cum << 16
constexpr uint32_t kCodeOfOff = 4096;    // u8  [8][256]: LUT code of each symbol
constexpr uint32_t kLutOff = 4608;       // u8  [8][128]: LUT entries

struct StreamPlan {
  uint32_t mode, param, bytes, sec;
  uint32_t n_present, n_words, n_exc, pad;
};

struct __align__(16) GroupSmem {
  uint32_t hist[kHistWords];
  StreamPlan plan[kMaxStreams];
  uint32_t states[kMaxStreams][kRansLanes];
  uint32_t scan[2][kMaxStreams][kGroupWarps];
  uint32_t warp_or[kGroupWarps];
  unsigned long long ticket;
  unsigned long long offset;
  uint32_t tensor, chunk, raw, size, last, pad[3];
};

// ---------------------------------------------------------------- small helpers

/// Loads 64 bytes of the chunk (zero past `valid`) as 16 little-endian words.
__device__ __forceinline__ void load_slice(const uint8_t* p, uint32_t valid, uint32_t* w) {
  if (valid == 64 && aligned16(p)) {
    const uint4* q = reinterpret_cast<const uint4*>(p);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint4 v = q[i];
      w[4 * i] = v.x; w[4 * i + 1] = v.y; w[4 * i + 2] = v.z; w[4 * i + 3] = v.w;
    }
  } else {
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      uint32_t v = 0;
      for (uint32_t b = 0; b < 4; ++b)
        if (4 * i + b < valid) v |= uint32_t(p[4 * i + b]) << (8 * b);
      w[i] = v;
    }
  }
}

/// Writes a little-endian bit stream: u32 words with aligned stores where possible, at most `left` bytes in all.
struct BitWriter {
  uint8_t* p;
  uint64_t acc = 0;
  uint32_t nb = 0, left;
  __device__ BitWriter(uint8_t* dst, uint32_t bytes) : p(dst), left(bytes) {}
  __device__ __forceinline__ void emit(uint32_t w, uint32_t nbytes) {
    const uint32_t k = nbytes < left ? nbytes : left;
    if (k == 4 && (reinterpret_cast<uintptr_t>(p) & 3) == 0) *reinterpret_cast<uint32_t*>(p) = w;
    else for (uint32_t i = 0; i < k; ++i) p[i] = uint8_t(w >> (8 * i));
    p += k;
    left -= k;
  }
  __device__ __forceinline__ void put(uint32_t v, uint32_t bits) {
    acc |= uint64_t(v) << nb;
    nb += bits;
    if (nb >= 32) {
      emit(uint32_t(acc), 4);
      acc >>= 32;
      nb -= 32;
    }
  }
  __device__ __forceinline__ void flush() {
    if (nb) emit(uint32_t(acc), (nb + 7) / 8);
    nb = 0;
  }
};

/// Packs the 4 byte-symbols of `s` (each < 2^w) into 4w bits.
__device__ __forceinline__ uint32_t pack4(uint32_t s, uint32_t w) {
  return (s & 0xFFu) | (((s >> 8) & 0xFFu) << w) | (((s >> 16) & 0xFFu) << (2 * w)) | ((s >> 24) << (3 * w));
}

__device__ __forceinline__ void zero_bytes(uint8_t* p, uint64_t n) {
  for (uint64_t i = 0; i < n; ++i) p[i] = 0;
}

// ---------------------------------------------------------------- RANS on one warp

/// Symbol of stream j of element i (one element loaded, split with the family's split4).
template <class F>
__device__ __forceinline__ uint32_t element_symbol(const uint8_t* in, uint32_t i, uint32_t j) {
  const uint8_t* p = in + uint64_t(i) * F::kEsize;
  uint32_t w[F::kEsize] = {};
  if constexpr (F::kEsize == 1) {
    w[0] = *p;
  } else if constexpr (F::kEsize == 2) {
    w[0] = (reinterpret_cast<uintptr_t>(p) & 1) ? uint32_t(p[0]) | (uint32_t(p[1]) << 8)
                                                 : *reinterpret_cast<const uint16_t*>(p);
  } else if constexpr (F::kEsize == 4) {
    w[0] = (reinterpret_cast<uintptr_t>(p) & 3) ? ld_bytes_le(p, 4) : *reinterpret_cast<const uint32_t*>(p);
  } else {
    if (reinterpret_cast<uintptr_t>(p) & 7) {
      w[0] = ld_bytes_le(p, 4);
      w[1] = ld_bytes_le(p + 4, 4);
    } else {
      const uint64_t v = *reinterpret_cast<const uint64_t*>(p);
      w[0] = uint32_t(v);
      w[1] = uint32_t(v >> 32);
    }
  }
  uint32_t s[F::kCount];
  F::split4(w, s);
  uint32_t r = 0;
#pragma unroll
  for (uint32_t q = 0; q < F::kCount; ++q)
    if (q == j) r = s[q] & 0xFFu;
  return r;
}

/// Runs the 32-lane rANS encoder of stream j over the chunk's n symbols, steps in reverse. Trial (words == nullptr):
/// counts the words and stops as soon as word_limit is reached (the result can then no longer win); returns the word
/// count, or UINT32_MAX when stopped. Writing: places each step's words at their final index (the CPU's rans_encode
/// order) below `n_words`. Final lane states go to states[lane].
template <class F>
__device__ uint32_t rans_run(const uint8_t* in, uint32_t n, uint32_t j, const uint32_t* fc, uint32_t word_limit,
                             uint8_t* words, uint32_t n_words, uint32_t* states) {
  const uint32_t lane = lane_id();
  const uint32_t steps = (n + kRansLanes - 1) / kRansLanes;
  uint32_t x = kRansLow, count = 0, pos = n_words;
  const bool al = (reinterpret_cast<uintptr_t>(words) & 1) == 0;
  constexpr int kB = 8;
  for (int64_t g0 = int64_t(steps) - 1; g0 >= 0; g0 -= kB) {
    uint32_t sy[kB];
#pragma unroll
    for (int b = 0; b < kB; ++b) {
      const int64_t g = g0 - b;
      const uint32_t i = uint32_t(g) * kRansLanes + lane;
      sy[b] = (g >= 0 && i < n) ? element_symbol<F>(in, i, j) : 0;
    }
#pragma unroll
    for (int b = 0; b < kB; ++b) {
      const int64_t g = g0 - b;
      if (g < 0) break;
      const uint32_t i = uint32_t(g) * kRansLanes + lane;
      const bool act = i < n;
      const uint32_t e = fc[sy[b]];
      const uint32_t f = e & 0xFFFFu, cum = e >> 16;
      const bool emit = act && x >= (f << 20);
      const uint32_t m = __ballot_sync(kFull, emit);
      const uint32_t ne = __popc(m);
      if (words) {
        pos -= ne;
        if (emit) {
          const uint32_t idx = pos + __popc(m & lanemask_lt());
          uint8_t* w = words + 2ull * idx;
          if (al) *reinterpret_cast<uint16_t*>(w) = uint16_t(x);
          else { w[0] = uint8_t(x); w[1] = uint8_t(x >> 8); }
        }
      }
      count += ne;
      if (emit) x >>= 16;
      if (act) x = ((x / f) << kRansProbBits) + (x % f) + cum;
    }
    if (!words && count >= word_limit) return UINT32_MAX;
  }
  states[lane] = x;
  return count;
}

// ---------------------------------------------------------------- planning (one warp per stream)

__device__ __forceinline__ bool lut_allowed(Codec c, uint32_t j) { return c == Codec::FAST ? j == 0 : true; }
__device__ __forceinline__ bool rans_allowed(Codec c) { return c == Codec::MAX || c == Codec::BYTES; }

template <class F>
__device__ void plan_stream(GroupSmem& S, const uint8_t* in, uint32_t n, Codec codec, uint32_t j, uint32_t first) {
  const uint32_t lane = lane_id();
  const uint32_t w = F::width(j);
  StreamPlan p{};
  p.mode = uint32_t(StreamMode::RAW);
  p.bytes = uint32_t(packed_bytes(n, w));
  const bool hist = codec != Codec::FAST || j == 0;
  if (!hist) {
    uint32_t any = 0;
#pragma unroll
    for (uint32_t q = 0; q < kGroupWarps; ++q) any |= S.warp_or[q];
    if (!((any >> j) & 1)) { p.mode = uint32_t(StreamMode::CONST); p.param = first; p.bytes = 0; }
    if (lane == 0) S.plan[j] = p;
    return;
  }
  const uint32_t* counts = S.hist + kCountsOff + 256 * j;
  uint32_t c8[8];
  uint32_t local = 0;
#pragma unroll
  for (int r = 0; r < 8; ++r) {
    c8[r] = counts[lane * 8 + r];
    local += c8[r] != 0;
  }
  const uint32_t m = warp_sum(local);
  p.n_present = m;
  if (m == 1) {
    p.mode = uint32_t(StreamMode::CONST);
    p.param = first;
    p.bytes = 0;
    if (lane == 0) S.plan[j] = p;
    return;
  }
  uint8_t* code_of = reinterpret_cast<uint8_t*>(S.hist + kCodeOfOff) + 256 * j;
  uint8_t* lut = reinterpret_cast<uint8_t*>(S.hist + kLutOff) + 128 * j;
  if (lut_allowed(codec, j) && w > 1) {
    uint32_t key[8];
#pragma unroll
    for (int r = 0; r < 8; ++r) key[r] = c8[r] ? (c8[r] << 8) | (255u - (lane * 8 + r)) : 0u;
    warp_sort256_desc(key);
    uint32_t pre[8], run = 0;
#pragma unroll
    for (int r = 0; r < 8; ++r) { run += key[r] >> 8; pre[r] = run; }
    const uint32_t base = warp_inclusive_sum(run) - run;
    uint64_t best = ~0ull;
    uint32_t best_k = 0, best_cov = 0;
    for (uint32_t k = 1; k < w; ++k) {
      const uint32_t idx = (1u << k) - 2;  // cap - 1
      uint32_t v = 0;
#pragma unroll
      for (int r = 0; r < 8; ++r) if (uint32_t(r) == (idx & 7)) v = pre[r];
      const uint32_t covered = __shfl_sync(kFull, base + v, idx >> 3);
      const uint64_t bytes = lut_exceptions_offset(k, n) + (n - covered);
      if (bytes < best) { best = bytes; best_k = k; best_cov = covered; }
    }
    if (best < p.bytes) {
      p.mode = uint32_t(StreamMode::LUT);
      p.param = best_k;
      p.bytes = uint32_t(best);
      p.n_exc = n - best_cov;
    }
    // LUT tables (used only when LUT stays the choice).
    const uint32_t cap = (1u << best_k) - 1, esc = cap;
#pragma unroll
    for (int r = 0; r < 8; ++r) code_of[lane * 8 + r] = uint8_t(esc);
    __syncwarp();
#pragma unroll
    for (int r = 0; r < 8; ++r) {
      const uint32_t i = lane * 8 + r;
      const bool present = (key[r] >> 8) != 0;
      const uint32_t sym = 255u - (key[r] & 255u);
      if (i < cap) {
        lut[i] = present ? uint8_t(sym) : 0;
        if (present) code_of[sym] = uint8_t(i);
      }
    }
  }
  if (rans_allowed(codec)) {
    const uint32_t ln = log2_fixed16(n);
    uint64_t cost = 0;
#pragma unroll
    for (int r = 0; r < 8; ++r)
      if (c8[r]) cost += uint64_t(c8[r]) * (ln - log2_fixed16(c8[r]));
    cost = warp_sum(cost);
    const uint64_t est = ((cost >> 16) + 7) / 8 + rans_words_offset(m);
    if (est < p.bytes) {
      // rans_normalize, one warp: f = max(1, c * 4096 / n) for present symbols.
      uint32_t f[8], sum = 0;
      uint32_t bc = 0, bi = 0;
#pragma unroll
      for (int r = 0; r < 8; ++r) {
        f[r] = c8[r] ? uint32_t((uint64_t(c8[r]) * kRansProbScale) / n) : 0u;
        if (c8[r] && f[r] == 0) f[r] = 1;
        sum += f[r];
        if (c8[r] > bc) { bc = c8[r]; bi = lane * 8 + r; }
      }
      if (bc == 0) bi = 0xFFFFFFFFu;
      sum = warp_sum(sum);
      warp_argmax(bc, bi);
      if (sum < kRansProbScale) {
#pragma unroll
        for (int r = 0; r < 8; ++r) if (lane * 8 + r == bi) f[r] += kRansProbScale - sum;
      } else {
        while (sum > kRansProbScale) {
          uint32_t tv = 0, ti = 0xFFFFFFFFu;
#pragma unroll
          for (int r = 0; r < 8; ++r) if (f[r] > tv) { tv = f[r]; ti = lane * 8 + r; }
          warp_argmax(tv, ti);
          uint32_t take = sum - kRansProbScale;
          if (take > tv - 1) take = tv - 1;
#pragma unroll
          for (int r = 0; r < 8; ++r) if (lane * 8 + r == ti) f[r] -= take;
          sum -= take;
        }
      }
      uint32_t fl = 0;
#pragma unroll
      for (int r = 0; r < 8; ++r) fl += f[r];
      uint32_t cum = warp_inclusive_sum(fl) - fl;
      uint32_t* fc = S.hist + kFcOff + 256 * j;
#pragma unroll
      for (int r = 0; r < 8; ++r) {
        fc[lane * 8 + r] = f[r] | (cum << 16);
        cum += f[r];
      }
      __syncwarp();
      const uint32_t hdr = rans_words_offset(m);
      // Words needed to lose: hdr + 2 * words >= p.bytes.
      const uint32_t limit = p.bytes > hdr ? (p.bytes - hdr + 1) / 2 : 0;
      const uint32_t nw = limit ? rans_run<F>(in, n, j, fc, limit, nullptr, 0, S.states[j]) : UINT32_MAX;
      if (nw != UINT32_MAX && uint64_t(hdr) + 2ull * nw < p.bytes) {
        p.mode = uint32_t(StreamMode::RANS);
        p.param = 0;
        p.bytes = hdr + 2 * nw;
        p.n_words = nw;
      }
    }
  }
  if (lane == 0) S.plan[j] = p;
}

}  // namespace
}  // namespace gpu
}  // namespace tzip
