// Device-side primitives of the CUDA backend (warp scans and sorts, SIMD byte shuffles, vector loads, a streaming
// XXH32, relaxed global atomics for the decoupled look-back). Only nvcc sees the bodies; the header is empty for a
// plain C++ compiler. Everything here computes exactly what the shared headers (xxhash32.h, format.h) define: it is
// a faster route to the same numbers, never a different rule.
#pragma once
#include "tzip/hostdevice.h"

#if defined(__CUDACC__)
#include "tzip/format.h"
#include "tzip/xxhash32.h"

namespace tzip {
namespace dev {

constexpr unsigned kFull = 0xFFFFFFFFu;

__device__ __forceinline__ uint64_t umin64(uint64_t a, uint64_t b) { return a < b ? a : b; }
__device__ __forceinline__ uint32_t umin32(uint32_t a, uint32_t b) { return a < b ? a : b; }

__device__ __forceinline__ uint32_t lane_id() { return threadIdx.x & 31u; }
__device__ __forceinline__ uint32_t lanemask_lt() {
  uint32_t m;
  asm("mov.u32 %0, %%lanemask_lt;" : "=r"(m));
  return m;
}

// ---------------------------------------------------------------- warp scans and reductions

template <typename T>
__device__ __forceinline__ T warp_inclusive_sum(T v) {
  const uint32_t lane = lane_id();
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const T o = __shfl_up_sync(kFull, v, d);
    if (lane >= uint32_t(d)) v += o;
  }
  return v;
}
template <typename T>
__device__ __forceinline__ T warp_sum(T v) {
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) v += __shfl_xor_sync(kFull, v, d);
  return v;
}
__device__ __forceinline__ uint32_t warp_or(uint32_t v) { return __reduce_or_sync(kFull, v); }

/// Argmax over the warp of (value, index): the largest value, ties to the lowest index. Every lane gets the result.
template <typename T>
__device__ __forceinline__ void warp_argmax(T& v, uint32_t& idx) {
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) {
    const T ov = __shfl_xor_sync(kFull, v, d);
    const uint32_t oi = __shfl_xor_sync(kFull, idx, d);
    if (ov > v || (ov == v && oi < idx)) { v = ov; idx = oi; }
  }
}

/// Bitonic sort of 256 keys held 8 per lane (element i = lane * 8 + r), descending. Keys must be distinct for a
/// deterministic order (callers fold the symbol into the key).
template <typename T>
__device__ __forceinline__ void warp_sort256_desc(T (&k)[8]) {
  const uint32_t lane = lane_id();
#pragma unroll
  for (uint32_t size = 2; size <= 256; size <<= 1) {
#pragma unroll
    for (uint32_t stride = size >> 1; stride > 0; stride >>= 1) {
      if (stride >= 8) {
        const uint32_t ls = stride >> 3;  // partner lane distance
#pragma unroll
        for (uint32_t r = 0; r < 8; ++r) {
          const uint32_t i = lane * 8 + r;
          const T o = __shfl_xor_sync(kFull, k[r], ls);
          const bool desc = (i & size) == 0;  // this block sorts descending
          const bool lower = (lane & ls) == 0;
          // lower element keeps the larger key when descending
          const bool keep_max = lower == desc;
          k[r] = keep_max ? (k[r] > o ? k[r] : o) : (k[r] < o ? k[r] : o);
        }
      } else {
#pragma unroll
        for (uint32_t r = 0; r < 8; ++r) {
          if ((r & stride) == 0) {
            const uint32_t i = lane * 8 + r;
            const bool desc = (i & size) == 0;
            const T a = k[r], b = k[r + stride];
            const bool swap = desc ? (a < b) : (a > b);
            k[r] = swap ? b : a;
            k[r + stride] = swap ? a : b;
          }
        }
      }
    }
  }
}

// ---------------------------------------------------------------- SIMD byte helpers

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t s) { return __byte_perm(a, b, s); }
/// Bitwise select, (a & m) | (b & ~m), as one LOP3 (the compiler splits the C expression into two when m is a
/// constant, since LOP3 takes one immediate).
__device__ __forceinline__ uint32_t bitsel(uint32_t a, uint32_t b, uint32_t m) {
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, 0xE4;" : "=r"(d) : "r"(a), "r"(b), "r"(m));
  return d;
}
__device__ __forceinline__ uint32_t rep4(uint32_t byte) { return byte * 0x01010101u; }
__device__ __forceinline__ uint32_t byte_of(uint32_t w, uint32_t q) { return (w >> (8 * q)) & 0xFFu; }

// ---------------------------------------------------------------- global memory helpers

__device__ __forceinline__ bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

__device__ __forceinline__ uint64_t ld_relaxed(const unsigned long long* p) {
  unsigned long long v;
  asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_relaxed(unsigned long long* p, unsigned long long v) {
  asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

/// Loads `n` (<= 4) little-endian bytes that may be unaligned.
__device__ __forceinline__ uint32_t ld_bytes_le(const uint8_t* p, uint32_t n) {
  uint32_t v = 0;
  for (uint32_t j = 0; j < n; ++j) v |= uint32_t(p[j]) << (8 * j);
  return v;
}

/// Stores the low `n` (<= 8) bytes of v at p, with the widest stores the address allows.
__device__ __forceinline__ void st_bytes(uint8_t* p, uint64_t v, uint32_t n) {
  while (n) {
    const uintptr_t a = reinterpret_cast<uintptr_t>(p);
    if (n >= 8 && (a & 7) == 0) { *reinterpret_cast<uint64_t*>(p) = v; return; }
    if (n >= 4 && (a & 3) == 0) { *reinterpret_cast<uint32_t*>(p) = uint32_t(v); p += 4; v >>= 32; n -= 4; continue; }
    if (n >= 2 && (a & 1) == 0) { *reinterpret_cast<uint16_t*>(p) = uint16_t(v); p += 2; v >>= 16; n -= 2; continue; }
    *p = uint8_t(v); ++p; v >>= 8; --n;
  }
}

// ---------------------------------------------------------------- XXH32, streaming

/// XXH32 (seed 0) state over a byte stream fed in 16-byte stripes, then finished with the tail. Gives exactly
/// tzip::xxh32 of the concatenated bytes.
struct Xxh32 {
  uint32_t v1 = kXXH32Prime1 + kXXH32Prime2, v2 = kXXH32Prime2, v3 = 0, v4 = 0u - kXXH32Prime1;
  uint64_t total = 0;
  __device__ __forceinline__ void stripe(uint32_t a, uint32_t b, uint32_t c, uint32_t d) {
    rounds(a, b, c, d);
    total += 16;
  }
  /// stripe() without counting the bytes: for a caller that sets `total` once, before finish (a 64-bit add per stripe
  /// less in a hot loop).
  __device__ __forceinline__ void rounds(uint32_t a, uint32_t b, uint32_t c, uint32_t d) {
    v1 = xxh32_round(v1, a);
    v2 = xxh32_round(v2, b);
    v3 = xxh32_round(v3, c);
    v4 = xxh32_round(v4, d);
  }
  /// Finishes with `len` (< 16) tail bytes at p (any alignment).
  __device__ __forceinline__ uint32_t finish(const uint8_t* p, uint32_t len) const {
    const uint64_t all = total + len;
    uint32_t h = all >= 16 ? rotl32(v1, 1) + rotl32(v2, 7) + rotl32(v3, 12) + rotl32(v4, 18) : kXXH32Prime5;
    h += uint32_t(all);
    return xxh32_finish(h, p, 0, len);
  }
  /// Feeds all whole stripes of [p, p + len) and returns how many bytes were consumed (a multiple of 16).
  /// Uses 16-byte loads, four stripes in flight, when p is 16-byte aligned; byte loads otherwise.
  __device__ __forceinline__ uint64_t stripes(const uint8_t* p, uint64_t len) {
    const uint64_t n = len / 16;
    uint64_t s = 0;
    if (aligned16(p)) {
      const uint4* q = reinterpret_cast<const uint4*>(p);
      for (; s + 8 <= n; s += 8) {
        uint4 v[8];
#pragma unroll
        for (int k = 0; k < 8; ++k) v[k] = q[s + k];
#pragma unroll
        for (int k = 0; k < 8; ++k) stripe(v[k].x, v[k].y, v[k].z, v[k].w);
      }
      for (; s < n; ++s) {
        const uint4 a = q[s];
        stripe(a.x, a.y, a.z, a.w);
      }
    } else {
      for (; s < n; ++s) {
        const uint8_t* b = p + 16 * s;
        stripe(ld_bytes_le(b, 4), ld_bytes_le(b + 4, 4), ld_bytes_le(b + 8, 4), ld_bytes_le(b + 12, 4));
      }
    }
    return n * 16;
  }
};

/// XXH32 (seed 0) of [p, p + len), one thread.
__device__ __forceinline__ uint32_t xxh32_dev(const uint8_t* p, uint64_t len) {
  Xxh32 st;
  const uint64_t done = st.stripes(p, len);
  return st.finish(p + done, uint32_t(len - done));
}

/// 16 bytes at p as little-endian words (16-byte load when aligned).
__device__ __forceinline__ uint4 ld_stripe(const uint8_t* p) {
  if (aligned16(p)) return *reinterpret_cast<const uint4*>(p);
  return make_uint4(ld_bytes_le(p, 4), ld_bytes_le(p + 4, 4), ld_bytes_le(p + 8, 4), ld_bytes_le(p + 12, 4));
}

// ---------------------------------------------------------------- chunk digest (format version 2), one warp

/// Feeds lane l's stripes of a chunk to its state `st`: the whole 16-byte stripes s = from + l, from + l + 32, ... of
/// the `len` bytes at p, in order (xxhash32.h, chunk_digest: lane l hashes the stripes s with s mod 32 == l). `from`
/// is a multiple of 32: the stripes before it were fed already (by a decoder, as it wrote them). Eight stripes per lane
/// are loaded before they are hashed, so a warp keeps 4 KiB of loads in flight.
__device__ __forceinline__ void digest_stripes(Xxh32& st, const uint8_t* p, uint32_t len, uint32_t from) {
  const uint32_t n = len / 16;
  uint32_t s = from + lane_id();
  if (aligned16(p)) {
    const uint4* q = reinterpret_cast<const uint4*>(p);
    for (; s + 7 * 32 < n; s += 8 * 32) {
      uint4 v[8];
#pragma unroll
      for (int k = 0; k < 8; ++k) v[k] = q[s + 32 * k];
#pragma unroll
      for (int k = 0; k < 8; ++k) st.stripe(v[k].x, v[k].y, v[k].z, v[k].w);
    }
    for (; s < n; s += 32) {
      const uint4 v = q[s];
      st.stripe(v.x, v.y, v.z, v.w);
    }
  } else {
    for (; s < n; s += 32) {
      const uint4 v = ld_stripe(p + 16ull * s);
      st.stripe(v.x, v.y, v.z, v.w);
    }
  }
}

/// The chunk digest from the lanes' states once every whole stripe of the `len` bytes at p has been fed: the last,
/// partial stripe (len % 16 bytes) goes to its lane's tail, every lane finishes its XXH32, and the 32 lane digests,
/// as 128 little-endian bytes, are hashed once more. Every lane returns the digest.
__device__ __forceinline__ uint32_t digest_finish(const Xxh32& st, const uint8_t* p, uint32_t len) {
  const uint32_t whole = len / 16, rest = len % 16;
  const bool tail = rest != 0 && (whole & 31u) == lane_id();
  const uint32_t d = st.finish(tail ? p + 16ull * whole : p, tail ? rest : 0u);
  Xxh32 top;
#pragma unroll
  for (int i = 0; i < 8; ++i)
    top.stripe(__shfl_sync(kFull, d, 4 * i), __shfl_sync(kFull, d, 4 * i + 1), __shfl_sync(kFull, d, 4 * i + 2),
               __shfl_sync(kFull, d, 4 * i + 3));
  return top.finish(p, 0);
}

/// Chunk digest of the `len` bytes at p (any alignment), one warp; every lane returns it.
__device__ __forceinline__ uint32_t warp_chunk_digest(const uint8_t* p, uint32_t len) {
  Xxh32 st;
  digest_stripes(st, p, len, 0);
  return digest_finish(st, p, len);
}

/// Warp-cooperative XXH32 over a stream of `nstripes` 16-byte stripes, stripe i given by get(i): each lane loads one
/// stripe per round (two rounds ahead of use), lane 0 feeds them to `st` in order through shuffles. The state is
/// meaningful in lane 0 only. A serial hash, but its loads are no longer one at a time.
template <class Get>
__device__ void warp_stripes(Xxh32& st, uint64_t nstripes, Get get) {
  const uint32_t lane = lane_id();
  auto fetch = [&](uint64_t i) { return i < nstripes ? get(i) : make_uint4(0, 0, 0, 0); };
  uint4 c0 = fetch(lane), c1 = fetch(32 + lane);
  for (uint64_t b = 0; b < nstripes; b += 32) {
    const uint4 c2 = fetch(b + 64 + lane);
    const uint32_t cnt = uint32_t(umin64(32, nstripes - b));
    for (uint32_t k = 0; k < cnt; ++k) {
      const uint32_t x = __shfl_sync(kFull, c0.x, k), y = __shfl_sync(kFull, c0.y, k);
      const uint32_t z = __shfl_sync(kFull, c0.z, k), w = __shfl_sync(kFull, c0.w, k);
      if (lane == 0) st.stripe(x, y, z, w);
    }
    c0 = c1;
    c1 = c2;
  }
}

// ---------------------------------------------------------------- stream families, 4 elements at a time
// A family is how (dtype, codec) splits an element into streams (format.h, split_element / merge_element). split4 takes
// 4 consecutive elements as esize little-endian u32 words and returns, per stream, their 4 symbols as the bytes of one
// u32 (element 0 in the low byte); merge4 is its inverse. Same results as split_element / merge_element, element by
// element (checked by the tests against the CPU encoder).

enum FamilyId : uint32_t { kFamBF16 = 0, kFamF16 = 1, kFamF32 = 2, kFamP1 = 3, kFamP2 = 4, kFamP4 = 5, kFamP8 = 6 };
constexpr uint32_t kNumFamilies = 7;

TZIP_HD uint32_t family_of(Dtype d, Codec c) {
  if ((c == Codec::FAST || c == Codec::MAX) && dtype_is_split_float(d))
    return d == Dtype::BF16 ? kFamBF16 : d == Dtype::F16 ? kFamF16 : kFamF32;
  switch (dtype_size(d)) {
    case 1: return kFamP1;
    case 2: return kFamP2;
    case 4: return kFamP4;
    default: return kFamP8;
  }
}

/// 4x4 byte transpose: r_j = [a.byte j, b.byte j, c.byte j, d.byte j].
__device__ __forceinline__ void transpose4(uint32_t a, uint32_t b, uint32_t c, uint32_t d, uint32_t* r) {
  const uint32_t t0 = prmt(a, b, 0x5140), t1 = prmt(a, b, 0x7362), t2 = prmt(c, d, 0x5140), t3 = prmt(c, d, 0x7362);
  r[0] = prmt(t0, t2, 0x5410);
  r[1] = prmt(t0, t2, 0x7632);
  r[2] = prmt(t1, t3, 0x5410);
  r[3] = prmt(t1, t3, 0x7632);
}

template <uint32_t F> struct Fam;

template <> struct Fam<kFamBF16> {
  static constexpr uint32_t kEsize = 2, kCount = 2;
  static constexpr bool kSplit = true;
  __host__ __device__ static constexpr uint32_t width(uint32_t) { return 8; }
  __device__ __forceinline__ static void split4(const uint32_t* in, uint32_t* s) {
    const uint32_t lo = prmt(in[0], in[1], 0x6420), hi = prmt(in[0], in[1], 0x7531);
    s[0] = ((hi << 1) & 0xFEFEFEFEu) | ((lo >> 7) & 0x01010101u);
    s[1] = (hi & 0x80808080u) | (lo & 0x7F7F7F7Fu);
  }
  __device__ __forceinline__ static void merge4(const uint32_t* s, uint32_t* out) {
    const uint32_t L = ((s[0] << 7) & 0x80808080u) | (s[1] & 0x7F7F7F7Fu);
    const uint32_t H = (s[1] & 0x80808080u) | ((s[0] >> 1) & 0x7F7F7F7Fu);
    out[0] = prmt(L, H, 0x5140);
    out[1] = prmt(L, H, 0x7362);
  }
};

template <> struct Fam<kFamF16> {
  static constexpr uint32_t kEsize = 2, kCount = 3;
  static constexpr bool kSplit = true;
  __host__ __device__ static constexpr uint32_t width(uint32_t j) { return j == 0 ? 5 : j == 1 ? 8 : 3; }
  __device__ __forceinline__ static void split4(const uint32_t* in, uint32_t* s) {
    const uint32_t lo = prmt(in[0], in[1], 0x6420), hi = prmt(in[0], in[1], 0x7531);
    s[0] = (hi >> 2) & 0x1F1F1F1Fu;
    s[1] = lo;
    s[2] = ((hi >> 5) & 0x04040404u) | (hi & 0x03030303u);
  }
  __device__ __forceinline__ static void merge4(const uint32_t* s, uint32_t* out) {
    const uint32_t H = ((s[2] & 0x04040404u) << 5) | ((s[0] & 0x1F1F1F1Fu) << 2) | (s[2] & 0x03030303u);
    out[0] = prmt(s[1], H, 0x5140);
    out[1] = prmt(s[1], H, 0x7362);
  }
};

template <> struct Fam<kFamF32> {
  static constexpr uint32_t kEsize = 4, kCount = 4;
  static constexpr bool kSplit = true;
  __host__ __device__ static constexpr uint32_t width(uint32_t) { return 8; }
  __device__ __forceinline__ static void split4(const uint32_t* in, uint32_t* s) {
    uint32_t b[4];
    transpose4(in[0], in[1], in[2], in[3], b);
    s[0] = ((b[3] << 1) & 0xFEFEFEFEu) | ((b[2] >> 7) & 0x01010101u);
    s[1] = b[0];
    s[2] = b[1];
    s[3] = (b[3] & 0x80808080u) | (b[2] & 0x7F7F7F7Fu);
  }
  __device__ __forceinline__ static void merge4(const uint32_t* s, uint32_t* out) {
    const uint32_t b2 = ((s[0] << 7) & 0x80808080u) | (s[3] & 0x7F7F7F7Fu);
    const uint32_t b3 = (s[3] & 0x80808080u) | ((s[0] >> 1) & 0x7F7F7F7Fu);
    transpose4(s[1], s[2], b2, b3, out);
  }
};

template <> struct Fam<kFamP1> {
  static constexpr uint32_t kEsize = 1, kCount = 1;
  static constexpr bool kSplit = false;
  __host__ __device__ static constexpr uint32_t width(uint32_t) { return 8; }
  __device__ __forceinline__ static void split4(const uint32_t* in, uint32_t* s) { s[0] = in[0]; }
  __device__ __forceinline__ static void merge4(const uint32_t* s, uint32_t* out) { out[0] = s[0]; }
};

template <> struct Fam<kFamP2> {
  static constexpr uint32_t kEsize = 2, kCount = 2;
  static constexpr bool kSplit = false;
  __host__ __device__ static constexpr uint32_t width(uint32_t) { return 8; }
  __device__ __forceinline__ static void split4(const uint32_t* in, uint32_t* s) {
    s[0] = prmt(in[0], in[1], 0x6420);
    s[1] = prmt(in[0], in[1], 0x7531);
  }
  __device__ __forceinline__ static void merge4(const uint32_t* s, uint32_t* out) {
    out[0] = prmt(s[0], s[1], 0x5140);
    out[1] = prmt(s[0], s[1], 0x7362);
  }
};

template <> struct Fam<kFamP4> {
  static constexpr uint32_t kEsize = 4, kCount = 4;
  static constexpr bool kSplit = false;
  __host__ __device__ static constexpr uint32_t width(uint32_t) { return 8; }
  __device__ __forceinline__ static void split4(const uint32_t* in, uint32_t* s) { transpose4(in[0], in[1], in[2], in[3], s); }
  __device__ __forceinline__ static void merge4(const uint32_t* s, uint32_t* out) { transpose4(s[0], s[1], s[2], s[3], out); }
};

template <> struct Fam<kFamP8> {
  static constexpr uint32_t kEsize = 8, kCount = 8;
  static constexpr bool kSplit = false;
  __host__ __device__ static constexpr uint32_t width(uint32_t) { return 8; }
  __device__ __forceinline__ static void split4(const uint32_t* in, uint32_t* s) {
    transpose4(in[0], in[2], in[4], in[6], s);
    transpose4(in[1], in[3], in[5], in[7], s + 4);
  }
  __device__ __forceinline__ static void merge4(const uint32_t* s, uint32_t* out) {
    uint32_t lo[4], hi[4];
    transpose4(s[0], s[1], s[2], s[3], lo);
    transpose4(s[4], s[5], s[6], s[7], hi);
#pragma unroll
    for (int e = 0; e < 4; ++e) { out[2 * e] = lo[e]; out[2 * e + 1] = hi[e]; }
  }
};

}  // namespace dev
}  // namespace tzip

#endif  // __CUDACC__
