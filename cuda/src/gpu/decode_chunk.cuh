// Decoder, one coded chunk (decode_coded): stream headers and tables, then the tile path (decode_tile.cuh) or the step
// path in the format's RANS order, every byte checked as on the CPU (cuda/src/core/chunk_codec.cpp).
#pragma once

#include "gpu/decode_tile.cuh"

namespace tzip {
namespace gpu {
namespace dec {
namespace {

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

}  // namespace
}  // namespace dec
}  // namespace gpu
}  // namespace tzip
