// Decoder, the tile path: float chunks without RANS streams, 1024 elements a tile through the ring, LUT codes looked up
// four at a time, escapes placed by one packed warp scan per tile, 16-byte coalesced stores.
#pragma once

#include "gpu/decode_ring.cuh"

namespace tzip {
namespace gpu {
namespace dec {
namespace {

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

}  // namespace
}  // namespace dec
}  // namespace gpu
}  // namespace tzip
