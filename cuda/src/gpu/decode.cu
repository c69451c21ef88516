// GPU frame decoder: decodes a batch of frames with the rules of tzip::decode_frame (cuda/src/core/frame.cpp +
// chunk_codec.cpp), validating every byte it uses, and reports per frame the error the CPU would raise.
//
// Launch sequence (one stream, grids sized by the SM budget, see codec.h):
//   1. parse_kernel: one block per frame: fixed header, shape, chunk table (offset chain and sizes, in parallel) and
//      frame/output lengths. A frame whose structure is invalid gets no chunk work.
//   2. scan_kernel: prefix sums of the task counts per decoder class: each frame's two verification tasks (header
//      digest, frame checksum: serial hashes, one warp each, taken first so that they run beside the chunks), then
//      its chunks.
//   3. decode kernels, one warp per task, persistent, atomic tickets:
//        class 3 (bf16 fast): 24 warps per block (80 registers each), no RANS tables: the bf16 tile path's dependent
//          chains need more warps per scheduler than the 16 that the fp32 paths' registers allow;
//        class 1 (fp16/fp32 fast, raw): 16 warps per block, no RANS tables;
//        class 2 (max, bytes): 16 warps per block, one RANS table and two LUT tables per warp;
//        class 4 (bf16 max): 32 warps per block (64 registers each), one RANS table and two LUT tables, no ring: the
//          RANS steps are one dependent chain per lane, so what hides their latency is warps;
//        fallback: chunks the class kernels could not take (more RANS/LUT streams than their tables, misaligned frames),
//        4 warps per block with eight of each.
//      The fixed-rate streams (RAW symbols, LUT codes) reach shared memory through a per-warp ring of 1024-element
//      tiles: bulk copies (cp.async.bulk, issued by one lane) that complete on the slot's mbarrier, one to three tiles
//      ahead (2 or 4 slots, as the tile's bytes fit). Chunks stored raw go through the same ring when source and
//      destination are 16-byte aligned (classes 1 and 2). Float chunks without RANS streams take the tile path: each
//      lane 16
//      output bytes per sub-tile (coalesced 16-byte stores), LUT codes looked up four at a time with __byte_perm,
//      escapes placed by one packed warp scan per tile with the chunk's exceptions in shared memory. Everything else
//      takes the step path in the format's RANS order (lane l, element 32g + l): per step one symbol per stream and
//      lane, RANS words fetched through a 256-word window held in the lanes' registers (ballot + popc give each lane
//      its word); bf16 chunks with RANS exponents and RAW or CONST sign+mantissa bytes (what the max encoder writes)
//      take a step loop specialised on those modes.
//      With verify on, each warp checks the chunk digest (format version 2: 32 lane hashes of interleaved 16-byte
//      stripes) of the chunk it wrote: the tile path and raw copies hash the 16-byte vectors they store on the way out,
//      other paths read the chunk back right after writing it (coalesced, from L2).
//   4. errors_kernel: the lowest-ranked error of each frame (the CPU's order of checks, then the lowest chunk) to the
//      caller's array.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "gpu/codec.h"
#include "gpu/graph.h"
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
};

/// Decode kernels live in their own translation units (decode_k0.cu to decode_k4.cu include this file
/// with TZIP_DECODE_PART set) so that they compile in parallel. Each launches its kernel on the stream.
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

#if !defined(TZIP_DECODE_PART)
// ---------------------------------------------------------------- 1. parse

__global__ void __launch_bounds__(1024, 1) parse_kernel(DecArgs a) {
  __shared__ int s_bad;
  for (uint32_t ti = blockIdx.x; ti < a.n; ti += gridDim.x) {
    DecTensor& T = a.t[ti];
    if (threadIdx.x == 0) {
      s_bad = 1;
      T.header_ok = 0;
      T.n_dec = 0;
      T.n_chunks = 0;
      const uint8_t* f = T.frame;
      const uint64_t avail = T.frame_len;
      uint32_t rank = 0;
      int32_t code = kCorrupt;
      do {
        if (avail < kFixedHeaderBytes) { rank = kRTruncFixed; code = kTruncated; break; }
        if (ld_le32u(f + kOffMagic) != kFrameMagic) { rank = kRMagic; break; }
        const uint32_t version = ld_le16u(f + kOffVersion);
        if (version == 0) { rank = kRVersion0; break; }
        // Version 1 (pre-release, whole-chunk XXH32 digests) is no longer read, as on the CPU.
        if (version != kFormatVersion) { rank = kRVersionNew; code = kUnsupported; break; }
        const uint32_t dt = f[kOffDtype], cd = f[kOffCodec];
        if (dt >= kNumDtypes) { rank = kRDtype; break; }
        if (cd >= kNumCodecs) { rank = kRCodec; break; }
        const Dtype d = Dtype(dt);
        const Codec c = Codec(cd);
        if ((c == Codec::FAST || c == Codec::MAX) && !dtype_is_split_float(d)) { rank = kRNormalize; break; }
        const uint32_t ndim = f[kOffNdim];
        if (ndim > kMaxNdim) { rank = kRNdim; break; }
        if (f[kOffFlags] != 0 || ld_le16u(f + 10) != 0 || ld_le32u(f + 44) != 0) { rank = kRReserved; break; }
        const uint32_t cs = ld_le32u(f + kOffChunkBytes);
        if (cs < kMinChunkBytes || cs > kMaxChunkBytes || cs % kChunkBytesMultiple != 0) { rank = kRChunkSize; break; }
        const uint64_t nbytes = ld_le64u(f + kOffNbytes), payload = ld_le64u(f + kOffPayloadBytes);
        const uint32_t nch = ld_le32u(f + kOffNumChunks);
        if (nch != num_chunks(nbytes, cs)) { rank = kRNumChunks; break; }
        const uint64_t table_off = chunk_table_offset(ndim), hdr = frame_header_bytes(ndim, nch);
        if (avail < table_off) { rank = kRTruncShape; code = kTruncated; break; }
        {
          bool nz = false;
          for (uint64_t q = kOffShape + 8ull * ndim; q < table_off; ++q) nz |= f[q] != 0;
          if (nz) { rank = kRShapePad; break; }
        }
        unsigned __int128 total = dtype_size(d);
        bool ok = true;
        uint64_t expect = 0;
        for (uint32_t k = 0; k < ndim; ++k) {
          total *= ld_le64u(f + kOffShape + 8 * k);
          if (total > UINT64_MAX) {
            ok = false;
            for (uint32_t q = 0; q < ndim; ++q)
              if (ld_le64u(f + kOffShape + 8 * q) == 0) { ok = true; break; }
            total = 0;
            break;
          }
        }
        expect = uint64_t(total);
        if (!ok || expect != nbytes) { rank = kRShape; break; }
        if (payload > nbytes) { rank = kRPayload; break; }
        if (avail < hdr) { rank = kRTruncTable; code = kTruncated; break; }
        T.header_ok = 1;
        T.dtype = uint8_t(dt);
        T.codec = uint8_t(cd);
        T.ndim = uint8_t(ndim);
        T.chunk_bytes = cs;
        T.nbytes = nbytes;
        T.payload_bytes = payload;
        T.n_chunks = nch;
        T.header_bytes = hdr;
        T.checksum = ld_le32u(f + kOffChecksum);
        const bool bf16_own = Dtype(dt) == Dtype::BF16 && a.bf16_class;
        T.cls = (c == Codec::FAST && bf16_own) ? 3 : (c == Codec::MAX && bf16_own) ? 4
              : (c == Codec::FAST || c == Codec::RAW) ? 1 : 2;
        s_bad = 0;
        const uint64_t frame_bytes = hdr + payload;
        if (avail < frame_bytes) { report(a, ti, err_key(kRTruncFrame, 0, 0, kTruncated)); s_bad = 1; }
        else if (avail > frame_bytes) { report(a, ti, err_key(kRTrailing, 0, 0, kCorrupt)); s_bad = 1; }
        else if (T.out_len != nbytes) { report(a, ti, err_key(kROutLen, 0, 0, kInvalidArgument)); s_bad = 1; }
      } while (false);
      if (rank) report(a, ti, err_key(rank, 0, 0, code));
    }
    __syncthreads();
    if (T.header_ok) {
      // Chunk table: each entry against the one before it (see frame.cpp, parse_frame_header).
      const uint8_t* table = T.frame + chunk_table_offset(T.ndim);
      const uint32_t nch = T.n_chunks, cs = T.chunk_bytes;
      bool bad = false;
      for (uint64_t i = threadIdx.x; i < nch; i += blockDim.x) {
        const uint8_t* e = table + kChunkEntryBytes * i;
        const uint64_t o = ld_le64u(e), size = ld_le32u(e + 8);
        const uint64_t raw_len = umin64(cs, T.nbytes - i * cs);
        uint64_t expect = 0;
        if (i > 0) {
          const uint8_t* pe = e - kChunkEntryBytes;
          expect = align16(ld_le64u(pe) + ld_le32u(pe + 8));
        }
        if (o != expect || size > raw_len || size == 0) bad = true;
        if (i + 1 == nch && o + size != T.payload_bytes) {
          if (!bad) report(a, ti, err_key(kRPayloadSum, 0, 0, kCorrupt));
          s_bad = 1;
        }
      }
      if (nch == 0 && T.payload_bytes != 0) {
        report(a, ti, err_key(kRPayloadSum, 0, 0, kCorrupt));
        s_bad = 1;
      }
      if (bad) {
        report(a, ti, err_key(kRTable, 0, 0, kCorrupt));
        s_bad = 1;
      }
    }
    __syncthreads();
    if (threadIdx.x == 0) T.n_dec = s_bad ? 0 : T.n_chunks;
    __syncthreads();
  }
}

// ---------------------------------------------------------------- 2. scan

__global__ void __launch_bounds__(1024, 1) scan_kernel(DecArgs a) {
  __shared__ uint64_t warp_tot[kClasses][32];
  __shared__ uint64_t carry[kClasses];
  const uint32_t tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  if (tid < kClasses) carry[tid] = 0;
  __syncthreads();
  for (uint32_t b0 = 0; b0 < a.n; b0 += blockDim.x) {
    const uint32_t ti = b0 + tid;
    uint64_t v[kClasses] = {};
    if (ti < a.n) {
      const DecTensor& T = a.t[ti];
      v[0] = T.n_dec;
      // A frame whose header parsed has its class (parse_kernel): its verification tasks, then its chunks to decode.
      if (T.cls > 0 && T.cls < kClasses) v[T.cls] = kVerifyTasks + T.n_dec;
    }
    uint64_t incl[kClasses];
#pragma unroll
    for (uint32_t c = 0; c < kClasses; ++c) {
      incl[c] = warp_inclusive_sum(v[c]);
      if (lane == 31) warp_tot[c][warp] = incl[c];
    }
    __syncthreads();
#pragma unroll
    for (uint32_t c = 0; c < kClasses; ++c) {
      uint64_t before = carry[c], tot = 0;
      for (uint32_t q = 0; q < blockDim.x / 32; ++q) {
        if (q < warp) before += warp_tot[c][q];
        tot += warp_tot[c][q];
      }
      if (ti < a.n) a.base[c][ti] = before + incl[c] - v[c];
      if (ti == a.n - 1) a.base[c][a.n] = before + incl[c];
      __syncthreads();
      if (tid == 0) carry[c] += tot;
    }
    __syncthreads();
  }
}

#endif  // !TZIP_DECODE_PART

#if defined(TZIP_DECODE_PART)
// ---------------------------------------------------------------- 3. decode

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
/// group up by one bit select; the bits it leaves outside the groups are cleared once at the end.
template <uint32_t KW, uint32_t V>
__device__ __forceinline__ uint32_t spread_nibbles(uint32_t y) {
  static_assert(KW >= 1 && KW <= 3 && (V == 4 || V == 8), "nibble spread of 1..3-bit codes, 4 or 8 of them");
  if constexpr (V == 8) {  // two groups of four codes -> 16-bit halves
    constexpr uint32_t m = (1u << (4 * KW)) - 1u;
    y = bitsel(y << (16 - 4 * KW), y, m << 16);
  }
  {  // pairs -> bytes
    constexpr uint32_t m = (1u << (2 * KW)) - 1u;
    y = bitsel(y << (8 - 2 * KW), y, (m << 8) * 0x00010001u);
  }
  {  // codes -> nibbles
    constexpr uint32_t m = (1u << KW) - 1u;
    y = bitsel(y << (4 - KW), y, (m << 4) * 0x01010101u);
  }
  return y & (((1u << KW) - 1u) * (V == 8 ? 0x11111111u : 0x1111u));
}

/// Bit 4e set where nibble e holds the escape code 2^KW - 1.
template <uint32_t KW>
__device__ __forceinline__ uint32_t escape_nibbles(uint32_t nib) {
  uint32_t t = nib;
  if constexpr (KW >= 2) t &= nib >> 1;
  if constexpr (KW >= 3) t &= nib >> 2;
  if constexpr (KW >= 4) t &= nib >> 3;
  return t & 0x11111111u;
}

/// Four LUT lookups at once: nibble e of `nib` (low 16 bits) indexes the 16-byte table L[0..3] (KW <= 3: only L[0..1]).
template <uint32_t KW>
__device__ __forceinline__ uint32_t lut4(const uint32_t* L, uint32_t nib) {
  if constexpr (KW <= 3) {
    // PRMT itself, not __byte_perm (which masks each selector to 3 bits first): spread_nibbles leaves bit 3 of every
    // nibble zero, so no byte is sign-replicated.
    uint32_t d;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(L[0]), "r"(L[1]), "r"(nib));
    return d;
  } else {
    const uint32_t n = nib & 0x7777u;
    const uint32_t a = prmt(L[0], L[1], n), b = prmt(L[2], L[3], n);
    return prmt(a, b, 0x3210u | ((nib >> 1) & 0x4444u));
  }
}

/// Each byte rotated right by one bit: a bf16 exponent e becomes e' = (e >> 1) | (e & 1) << 7, the two halves of e in the
/// bit positions they take in the element's high and low byte, so the merge needs no shifts (merge4_bf16_rot).
__device__ __forceinline__ uint32_t rotr1_bytes(uint32_t x) {
  return ((x >> 1) & 0x7F7F7F7Fu) | ((x << 7) & 0x80808080u);
}
/// Fam<kFamBF16>::merge4 with the exponents rotated by rotr1_bytes: four elements from e' and the sign+mantissa bytes r.
__device__ __forceinline__ void merge4_bf16_rot(uint32_t e, uint32_t r, uint32_t* out) {
  const uint32_t lo = bitsel(e, r, 0x80808080u), hi = bitsel(r, e, 0x80808080u);
  out[0] = prmt(lo, hi, 0x5140);
  out[1] = prmt(lo, hi, 0x7362);
}
/// Whether the tile path of a bf16 LUT stream of k-bit codes works on rotated exponents (rotr1_bytes): its LUT and
/// exceptions are rotated once per chunk, which saves the merge four instructions per four elements.
__device__ __forceinline__ constexpr bool bf16_rotated(uint32_t fid, uint32_t k) { return fid == kFamBF16 && k <= 4; }

/// Tile path (float families, no RANS): tiles [t, tiles_full) from the ring. Lane l handles V consecutive elements of
/// each sub-tile and stores them as one 16-byte vector, which is also the lane's next stripe of the chunk digest
/// (xxhash32.h, chunk_digest: a sub-tile is 512 bytes, so lane l writes exactly the stripes l, l + 32, ...); with
/// `verify` each stored vector goes into the lane's XXH32 state `dg` on the way out.
/// With a LUT exponent stream a tile takes three steps: (1) every sub-tile's codes are looked up (four at a time with
/// __byte_perm when KW <= 4; an escape looks up the zero padding entry) into the warp's exponent `stage` in shared
/// memory, escapes noted as nibble flags; (2) one warp scan of the per-sub-tile escape counts, packed 8 bits each,
/// gives each lane the exception index of its first escape in each sub-tile, and the lane writes its exceptions over
/// its escapes in the stage (from `exc_smem`, where run_tiles copied a chunk's exceptions when they fit; with GEXC
/// from the section in global memory, where the warp's reads of neighbouring indices share L1 lines, so that no
/// number of exceptions sends a chunk to the step path); (3) symbols are merged
/// into elements, stored and hashed. A lane only ever touches its own bytes of the stage (no __syncwarp needed).
/// The packed scan is exact although a sub-tile may hold 256 escapes (one more than a field holds): every exclusive
/// prefix is at most 31 lanes x 8 = 248, and the totals are taken from lane 31's exclusive prefix plus its own counts.
template <uint32_t FID, uint32_t KW, bool LUTE, bool GEXC>
__device__ __forceinline__ bool tile_loop(const StreamState* ss, Ring& rg, uint32_t& t, uint32_t tiles_full,
                                          uint8_t* dst, const uint8_t* lut, uint8_t* stage, const uint8_t* exc_smem,
                                          uint32_t& cursor, bool verify, Xxh32& dg) {
  using F = Fam<FID>;
  constexpr uint32_t E = F::kEsize, NS = F::kCount, V = 16 / E, SUB = 32 * V, NSUB = kTile / SUB;
  static_assert(V == 4 || V == 8, "16-byte vectors of 2- or 4-byte elements");
  static_assert(NSUB * V == 32, "a lane's escape flags of one tile fill one 32-bit word per 8 elements' nibbles");
  using Sym = std::conditional_t<V == 8, uint64_t, uint32_t>;  // V symbol bytes of one stream
  constexpr bool kNib = LUTE && KW <= 4;  // codes looked up four at a time with __byte_perm
  // Where escapes are patched: 8 symbols (64 bits) per lane and sub-tile go through the shared-memory stage (a byte
  // store per escape); 4 symbols stay in a register (a shift and an OR per escape; measured faster for fp32).
  constexpr bool kStaged = V == 8;
  constexpr bool kRot = LUTE && bf16_rotated(FID, KW);  // LUT and exceptions hold rotated exponents (run_tiles)
  const uint32_t lane = lane_id();
  constexpr uint32_t w0 = F::width(0);
  const StreamState& s0 = ss[0];
  uint32_t L[4] = {0, 0, 0, 0};
  if constexpr (kNib) {
    const uint32_t* l32 = reinterpret_cast<const uint32_t*>(lut);
#pragma unroll
    for (int q = 0; q < 4; ++q) L[q] = kRot ? rotr1_bytes(l32[q]) : l32[q];
  }
  // Field `sub` (8 bits) of a pair of packed words: sub-tiles 0..3 in lo, 4..7 in hi.
  auto field = [](uint32_t lo, uint32_t hi, uint32_t sub) { return ((sub < 4 ? lo : hi) >> (8 * (sub & 3))) & 0xFFu; };
  for (; t < tiles_full; ++t) {
    // Decoder tile t is half h of its ring tile when ring tiles are pairs: a stream of w-bit symbols starts h * 128 * w
    // bytes into its segment.
    const uint8_t* slot = ring_tile<NS>(rg, ss, t);
    const uint32_t h = t & ((1u << rg.rs) - 1u);
    bool bad = false;
    Sym es[NSUB];
    if constexpr (LUTE) {
      // ---- 1: LUT lookups into the stage (or registers); escapes as nibble flags (bit 4e of a sub-tile's word)
      const uint32_t* e_words = reinterpret_cast<const uint32_t*>(slot + s0.seg + h * (kTile / 8 * KW));
      uint32_t escw[NSUB];
      uint32_t cnt_lo = 0, cnt_hi = 0;  // packed per-sub-tile escape counts, 8 bits each
      // A sub-tile's codes are SUB * KW bits, a whole number of words: the lane's word and shift are the same in each.
      static_assert(SUB * KW % 32 == 0, "sub-tiles of whole code words");
      const uint32_t lb = lane * V * KW, sh = lb & 31;
#pragma unroll
      for (uint32_t sub = 0; sub < NSUB; ++sub) {
        const uint32_t le = sub * SUB + lane * V;
        const uint32_t wi = sub * (SUB * KW / 32) + (lb >> 5);
        const uint32_t x0 = e_words[wi], x1 = e_words[wi + 1];
        Sym e = 0;
        uint32_t escn = 0;
        if constexpr (kNib) {
          uint32_t v = __funnelshift_r(x0, x1, sh);  // V * KW <= 32 bits; the rest belongs to the next lane
          // The bits past the lane's V codes: the spread drops them itself; four 4-bit codes need the mask.
          if constexpr (V == 4 && KW == 4) v &= (1u << (V * KW)) - 1u;
          const uint32_t nib = KW == 4 ? v : spread_nibbles<(KW < 4 ? KW : 1), V>(v);
          e = lut4<KW>(L, nib);
          if constexpr (V == 8) e |= uint64_t(lut4<KW>(L, nib >> 16)) << 32;
          escn = escape_nibbles<KW>(nib);
        } else {
          constexpr uint32_t mask = (1u << KW) - 1;
          const uint32_t x2 = e_words[wi + 2];
          const uint64_t v = uint64_t(__funnelshift_r(x0, x1, sh)) | (uint64_t(__funnelshift_r(x1, x2, sh)) << 32);
#pragma unroll
          for (uint32_t q = 0; q < V; ++q) {
            const uint32_t c = uint32_t(v >> (q * KW)) & mask;
            e |= Sym(lut[c]) << (8 * q);  // lut[mask] is the zero padding entry
            escn |= uint32_t(c == mask) << (4 * q);
          }
        }
        if constexpr (kStaged) *reinterpret_cast<Sym*>(stage + le) = e;
        else es[sub] = e;
        escw[sub] = escn;
        const uint32_t c = uint32_t(__popc(escn));
        if (sub < 4) cnt_lo |= c << (8 * sub);  // sub is a constant after unrolling
        else cnt_hi |= c << (8 * (sub - 4));
      }
      // ---- 2: exception indices by one packed scan; each lane writes its own exceptions into the stage
      if (__any_sync(kFull, (cnt_lo | cnt_hi) != 0)) {
        uint32_t in_lo = cnt_lo, in_hi = cnt_hi;
#pragma unroll
        for (int d = 1; d < 32; d <<= 1) {
          const uint32_t o_lo = __shfl_up_sync(kFull, in_lo, d);
          const uint32_t o_hi = NSUB > 4 ? __shfl_up_sync(kFull, in_hi, d) : 0u;
          if (lane >= uint32_t(d)) { in_lo += o_lo; in_hi += o_hi; }
        }
        const uint32_t ex_lo = in_lo - cnt_lo, ex_hi = in_hi - cnt_hi;  // exact: every field <= 248
        const uint32_t ex31_lo = __shfl_sync(kFull, ex_lo, 31), c31_lo = __shfl_sync(kFull, cnt_lo, 31);
        const uint32_t ex31_hi = NSUB > 4 ? __shfl_sync(kFull, ex_hi, 31) : 0u;
        const uint32_t c31_hi = NSUB > 4 ? __shfl_sync(kFull, cnt_hi, 31) : 0u;
        // Sub-tile totals (up to 256 each) summed with dp4a: the exact byte sums of lane 31's prefix and counts.
        constexpr uint32_t ones = 0x01010101u;
        const uint32_t total = __dp4a(ex31_lo, ones, __dp4a(c31_lo, ones, 0u)) +
                               __dp4a(ex31_hi, ones, __dp4a(c31_hi, ones, 0u));
        if (uint64_t(cursor) + total > s0.n_exc) return false;  // more escapes than exceptions (warp-uniform)
        uint32_t run = cursor;
#pragma unroll
        for (uint32_t sub = 0; sub < NSUB; ++sub) {
          uint32_t idx = run + field(ex_lo, ex_hi, sub), m = escw[sub];
          uint8_t* sp = stage + sub * SUB + lane * V;
          while (m) {
            const uint32_t b = uint32_t(__ffs(m) - 1);  // 4 x (x: element within the lane's V)
            m &= m - 1;
            uint32_t sv;
            if constexpr (GEXC) {
              sv = __ldg(s0.exc + idx++);
              if constexpr (kRot) sv = rotr1_bytes(sv);  // a byte rotated within itself
            } else {
              sv = exc_smem[idx++];  // rotated by the copy
            }
            if (w0 < 8 && (sv >> w0)) bad = true;
            if constexpr (kStaged) sp[b >> 2] = uint8_t(sv);
            else es[sub] |= Sym(sv) << (2 * b);  // an escape looked up the zero entry
          }
          run += field(ex31_lo, ex31_hi, sub) + field(c31_lo, c31_hi, sub);
        }
        cursor += total;
      }
    }
    // ---- 3: merge, store, hash
#pragma unroll
    for (uint32_t sub = 0; sub < NSUB; ++sub) {
      const uint32_t le = sub * SUB + lane * V;  // element within the tile
      // Symbols as bytes of 32/64-bit values: no arrays, so nothing is indexed at run time (which would put them in
      // local memory).
      Sym e = 0;
      Sym rs[NS];
      if constexpr (LUTE) {
        if constexpr (kStaged) e = *reinterpret_cast<const Sym*>(stage + le);
        else e = es[sub];
      } else if constexpr (KW == 0) {
        e = Sym(uint64_t(rep4(s0.param)) * 0x100000001ull);
      } else if constexpr (KW == 8) {
        e = *reinterpret_cast<const Sym*>(slot + s0.seg + h * kTile + le);
      } else {  // RAW exponents narrower than a byte (fp16: 5 bits)
        const uint32_t* e_words = reinterpret_cast<const uint32_t*>(slot + s0.seg + h * (kTile / 8 * KW));
        const uint32_t b0 = le * KW, wi = b0 >> 5, sh = b0 & 31;
        const uint32_t x0 = e_words[wi], x1 = e_words[wi + 1], x2 = e_words[wi + 2];
        const uint64_t v = uint64_t(__funnelshift_r(x0, x1, sh)) | (uint64_t(__funnelshift_r(x1, x2, sh)) << 32);
#pragma unroll
        for (uint32_t q = 0; q < V; ++q) e |= Sym(uint32_t(v >> (q * KW)) & ((1u << KW) - 1)) << (8 * q);
      }
#pragma unroll
      for (uint32_t j = 1; j < NS; ++j) {
        const StreamState& sj = ss[j];
        if (sj.mode == uint32_t(StreamMode::CONST)) {
          rs[j] = Sym(uint64_t(rep4(sj.param)) * 0x100000001ull);
        } else if (FID == kFamF16 && j == 2) {
          const uint32_t* r_words = reinterpret_cast<const uint32_t*>(slot + sj.seg + h * (kTile / 8 * 3));
          const uint32_t b0 = le * 3, wi = b0 >> 5, sh = b0 & 31;
          const uint64_t v = uint64_t(__funnelshift_r(r_words[wi], r_words[wi + 1], sh)) |
                             (uint64_t(__funnelshift_r(r_words[wi + 1], r_words[wi + 2], sh)) << 32);
          Sym r = 0;
#pragma unroll
          for (uint32_t q = 0; q < V; ++q) r |= Sym((v >> (q * 3)) & 7u) << (8 * q);
          rs[j] = r;
        } else {
          rs[j] = *reinterpret_cast<const Sym*>(slot + sj.seg + h * kTile + le);
        }
      }
      uint32_t out[4];
#pragma unroll
      for (uint32_t q = 0; q < V / 4; ++q) {
        if constexpr (kRot) {
          merge4_bf16_rot(uint32_t(uint64_t(e) >> (32 * q)), uint32_t(uint64_t(rs[1]) >> (32 * q)), out + q * E);
          continue;
        }
        uint32_t s4[NS];
        s4[0] = uint32_t(uint64_t(e) >> (32 * q));
#pragma unroll
        for (uint32_t j = 1; j < NS; ++j) s4[j] = uint32_t(uint64_t(rs[j]) >> (32 * q));
        F::merge4(s4, out + q * E);
      }
      *reinterpret_cast<uint4*>(dst + uint64_t(t * kTile + le) * E) = make_uint4(out[0], out[1], out[2], out[3]);
      if (verify) dg.stripe(out[0], out[1], out[2], out[3]);
    }
    __syncwarp();  // every lane has read the slot before it is refilled
    if (w0 < 8 && LUTE && __any_sync(kFull, bad)) return false;
  }
  return true;
}

/// Runs the tile path on tiles [t, tiles_full). A LUT exponent stream's exceptions are first copied to `exc_smem` when
/// they fit there (XCAP bytes), else read from global memory (tile_loop, GEXC).
template <uint32_t FID, uint32_t XCAP>
__device__ __forceinline__ bool run_tiles(const StreamState* ss, Ring& rg, uint32_t& t, uint32_t tiles_full,
                                          uint8_t* dst, const uint8_t* lut, uint8_t* stage, uint8_t* exc_smem,
                                          uint32_t& cursor, bool verify, Xxh32& dg) {
  const StreamState& s0 = ss[0];
  const bool gexc = XCAP == 0 || s0.n_exc > XCAP;
  if (s0.mode == uint32_t(StreamMode::LUT) && !gexc) {
    // The section starts 16-aligned (docs/format.md, 8.3): 16-byte loads, then the last n_exc % 16 bytes.
    const bool rot = bf16_rotated(FID, s0.param);
    const uint32_t nv = s0.n_exc / 16;
    for (uint32_t v = lane_id(); v < nv; v += 32) {
      uint4 x = reinterpret_cast<const uint4*>(s0.exc)[v];
      if (rot) x = make_uint4(rotr1_bytes(x.x), rotr1_bytes(x.y), rotr1_bytes(x.z), rotr1_bytes(x.w));
      reinterpret_cast<uint4*>(exc_smem)[v] = x;
    }
    for (uint32_t b = nv * 16 + lane_id(); b < s0.n_exc; b += 32) exc_smem[b] = uint8_t(rot ? rotr1_bytes(s0.exc[b]) : s0.exc[b]);
    __syncwarp();
  }
#define TZIP_TILES(KW, LUTE)                                                                                       \
  (gexc ? tile_loop<FID, KW, LUTE, true>(ss, rg, t, tiles_full, dst, lut, stage, exc_smem, cursor, verify, dg)  \
        : tile_loop<FID, KW, LUTE, XCAP == 0>(ss, rg, t, tiles_full, dst, lut, stage, exc_smem, cursor, verify, dg))
  // CONST and RAW exponent streams have no exceptions.
#define TZIP_FIXED(KW) tile_loop<FID, KW, false, false>(ss, rg, t, tiles_full, dst, lut, stage, exc_smem, cursor, verify, dg)
  if (s0.mode == uint32_t(StreamMode::CONST)) return TZIP_FIXED(0);
  if (s0.mode == uint32_t(StreamMode::RAW)) {
    if constexpr (FID == kFamF16) return TZIP_FIXED(5);
    else return TZIP_FIXED(8);
  }
  switch (s0.param) {
    case 1: return TZIP_TILES(1, true);
    case 2: return TZIP_TILES(2, true);
    case 3: return TZIP_TILES(3, true);
    case 4: return TZIP_TILES(4, true);
    default:
      if constexpr (FID != kFamF16) {
        switch (s0.param) {
          case 5: return TZIP_TILES(5, true);
          case 6: return TZIP_TILES(6, true);
          default: return TZIP_TILES(7, true);
        }
      }
      return false;
  }
#undef TZIP_TILES
#undef TZIP_FIXED
}

/// The RANS state of one stream of a chunk as the step path holds it: the lane's state x, a 256-word window of the
/// stream's 16-bit words (h0..h3: words base + 64 r + lane and base + 64 r + 32 + lane of each), the words consumed.
struct RansLane {
  uint32_t x, h0, h1, h2, h3, pos, base;
};

/// Steps [g0, g1) of a bf16 chunk whose exponent stream is RANS and whose sign+mantissa stream is RAW (RRAW, bytes at
/// r + i for element i) or CONST (rconst): element i = 32 g + lane, decoded, merged and stored at out[i] (2-byte
/// aligned). ACT: the last step may be partial (elements >= n do nothing). AHEAD: sign+mantissa bytes are loaded that
/// many steps before their step (0: at it, from shared memory), so that their latency hides behind the RANS chain.
/// Sets `bad` when the words run out (the caller checks the rest, as for the general step path). The RANS step is
/// written out here and in decode_coded's step path alike: one function for both cost that path 7% (docs/benchmarks.md).
template <bool RRAW, bool ACT, uint32_t AHEAD>
__device__ __forceinline__ void rans_bf16_steps(RansLane& st, const uint8_t* symt, const uint32_t* fc, const uint8_t* words,
                                                uint32_t n_words, const uint8_t* r, uint32_t rconst, uint16_t* out,
                                                uint32_t n, uint32_t g0, uint32_t g1, bool& bad) {
  const uint32_t lane = lane_id();
  uint32_t xr = st.x, w0 = st.h0, w1 = st.h1, w2 = st.h2, w3 = st.h3, ps = st.pos, bs = st.base;
  constexpr uint32_t QA = AHEAD > 0 ? AHEAD : 1;
  uint32_t rq[QA];
#pragma unroll
  for (uint32_t q = 0; q < QA; ++q) {
    const uint32_t iq = (g0 + q) * 32 + lane;
    rq[q] = RRAW && AHEAD > 0 && iq < n ? uint32_t(r[iq]) : 0u;
  }
#pragma unroll 4
  for (uint32_t g = g0; g < g1; ++g) {
    const uint32_t i = g * 32 + lane;
    const bool act = !ACT || i < n;
    uint32_t e = 0;
    if (act) {
      const uint32_t sl = xr & (kRansProbScale - 1);
      e = symt[sl];
      const uint32_t f = fc[e];
      xr = (f & 0xFFFFu) * (xr >> kRansProbBits) + sl - (f >> 16);
    }
    const bool need = act && xr < kRansLow;
    const uint32_t b = __ballot_sync(kFull, need);
    if (b) {
      const uint32_t cnt = __popc(b);
      if (ps + cnt > n_words) bad = true;
      const uint32_t off = ps + __popc(b & lanemask_lt()) - bs;  // < 96
      const uint32_t a0 = __shfl_sync(kFull, w0, off & 31), a1 = __shfl_sync(kFull, w1, off & 31);
      const uint32_t word = off < 32 ? (a0 & 0xFFFFu) : off < 64 ? (a0 >> 16) : (a1 & 0xFFFFu);
      if (need) xr = (xr << 16) | word;
      ps += cnt;
      if (ps - bs >= 64) {
        bs += 64;
        w0 = w1;
        w1 = w2;
        w2 = w3;
        const uint32_t k0 = bs + 192 + lane, k1 = k0 + 32;
        w3 = (k0 < n_words ? ld_le16u(words + 2ull * k0) : 0u) | ((k1 < n_words ? ld_le16u(words + 2ull * k1) : 0u) << 16);
      }
    }
    uint32_t rv = rconst;
    if constexpr (RRAW) {
      if constexpr (AHEAD > 0) {
        rv = rq[0];
#pragma unroll
        for (uint32_t q = 0; q + 1 < QA; ++q) rq[q] = rq[q + 1];
        const uint32_t ia = i + 32 * AHEAD;
        rq[QA - 1] = ia < n ? uint32_t(r[ia]) : 0u;
      } else {
        rv = act ? uint32_t(r[i]) : 0u;
      }
    }
    if (act) out[i] = uint16_t(((rv & 0x80u) << 8) | (e << 7) | (rv & 0x7Fu));
  }
  st = RansLane{xr, w0, w1, w2, w3, ps, bs};
}

/// Decodes one coded chunk with one warp. Returns kChunkOk, kChunkBad (corrupt) or kChunkDefer (needs more tables
/// than this kernel has, a misaligned frame in a streaming kernel, or a tile too large for two ring slots: nothing
/// was written).
/// STREAM: fixed-rate streams come through the shared-memory ring (bulk copies, tiles ahead); otherwise they are read
/// from global memory where they are (any alignment).
template <uint32_t FID, uint32_t C, uint32_t L, uint32_t RING, uint32_t XS>
__device__ int decode_coded(const uint8_t* src, uint32_t size, uint32_t raw_len, uint8_t* dst, uint8_t* ws,
                            bool tile_ok, bool pairs, bool verify, Xxh32& dg, uint32_t& dg_from) {
  using F = Fam<FID>;
  using WL = WarpLayout<C, L, RING, XS>;
  constexpr bool STREAM = RING > 0;
  constexpr uint32_t E = F::kEsize, NS = F::kCount;
  const uint32_t lane = lane_id();
  const uint32_t n = raw_len / E;
  if (STREAM && !aligned16(src)) return kChunkDefer;
  if (size < chunk_sections_offset(NS)) return kBadAt(__LINE__);
  if (src[0] != kChunkKindCoded || src[1] != NS || ld_le16u(src + 2) != 0 || ld_le32u(src + 4) != n) return kBadAt(__LINE__);
  if (!warp_zero(src + kChunkHeaderBytes + kStreamDescriptorBytes * NS,
                 chunk_sections_offset(NS) - kChunkHeaderBytes - kStreamDescriptorBytes * NS))
    return kBadAt(__LINE__);

  StreamState ss[NS];
  uint32_t nr = 0, nl = 0;
  {
    uint32_t off = chunk_sections_offset(NS);
#pragma unroll
    for (uint32_t j = 0; j < NS; ++j) {
      const uint8_t* d = src + kChunkHeaderBytes + kStreamDescriptorBytes * j;
      StreamState& s = ss[j];
      s.mode = d[0];
      s.param = d[1];
      s.w = F::width(j);
      s.bytes = ld_le32u(d + 4);
      s.cursor = 0;
      s.slot = 0;
      s.n_exc = 0;
      s.len = 0;
      s.seg = 0;
      s.tile_bytes = 0;
      if (ld_le16u(d + 2) != 0) return kBadAt(__LINE__);
      const uint32_t al = uint32_t(align16(off));
      if (al > size) return kBadAt(__LINE__);
      if (!warp_zero(src + off, al - off)) return kBadAt(__LINE__);
      off = al;
      if (s.bytes > size - off) return kBadAt(__LINE__);
      s.sec = src + off;
      s.data = s.sec;
      s.exc = s.sec;
      off += s.bytes;
      if (s.mode == uint32_t(StreamMode::RANS)) s.slot = nr++;
      else if (s.mode == uint32_t(StreamMode::LUT)) s.slot = nl++;
      else if (s.mode > uint32_t(StreamMode::RANS)) return kBadAt(__LINE__);
    }
    if (off != size) return kBadAt(__LINE__);
  }
  if (nr > C || nl > L) return kChunkDefer;

  uint8_t* lut_base = ws + WL::kLut;
  // Per-stream validation and tables (the CPU's checks, all of which mean TZIP_CORRUPT).
#pragma unroll
  for (uint32_t j = 0; j < NS; ++j) {
    StreamState& s = ss[j];
    const uint32_t w = s.w;
    if (s.mode == uint32_t(StreamMode::CONST)) {
      if (s.bytes != 0 || (s.param >> w)) return kBadAt(__LINE__);
    } else if (s.mode == uint32_t(StreamMode::RAW)) {
      if (s.bytes != packed_bytes(n, w) || s.param != 0) return kBadAt(__LINE__);
      if (w < 8 && !tail_bits_zero(s.sec, n, w)) return kBadAt(__LINE__);
      s.len = s.bytes;
    } else if (s.mode == uint32_t(StreamMode::LUT)) {
      const uint32_t k = s.param;
      if (k < 1 || k >= w) return kBadAt(__LINE__);
      if (s.bytes < lut_codes_offset(k)) return kBadAt(__LINE__);
      const uint32_t n_exc = ld_le32u(s.sec);
      if (n_exc > n || uint64_t(s.bytes) != lut_exceptions_offset(k, n) + n_exc) return kBadAt(__LINE__);
      s.n_exc = n_exc;
      s.data = s.sec + lut_codes_offset(k);
      s.exc = s.sec + lut_exceptions_offset(k, n);
      s.len = uint32_t(packed_bytes(n, k));
      const uint32_t cap = (1u << k) - 1;
      if (!warp_zero(s.sec + 4 + cap, lut_codes_offset(k) - 4 - cap)) return kBadAt(__LINE__);
      if (!warp_zero(s.data + s.len, uint32_t(lut_exceptions_offset(k, n) - lut_codes_offset(k)) - s.len))
        return kBadAt(__LINE__);
      if (!tail_bits_zero(s.data, n, k)) return kBadAt(__LINE__);
      uint8_t* lut = lut_base + 128 * s.slot;
      bool bad = false;
      for (uint32_t i = lane; i < 128; i += 32) {
        const uint32_t v = i < cap ? s.sec[4 + i] : 0u;
        if (v >> w) bad = true;
        lut[i] = uint8_t(v);
      }
      __syncwarp();  // lanes read each other's LUT entries below (racecheck flagged the hazard without it)
      if (__any_sync(kFull, bad)) return kBadAt(__LINE__);
    } else {  // RANS
      if constexpr (C > 0) {
        if (s.param != 0 || s.bytes < kRansBitmapBytes) return kBadAt(__LINE__);
        const uint32_t bits = s.sec[lane];
        const uint32_t m = warp_sum(uint32_t(__popc(bits)));
        if (m < 2) return kBadAt(__LINE__);
        if (s.bytes < rans_words_offset(m)) return kBadAt(__LINE__);
        uint32_t idx = warp_inclusive_sum(uint32_t(__popc(bits))) - __popc(bits);
        uint32_t f[8], fl = 0;
        bool bad = false;
#pragma unroll
        for (int r = 0; r < 8; ++r) {
          f[r] = 0;
          if ((bits >> r) & 1) {
            if ((lane * 8 + r) >> w) bad = true;
            f[r] = ld_le16u(s.sec + kRansBitmapBytes + 2 * idx++);
            if (f[r] == 0 || f[r] >= kRansProbScale) bad = true;
          }
          fl += f[r];
        }
        if (__any_sync(kFull, bad)) return kBadAt(__LINE__);
        const uint32_t incl = warp_inclusive_sum(fl);
        if (__shfl_sync(kFull, incl, 31) != kRansProbScale) return kBadAt(__LINE__);
        const uint32_t so = rans_states_offset(m), wo = rans_words_offset(m);
        const uint32_t x = ld_le32u(s.sec + so + 4 * lane);
        if (__any_sync(kFull, x < kRansLow)) return kBadAt(__LINE__);
        const uint32_t nw = ld_le32u(s.sec + so + 4 * kRansLanes);
        if (nw > n || uint64_t(s.bytes) != uint64_t(wo) + 2ull * nw) return kBadAt(__LINE__);
        if (!warp_zero(s.sec + kRansBitmapBytes + 2 * m, so - kRansBitmapBytes - 2 * m)) return kBadAt(__LINE__);
        if (!warp_zero(s.sec + so + 4 * kRansLanes + 4, wo - so - 4 * kRansLanes - 4)) return kBadAt(__LINE__);
        s.len = nw;
        s.data = s.sec + wo;
        // Tables: fc[s] = freq | cum << 16; sym[slot] by a max-scan over the start markers.
        uint8_t* symt = ws + WL::kRansSym + 4096 * s.slot;
        uint32_t* fc = reinterpret_cast<uint32_t*>(ws + WL::kRansFc) + 256 * s.slot;
        uint32_t* symw = reinterpret_cast<uint32_t*>(symt);
        for (uint32_t q = lane; q < 1024; q += 32) symw[q] = 0;
        __syncwarp();
        uint32_t cum = incl - fl;
#pragma unroll
        for (int r = 0; r < 8; ++r) {
          fc[lane * 8 + r] = f[r] | (cum << 16);
          if (f[r]) symt[cum] = uint8_t(lane * 8 + r);
          cum += f[r];
        }
        __syncwarp();
        uint32_t words[32], run = 0;
#pragma unroll
        for (int q = 0; q < 32; ++q) {
          words[q] = symw[lane * 32 + q];
          const uint32_t wq = words[q];
          run = max(run, max(max(wq & 0xFFu, (wq >> 8) & 0xFFu), max((wq >> 16) & 0xFFu, wq >> 24)));
        }
        uint32_t pre = run;
#pragma unroll
        for (int d = 1; d < 32; d <<= 1) {
          const uint32_t o = __shfl_up_sync(kFull, pre, d);
          if (lane >= uint32_t(d)) pre = max(pre, o);
        }
        uint32_t cur = __shfl_up_sync(kFull, pre, 1);
        if (lane == 0) cur = 0;
#pragma unroll
        for (int q = 0; q < 32; ++q) {
          uint32_t wq = words[q], o = 0;
#pragma unroll
          for (int b = 0; b < 4; ++b) {
            cur = max(cur, (wq >> (8 * b)) & 0xFFu);
            o |= cur << (8 * b);
          }
          symw[lane * 32 + q] = o;
        }
        __syncwarp();
        s.cursor = x;  // the lane's initial state, picked up below
      } else {
        return kChunkDefer;
      }
    }
  }

  // The ring: one segment per fixed-rate stream (RAW, LUT codes), one slot per ring tile. With `pairs`, a ring tile is
  // two decoder tiles when two slots of them fit: half the bulk copies (and their issue) per element.
  Ring rg{};
  const uint32_t tiles = (n + kTile - 1) / kTile;
  if constexpr (STREAM) {
    auto wbits_of = [](const StreamState& s) {
      return s.mode == uint32_t(StreamMode::RAW) ? s.w : s.mode == uint32_t(StreamMode::LUT) ? s.param : 0u;
    };
    uint32_t sb2 = 0;  // slot bytes of two-tile ring tiles
#pragma unroll
    for (uint32_t j = 0; j < NS; ++j) {
      const uint32_t wbits = wbits_of(ss[j]);
      if (wbits) sb2 += kTile / 4 * wbits + (wbits < 8 ? 16 : 0);
    }
    rg.rs = pairs && RING >= 2 * sb2 ? 1u : 0u;
    uint32_t sb = 0;
#pragma unroll
    for (uint32_t j = 0; j < NS; ++j) {
      StreamState& s = ss[j];
      const uint32_t wbits = wbits_of(s);
      if (!wbits) continue;
      s.tile_bytes = (kTile / 8 * wbits) << rg.rs;
      s.seg = sb;
      sb += s.tile_bytes + (wbits < 8 ? 16 : 0);
    }
    const uint32_t rt = kTile << rg.rs;
    if (!ring_start<NS>(rg, ss, ws + WL::kRing, reinterpret_cast<uint64_t*>(ws + WL::kBars), sb, RING,
                        (n + rt - 1) / rt, n % rt == 0))
      return kChunkDefer;
  }

  uint32_t t = 0;
  if constexpr (F::kSplit && STREAM) {
    bool ok = tile_ok && ss[0].mode != uint32_t(StreamMode::RANS);
#pragma unroll
    for (uint32_t j = 1; j < NS; ++j)
      ok = ok && (ss[j].mode == uint32_t(StreamMode::CONST) || ss[j].mode == uint32_t(StreamMode::RAW));
    const uint32_t tiles_full = n / kTile;
    if (ok && tiles_full) {
      uint32_t cursor = 0;
      const uint8_t* lut = lut_base + 128 * ss[0].slot;
      if (!run_tiles<FID, WL::kExcBytes>(ss, rg, t, tiles_full, dst, lut, ws + WL::kStage, ws + WL::kExc, cursor, verify, dg)) {
        ring_drain(rg);
        return kBadAt(__LINE__);
      }
      ss[0].cursor = cursor;
      dg_from = tiles_full * (kTile * E / 16);  // every lane fed its stripes of the tiles (a multiple of 32 stripes)
    }
  }

  // Step path: element 32 g + lane, one symbol per stream per step. RANS lane states and a 256-word window of each
  // RANS stream's words are held in registers (indexed by stream), the tables by the stream's slot.
  uint32_t x[NS], h0[NS], h1[NS], h2[NS], h3[NS], pos[NS], base[NS];
#pragma unroll
  for (uint32_t j = 0; j < NS; ++j) {
    const StreamState& s = ss[j];
    x[j] = kRansLow;
    h0[j] = h1[j] = h2[j] = h3[j] = 0;
    pos[j] = 0;
    base[j] = 0;
    if (C > 0 && s.mode == uint32_t(StreamMode::RANS)) {
      x[j] = s.cursor;
      auto wd = [&](uint32_t k) { return k < s.len ? ld_le16u(s.data + 2 * k) : 0u; };
      h0[j] = wd(lane) | (wd(lane + 32) << 16);
      h1[j] = wd(lane + 64) | (wd(lane + 96) << 16);
      h2[j] = wd(lane + 128) | (wd(lane + 160) << 16);
      h3[j] = wd(lane + 192) | (wd(lane + 224) << 16);
    }
  }
  const bool dst_al = (reinterpret_cast<uintptr_t>(dst) & (E - 1)) == 0;
  const uint32_t steps = (n + 31) / 32;
  bool bad = false;
  // bf16 `max` chunks as the canonical encoder writes them (exponents RANS, sign+mantissa RAW or CONST) take a step
  // loop of their own: no mode tests per element, one RANS state and window, one 2-byte store.
  bool lean = false;
  if constexpr (FID == kFamBF16 && C > 0)
    lean = dst_al && ss[0].mode == uint32_t(StreamMode::RANS) &&
           (ss[1].mode == uint32_t(StreamMode::RAW) || ss[1].mode == uint32_t(StreamMode::CONST));
  for (; t < tiles; ++t) {
    const uint8_t* slot = nullptr;
    if constexpr (STREAM) slot = ring_tile<NS>(rg, ss, t);
    const uint32_t g_end = min(steps, (t + 1) * 32);
    if constexpr (FID == kFamBF16 && C > 0) {
      if (lean) {
        const StreamState& se = ss[0];
        const StreamState& sr = ss[1];
        const uint8_t* symt = ws + WL::kRansSym + 4096 * se.slot;
        const uint32_t* fc = reinterpret_cast<const uint32_t*>(ws + WL::kRansFc) + 256 * se.slot;
        const bool r_raw = sr.mode == uint32_t(StreamMode::RAW);
        // Element i's sign+mantissa byte is at rsrc[i]: in the ring tile's segment, or in the section itself. A kernel
        // without the ring takes the whole chunk at once.
        const uint8_t* rsrc = STREAM ? slot + sr.seg - ((t >> rg.rs) << rg.rs) * kTile : sr.data;
        const uint32_t g0 = t * 32, g1 = STREAM ? g_end : steps, full = min(g1, n / 32);
        constexpr uint32_t kAhead = STREAM ? 0 : 4;
        RansLane st{x[0], h0[0], h1[0], h2[0], h3[0], pos[0], base[0]};
        uint16_t* out = reinterpret_cast<uint16_t*>(dst);
        if (r_raw) {
          rans_bf16_steps<true, false, kAhead>(st, symt, fc, se.data, se.len, rsrc, 0, out, n, g0, full, bad);
          if (full < g1) rans_bf16_steps<true, true, 0>(st, symt, fc, se.data, se.len, rsrc, 0, out, n, full, g1, bad);
        } else {
          rans_bf16_steps<false, false, 0>(st, symt, fc, se.data, se.len, rsrc, sr.param, out, n, g0, full, bad);
          if (full < g1) rans_bf16_steps<false, true, 0>(st, symt, fc, se.data, se.len, rsrc, sr.param, out, n, full, g1, bad);
        }
        x[0] = st.x; h0[0] = st.h0; h1[0] = st.h1; h2[0] = st.h2; h3[0] = st.h3; pos[0] = st.pos; base[0] = st.base;
        bad = __any_sync(kFull, bad);
        if constexpr (STREAM) __syncwarp();
        if (bad) break;
        if constexpr (!STREAM) {
          t = tiles;  // every step done
          break;
        }
        continue;
      }
    }
    for (uint32_t g = t * 32; g < g_end; ++g) {
      const uint32_t i = g * 32 + lane;
      const uint32_t il = i - ((t >> rg.rs) << rg.rs) * kTile;  // element within the ring tile
      const bool act = i < n;
      uint32_t sym[NS];
#pragma unroll
      for (uint32_t j = 0; j < NS; ++j) {
        StreamState& s = ss[j];
        uint32_t v = 0;
        if (s.mode == uint32_t(StreamMode::CONST)) {
          v = s.param;
        } else if (s.mode == uint32_t(StreamMode::RAW)) {
          if (act) {
            if (STREAM) v = s.w == 8 ? uint32_t(slot[s.seg + il]) : extract_bits(slot + s.seg, il * s.w, s.w, 1u << 30);
            else v = s.w == 8 ? uint32_t(s.data[i]) : extract_bits(s.data, i * s.w, s.w, s.len);
          }
        } else if (s.mode == uint32_t(StreamMode::LUT)) {
          const uint32_t k = s.param, esc = (1u << k) - 1;
          uint32_t c = 0;
          if (act) c = STREAM ? extract_bits(slot + s.seg, il * k, k, 1u << 30) : extract_bits(s.data, i * k, k, s.len);
          const bool is_esc = act && c == esc;
          const uint32_t b = __ballot_sync(kFull, is_esc);
          v = lut_base[128 * s.slot + c];
          if (b) {
            const uint32_t idx = s.cursor + __popc(b & lanemask_lt());
            if (is_esc) {
              if (idx < s.n_exc) v = s.exc[idx];
              else bad = true;
              if (v >> s.w) bad = true;
            }
            s.cursor += __popc(b);
          }
        } else if constexpr (C > 0) {  // RANS
          const uint8_t* symt = ws + WL::kRansSym + 4096 * s.slot;
          const uint32_t* fc = reinterpret_cast<const uint32_t*>(ws + WL::kRansFc) + 256 * s.slot;
          uint32_t xr = x[j];
          if (act) {
            const uint32_t sl = xr & (kRansProbScale - 1);
            v = symt[sl];
            const uint32_t e = fc[v];
            xr = (e & 0xFFFFu) * (xr >> kRansProbBits) + sl - (e >> 16);
          }
          const bool need = act && xr < kRansLow;
          const uint32_t b = __ballot_sync(kFull, need);
          if (b) {
            const uint32_t cnt = __popc(b);
            if (pos[j] + cnt > s.len) bad = true;
            const uint32_t off = pos[j] + __popc(b & lanemask_lt()) - base[j];  // < 96
            const uint32_t a0 = __shfl_sync(kFull, h0[j], off & 31), a1 = __shfl_sync(kFull, h1[j], off & 31);
            const uint32_t word = off < 32 ? (a0 & 0xFFFFu) : off < 64 ? (a0 >> 16) : (a1 & 0xFFFFu);
            if (need) xr = (xr << 16) | word;
            pos[j] += cnt;
            if (pos[j] - base[j] >= 64) {
              base[j] += 64;
              h0[j] = h1[j];
              h1[j] = h2[j];
              h2[j] = h3[j];
              const uint32_t k0 = base[j] + 192 + lane, k1 = k0 + 32;
              h3[j] = (k0 < s.len ? ld_le16u(s.data + 2ull * k0) : 0u) |
                      ((k1 < s.len ? ld_le16u(s.data + 2ull * k1) : 0u) << 16);
            }
          }
          x[j] = xr;
        }
        sym[j] = v;
      }
      bad = __any_sync(kFull, bad);  // uniform from here on: every lane leaves together
      if (bad) break;
      if (act) {
        uint32_t out[E];
        F::merge4(sym, out);
        uint8_t* p = dst + uint64_t(i) * E;
        if constexpr (E == 1) {
          *p = uint8_t(out[0]);
        } else if constexpr (E == 2) {
          if (dst_al) *reinterpret_cast<uint16_t*>(p) = uint16_t(out[0]);
          else { p[0] = uint8_t(out[0]); p[1] = uint8_t(out[0] >> 8); }
        } else if constexpr (E == 4) {
          if (dst_al) *reinterpret_cast<uint32_t*>(p) = out[0];
          else st_bytes(p, out[0], 4);
        } else {
          if (dst_al) *reinterpret_cast<uint2*>(p) = make_uint2(out[0], out[1]);
          else { st_bytes(p, out[0], 4); st_bytes(p + 4, out[1], 4); }
        }
      }
    }
    if constexpr (STREAM) __syncwarp();
    if (bad) break;
  }
  if constexpr (STREAM) ring_drain(rg);  // no copy may land in the ring after this chunk
  if (bad) return kBadAt(__LINE__);
  // All exceptions used, all words used, every lane back at its initial state.
#pragma unroll
  for (uint32_t j = 0; j < NS; ++j) {
    const StreamState& s = ss[j];
    if (s.mode == uint32_t(StreamMode::LUT) && s.cursor != s.n_exc) return kBadAt(__LINE__);
    if (C > 0 && s.mode == uint32_t(StreamMode::RANS)) {
      if (pos[j] != s.len) return kBadAt(__LINE__);
      if (__any_sync(kFull, x[j] != kRansLow)) return kBadAt(__LINE__);
    }
  }
  return kChunkOk;
}

/// Verification task `which` of frame ti, one warp: 0 the header digest, 1 the frame checksum (serial XXH32 hashes; the
/// chunk digests are checked by the decode kernels as they write each chunk). These are the first two tickets of every
/// frame in its class's decode kernel, so the hashes of a large frame run while the other warps decode its chunks.
__device__ void verify_task(const DecArgs& a, uint32_t ti, uint64_t which) {
  const DecTensor& T = a.t[ti];
  const uint8_t* f = T.frame;
  const uint32_t lane = lane_id();
  Xxh32 st;
  if (which == 0) {
    // Header digest: XXH32 of [0, header_bytes) with the digest field read as zero (header_bytes % 16 == 0).
    warp_stripes(st, T.header_bytes / 16, [&](uint64_t i) {
      uint4 v = ld_stripe(f + 16 * i);
      if (i == kOffHeaderDigest / 16) v.z = 0;
      return v;
    });
    if (lane == 0 && st.finish(f, 0) != ld_le32u(f + kOffHeaderDigest)) report(a, ti, err_key(kRHeaderDigest, 0, 0, kCorrupt));
  } else {
    // Checksum: XXH32 of the chunk digests (at +12 of each table entry) as little-endian u32s.
    const uint8_t* table = f + chunk_table_offset(T.ndim);
    const uint64_t nd = T.n_chunks;
    warp_stripes(st, nd / 4, [&](uint64_t i) {
      const uint8_t* e = table + kChunkEntryBytes * 4 * i + 12;
      return make_uint4(ld_le32u(e), ld_le32u(e + 16), ld_le32u(e + 32), ld_le32u(e + 48));
    });
    if (lane == 0) {
      uint8_t tail[16];
      const uint64_t i0 = nd / 4 * 4;
      for (uint64_t q = i0; q < nd; ++q) store_le32(tail + 4 * (q - i0), ld_le32u(table + kChunkEntryBytes * q + 12));
      if (st.finish(tail, uint32_t(4 * (nd - i0))) != T.checksum) report(a, ti, err_key(kRChecksum, 0, 0, kCorrupt));
    }
  }
}

template <uint32_t C, uint32_t L, uint32_t W, uint32_t RING, int MODE>  // MODE: the class (1 to 4), 0 fallback
__global__ void __launch_bounds__(W * 32, 1) decode_kernel(DecArgs a, uint32_t tile_ok, uint32_t defer_all) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  constexpr uint32_t XS = exc_smem_bytes(MODE);
  using WL = WarpLayout<C, L, RING, XS>;
  const uint32_t warp = threadIdx.x / 32, lane = lane_id();
  uint8_t* ws = smem_raw + WL::kBytes * warp;
  if constexpr (RING > 0) ring_init(reinterpret_cast<uint64_t*>(ws + WL::kBars));
  const uint32_t nt = a.n;
  for (;;) {
    unsigned long long c = 0;
    if (lane == 0) c = atomicAdd(a.tickets + ticket_of(MODE), 1ull);
    c = __shfl_sync(kFull, c, 0);
    uint32_t ti;
    uint64_t ci;
    if constexpr (MODE == 0) {
      if (c >= *((volatile unsigned long long*)a.queue_len) || c >= a.queue_cap) break;
      const unsigned long long q = a.queue[c];
      ti = uint32_t(q >> 32);
      ci = uint32_t(q);
    } else {
      if (c >= a.base[MODE][nt]) break;
      ti = find_frame(a.base[MODE], nt, c);
      const uint64_t task = c - a.base[MODE][ti];  // kVerifyTasks verification tasks, then the chunks
      if (task < kVerifyTasks) {
        verify_task(a, ti, task);
        continue;
      }
      ci = task - kVerifyTasks;
    }
    const DecTensor& T = a.t[ti];
    const uint32_t cs = T.chunk_bytes;
    const uint8_t* e = T.frame + chunk_table_offset(T.ndim) + kChunkEntryBytes * ci;
    const uint64_t off = ld_le64u(e);
    const uint32_t size = ld_le32u(e + 8);
    const uint8_t* payload = T.frame + T.header_bytes;
    const uint8_t* src = payload + off;
    uint8_t* dst = T.out + ci * cs;
    const uint32_t raw_len = uint32_t(umin64(cs, T.nbytes - ci * cs));
    int r = kChunkOk;
    const bool vfy = a.verify != 0;
    Xxh32 dg;              // this lane's share of the chunk digest (docs/format.md, section 9)
    uint32_t dg_from = 0;  // stripes of the output already fed to dg (by the copy or the tile path)
    // Padding up to the next chunk must be zero (checked before the chunk, as on the CPU).
    if (ci + 1 < T.n_chunks && !warp_zero(src + size, uint32_t(align16(off + size) - (off + size)))) {
      r = kChunkBad;
    } else if (size == raw_len) {
      if constexpr (RING >= 2 * kTile) {
        if (aligned16(src) && aligned16(dst)) {
          ring_copy(dst, src, raw_len, ws + WL::kRing, reinterpret_cast<uint64_t*>(ws + WL::kBars), RING, vfy, dg,
                    dg_from);
        } else {
          warp_copy(dst, src, raw_len, vfy, dg, dg_from);
        }
      } else {
        warp_copy(dst, src, raw_len, vfy, dg, dg_from);
      }
    } else if (T.codec == uint8_t(Codec::RAW)) {
      r = kChunkBad;
    } else if (MODE != 0 && defer_all) {
      r = kChunkDefer;
    } else {
      const bool tok = tile_ok && aligned16(dst);
      const bool pairs = MODE == 3 && a.ring_pairs;  // class 3's ring has room for two slots of tile pairs
      const uint32_t fam = family_of(Dtype(T.dtype), Codec(T.codec));
      if constexpr (MODE == 3 || MODE == 4) {
        // Classes 3 and 4 hold only bf16 frames (fast, max): the other families' code would cost them their registers.
        r = fam == kFamBF16 ? decode_coded<kFamBF16, C, L, RING, XS>(src, size, raw_len, dst, ws, tok, pairs, vfy, dg, dg_from)
                            : int(kChunkBad);
      } else switch (fam) {
        case kFamBF16: r = decode_coded<kFamBF16, C, L, RING, XS>(src, size, raw_len, dst, ws, tok, pairs, vfy, dg, dg_from); break;
        case kFamF16: r = decode_coded<kFamF16, C, L, RING, XS>(src, size, raw_len, dst, ws, tok, pairs, vfy, dg, dg_from); break;
        case kFamF32: r = decode_coded<kFamF32, C, L, RING, XS>(src, size, raw_len, dst, ws, tok, pairs, vfy, dg, dg_from); break;
        default:
          if constexpr (MODE == 1) {
            r = kChunkBad;  // class 1 holds only fast and raw frames, whose families are the three above
          } else {
            switch (family_of(Dtype(T.dtype), Codec(T.codec))) {
              case kFamP1: r = decode_coded<kFamP1, C, L, RING, XS>(src, size, raw_len, dst, ws, tok, pairs, vfy, dg, dg_from); break;
              case kFamP2: r = decode_coded<kFamP2, C, L, RING, XS>(src, size, raw_len, dst, ws, tok, pairs, vfy, dg, dg_from); break;
              case kFamP4: r = decode_coded<kFamP4, C, L, RING, XS>(src, size, raw_len, dst, ws, tok, pairs, vfy, dg, dg_from); break;
              default: r = decode_coded<kFamP8, C, L, RING, XS>(src, size, raw_len, dst, ws, tok, pairs, vfy, dg, dg_from); break;
            }
          }
      }
    }
    bool digest_bad = false;
    if (r == kChunkOk && vfy) {
      // The chunk digest of the bytes written: the stripes not fed on the way out are read back (this warp wrote them;
      // __syncwarp orders the lanes' stores before the loads).
      __syncwarp();
      digest_stripes(dg, dst, raw_len, dg_from);
      digest_bad = digest_finish(dg, dst, raw_len) != ld_le32u(e + 12);
    }
    if (lane == 0) {
      if (digest_bad) report(a, ti, err_key(kRChunk, ci, 1, kChecksum));
      if (r & kChunkBad) {
        report(a, ti, err_key(kRChunk, ci, 0, kCorrupt));
        if (a.debug) printf("tzip decode: frame %u chunk %llu rejected at decode.cu:%d\n", ti, (unsigned long long)ci, r >> 2);
      }
      else if (r == kChunkDefer) {
        const unsigned long long q = atomicAdd(a.queue_len, 1ull);
        if (q < a.queue_cap) a.queue[q] = (static_cast<unsigned long long>(ti) << 32) | ci;
      }
    }
    __syncwarp();
  }
}

#endif  // TZIP_DECODE_PART

#if !defined(TZIP_DECODE_PART)
// ---------------------------------------------------------------- 4. errors

__global__ void errors_kernel(DecArgs a) {
  for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < a.n; i += gridDim.x * blockDim.x) {
    const unsigned long long k = a.err[i];
    a.errors[i] = k == ~0ull ? int32_t(kOk) : int32_t(k & 0xFF);
  }
}

#endif  // !TZIP_DECODE_PART

}  // namespace

#if defined(TZIP_DECODE_PART)
// Part 1: fast and raw frames. Part 2: max and bytes frames. Part 3: bf16 fast frames. Part 4: bf16 max frames.
// Part 0: the fallback queue.
#if TZIP_DECODE_PART == 4
// bf16 max frames: 32 warps x 64 registers, no ring (the RAW sign+mantissa bytes are read ahead from global memory),
// 32 x 5376 bytes of shared memory: the RANS table and two LUT tables, so that every chunk class 2 took stays here
// (chunks with LUT exponents take the step path: the tile path needs the ring).
#define TZIP_PART_FN run_part4
constexpr uint32_t kC = 1, kL = 2, kW = 32, kRingBytes = 0;
constexpr int kMode = 4;
#elif TZIP_DECODE_PART == 3
// 24 warps x 80 registers (ptxas: 16 bytes spilled, outside the tile loop) and 24 x 9680 bytes of shared memory (of
// 232448): the ring holds 4 one-tile slots of 3-bit codes and RAW mantissas (2 of anything wider), or 2 slots of tile
// pairs (ring_pairs).
#define TZIP_PART_FN run_part3
constexpr uint32_t kC = 0, kL = 1, kW = 24, kRingBytes = 5920;
constexpr int kMode = 3;
#elif TZIP_DECODE_PART == 1
#define TZIP_PART_FN run_part1
constexpr uint32_t kC = 0, kL = 1, kW = 16, kRingBytes = 8192;
constexpr int kMode = 1;
#elif TZIP_DECODE_PART == 2
#define TZIP_PART_FN run_part2
constexpr uint32_t kC = 1, kL = 2, kW = 16, kRingBytes = 7168;  // 16 warps x 13.3 KB fit in 227 KB
constexpr int kMode = 2;
#else
#define TZIP_PART_FN run_part0
constexpr uint32_t kC = 8, kL = 8, kW = 4, kRingBytes = 0;
constexpr int kMode = 0;
#endif
Status TZIP_PART_FN(const DecArgs& a, int sm_budget, int sm_count, cudaStream_t s, uint32_t tile_ok,
                    uint32_t defer_all) {
  auto k = decode_kernel<kC, kL, kW, kRingBytes, kMode>;
  size_t smem = WarpLayout<kC, kL, kRingBytes, exc_smem_bytes(kMode)>::kBytes * kW;
  int grid = 0;
  Status st = detail::persistent_grid(reinterpret_cast<const void*>(k), kW * 32, &smem, sm_budget, sm_count, ~0ull,
                                      &grid);
  if (!st.ok()) return st;
  k<<<grid, kW * 32, smem, s>>>(a, tile_ok, defer_all);
  return detail::check_launch("decode_kernel");
}
#undef TZIP_PART_FN
#endif  // TZIP_DECODE_PART

}  // namespace dec

#if !defined(TZIP_DECODE_PART)
using namespace dec;

namespace {

/// The workspace of a call of `count` frames: descriptors, error keys and tickets first and contiguous (one upload
/// sets all three), then the per-class prefix sums and the queue of deferred chunks.
struct Workspace {
  size_t b_t, b_err, b_base, b_tickets, b_queue;
  size_t bytes() const { return b_t + b_err + kClasses * b_base + b_tickets + b_queue; }
  size_t image_bytes() const { return b_t + b_err + b_tickets; }
};

Workspace workspace_of(size_t count, uint64_t queue_cap) {
  auto al = [](size_t x) { return (x + 255) & ~size_t(255); };
  return Workspace{al(sizeof(DecTensor) * count), al(8 * count), al(8 * (count + 1)), al(64), al(8 * queue_cap)};
}

/// Checks the items, fills their descriptors and makes their device current through `guard` (opt.device, or the
/// device of every pointer); *queue_cap and *out_total get the queue's size and the output bytes.
Status describe(const DecodeItem* items, size_t count, const DecodeOptions& opt, int32_t* d_errors,
                detail::DeviceGuard* guard, std::vector<DecTensor>* tensors, uint64_t* queue_cap,
                uint64_t* out_total) {
  std::vector<const void*> ptrs;
  Status st;
  if (!items || !d_errors) {
    st.code = kInvalidArgument;
    st.message = "decode: null items or error array";
    return st;
  }
  if (count > UINT32_MAX) {
    st.code = kInvalidArgument;
    st.message = "too many frames in one call";
    return st;
  }
  tensors->assign(count, DecTensor{});
  ptrs.push_back(d_errors);
  *queue_cap = 0;
  *out_total = 0;
  for (size_t i = 0; i < count; ++i) {
    const DecodeItem& it = items[i];
    if ((!it.frame && it.frame_bytes) || (!it.out && it.out_bytes)) {
      st.code = kInvalidArgument;
      st.message = "frame " + std::to_string(i) + ": null pointer with a nonzero size";
      return st;
    }
    DecTensor& t = (*tensors)[i];
    std::memset(&t, 0, sizeof t);
    t.frame = static_cast<const uint8_t*>(it.frame);
    t.frame_len = it.frame ? it.frame_bytes : 0;
    t.out = static_cast<uint8_t*>(it.out);
    t.out_len = it.out_bytes;
    *queue_cap += it.out_bytes / kMinChunkBytes + 1;
    *out_total += it.out_bytes;
    if (it.frame) ptrs.push_back(it.frame);
    if (it.out) ptrs.push_back(it.out);
  }
  return opt.device >= 0 ? guard->bind_device(opt.device) : guard->bind(ptrs.data(), ptrs.size());
}

/// The kernels' arguments over a workspace laid out by `w` at `ws`.
DecArgs args_over(void* ws, const Workspace& w, size_t count, uint64_t queue_cap, bool verify, int32_t* d_errors,
                  const Tuning& tune) {
  uint8_t* p = static_cast<uint8_t*>(ws);
  DecArgs a{};
  a.t = reinterpret_cast<DecTensor*>(p); p += w.b_t;
  a.err = reinterpret_cast<unsigned long long*>(p); p += w.b_err;
  a.tickets = reinterpret_cast<unsigned long long*>(p);
  a.queue_len = a.tickets + 3;
  p += w.b_tickets;
  for (uint32_t c = 0; c < kClasses; ++c) { a.base[c] = reinterpret_cast<uint64_t*>(p); p += w.b_base; }
  a.queue = reinterpret_cast<unsigned long long*>(p);
  a.queue_cap = queue_cap;
  a.n = uint32_t(count);
  a.verify = verify ? 1 : 0;
  a.errors = d_errors;
  a.debug = tune.debug ? 1 : 0;
  a.bf16_class = tune.bf16_kernel ? 1 : 0;
  a.ring_pairs = tune.ring_pairs ? 1 : 0;
  return a;
}

/// The image the upload copies to the start of the workspace: descriptors, error keys at ~0 (no error), tickets at 0.
std::vector<uint8_t> image_of(const std::vector<DecTensor>& tensors, const Workspace& w) {
  std::vector<uint8_t> image(w.image_bytes(), 0);
  std::memcpy(image.data(), tensors.data(), sizeof(DecTensor) * tensors.size());
  std::memset(image.data() + w.b_t, 0xFF, 8 * tensors.size());
  return image;
}

/// The kernels of a call, in order, on `s` (after its descriptors, error keys and tickets are in place).
Status queue_kernels(const DecArgs& a, int sm_budget, int sms, cudaStream_t s, uint32_t tile_ok, uint32_t defer_all) {
  using namespace detail;
  int grid = 0;
  size_t smem = 0;
  Status r = persistent_grid(reinterpret_cast<const void*>(parse_kernel), 1024, &smem, sm_budget, sms, a.n, &grid);
  if (!r.ok()) return r;
  parse_kernel<<<grid, 1024, smem, s>>>(a);
  if (!(r = check_launch("parse_kernel")).ok()) return r;
  scan_kernel<<<1, 1024, 0, s>>>(a);
  if (!(r = check_launch("scan_kernel")).ok()) return r;
  if (!(r = run_part1(a, sm_budget, sms, s, tile_ok, defer_all)).ok()) return r;
  if (!(r = run_part2(a, sm_budget, sms, s, tile_ok, defer_all)).ok()) return r;
  if (a.bf16_class && !(r = run_part3(a, sm_budget, sms, s, tile_ok, defer_all)).ok()) return r;
  if (a.bf16_class && !(r = run_part4(a, sm_budget, sms, s, tile_ok, defer_all)).ok()) return r;
  if (!(r = run_part0(a, sm_budget, sms, s, 0, 0)).ok()) return r;
  errors_kernel<<<(unsigned)std::min<size_t>((a.n + 255) / 256, 1024), 256, 0, s>>>(a);
  return check_launch("errors_kernel");
}

}  // namespace

Status decode(const DecodeItem* items, size_t count, const DecodeOptions& opt, int32_t* d_errors) {
  using namespace detail;
  if (count == 0) return Status{};
  std::vector<DecTensor> tensors;
  uint64_t queue_cap = 0, out_total = 0;
  DeviceGuard guard;
  Status st = describe(items, count, opt, d_errors, &guard, &tensors, &queue_cap, &out_total);
  if (!st.ok()) return st;
  void* stream = opt.stream;
  const Tuning tune = get_tuning();
  const Workspace w = workspace_of(count, queue_cap);
  void* ws = nullptr;
  st = alloc_async(&ws, w.bytes(), stream);
  if (!st.ok()) return st;
  const DecArgs a = args_over(ws, w, count, queue_cap, opt.verify, d_errors, tune);

  auto fail = [&](Status s) {
    free_async(ws, stream);
    return s;
  };
  const cudaStream_t s = cudaStream_t(stream);
  const int sms = guard.sm_count();
  const uint32_t tile_ok = tune.use_tile_decode ? 1 : 0, defer_all = tune.defer_all ? 1 : 0;
  auto kernels = [&]() -> Status { return queue_kernels(a, opt.sm_budget, sms, s, tile_ok, defer_all); };
  // The error keys start at ~0 (no error) and the tickets at 0. For a batch of up to kInitUploadBytes of them, they go
  // up with the descriptors: a small call's fixed cost is mostly its stream operations (gpu_test --small-calls), and
  // this saves two of them. Such a call of a caller that allows it (opt.graphs) is replayed from a CUDA graph of the
  // whole sequence, kept per stream and everything the kernels' arguments are made of (gpu/graph.h).
  if (w.b_err <= kInitUploadBytes) {
    const std::vector<uint8_t> image = image_of(tensors, w);
    if (opt.graphs && count <= kGraphMaxItems && out_total <= kGraphMaxBytes) {
      GraphKey key;
      key.w = {1, uint64_t(guard.device()), uint64_t(reinterpret_cast<uintptr_t>(stream)), count, a.verify,
               uint64_t(int64_t(opt.sm_budget)), queue_cap, uint64_t(reinterpret_cast<uintptr_t>(ws)),
               uint64_t(reinterpret_cast<uintptr_t>(d_errors)), image.size(),
               uint64_t(tile_ok | defer_all << 1 | a.bf16_class << 2 | a.ring_pairs << 3 | a.debug << 4), uint64_t(sms)};
      if (launch_graph(key, image.data(), image.size(), a.t, stream, kernels)) {
        free_async(ws, stream);
        return Status{};
      }
    }
    if (!(st = upload(a.t, image.data(), image.size(), stream)).ok()) return fail(st);
  } else {
    if (!(st = upload(a.t, tensors.data(), sizeof(DecTensor) * count, stream)).ok()) return fail(st);
    if (!(st = memset_async(a.err, 0xFF, 8 * count, stream)).ok()) return fail(st);
    if (!(st = memset_async(a.tickets, 0, 64, stream)).ok()) return fail(st);
  }
  if (!(st = kernels()).ok()) return fail(st);
  free_async(ws, stream);
  return Status{};
}

// ------------------------------------------------------------------------------------------------ decode plans

struct DecodePlan {
  int device = -1;
  int sm_budget = kDefaultSmBudget;
  int sms = 0;
  uint32_t tile_ok = 1, defer_all = 0;
  void* ws = nullptr;  // cudaMalloc'd: lives as long as the plan
  DecArgs args{};
  // A plan's run is the same ten stream operations every time (two memsets, the kernels), about 48 us of driver time
  // (H100, docs/benchmarks.md): a graph of them is captured at the second eager run (the first fills the launch
  // geometry's caches) and replayed by one cudaGraphLaunch. Runs are ordered by the caller (codec.h), so the plan's
  // own state needs no lock.
  cudaGraphExec_t exec = nullptr;
  int eager_runs = 0;
  bool graph_failed = false;
};

namespace {

/// Captures the plan's run on `s` (not capturing, device current) into plan->exec; false (nothing queued, the stream
/// out of capture mode) on failure.
bool capture_plan(DecodePlan* plan, cudaStream_t s) {
  using namespace detail;
  if (cudaPeekAtLastError() != cudaSuccess) return false;  // the capture's launch checks would take it for their own
  const DecArgs& a = plan->args;
  return capture_exec(s, [&]() -> Status {
    Status st = memset_async(a.err, 0xFF, 8 * size_t(a.n), s);
    if (st.ok()) st = memset_async(a.tickets, 0, 64, s);
    return st.ok() ? queue_kernels(a, plan->sm_budget, plan->sms, s, plan->tile_ok, plan->defer_all) : st;
  }, &plan->exec);
}

}  // namespace

Status decode_plan_create(const DecodeItem* items, size_t count, const DecodeOptions& opt, int32_t* d_errors,
                          DecodePlan** out) {
  using namespace detail;
  if (!out) return Status{kInvalidArgument, "decode_plan_create: null result pointer"};
  *out = nullptr;
  if (count == 0) return Status{kInvalidArgument, "decode_plan_create: a plan needs at least one frame"};
  std::vector<DecTensor> tensors;
  uint64_t queue_cap = 0, out_total = 0;
  DeviceGuard guard;
  Status st = describe(items, count, opt, d_errors, &guard, &tensors, &queue_cap, &out_total);
  if (!st.ok()) return st;
  const Tuning tune = get_tuning();
  const Workspace w = workspace_of(count, queue_cap);
  auto plan = std::make_unique<DecodePlan>();
  cudaError_t e = cudaMalloc(&plan->ws, w.bytes());
  if (e != cudaSuccess) {
    cudaGetLastError();
    plan->ws = nullptr;
    return cuda_status(e, "cudaMalloc of a decode plan's workspace");
  }
  // Synchronous: the descriptors are in place before any stream can run the plan.
  const std::vector<uint8_t> image = image_of(tensors, w);
  e = cudaMemcpy(plan->ws, image.data(), image.size(), cudaMemcpyHostToDevice);
  if (e != cudaSuccess) {
    cudaGetLastError();
    cudaFree(plan->ws);
    return cuda_status(e, "cudaMemcpy of a decode plan's descriptors");
  }
  plan->device = guard.device();
  plan->sm_budget = opt.sm_budget;
  plan->sms = guard.sm_count();
  plan->tile_ok = tune.use_tile_decode ? 1 : 0;
  plan->defer_all = tune.defer_all ? 1 : 0;
  plan->args = args_over(plan->ws, w, count, queue_cap, opt.verify, d_errors, tune);
  *out = plan.release();
  return Status{};
}

Status decode_plan_run(DecodePlan* plan, void* stream) {
  using namespace detail;
  if (!plan) return Status{kInvalidArgument, "decode_plan_run: null plan"};
  DeviceGuard guard;
  Status st = guard.bind_device(plan->device);
  if (!st.ok()) return st;
  const cudaStream_t s = cudaStream_t(stream);
  // Inside the caller's own capture (torch.cuda.graph) the operations join that graph as they are: no graph launch.
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(s, &capturing) != cudaSuccess) {
    cudaGetLastError();
    capturing = cudaStreamCaptureStatusActive;  // (unknown: the plain path is right either way)
  }
  if (capturing == cudaStreamCaptureStatusNone && !plan->graph_failed && plan->eager_runs >= 1) {
    if (!plan->exec && !capture_plan(plan, s)) plan->graph_failed = true;
    if (plan->exec) {
      if (cudaGraphLaunch(plan->exec, s) == cudaSuccess) return Status{};
      cudaGetLastError();  // nothing queued: queue the operations as usual, from now on always
      plan->graph_failed = true;
    }
  }
  if (capturing == cudaStreamCaptureStatusNone) ++plan->eager_runs;
  const DecArgs& a = plan->args;
  // The parse kernel rewrites every parsed field of the descriptors, so only the error keys and tickets start over.
  if (!(st = memset_async(a.err, 0xFF, 8 * size_t(a.n), stream)).ok()) return st;
  if (!(st = memset_async(a.tickets, 0, 64, stream)).ok()) return st;
  return queue_kernels(a, plan->sm_budget, plan->sms, cudaStream_t(stream), plan->tile_ok, plan->defer_all);
}

void decode_plan_destroy(DecodePlan* plan) {
  if (!plan) return;
  detail::DeviceGuard guard;
  if (guard.bind_device(plan->device).ok()) {
    if (plan->exec) cudaGraphExecDestroy(plan->exec);
    cudaFree(plan->ws);
  }
  delete plan;
}
#endif  // !TZIP_DECODE_PART

}  // namespace gpu
}  // namespace tzip
