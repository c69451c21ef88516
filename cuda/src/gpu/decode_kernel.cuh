// Decoder, step 3 of decode.cu's launch sequence: the persistent decode kernel of one class (one warp per task, atomic
// tickets: a frame's two verification tasks, then its chunks) and its launch. Included once by each of decode_k0.cu to
// decode_k4.cu, which pick the class's figures.
#pragma once

#include "gpu/decode_chunk.cuh"

namespace tzip {
namespace gpu {
namespace dec {
namespace {

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
        if (a.debug) printf("tzip decode: frame %u chunk %llu rejected at decode_chunk.cuh:%d\n", ti, (unsigned long long)ci, r >> 2);
      }
      else if (r == kChunkDefer) {
        const unsigned long long q = atomicAdd(a.queue_len, 1ull);
        if (q < a.queue_cap) a.queue[q] = (static_cast<unsigned long long>(ti) << 32) | ci;
      }
    }
    __syncwarp();
  }
}

/// Launches class MODE's decode kernel (C RANS tables, L LUT tables, W warps per block, RING bytes of ring per warp)
/// on `s`, one persistent block per SM of the budget. Each decode_k*.cu instantiates it once, with its class's
/// figures, so that the five kernels compile in parallel.
template <uint32_t C, uint32_t L, uint32_t W, uint32_t RING, int MODE>
Status launch_decode(const DecArgs& a, int sm_budget, int sm_count, cudaStream_t s, uint32_t tile_ok,
                     uint32_t defer_all) {
  auto k = decode_kernel<C, L, W, RING, MODE>;
  const uint32_t warps = a.warps && a.warps < W ? a.warps : W;  // Tuning::decode_warps, at most W
  size_t smem = WarpLayout<C, L, RING, exc_smem_bytes(MODE)>::kBytes * warps;
  int grid = 0;
  Status st = detail::persistent_grid(reinterpret_cast<const void*>(k), int(warps * 32), &smem, sm_budget, sm_count,
                                      ~0ull, &grid);
  if (!st.ok()) return st;
  k<<<grid, warps * 32, smem, s>>>(a, tile_ok, defer_all);
  return detail::check_launch("decode_kernel");
}

}  // namespace
}  // namespace dec
}  // namespace gpu
}  // namespace tzip
