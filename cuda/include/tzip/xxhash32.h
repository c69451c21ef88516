// XXH32 (seed 0 in tzip), the xxHash 32-bit algorithm by Yann Collet (spec: xxhash_spec.md, "XXH32").
// One implementation for CPU and GPU so chunk digests agree on both; tests compare it with the
// reference library (python `xxhash`). Used for per-chunk digests of the original bytes.
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

}  // namespace tzip
