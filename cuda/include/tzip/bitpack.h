// LSB-first packing of k-bit symbols (1 <= k <= 8), used by LUT codes and by RAW streams narrower than a byte.
// Symbol i occupies bits [i*k, i*k + k) of a little-endian bit string; 8 symbols fill exactly k bytes, so a group of
// 8 symbols packs and unpacks without crossing into its neighbours (and 32 symbols are k 32-bit words on a GPU).
#pragma once
#include "tzip/hostdevice.h"

namespace tzip {

/// Packs 8 symbols of `k` bits into the low 8*k bits of the result.
TZIP_HD uint64_t pack8(const uint8_t* sym, uint32_t k) {
  uint64_t v = 0;
  for (uint32_t j = 0; j < 8; ++j) v |= uint64_t(sym[j]) << (j * k);
  return v;
}

/// Unpacks 8 symbols of `k` bits from the low 8*k bits of `v`.
TZIP_HD void unpack8(uint64_t v, uint32_t k, uint8_t* sym) {
  const uint64_t mask = (1u << k) - 1u;
  for (uint32_t j = 0; j < 8; ++j) sym[j] = uint8_t((v >> (j * k)) & mask);
}

/// Loads `nbytes` (<= 8) little-endian bytes.
TZIP_HD uint64_t load_le_bytes(const uint8_t* p, uint32_t nbytes) {
  uint64_t v = 0;
  for (uint32_t j = 0; j < nbytes; ++j) v |= uint64_t(p[j]) << (8 * j);
  return v;
}
TZIP_HD void store_le_bytes(uint8_t* p, uint64_t v, uint32_t nbytes) {
  for (uint32_t j = 0; j < nbytes; ++j) p[j] = uint8_t(v >> (8 * j));
}

}  // namespace tzip
