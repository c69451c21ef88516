// XXH32 (seed 0 in tzip), the xxHash 32-bit algorithm by Yann Collet (spec: xxhash_spec.md, "XXH32"), and the
// chunk digest built from it (docs/format.md, "Checksums"). One implementation for CPU and GPU so digests agree on
// both; tests compare them with the reference library (python `xxhash`) and python-bridge/tzip/reference.py.
#pragma once
#include "tzip/hostdevice.h"

namespace tzip {

constexpr uint32_t kXXH32Prime1 = 0x9E3779B1u;
constexpr uint32_t kXXH32Prime2 = 0x85EBCA77u;
constexpr uint32_t kXXH32Prime3 = 0xC2B2AE3Du;
constexpr uint32_t kXXH32Prime4 = 0x27D4EB2Fu;
constexpr uint32_t kXXH32Prime5 = 0x165667B1u;

TZIP_HD uint32_t rotl32(uint32_t x, int r) { return (x << r) | (x >> (32 - r)); }

TZIP_HD uint32_t xxh32_round(uint32_t acc, uint32_t input) {
  acc += input * kXXH32Prime2;
  acc = rotl32(acc, 13);
  return acc * kXXH32Prime1;
}

/// The end of XXH32: folds bytes [i, len) of `p` (fewer than 16) into `h` and applies the final avalanche.
/// Shared by the one-call hash below and the GPU's streaming hash (tzip/warp.h).
TZIP_HD uint32_t xxh32_finish(uint32_t h, const uint8_t* p, uint64_t i, uint64_t len) {
  for (; i + 4 <= len; i += 4) {
    h += load_le32(p + i) * kXXH32Prime3;
    h = rotl32(h, 17) * kXXH32Prime4;
  }
  for (; i < len; ++i) {
    h += uint32_t(p[i]) * kXXH32Prime5;
    h = rotl32(h, 11) * kXXH32Prime1;
  }
  h ^= h >> 15;
  h *= kXXH32Prime2;
  h ^= h >> 13;
  h *= kXXH32Prime3;
  h ^= h >> 16;
  return h;
}

/// XXH32 of `len` bytes at `p` with `seed`. Reads bytes one at a time through load_le32, so `p` may be unaligned.
TZIP_HD uint32_t xxh32(const uint8_t* p, uint64_t len, uint32_t seed) {
  uint64_t i = 0;  // offsets, not pointer arithmetic: p may be null when len is 0
  uint32_t h;
  if (len >= 16) {
    uint32_t v1 = seed + kXXH32Prime1 + kXXH32Prime2, v2 = seed + kXXH32Prime2, v3 = seed, v4 = seed - kXXH32Prime1;
    for (; i + 16 <= len; i += 16) {
      v1 = xxh32_round(v1, load_le32(p + i));
      v2 = xxh32_round(v2, load_le32(p + i + 4));
      v3 = xxh32_round(v3, load_le32(p + i + 8));
      v4 = xxh32_round(v4, load_le32(p + i + 12));
    }
    h = rotl32(v1, 1) + rotl32(v2, 7) + rotl32(v3, 12) + rotl32(v4, 18);
  } else {
    h = seed + kXXH32Prime5;
  }
  h += uint32_t(len);
  return xxh32_finish(h, p, i, len);
}

constexpr uint32_t kDigestLanes = 32;        // lanes of the chunk digest (one warp)
constexpr uint32_t kDigestStripeBytes = 16;  // bytes per stripe = one XXH32 round group

/// The chunk digest of format version 2 (docs/format.md, section 9): the `len` bytes at `p` are cut into 16-byte
/// stripes (only the last may be shorter); lane l (0..31) takes stripes l, l+32, l+64, ... in order and
/// d_l = XXH32(concatenation of its stripes, seed 0) (XXH32("") = 0x02CC5D05 for a lane with no stripe); the digest
/// is XXH32(LE32(d_0) || ... || LE32(d_31), seed 0) of those 128 bytes. A warp computes it with one coalesced
/// 16-byte load per lane per step; here the 32 lane states advance stripe by stripe, which is exactly XXH32 of
/// each lane's bytes because a whole stripe is one XXH32 round group (v1..v4) and only a lane's last stripe can be
/// short. Byte loads, so `p` may be unaligned; `p` may be null when `len` is 0. No heap; 640 bytes of stack.
TZIP_HD uint32_t chunk_digest(const uint8_t* p, uint64_t len) {
  uint32_t v[kDigestLanes][4];
  for (uint32_t l = 0; l < kDigestLanes; ++l) {
    v[l][0] = kXXH32Prime1 + kXXH32Prime2;
    v[l][1] = kXXH32Prime2;
    v[l][2] = 0;
    v[l][3] = 0u - kXXH32Prime1;
  }
  const uint64_t full = len / kDigestStripeBytes;  // whole stripes; a short last one is stripe `full`
  uint64_t s = 0;
  for (; s + kDigestLanes <= full; s += kDigestLanes) {  // 512 bytes: one stripe per lane, independent (vectorizes)
    const uint8_t* b = p + kDigestStripeBytes * s;
    for (uint32_t l = 0; l < kDigestLanes; ++l)
      for (uint32_t k = 0; k < 4; ++k) v[l][k] = xxh32_round(v[l][k], load_le32(b + 16 * l + 4 * k));
  }
  for (uint32_t l = 0; s < full; ++s, ++l)
    for (uint32_t k = 0; k < 4; ++k) v[l][k] = xxh32_round(v[l][k], load_le32(p + kDigestStripeBytes * s + 4 * k));
  const uint32_t tail_lane = uint32_t(full % kDigestLanes);  // lane of the short stripe, if there is one
  const uint64_t tail = len - kDigestStripeBytes * full;     // 0..15 bytes
  uint8_t le[4 * kDigestLanes];
  for (uint32_t l = 0; l < kDigestLanes; ++l) {
    const uint64_t whole = full / kDigestLanes + (l < tail_lane ? 1 : 0);  // whole stripes of lane l
    const uint64_t lane_tail = l == tail_lane ? tail : 0;
    const uint64_t lane_len = kDigestStripeBytes * whole + lane_tail;
    uint32_t h = whole ? rotl32(v[l][0], 1) + rotl32(v[l][1], 7) + rotl32(v[l][2], 12) + rotl32(v[l][3], 18)
                       : kXXH32Prime5;  // seed 0 + Prime5 below 16 bytes
    h += uint32_t(lane_len);
    // The tail bytes are [16*full, len) of p; an empty tail reads nothing.
    store_le32(le + 4 * l, lane_tail ? xxh32_finish(h, p, kDigestStripeBytes * full, len) : xxh32_finish(h, p, 0, 0));
  }
  return xxh32(le, sizeof le, 0);
}

}  // namespace tzip
