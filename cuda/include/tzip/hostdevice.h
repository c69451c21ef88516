// Qualifiers that let one header compile for both the CPU backend (g++/clang) and the CUDA kernels (nvcc).
#pragma once
#include <cstddef>
#include <cstdint>

#if defined(__CUDACC__)
#define TZIP_HD __host__ __device__ __forceinline__
#else
#define TZIP_HD inline
#endif

namespace tzip {

/// Rounds `x` up to a multiple of 16 bytes: every section and chunk of the format starts 16-byte aligned
/// so that GPU decoders can use 16-byte vector loads (docs/format.md, "Alignment").
TZIP_HD uint64_t align16(uint64_t x) { return (x + 15u) & ~uint64_t(15); }

TZIP_HD uint32_t load_le32(const uint8_t* p) {
  return uint32_t(p[0]) | (uint32_t(p[1]) << 8) | (uint32_t(p[2]) << 16) | (uint32_t(p[3]) << 24);
}
TZIP_HD uint16_t load_le16(const uint8_t* p) { return uint16_t(p[0] | (p[1] << 8)); }
TZIP_HD uint64_t load_le64(const uint8_t* p) { return uint64_t(load_le32(p)) | (uint64_t(load_le32(p + 4)) << 32); }
TZIP_HD void store_le16(uint8_t* p, uint16_t v) { p[0] = uint8_t(v); p[1] = uint8_t(v >> 8); }
TZIP_HD void store_le32(uint8_t* p, uint32_t v) {
  p[0] = uint8_t(v); p[1] = uint8_t(v >> 8); p[2] = uint8_t(v >> 16); p[3] = uint8_t(v >> 24);
}
TZIP_HD void store_le64(uint8_t* p, uint64_t v) { store_le32(p, uint32_t(v)); store_le32(p + 4, uint32_t(v >> 32)); }

}  // namespace tzip
