// Interleaved rANS over 32 lanes: the max codec's entropy coder (docs/format.md, "RANS mode").
// Symbol i of a stream belongs to lane i % 32 and step i / 32. 32-bit states in [2^16, 2^32), 16-bit renormalisation
// words, probabilities quantised to 12 bits. The word stream is ordered as a 32-lane decoder reads it: step by step,
// and within a step by ascending lane, so a warp decodes it with one coalesced read per step.
// The frequency normalisation, table layout and cost estimates below are shared by the CPU backend and the CUDA
// kernels; the per-symbol steps are written out where each backend needs its own form (docs/format.md, "RANS mode").
#pragma once
#include "tzip/hostdevice.h"

namespace tzip {

constexpr uint32_t kRansLanes = 32;
constexpr uint32_t kRansProbBits = 12;
constexpr uint32_t kRansProbScale = 1u << kRansProbBits;  // 4096
constexpr uint32_t kRansLow = 1u << 16;                   // L: lower bound of a normalised state
constexpr uint32_t kRansBitmapBytes = 32;                 // presence bitmap of the 256 possible symbols

/// Normalises symbol counts (sum n >= 1, at least two symbols present) to frequencies summing to 4096, each present
/// symbol >= 1. Integer-only, so CPU and GPU produce the same table:
///   f_s = max(1, floor(c_s * 4096 / n)); the shortfall 4096 - sum goes to the most frequent symbol (ties: lowest
///   symbol); an excess is taken from the largest frequencies first, never below 1.
TZIP_HD void rans_normalize(const uint32_t* counts, uint64_t n, uint32_t* freq) {
  uint32_t sum = 0, best = 0;
  for (uint32_t s = 0; s < 256; ++s) {
    uint32_t f = 0;
    if (counts[s]) {
      f = uint32_t((uint64_t(counts[s]) * kRansProbScale) / n);
      if (f == 0) f = 1;
      if (counts[s] > counts[best]) best = s;
    }
    freq[s] = f;
    sum += f;
  }
  if (sum < kRansProbScale) {
    freq[best] += kRansProbScale - sum;
  } else {
    while (sum > kRansProbScale) {
      uint32_t top = 0;
      for (uint32_t s = 1; s < 256; ++s) if (freq[s] > freq[top]) top = s;
      uint32_t take = sum - kRansProbScale;
      if (take > freq[top] - 1) take = freq[top] - 1;
      freq[top] -= take;
      sum -= take;
    }
  }
}

/// Size in bytes of the table part of a RANS section: bitmap, u16 frequencies of present symbols, pad to 4,
/// 32 u32 lane states, u32 word count; the words start at the next multiple of 16.
TZIP_HD uint32_t rans_words_offset(uint32_t n_present) {
  return uint32_t(align16(((kRansBitmapBytes + 2u * n_present + 3u) & ~3u) + 4u * kRansLanes + 4u));
}
TZIP_HD uint32_t rans_states_offset(uint32_t n_present) { return (kRansBitmapBytes + 2u * n_present + 3u) & ~3u; }

// ---- Integer cost estimates (deterministic on CPU and GPU; used only to decide what to try) ----

/// log2(x) in 16.16 fixed point for x >= 1, by integer squaring (the same result on every platform).
TZIP_HD uint32_t log2_fixed16(uint64_t x) {
  uint32_t ip = 63;
  while (!(x >> ip)) --ip;
  // Mantissa 1.f with 32 fraction bits, in [2^32, 2^33); bits below the 33 kept ones are dropped.
  uint64_t m = ip <= 32 ? (x << (32 - ip)) : (x >> (ip - 32));
  uint32_t frac = 0;
  for (int b = 15; b >= 0; --b) {
    m = (m >> 16) * (m >> 16);  // square, keeping 32 fraction bits
    if (m >= (uint64_t(2) << 32)) { frac |= 1u << b; m >>= 1; }
  }
  return (ip << 16) | frac;
}

/// Order-0 cost of a histogram in bits, 16.16 fixed point: sum_s c_s * (log2 n - log2 c_s).
template <typename Count>
TZIP_HD uint64_t order0_cost_fixed16(const Count* counts, uint32_t n_symbols, uint64_t n) {
  if (n == 0) return 0;
  uint64_t cost = 0;
  const uint32_t ln = log2_fixed16(n);
  for (uint32_t s = 0; s < n_symbols; ++s)
    if (counts[s]) cost += uint64_t(counts[s]) * (ln - log2_fixed16(counts[s]));
  return cost;
}

}  // namespace tzip
