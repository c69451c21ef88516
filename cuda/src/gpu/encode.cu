// GPU frame encoder: the same bytes as tzip::encode_frame (cuda/src/core/frame.cpp + chunk_codec.cpp) for a batch of
// tensors, all on the device.
//
// Launch sequence (one stream, every grid sized by the SM budget, see codec.h):
//   1. auto_hist_kernel + auto_resolve_kernel   (only when some tensor asks for "auto"): the exponent histogram of each
//      such tensor and the integer rule of tzip::resolve_auto, written into the tensor's descriptor.
//   2. the fast encoder (encode_fast.cu), for fast and raw tensors whose input and frame are 16-byte aligned:
//      fast_plan_kernel when any is `fast` (each chunk's plan and offset), then fast_code_kernel for each kind present
//      (raw, bf16, fp16, fp32: coded or copied chunks and their digests).
//   3. digest_kernel (only when encode_kernel has tensors): the digest of each of its chunks' input (format version
//      2), one warp per chunk; the fast encoder's chunks are skipped.
//   4. encode_kernel: one group of 256 threads per chunk (4 groups per 1024-thread block, named barriers). Per chunk:
//      pass 1 reads the chunk (16-byte loads), splits it into streams 4 elements at a time (warp.h, Fam<>::split4) and
//      builds the stream histograms in shared memory (32-way replicated u16 counters: lane-private columns, so the
//      atomics of one warp never collide); one warp per stream then takes the CPU's decisions (CONST / RAW / LUT with
//      the (count desc, symbol asc) ranking by a warp bitonic sort / RANS gate, normalisation and a trial encode);
//      the chunk's stored size is then known, and a decoupled look-back over the chunks of the tensor gives its final
//      offset in the payload; pass 2 re-reads the chunk (now in L2) and writes the sections straight to that offset,
//      exceptions placed with a group-wide scan, RANS words by the stream's warp walking the steps backwards with a
//      ballot per step (same word order as the CPU's rans_encode).
//   5. finalize_kernel: per tensor, chunk table, header, checksum and header digest; frame size to the caller's array.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "gpu/codec.h"
#include "gpu/graph.h"
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

// ---------------------------------------------------------------- one chunk, one group

struct ChunkJob {
  const EncTensor* t;
  uint64_t g;          // global chunk index
  uint32_t i;          // chunk index in the tensor
  const uint8_t* in;
  uint32_t raw_len;
  Codec codec;
  bool last;
};

template <uint32_t FID>
__device__ void encode_chunk(GroupSmem& S, const EncArgs& a, const ChunkJob job, uint32_t tid, uint32_t bar) {
  using F = Fam<FID>;
  constexpr uint32_t E = F::kEsize, NS = F::kCount, EPT = 64 / E, G4 = EPT / 4;
  const uint32_t warp = tid / 32, lane = tid % 32;
  const uint32_t n = job.raw_len / E;
  const Codec codec = job.codec;
  const bool fast = codec == Codec::FAST;
  const uint32_t nh = fast ? 1 : NS;
  // u32 counters, R replicas per bin (lane % R picks the replica: one warp's atomics never collide when R == 32).
  const uint32_t R = nh <= 1 ? 32 : nh <= 2 ? 16 : nh <= 4 ? 8 : 4;
  const uint32_t nslices = (job.raw_len + 63) / 64;

  // ---- pass 1: histograms (and the all-equal test of streams that only choose CONST or RAW)
  for (uint32_t w = tid; w < nh * 256 * R; w += kGroupThreads) S.hist[w] = 0;
  uint32_t first[NS];
  {
    uint32_t w0[16];
    load_slice(job.in, E, w0);
    uint32_t s0[NS];
    F::split4(w0, s0);
#pragma unroll
    for (uint32_t j = 0; j < NS; ++j) first[j] = s0[j] & 0xFFu;
  }
  named_sync(bar, kGroupThreads);
  uint32_t neq = 0;
  for (uint32_t s = tid; s < nslices; s += kGroupThreads) {
    uint32_t wd[16];
    const uint32_t off = s * 64;
    load_slice(job.in + off, min(64u, job.raw_len - off), wd);
    const uint32_t nvalid = min(EPT, n - s * EPT);
#pragma unroll
    for (uint32_t q = 0; q < G4; ++q) {
      uint32_t sy[NS];
      F::split4(wd + q * E, sy);
      const uint32_t vc = nvalid > 4 * q ? min(4u, nvalid - 4 * q) : 0u;
      const uint32_t bmask = vc >= 4 ? 0xFFFFFFFFu : (1u << (8 * vc)) - 1u;
#pragma unroll
      for (uint32_t j = 0; j < NS; ++j) {
        if (fast && j > 0) {
          if ((sy[j] ^ rep4(first[j])) & bmask) neq |= 1u << j;
        } else {
          uint32_t* h = S.hist + j * 256 * R + (lane & (R - 1));
          if (vc == 4) {
#pragma unroll
            for (uint32_t e = 0; e < 4; ++e) atomicAdd(h + byte_of(sy[j], e) * R, 1u);
          } else {
            for (uint32_t e = 0; e < vc; ++e) atomicAdd(h + byte_of(sy[j], e) * R, 1u);
          }
        }
      }
    }
  }
  neq = warp_or(neq);
  if (lane == 0) S.warp_or[warp] = neq;
  named_sync(bar, kGroupThreads);
  {
    uint32_t cnt[NS];
    const uint32_t b = tid;
#pragma unroll
    for (uint32_t j = 0; j < NS; ++j) {
      cnt[j] = 0;
      if (j < nh) {
        const uint32_t* h = S.hist + (j * 256 + b) * R;
        for (uint32_t r = 0; r < R; ++r) cnt[j] += h[(r + b) & (R - 1)];
      }
    }
    named_sync(bar, kGroupThreads);
#pragma unroll
    for (uint32_t j = 0; j < NS; ++j)
      if (j < nh) S.hist[kCountsOff + 256 * j + b] = cnt[j];
  }
  named_sync(bar, kGroupThreads);

  // ---- decisions
  if (warp < NS) {
#pragma unroll
    for (uint32_t j = 0; j < NS; ++j)
      if (j == warp) plan_stream<F>(S, job.in, n, codec, j, first[j]);
  }
  named_sync(bar, kGroupThreads);

  // ---- layout, size, look-back
  if (tid == 0) {
    uint64_t off = chunk_sections_offset(NS);
    for (uint32_t j = 0; j < NS; ++j) {
      off = align16(off);
      S.plan[j].sec = uint32_t(off);
      off += S.plan[j].bytes;
    }
    const bool raw = align16(off) >= job.raw_len;
    S.raw = raw;
    S.size = raw ? job.raw_len : uint32_t(off);
  }
  if (warp == 0) {
    __syncwarp();
    const uint64_t o = warp_look_back(a, job.g, job.i, S.size);
    if (tid == 0) {
      S.offset = o;
      a.offsets[job.g] = o;
      a.sizes[job.g] = S.size;
    }
  }
  named_sync(bar, kGroupThreads);
  uint8_t* dst = job.t->out + job.t->header_bytes + S.offset;
  if (S.raw) {
    threads_copy<kGroupThreads>(dst, job.in, job.raw_len, tid);
    return;
  }
  const uint32_t size = S.size;

  // ---- pass 2: chunk header, section headers and paddings (thread 0), then the data
  if (tid == 0) {
    put_chunk_header(dst, NS, n);
    uint32_t end = kChunkHeaderBytes;
    for (uint32_t j = 0; j < NS; ++j) {
      const StreamPlan& p = S.plan[j];
      put_descriptor(dst, j, p.mode, p.param, p.bytes);
      end += kStreamDescriptorBytes;
    }
    for (uint32_t j = 0; j < NS; ++j) {
      const StreamPlan& p = S.plan[j];
      zero_bytes(dst + end, p.sec - end);
      end = p.sec + p.bytes;
      uint8_t* sec = dst + p.sec;
      if (p.mode == uint32_t(StreamMode::LUT)) {
        const uint32_t k = p.param, cap = (1u << k) - 1;
        st_bytes(sec, p.n_exc, 4);
        const uint8_t* lut = reinterpret_cast<const uint8_t*>(S.hist + kLutOff) + 128 * j;
        for (uint32_t i = 0; i < cap; ++i) sec[4 + i] = lut[i];
        zero_bytes(sec + 4 + cap, lut_codes_offset(k) - 4 - cap);
        const uint64_t codes_end = lut_codes_offset(k) + packed_bytes(n, k);
        zero_bytes(sec + codes_end, lut_exceptions_offset(k, n) - codes_end);
      }
    }
    if (!job.last) zero_bytes(dst + size, align16(size) - size);
  }

  bool any_data = false, any_lut = false, any_rans = false;
#pragma unroll
  for (uint32_t j = 0; j < NS; ++j) {
    const uint32_t m = S.plan[j].mode;
    any_data |= m == uint32_t(StreamMode::RAW) || m == uint32_t(StreamMode::LUT);
    any_lut |= m == uint32_t(StreamMode::LUT);
    any_rans |= m == uint32_t(StreamMode::RANS);
  }
  if (any_data) {
    uint32_t exc_base[NS];
#pragma unroll
    for (uint32_t j = 0; j < NS; ++j) exc_base[j] = 0;
    const uint32_t iters = (nslices + kGroupThreads - 1) / kGroupThreads;
    for (uint32_t it = 0; it < iters; ++it) {
      const uint32_t s = it * kGroupThreads + tid;
      const bool active = s < nslices;
      uint32_t wd[16];
      const uint32_t off = s * 64;
      if (active) load_slice(job.in + off, min(64u, job.raw_len - off), wd);
      else {
#pragma unroll
        for (int i = 0; i < 16; ++i) wd[i] = 0;
      }
      const uint32_t nvalid = active ? min(EPT, n - s * EPT) : 0u;
      uint32_t sy[NS][G4];
#pragma unroll
      for (uint32_t q = 0; q < G4; ++q) {
        uint32_t t4[NS];
        F::split4(wd + q * E, t4);
        const uint32_t vc = nvalid > 4 * q ? min(4u, nvalid - 4 * q) : 0u;
        const uint32_t bmask = vc >= 4 ? 0xFFFFFFFFu : (1u << (8 * vc)) - 1u;
#pragma unroll
        for (uint32_t j = 0; j < NS; ++j) sy[j][q] = t4[j] & bmask;
      }
      uint32_t ecnt[NS], emine = 0;
#pragma unroll
      for (uint32_t j = 0; j < NS; ++j) {
        ecnt[j] = 0;
        const StreamPlan& p = S.plan[j];
        if (!active) continue;
        const uint32_t w = F::width(j);
        if (p.mode == uint32_t(StreamMode::RAW)) {
          if (w == 8) {
            uint8_t* o = dst + p.sec + s * EPT;
            if (nvalid == EPT && (reinterpret_cast<uintptr_t>(o) & 15) == 0) {
#pragma unroll
              for (uint32_t q = 0; q < G4; q += 4) {
                if constexpr (G4 >= 4) {
                  *reinterpret_cast<uint4*>(o + 4 * q) = make_uint4(sy[j][q], sy[j][q + 1], sy[j][q + 2], sy[j][q + 3]);
                }
              }
              if constexpr (G4 < 4) {
#pragma unroll
                for (uint32_t q = 0; q < G4; ++q) st_bytes(o + 4 * q, sy[j][q], 4);
              }
            } else {
#pragma unroll
              for (uint32_t q = 0; q < G4; ++q) {
                const uint32_t vc = nvalid > 4 * q ? min(4u, nvalid - 4 * q) : 0u;
                if (vc) st_bytes(o + 4 * q, sy[j][q], vc);
              }
            }
          } else {
            BitWriter bw(dst + p.sec + s * EPT * w / 8, (nvalid * w + 7) / 8);
#pragma unroll
            for (uint32_t q = 0; q < G4; ++q) bw.put(pack4(sy[j][q], w), 4 * w);
            bw.flush();
          }
        } else if (p.mode == uint32_t(StreamMode::LUT)) {
          const uint32_t k = p.param, esc = (1u << k) - 1;
          const uint8_t* code_of = reinterpret_cast<const uint8_t*>(S.hist + kCodeOfOff) + 256 * j;
          BitWriter bw(dst + p.sec + lut_codes_offset(k) + s * EPT * k / 8, (nvalid * k + 7) / 8);
#pragma unroll
          for (uint32_t q = 0; q < G4; ++q) {
            uint32_t codes = 0;
#pragma unroll
            for (uint32_t e = 0; e < 4; ++e) {
              const bool valid = 4 * q + e < nvalid;
              const uint32_t c = valid ? code_of[byte_of(sy[j][q], e)] : 0u;
              ecnt[j] += valid && c == esc;
              codes |= c << (e * k);
            }
            bw.put(codes, 4 * k);
          }
          bw.flush();
        }
      }
      if (any_lut) {
        const uint32_t par = it & 1;
#pragma unroll
        for (uint32_t j = 0; j < NS; ++j) {
          if (S.plan[j].mode != uint32_t(StreamMode::LUT)) continue;
          const uint32_t incl = warp_inclusive_sum(ecnt[j]);
          if (lane == 31) S.scan[par][j][warp] = incl;
          emine |= uint32_t(ecnt[j] != 0) << j;
          ecnt[j] = incl - ecnt[j];  // exclusive within the warp
        }
        named_sync(bar, kGroupThreads);
#pragma unroll
        for (uint32_t j = 0; j < NS; ++j) {
          const StreamPlan& p = S.plan[j];
          if (p.mode != uint32_t(StreamMode::LUT)) continue;
          uint32_t before = 0, total = 0;
#pragma unroll
          for (uint32_t q = 0; q < kGroupWarps; ++q) {
            const uint32_t v = S.scan[par][j][q];
            if (q < warp) before += v;
            total += v;
          }
          uint32_t idx = exc_base[j] + before + ecnt[j];
          exc_base[j] += total;
          if (!active || !((emine >> j) & 1)) continue;
          const uint32_t k = p.param, esc = (1u << k) - 1;
          const uint8_t* code_of = reinterpret_cast<const uint8_t*>(S.hist + kCodeOfOff) + 256 * j;
          uint8_t* exc = dst + p.sec + lut_exceptions_offset(k, n);
#pragma unroll
          for (uint32_t q = 0; q < G4; ++q) {
#pragma unroll
            for (uint32_t e = 0; e < 4; ++e) {
              const uint32_t sym = byte_of(sy[j][q], e);
              if (4 * q + e < nvalid && code_of[sym] == esc) exc[idx++] = uint8_t(sym);
            }
          }
        }
      }
    }
  }
  if (any_rans && warp < NS) {
#pragma unroll
    for (uint32_t j = 0; j < NS; ++j) {
      if (j != warp) continue;
      const StreamPlan& p = S.plan[j];
      if (p.mode != uint32_t(StreamMode::RANS)) continue;
      uint8_t* sec = dst + p.sec;
      const uint32_t* fc = S.hist + kFcOff + 256 * j;
      const uint32_t m = p.n_present;
      uint32_t bits = 0, fl[8];
#pragma unroll
      for (int r = 0; r < 8; ++r) {
        fl[r] = fc[lane * 8 + r] & 0xFFFFu;
        bits |= uint32_t(fl[r] != 0) << r;
      }
      sec[lane] = uint8_t(bits);
      uint32_t idx = warp_inclusive_sum(uint32_t(__popc(bits))) - __popc(bits);
#pragma unroll
      for (int r = 0; r < 8; ++r)
        if (fl[r]) { st_bytes(sec + kRansBitmapBytes + 2 * idx, fl[r], 2); ++idx; }
      const uint32_t so = rans_states_offset(m), wo = rans_words_offset(m);
      if (lane == 0) {
        zero_bytes(sec + kRansBitmapBytes + 2 * m, so - (kRansBitmapBytes + 2 * m));
        st_bytes(sec + so + 4 * kRansLanes, p.n_words, 4);
        zero_bytes(sec + so + 4 * kRansLanes + 4, wo - (so + 4 * kRansLanes + 4));
      }
      st_bytes(sec + so + 4 * lane, S.states[j][lane], 4);
      rans_run<F>(job.in, n, j, fc, 0, sec + wo, p.n_words, S.states[j]);
    }
  }
}

// ---------------------------------------------------------------- kernels

__global__ void __launch_bounds__(kGroups * kGroupThreads, 1) encode_kernel(EncArgs a) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const uint32_t grp = threadIdx.x / kGroupThreads, tid = threadIdx.x % kGroupThreads;
  GroupSmem& S = reinterpret_cast<GroupSmem*>(smem_raw)[grp];
  const uint32_t bar = 1 + grp;
  for (;;) {
    if (tid == 0) {
      uint32_t t = 0;
      const uint64_t g = draw_chunk<uint32_t(Share::kGeneral)>(a, a.tickets + kTicketEncode, &t);
      S.ticket = g;
      if (g < a.total_chunks) {
        S.tensor = t;
        S.chunk = uint32_t(g - a.tensors[t].chunk_base);
      }
    }
    named_sync(bar, kGroupThreads);
    const uint64_t g = S.ticket;
    if (g >= a.total_chunks) break;
    const EncTensor* t = a.tensors + S.tensor;
    ChunkJob job;
    job.t = t;
    job.g = g;
    job.i = S.chunk;
    const uint64_t begin = uint64_t(job.i) * a.chunk_bytes;
    job.in = t->in + begin;
    job.raw_len = uint32_t(umin64(a.chunk_bytes, t->nbytes - begin));
    job.codec = Codec(t->codec);
    job.last = job.i + 1 == t->n_chunks;
    if (job.codec == Codec::RAW) {
      if (tid < 32) {
        const uint64_t o = warp_look_back(a, job.g, job.i, job.raw_len);
        if (tid == 0) {
          S.offset = o;
          a.offsets[g] = o;
          a.sizes[g] = job.raw_len;
        }
      }
      named_sync(bar, kGroupThreads);
      threads_copy<kGroupThreads>(t->out + t->header_bytes + S.offset, job.in, job.raw_len, tid);
    } else {
      switch (family_of(Dtype(t->dtype), job.codec)) {
        case kFamBF16: encode_chunk<kFamBF16>(S, a, job, tid, bar); break;
        case kFamF16: encode_chunk<kFamF16>(S, a, job, tid, bar); break;
        case kFamF32: encode_chunk<kFamF32>(S, a, job, tid, bar); break;
        case kFamP1: encode_chunk<kFamP1>(S, a, job, tid, bar); break;
        case kFamP2: encode_chunk<kFamP2>(S, a, job, tid, bar); break;
        case kFamP4: encode_chunk<kFamP4>(S, a, job, tid, bar); break;
        default: encode_chunk<kFamP8>(S, a, job, tid, bar); break;
      }
    }
    named_sync(bar, kGroupThreads);
  }
}

/// Digest of each chunk's input (format version 2: xxhash32.h, chunk_digest), one warp per chunk, coalesced 16-byte
/// loads; consecutive chunks go to different blocks so that every SM of the grid gets work even when there are few.
__global__ void __launch_bounds__(1024, 1) digest_kernel(EncArgs a) {
  const uint32_t warps = blockDim.x / 32, w = threadIdx.x / 32;
  const uint64_t stride = uint64_t(gridDim.x) * warps;
  for (uint64_t g = uint64_t(w) * gridDim.x + blockIdx.x; g < a.total_chunks; g += stride) {
    const uint32_t t = find_tensor(a.tensors, a.n_tensors, g);
    const EncTensor& T = a.tensors[t];
    if (fast_kernel_takes(a, T)) continue;  // the fast encoder digests its chunks as it codes them
    const ChunkSpan c = chunk_span(a, T, g);
    const uint32_t d = warp_chunk_digest(T.in + c.begin, c.len);
    if (lane_id() == 0) a.digests[g] = d;
  }
}

/// Per tensor: chunk table, header (with checksum and header digest), frame size. Warp 0 computes the checksum while
/// the block writes the table, then the header digest over what the block wrote.
__global__ void __launch_bounds__(1024, 1) finalize_kernel(EncArgs a) {
  __shared__ uint32_t s_checksum;
  const uint32_t lane = lane_id();
  for (uint32_t ti = blockIdx.x; ti < a.n_tensors; ti += gridDim.x) {
    const EncTensor& T = a.tensors[ti];
    uint8_t* f = T.out;
    const uint32_t ndim = T.ndim;
    const uint64_t table = chunk_table_offset(ndim);
    const uint64_t nd = T.n_chunks;
    const uint32_t* dg = a.digests + T.chunk_base;
    if (threadIdx.x < 32) {
      Xxh32 cs;
      warp_stripes(cs, nd / 4, [&](uint64_t i) { return make_uint4(dg[4 * i], dg[4 * i + 1], dg[4 * i + 2], dg[4 * i + 3]); });
      if (lane == 0) {
        uint8_t tail[16];
        const uint64_t i0 = nd / 4 * 4;
        for (uint64_t k = i0; k < nd; ++k) store_le32(tail + 4 * (k - i0), dg[k]);
        s_checksum = cs.finish(tail, uint32_t(4 * (nd - i0)));
      }
    }
    for (uint64_t i = threadIdx.x; i < nd; i += blockDim.x) {
      const uint64_t g = T.chunk_base + i;
      uint8_t* e = f + table + kChunkEntryBytes * i;
      if (aligned16(e)) {
        const uint64_t o = a.offsets[g];
        *reinterpret_cast<uint4*>(e) = make_uint4(uint32_t(o), uint32_t(o >> 32), a.sizes[g], a.digests[g]);
      } else {
        st_bytes(e, a.offsets[g], 8);
        st_bytes(e + 8, a.sizes[g], 4);
        st_bytes(e + 12, a.digests[g], 4);
      }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      const uint64_t payload = nd ? a.offsets[T.chunk_base + nd - 1] + a.sizes[T.chunk_base + nd - 1] : 0;
      uint8_t h[kFixedHeaderBytes];
      for (uint32_t k = 0; k < kFixedHeaderBytes; ++k) h[k] = 0;
      store_le32(h + kOffMagic, kFrameMagic);
      store_le16(h + kOffVersion, kFormatVersion);
      h[kOffDtype] = T.dtype;
      h[kOffCodec] = T.codec;
      h[kOffNdim] = uint8_t(ndim);
      store_le32(h + kOffChunkBytes, a.chunk_bytes);
      store_le64(h + kOffNbytes, T.nbytes);
      store_le64(h + kOffPayloadBytes, payload);
      store_le32(h + kOffNumChunks, T.n_chunks);
      store_le32(h + kOffChecksum, s_checksum);
      for (uint32_t k = 0; k < kFixedHeaderBytes; ++k) f[k] = h[k];
      for (uint32_t d = 0; d < ndim; ++d) st_bytes(f + kOffShape + 8 * d, a.shapes[T.shape_off + d], 8);
      zero_bytes(f + kOffShape + 8 * ndim, table - (kOffShape + 8 * ndim));
      a.frame_bytes[ti] = T.header_bytes + payload;
    }
    __syncthreads();
    if (threadIdx.x < 32) {
      Xxh32 hd;
      warp_stripes(hd, T.header_bytes / 16, [&](uint64_t i) { return ld_stripe(f + 16 * i); });
      if (lane == 0) st_bytes(f + kOffHeaderDigest, hd.finish(f, 0), 4);
    }
    __syncthreads();
  }
}

// ---------------------------------------------------------------- auto

/// Exponent histogram (the FAST split's stream 0) of every auto tensor: one block per chunk at a time, replicated
/// u16 counters per chunk, accumulated per block in u64 and flushed to the tensor's global histogram.
__global__ void __launch_bounds__(1024, 1) auto_hist_kernel(EncArgs a) {
  __shared__ uint32_t rep[128 * 32];
  __shared__ unsigned long long acc[256];
  __shared__ unsigned long long s_g;
  __shared__ uint32_t s_t;
  uint32_t cur = 0xFFFFFFFFu;
  const uint32_t tid = threadIdx.x, lane = tid & 31;
  for (uint32_t i = tid; i < 256; i += blockDim.x) acc[i] = 0;
  for (;;) {
    for (uint32_t i = tid; i < 128 * 32; i += blockDim.x) rep[i] = 0;
    if (tid == 0) {
      unsigned long long g;
      uint32_t t = 0;
      for (;;) {  // next chunk of an auto tensor
        g = atomicAdd(a.tickets + kTicketAutoHist, 1ull);
        if (g >= a.total_chunks) break;
        t = find_tensor(a.tensors, a.n_tensors, g);
        if (a.tensors[t].is_auto) break;
      }
      s_g = g;
      s_t = t;
    }
    __syncthreads();
    const unsigned long long g = s_g;
    const uint32_t t = g < a.total_chunks ? s_t : 0xFFFFFFFFu;
    if (t != cur) {  // flush the block's histogram of the previous tensor
      if (cur != 0xFFFFFFFFu)
        for (uint32_t i = tid; i < 256; i += blockDim.x) {
          if (acc[i]) atomicAdd(a.auto_hist + 256ull * a.tensors[cur].auto_slot + i, acc[i]);
          acc[i] = 0;
        }
      cur = t;
    }
    if (g >= a.total_chunks) break;
    const EncTensor& T = a.tensors[t];
    const ChunkSpan c = chunk_span(a, T, g);
    const uint64_t begin = c.begin;
    const uint32_t len = c.len;
    const Dtype d = Dtype(T.dtype);
    const uint32_t es = dtype_size(d);
    const uint32_t n = len / es;
    __syncthreads();
    for (uint32_t s = tid; s * 64 < len; s += blockDim.x) {
      uint32_t wd[16];
      load_slice(T.in + begin + s * 64, min(64u, len - s * 64), wd);
      const uint32_t ept = 64 / es, nvalid = min(ept, n - s * ept);
      for (uint32_t q = 0; q * 4 < nvalid; ++q) {
        uint32_t sy[4];
        if (d == Dtype::BF16) Fam<kFamBF16>::split4(wd + 2 * q, sy);
        else if (d == Dtype::F16) Fam<kFamF16>::split4(wd + 2 * q, sy);
        else Fam<kFamF32>::split4(wd + 4 * q, sy);
        const uint32_t vc = min(4u, nvalid - 4 * q);
        for (uint32_t e = 0; e < vc; ++e) {
          const uint32_t b = byte_of(sy[0], e);
          atomicAdd(&rep[(b >> 1) * 32 + lane], 1u << ((b & 1) << 4));
        }
      }
    }
    __syncthreads();
    for (uint32_t b = tid; b < 256; b += blockDim.x) {
      const uint32_t row = b >> 1, sh = (b & 1) << 4;
      uint32_t c = 0;
      for (uint32_t r = 0; r < 32; ++r) c += (rep[row * 32 + ((r + row) & 31)] >> sh) & 0xFFFFu;
      acc[b] += c;
    }
    __syncthreads();
  }
}

/// One warp per auto tensor: tzip::resolve_auto's rule on the histogram.
__global__ void __launch_bounds__(256, 1) auto_resolve_kernel(EncArgs a) {
  const uint32_t lane = lane_id();
  const uint32_t warps = gridDim.x * (blockDim.x / 32);
  for (uint32_t ti = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; ti < a.n_tensors; ti += warps) {
    EncTensor& T = a.tensors[ti];
    if (!T.is_auto) continue;
    const Dtype d = Dtype(T.dtype);
    const uint64_t n = T.nbytes / dtype_size(d);
    Codec c = Codec::FAST;
    if (n > 0) {
      const unsigned long long* h = a.auto_hist + 256ull * T.auto_slot;
      unsigned long long key[8];
      const uint32_t ln = log2_fixed16(n);
      uint64_t cost = 0;
#pragma unroll
      for (int r = 0; r < 8; ++r) {
        const unsigned long long v = h[lane * 8 + r];
        key[r] = (v << 8) | (255u - (lane * 8 + r));
        if (v) cost += v * (ln - log2_fixed16(v));
      }
      cost = warp_sum(cost);
      warp_sort256_desc(key);
      unsigned long long pre[8], run = 0;
#pragma unroll
      for (int r = 0; r < 8; ++r) { run += key[r] >> 8; pre[r] = run; }
      const unsigned long long base = warp_inclusive_sum(run) - run;
      const uint32_t w = d == Dtype::F16 ? 5 : 8;
      uint64_t fast_bits = uint64_t(w) * n;
      for (uint32_t k = 1; k < w; ++k) {
        const uint32_t idx = (1u << k) - 2;
        unsigned long long v = 0;
#pragma unroll
        for (int r = 0; r < 8; ++r) if (uint32_t(r) == (idx & 7)) v = pre[r];
        const uint64_t covered = __shfl_sync(kFull, base + v, idx >> 3);
        fast_bits = umin64(fast_bits, uint64_t(k) * n + 8 * (n - covered));
      }
      const uint64_t max_bits = cost >> 16;
      if (fast_bits > max_bits && (fast_bits - max_bits) * 100 >= 2ull * 8 * T.nbytes) c = Codec::MAX;
    }
    if (lane == 0) T.codec = uint8_t(c);
  }
}

/// Zeroed workspace (tickets, look-back words) up to this size goes up with the descriptors instead of a memset.
constexpr size_t kZeroUploadBytes = size_t(64) << 10;

Status invalid(const std::string& m) {
  Status s;
  s.code = kInvalidArgument;
  s.message = m;
  return s;
}

}  // namespace

Status encode(const EncodeItem* items, size_t count, const EncodeOptions& opt, uint64_t* d_frame_bytes) {
  using namespace detail;
  if (count == 0) return Status{};
  if (!items || !d_frame_bytes) return invalid("encode: null items or frame size array");
  const uint32_t cs = opt.chunk_bytes;
  if (cs < kMinChunkBytes || cs > kMaxChunkBytes || cs % kChunkBytesMultiple != 0)
    return invalid("chunk size " + std::to_string(cs) + " must be a multiple of 256 between 4096 and 65536 bytes");
  if (count > UINT32_MAX) return invalid("too many tensors in one call");

  std::vector<EncTensor> tensors(count);
  std::vector<uint64_t> shapes;
  std::vector<const void*> ptrs;
  ptrs.push_back(d_frame_bytes);
  uint64_t total_chunks = 0, in_total = 0;
  uint32_t n_auto = 0;
  const bool use_fast = get_tuning().fast_encoder;
  bool need_general = false;
  uint32_t fast_kinds = 0;  // CodeKind bits of the fast encoder's tensors (none: it is not launched)
  for (size_t i = 0; i < count; ++i) {
    const EncodeItem& it = items[i];
    const std::string who = "tensor " + std::to_string(i) + ": ";
    if (it.dtype >= kNumDtypes) return invalid(who + "unknown dtype code " + std::to_string(it.dtype));
    if (it.codec >= kNumCodecs && it.codec != kCodecAuto) return invalid(who + "unknown codec id");
    if (it.ndim > kMaxNdim) return invalid(who + "at most 32 dimensions are supported");
    if (it.ndim && !it.shape) return invalid(who + "null shape");
    const Dtype d = Dtype(it.dtype);
    unsigned __int128 total = dtype_size(d);
    bool overflow = false, zero = false;
    for (uint32_t k = 0; k < it.ndim; ++k) {
      if (it.shape[k] == 0) zero = true;
      total *= it.shape[k];
      if (total > UINT64_MAX) overflow = true;
    }
    const uint64_t expect = zero ? 0 : overflow ? ~0ull : uint64_t(total);
    if ((overflow && !zero) || expect != it.nbytes)
      return invalid(who + "input is " + std::to_string(it.nbytes) + " bytes but the shape needs " +
                     std::to_string(expect));
    if (!it.frame) return invalid(who + "null frame pointer");
    if (it.nbytes && !it.data) return invalid(who + "null data pointer");
    const uint64_t nch = num_chunks(it.nbytes, cs);
    if (nch > UINT32_MAX) return invalid(who + "tensor too large for one frame");
    EncTensor& t = tensors[i];
    std::memset(&t, 0, sizeof t);
    t.in = static_cast<const uint8_t*>(it.data);
    t.out = static_cast<uint8_t*>(it.frame);
    t.nbytes = it.nbytes;
    t.chunk_base = total_chunks;
    t.n_chunks = uint32_t(nch);
    t.header_bytes = frame_header_bytes(it.ndim, nch);
    t.shape_off = shapes.size();
    t.dtype = it.dtype;
    t.ndim = uint8_t(it.ndim);
    Codec c = it.codec == kCodecAuto ? Codec::MAX : Codec(it.codec);
    if (it.codec == kCodecAuto) {
      if (!dtype_is_split_float(d)) c = Codec::BYTES;
      else if (it.nbytes < dtype_size(d)) c = Codec::FAST;
      else { t.is_auto = 1; t.auto_slot = n_auto++; c = Codec::FAST; }
    }
    if ((c == Codec::FAST || c == Codec::MAX) && !dtype_is_split_float(d)) c = Codec::BYTES;
    t.codec = uint8_t(c);
    t.aligned = ((reinterpret_cast<uintptr_t>(it.data) | reinterpret_cast<uintptr_t>(it.frame)) & 15) == 0;
    // Which coding kernels the batch needs: an auto tensor may resolve to fast or max on the device.
    if (nch) {
      const bool fast_able = use_fast && t.aligned && (c == Codec::FAST || c == Codec::RAW);
      if (fast_able) fast_kinds |= 1u << code_kind(t.dtype, t.codec);
      need_general |= !fast_able || t.is_auto;
    }
    for (uint32_t k = 0; k < it.ndim; ++k) shapes.push_back(it.shape[k]);
    total_chunks += nch;
    in_total += it.nbytes;
    ptrs.push_back(it.frame);
    if (it.nbytes) ptrs.push_back(it.data);
  }

  DeviceGuard guard;
  Status st = opt.device >= 0 ? guard.bind_device(opt.device) : guard.bind(ptrs.data(), ptrs.size());
  if (!st.ok()) return st;
  void* stream = opt.stream;

  // Workspace: descriptors, shapes, tickets, look-back words, offsets, sizes, digests, auto histograms, fast plans.
  auto al = [](size_t x) { return (x + 255) & ~size_t(255); };
  const size_t b_tensors = al(sizeof(EncTensor) * count), b_shapes = al(8 * std::max<size_t>(1, shapes.size())),
               b_tickets = al(8 * kNumTickets), b_status = al(8 * total_chunks), b_offsets = al(8 * total_chunks),
               b_sizes = al(4 * total_chunks), b_digests = al(4 * total_chunks), b_hist = al(8 * 256ull * n_auto),
               b_plans = (fast_kinds & ~(1u << kCodeRaw)) ? al(sizeof(FastPlan) * total_chunks) : 0;
  const size_t total = b_tensors + b_shapes + b_tickets + b_status + b_offsets + b_sizes + b_digests + b_hist + b_plans;
  void* ws = nullptr;
  st = alloc_async(&ws, total, stream);
  if (!st.ok()) return st;
  uint8_t* p = static_cast<uint8_t*>(ws);
  EncArgs a{};
  a.tensors = reinterpret_cast<EncTensor*>(p); p += b_tensors;
  uint64_t* d_shapes = reinterpret_cast<uint64_t*>(p); p += b_shapes;
  a.tickets = reinterpret_cast<unsigned long long*>(p); p += b_tickets;
  a.status = reinterpret_cast<unsigned long long*>(p); p += b_status;
  a.offsets = reinterpret_cast<unsigned long long*>(p); p += b_offsets;
  a.sizes = reinterpret_cast<uint32_t*>(p); p += b_sizes;
  a.digests = reinterpret_cast<uint32_t*>(p); p += b_digests;
  a.auto_hist = reinterpret_cast<unsigned long long*>(p); p += b_hist;
  a.plans = b_plans ? reinterpret_cast<FastPlan*>(p) : nullptr; p += b_plans;
  a.shapes = d_shapes;
  a.n_tensors = uint32_t(count);
  a.chunk_bytes = cs;
  a.total_chunks = total_chunks;
  a.frame_bytes = d_frame_bytes;
  a.use_fast = use_fast;

  auto fail = [&](Status s) {
    free_async(ws, stream);
    return s;
  };
  // Descriptors, shapes, tickets and look-back words are contiguous. One upload brings the descriptors and shapes and,
  // when they are few (kZeroUploadBytes), the zeroed tickets and look-back words too: a small call's fixed cost is
  // mostly its stream operations (gpu_test --small-calls), and this saves two of them.
  const bool zeros_too = b_tickets + b_status <= kZeroUploadBytes;
  const cudaStream_t s = cudaStream_t(stream);
  const int sms = guard.sm_count();
  // The memsets and kernels of the call, in order (queued after the descriptors' upload).
  auto kernels = [&]() -> Status {
    Status r;
    if (!zeros_too && !(r = memset_async(a.tickets, 0, b_tickets + b_status, stream)).ok()) return r;
    if (n_auto && !(r = memset_async(a.auto_hist, 0, 8 * 256ull * n_auto, stream)).ok()) return r;
    int grid = 0;
    size_t smem = 0;
    if (n_auto) {
      if (!(r = persistent_grid(reinterpret_cast<const void*>(auto_hist_kernel), 1024, &smem, opt.sm_budget, sms,
                                total_chunks, &grid)).ok())
        return r;
      auto_hist_kernel<<<grid, 1024, smem, s>>>(a);
      if (!(r = check_launch("auto_hist_kernel")).ok()) return r;
      smem = 0;
      if (!(r = persistent_grid(reinterpret_cast<const void*>(auto_resolve_kernel), 256, &smem, opt.sm_budget, sms,
                                (count + 7) / 8, &grid)).ok())
        return r;
      auto_resolve_kernel<<<grid, 256, smem, s>>>(a);
      if (!(r = check_launch("auto_resolve_kernel")).ok()) return r;
    }
    if (fast_kinds && !(r = launch_fast_encode(a, fast_kinds, opt.sm_budget, sms, s)).ok()) return r;
    if (need_general) {
      smem = 0;
      if (!(r = persistent_grid(reinterpret_cast<const void*>(digest_kernel), 1024, &smem, opt.sm_budget, sms,
                                total_chunks, &grid)).ok())
        return r;
      digest_kernel<<<grid, 1024, smem, s>>>(a);
      if (!(r = check_launch("digest_kernel")).ok()) return r;
      smem = sizeof(GroupSmem) * kGroups;
      if (!(r = persistent_grid(reinterpret_cast<const void*>(encode_kernel), kGroups * kGroupThreads, &smem,
                                opt.sm_budget, sms, (total_chunks + kGroups - 1) / kGroups, &grid)).ok())
        return r;
      encode_kernel<<<grid, kGroups * kGroupThreads, smem, s>>>(a);
      if (!(r = check_launch("encode_kernel")).ok()) return r;
    }
    smem = 0;
    if (!(r = persistent_grid(reinterpret_cast<const void*>(finalize_kernel), 1024, &smem, opt.sm_budget, sms, count,
                              &grid)).ok())
      return r;
    finalize_kernel<<<grid, 1024, smem, s>>>(a);
    return check_launch("finalize_kernel");
  };
  {
    std::vector<uint8_t> image(b_tensors + b_shapes + (zeros_too ? b_tickets + b_status : 0), 0);
    std::memcpy(image.data(), tensors.data(), sizeof(EncTensor) * count);
    if (!shapes.empty()) std::memcpy(image.data() + b_tensors, shapes.data(), 8 * shapes.size());
    // A small call of a caller that allows it (opt.graphs) is replayed from a CUDA graph of the whole sequence, kept
    // per stream and everything the kernels' arguments are made of (gpu/graph.h).
    if (opt.graphs && count <= kGraphMaxItems && in_total <= kGraphMaxBytes) {
      GraphKey key;
      key.w = {2, uint64_t(guard.device()), uint64_t(reinterpret_cast<uintptr_t>(stream)), count, cs, total_chunks,
               shapes.size(), n_auto, uint64_t(need_general << 1 | use_fast << 2 | zeros_too << 3 | fast_kinds << 4),
               uint64_t(int64_t(opt.sm_budget)), uint64_t(reinterpret_cast<uintptr_t>(ws)),
               uint64_t(reinterpret_cast<uintptr_t>(d_frame_bytes)), image.size(), uint64_t(sms)};
      if (launch_graph(key, image.data(), image.size(), a.tensors, stream, kernels)) {
        free_async(ws, stream);
        return Status{};
      }
    }
    if (!(st = upload(a.tensors, image.data(), image.size(), stream)).ok()) return fail(st);
  }
  if (!(st = kernels()).ok()) return fail(st);
  free_async(ws, stream);
  return Status{};
}

}  // namespace gpu
}  // namespace tzip
