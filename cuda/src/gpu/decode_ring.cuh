// Decoder, per warp: its shared-memory layout, chunk results, plain warp copies and the ring of tiles that bulk copies
// fill (the fixed-rate streams of the next tiles, chunks stored raw). Included by decode_kernel.cuh through
// decode_chunk.cuh; one copy per decode kernel's translation unit (anonymous namespace).
#pragma once

#include "gpu/decode_args.cuh"

namespace tzip {
namespace gpu {
namespace dec {
namespace {

constexpr uint32_t kTile = 1024;  // elements per tile: 32 steps of 32 lanes

/// Per-warp shared memory, laid out by byte offsets: C RANS tables, L LUT tables, a ring of RING bytes that bulk copies
/// fill with the fixed-rate streams of the next tiles, a LUT stream's exceptions and the ring's mbarriers (STREAM
/// kernels).
/// Bytes of a warp's shared memory that hold a LUT stream's exceptions in decode kernel class `mode`. Only the bf16
/// kernel (class 3) copies them there (chunks with at most this many; the others, and every chunk of the other
/// classes, read them from global memory): in the class-1 kernel the copy path costs registers that its fp32 paths
/// need (ptxas spills), and class 2 has no room left. 2560 bytes hold the exceptions of every chunk of MiniLM's bf16
/// weights and gradients (at most 2339 in a 64 KiB chunk); more would leave less L1 for the global reads.
constexpr uint32_t exc_smem_bytes(int mode) { return mode == 3 ? 2560 : 0; }

template <uint32_t C, uint32_t L, uint32_t RING, uint32_t XS>
struct WarpLayout {
  static constexpr uint32_t kRansSym = 0;                   // u8 [C][4096]
  static constexpr uint32_t kRansFc = kRansSym + 4096 * C;  // u32 [C][256]
  static constexpr uint32_t kLut = kRansFc + 1024 * C;      // u8 [L][128]
  static constexpr uint32_t kRing = kLut + 128 * L;
  static constexpr uint32_t kStage = kRing + RING;          // u8 [kTile] exponent symbols of a tile (tile path)
  static constexpr uint32_t kExc = kStage + (RING > 0 ? kTile : 0);  // u8 [kExcBytes] a LUT stream's exceptions
  static constexpr uint32_t kExcBytes = RING > 0 ? XS : 0;  // exc_smem_bytes
  static constexpr uint32_t kBars = kExc + kExcBytes;       // u64 [4] the ring slots' mbarriers, u32 their parities
  static constexpr uint32_t kBytes = kBars + (RING > 0 ? 48 : 0);
  static_assert(kRing % 16 == 0 && kBytes % 16 == 0, "bulk copies need 16-byte aligned slots in every warp's area");
};

enum ChunkResult : int { kChunkOk = 0, kChunkBad = 1, kChunkDefer = 2 };
/// A rejection, with the line of the check that failed (for Tuning::debug traces): bit 0 set, line above bit 2.
__device__ __forceinline__ int kBadAt(int line) { return (line << 2) | kChunkBad; }

/// Copies n bytes with one warp. With `verify`, lane l feeds the 16-byte stripes l, l + 32, ... it copies to its
/// chunk-digest state `dg` and sets `from` past the last whole stripe it fed (aligned copies only; otherwise the
/// caller hashes the copied bytes afterwards from stripe `from` = 0).
__device__ void warp_copy(uint8_t* dst, const uint8_t* src, uint32_t n, bool verify, Xxh32& dg, uint32_t& from) {
  const uint32_t lane = lane_id();
  if (aligned16(dst) && aligned16(src)) {
    const uint32_t nv = n / 16;
    const uint4* s = reinterpret_cast<const uint4*>(src);
    uint4* d = reinterpret_cast<uint4*>(dst);
    uint32_t v = lane;
    for (; v + 224 < nv; v += 256) {
      uint4 x[8];
#pragma unroll
      for (int q = 0; q < 8; ++q) x[q] = s[v + 32 * q];
#pragma unroll
      for (int q = 0; q < 8; ++q) d[v + 32 * q] = x[q];
      if (verify) {
#pragma unroll
        for (int q = 0; q < 8; ++q) dg.stripe(x[q].x, x[q].y, x[q].z, x[q].w);
      }
    }
    for (; v < nv; v += 32) {
      const uint4 x = s[v];
      d[v] = x;
      if (verify) dg.stripe(x.x, x.y, x.z, x.w);
    }
    for (uint32_t b = nv * 16 + lane; b < n; b += 32) dst[b] = src[b];
    from = (nv + 31) & ~31u;
  } else {
    for (uint32_t b = lane; b < n; b += 32) dst[b] = src[b];
  }
}

/// k-bit field at bit `pos` of a packed stream of `len` bytes (k <= 7, so at most two bytes).
__device__ __forceinline__ uint32_t extract_bits(const uint8_t* p, uint32_t pos, uint32_t k, uint32_t len) {
  const uint32_t byte = pos >> 3, sh = pos & 7;
  uint32_t v = p[byte];
  if (sh + k > 8 && byte + 1 < len) v |= uint32_t(p[byte + 1]) << 8;
  return (v >> sh) & ((1u << k) - 1u);
}

/// True when the `len` (<= 32) bytes at p are all zero (one warp).
__device__ __forceinline__ bool warp_zero(const uint8_t* p, uint32_t len) {
  const uint32_t v = lane_id() < len ? p[lane_id()] : 0u;
  return !__any_sync(kFull, v != 0);
}
/// True when the bits of the last byte past n symbols of w bits are zero.
__device__ __forceinline__ bool tail_bits_zero(const uint8_t* packed, uint32_t n, uint32_t w) {
  const uint32_t bits = n * w;
  return (bits & 7) == 0 || (packed[bits >> 3] >> (bits & 7)) == 0;
}

/// Uniform per-stream state of a chunk being decoded by one warp.
struct StreamState {
  uint32_t mode, w, param, bytes;
  const uint8_t* sec;   // section start
  const uint8_t* data;  // RAW: symbols; LUT: codes; RANS: words
  const uint8_t* exc;   // LUT: exceptions
  uint32_t len;         // RAW/LUT: packed bytes; RANS: n_words
  uint32_t n_exc, cursor, slot;
  uint32_t seg, tile_bytes;  // ring segment offset and bytes per tile (0: not in the ring)
};

/// The per-warp ring: slot t % S holds tile t of every ring stream. Whole tiles arrive by bulk copies (the Hopper copy
/// engine, cp.async.bulk: one lane issues them, no per-lane bookkeeping) that complete on the slot's mbarrier; a
/// partial last tile, whose stream ends may be the end of the frame's memory, is copied by the lanes with cp.async
/// (zero-filled past the stream's end). The barriers are initialised once per warp (decode_kernel) and each slot's
/// phase parity is carried from chunk to chunk in shared memory; `issued` and `waited` count tiles so that a chunk that
/// stops early still waits for every copy it started before the ring is reused (ring_drain).
struct Ring {
  uint8_t* base;
  uint64_t* bars;                            // S mbarriers, one per slot
  uint32_t* phase_word;                      // in shared memory: bit i = parity of slot i's next phase
  uint32_t slot_bytes, S, tiles, tx;         // S: slots, 2 or 4; tx: bytes of one whole tile over all ring streams
  uint32_t rs;                               // a ring tile is 2^rs decoder tiles (kTile elements each), 0 or 1
  uint32_t phase;                            // *phase_word while the ring is in use
  uint32_t issued, waited;                   // tiles [0, issued) issued, [0, waited) landed and seen by every lane
  bool whole_last;                           // the last tile is whole too (n a multiple of the tile)
};

template <uint32_t NS>
__device__ __forceinline__ void ring_issue(Ring& rg, const StreamState* ss, uint32_t t) {
  if (t >= rg.tiles) return;
  rg.issued = t + 1;
  const uint32_t si = t & (rg.S - 1);
  uint8_t* slot = rg.base + si * rg.slot_bytes;
  if (t + 1 < rg.tiles || rg.whole_last) {
    // No proxy fence before overwriting the slot: every lane consumed the values it loaded from it (they feed the
    // stores of its tile) before the __syncwarp that ends the tile, so no read of the slot is outstanding.
    if (lane_id() == 0) {
      mbar_arrive_expect_tx(rg.bars + si, rg.tx);
#pragma unroll
      for (uint32_t j = 0; j < NS; ++j) {
        const StreamState& s = ss[j];
        if (s.tile_bytes) bulk_copy(slot + s.seg, s.data + t * s.tile_bytes, s.tile_bytes, rg.bars + si);
      }
    }
    return;
  }
#pragma unroll
  for (uint32_t j = 0; j < NS; ++j) {
    const StreamState& s = ss[j];
    if (!s.tile_bytes) continue;
    const uint32_t off = t * s.tile_bytes;
    const uint32_t rem = s.len - off;
    const uint32_t nb = rem < s.tile_bytes ? rem : s.tile_bytes;
    const uint32_t units = (nb + 15) / 16;
    for (uint32_t u = lane_id(); u < units; u += 32) {
      const uint32_t b = nb - 16 * u;
      cp_async16(slot + s.seg + 16 * u, s.data + off + 16 * u, b < 16 ? b : 16);
    }
  }
  cp_commit();
}
/// Waits (every lane) until tile `waited` has landed.
__device__ __forceinline__ void ring_wait_next(Ring& rg) {
  const uint32_t t = rg.waited++;
  if (t + 1 < rg.tiles || rg.whole_last) {
    const uint32_t si = t & (rg.S - 1);
    while (!mbar_try_wait(rg.bars + si, (rg.phase >> si) & 1u)) {
    }
    rg.phase ^= 1u << si;
  } else {
    cp_wait_all();
    fence_proxy_async();  // these generic-proxy writes before the bulk copies that later refill the slot
  }
  __syncwarp();
}
/// Before tile t: issue tile t + S - 1, wait until tile t has landed. Returns tile t's slot.
template <uint32_t NS>
__device__ __forceinline__ const uint8_t* ring_advance(Ring& rg, const StreamState* ss, uint32_t t) {
  ring_issue<NS>(rg, ss, t + rg.S - 1);
  ring_wait_next(rg);
  return rg.base + (t & (rg.S - 1)) * rg.slot_bytes;
}
/// Before decoder tile t (kTile elements; ring tile t >> rs): advances the ring when t starts a ring tile not yet waited
/// for. Returns the ring tile's slot.
template <uint32_t NS>
__device__ __forceinline__ const uint8_t* ring_tile(Ring& rg, const StreamState* ss, uint32_t t) {
  const uint32_t r = t >> rg.rs;
  if (rg.waited <= r) ring_advance<NS>(rg, ss, r);
  return rg.base + (r & (rg.S - 1)) * rg.slot_bytes;
}
/// Waits for every tile issued and not yet waited for (a chunk that stops early), so no copy lands after the chunk,
/// and keeps the slots' phase parities for the next chunk.
__device__ __forceinline__ void ring_drain(Ring& rg) {
  while (rg.waited < rg.issued) ring_wait_next(rg);
  if (lane_id() == 0) *rg.phase_word = rg.phase;
  __syncwarp();
}
/// Once per warp, before its first chunk: the slots' mbarriers (one arrival per phase: the issuing lane's) and their
/// phase parities. `bars` holds 4 mbarriers and then the phase word.
__device__ __forceinline__ void ring_init(uint64_t* bars) {
  if (lane_id() == 0) {
    for (uint32_t i = 0; i < 4; ++i) mbar_init(bars + i);
    *reinterpret_cast<uint32_t*>(bars + 4) = 0;
    mbar_init_fence();
  }
  __syncwarp();
}

/// Sets up the ring for one chunk in `tiles` tiles (slot_bytes per tile over the ring streams, `ring` bytes of shared
/// memory; whole_last: the last tile is whole too) and issues the first S - 1 tiles. False when fewer than two slots
/// fit.
template <uint32_t NS>
__device__ __forceinline__ bool ring_start(Ring& rg, const StreamState* ss, uint8_t* base, uint64_t* bars,
                                           uint32_t slot_bytes, uint32_t ring, uint32_t tiles, bool whole_last) {
  rg.base = base;
  rg.bars = bars;
  rg.slot_bytes = slot_bytes;
  rg.phase_word = reinterpret_cast<uint32_t*>(bars + 4);
  rg.S = slot_bytes ? min(4u, ring / slot_bytes) : 4u;
  if (rg.S == 3) rg.S = 2;  // a power of two: slots by mask, not by division
  rg.tiles = tiles;
  rg.whole_last = whole_last;
  rg.issued = rg.waited = 0;
  rg.tx = 0;
#pragma unroll
  for (uint32_t j = 0; j < NS; ++j) rg.tx += ss[j].tile_bytes;
  if (rg.S < 2) return false;
  rg.phase = *rg.phase_word;  // the previous chunk drained the ring: every barrier is between phases
  for (uint32_t t = 0; t + 1 < rg.S; ++t) ring_issue<NS>(rg, ss, t);
  return true;
}

/// A chunk stored raw (n bytes, src and dst 16-byte aligned) copied through the ring: bulk copies in (no L1 lines held
/// for loads in flight, so the copy keeps its speed when the decode kernel's shared memory leaves little L1), 16-byte
/// vectors out. With `verify`, lane l feeds the stripes l, l + 32, ... it stores to `dg` and `from` is set as by
/// warp_copy. A ring tile is a quarter of the ring, rounded down to 512 bytes (a multiple of 32 stripes).
__device__ void ring_copy(uint8_t* dst, const uint8_t* src, uint32_t n, uint8_t* ring_base, uint64_t* bars,
                          uint32_t ring, bool verify, Xxh32& dg, uint32_t& from) {
  const uint32_t tb = (ring / 4) & ~511u;  // >= 512: the caller's ring has at least 2 * kTile bytes
  StreamState st{};
  st.data = src;
  st.len = n;
  st.tile_bytes = tb;
  Ring rg{};
  const uint32_t tiles = (n + tb - 1) / tb;
  ring_start<1>(rg, &st, ring_base, bars, tb, ring, tiles, n % tb == 0);
  const uint32_t lane = lane_id(), nv = n / 16;
  for (uint32_t t = 0; t < tiles; ++t) {
    const uint4* slot = reinterpret_cast<const uint4*>(ring_advance<1>(rg, &st, t));
    const uint32_t v0 = t * (tb / 16), v1 = min(nv, v0 + tb / 16);
#pragma unroll 4
    for (uint32_t v = v0 + lane; v < v1; v += 32) {
      const uint4 x = slot[v - v0];
      reinterpret_cast<uint4*>(dst)[v] = x;
      if (verify) dg.stripe(x.x, x.y, x.z, x.w);
    }
    __syncwarp();  // every lane has read the slot before it is refilled
  }
  ring_drain(rg);
  for (uint32_t b = nv * 16 + lane; b < n; b += 32) dst[b] = src[b];
  from = (nv + 31) & ~31u;
}

/// V codes of KW (1..3) bits, packed LSB-first from bit 0 of y (the bits above them are ignored), spread to one code per
/// nibble (code e in bits [4e, 4e + KW), the other bits of the V nibbles zero, nibbles past V zero): the selector of
/// PRMT, which then looks up four codes in an 8-entry LUT at once (lut4). Each step moves the upper half of every

}  // namespace
}  // namespace dec
}  // namespace gpu
}  // namespace tzip
