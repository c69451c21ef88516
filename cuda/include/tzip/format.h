// The tzip frame format: constants, dtypes, codecs and the split of an element into coded streams.
// docs/format.md is the specification; this header is its single source of numbers for CPU and GPU.
#pragma once
#include "tzip/generated/constants.h"
#include "tzip/hostdevice.h"

namespace tzip {

// ---- Frame header (docs/format.md, "Frame") ----
// kFrameMagic (bytes "TZFR"), kFormatVersion, kFixedHeaderBytes (fields before the shape), kChunkEntryBytes (u64 offset,
// u32 size, u32 chunk digest: xxhash32.h, chunk_digest), kMaxNdim, kDefaultChunkBytes (64 KiB of input per chunk),
// kMinChunkBytes, kMaxChunkBytes and kChunkBytesMultiple (keeps every chunk element-aligned and 16-byte aligned) come
// from generated/constants.h, as do Dtype, dtype_size, Codec and the error codes.

// Field offsets inside the fixed header.
constexpr uint32_t kOffMagic = 0, kOffVersion = 4, kOffDtype = 6, kOffCodec = 7, kOffNdim = 8, kOffFlags = 9,
                   kOffChunkBytes = 12, kOffNbytes = 16, kOffPayloadBytes = 24, kOffNumChunks = 32,
                   kOffChecksum = 36, kOffHeaderDigest = 40, kOffShape = 48;

/// Offset of the chunk table inside a frame with `ndim` dimensions (bytes).
TZIP_HD uint64_t chunk_table_offset(uint32_t ndim) { return align16(kFixedHeaderBytes + 8ull * ndim); }
/// Bytes before the payload: fixed header, shape, padding and chunk table.
TZIP_HD uint64_t frame_header_bytes(uint32_t ndim, uint64_t n_chunks) {
  return chunk_table_offset(ndim) + uint64_t(kChunkEntryBytes) * n_chunks;
}
TZIP_HD uint64_t num_chunks(uint64_t nbytes, uint32_t chunk_bytes) {
  return nbytes / chunk_bytes + (nbytes % chunk_bytes != 0);  // no overflow near 2^64
}
/// Exact upper bound of a frame's size in bytes: the payload never exceeds the input, because a chunk whose
/// coded form (padded to 16 bytes) is not smaller than its raw bytes is stored raw (docs/format.md, "Bound").
TZIP_HD uint64_t max_frame_bytes(uint64_t nbytes, uint32_t ndim, uint32_t chunk_bytes) {
  return frame_header_bytes(ndim, num_chunks(nbytes, chunk_bytes)) + nbytes;
}

// ---- Dtypes: codes follow the safetensors dtype names (docs/format.md, "Dtypes") ----
// enum class Dtype, kNumDtypes, kDtypeNames and dtype_size(Dtype): generated/constants.h.
/// True for the dtypes the float codecs (fast, max) split into exponent and residual streams.
TZIP_HD bool dtype_is_split_float(Dtype d) { return d == Dtype::BF16 || d == Dtype::F16 || d == Dtype::F32; }

// ---- Codecs ----
// enum class Codec, kNumCodecs, kCodecNames and kCodecAuto: generated/constants.h.

// ---- Streams of a coded chunk ----
// A float element is split into an exponent stream E and residual streams holding sign and mantissa;
// the byte codec splits an element of w bytes into w byte planes (little-endian byte order).
enum class StreamMode : uint8_t { CONST = 0, RAW = 1, LUT = 2, RANS = 3 };
constexpr uint32_t kMaxStreams = 8;

struct StreamLayout {
  uint32_t count;                // number of streams
  uint8_t bits[kMaxStreams];     // symbol width of each stream (1..8 bits)
};

/// Streams of `dtype` under `codec` (FAST/MAX for bf16/fp16/fp32, otherwise byte planes).
TZIP_HD StreamLayout stream_layout(Dtype d, Codec c) {
  StreamLayout s{};
  if ((c == Codec::FAST || c == Codec::MAX) && dtype_is_split_float(d)) {
    if (d == Dtype::BF16) { s.count = 2; s.bits[0] = 8; s.bits[1] = 8; }
    else if (d == Dtype::F16) { s.count = 3; s.bits[0] = 5; s.bits[1] = 8; s.bits[2] = 3; }
    else { s.count = 4; s.bits[0] = 8; s.bits[1] = 8; s.bits[2] = 8; s.bits[3] = 8; }
  } else {
    s.count = dtype_size(d);
    for (uint32_t i = 0; i < s.count; ++i) s.bits[i] = 8;
  }
  return s;
}

/// Splits element `i` of a chunk (little-endian bytes at `p`) into one symbol per stream.
/// bf16 s|e8|m7      -> E=e, R0=s<<7|m
/// fp16 s|e5|m10     -> E=e, R0=m[7:0], R1=s<<2|m[9:8]
/// fp32 s|e8|m23     -> E=e, R0=m[7:0], R1=m[15:8], R2=s<<7|m[22:16]
/// byte planes       -> P_j = byte j
TZIP_HD void split_element(Dtype d, Codec c, const uint8_t* p, uint8_t* sym) {
  if ((c == Codec::FAST || c == Codec::MAX) && dtype_is_split_float(d)) {
    if (d == Dtype::BF16) {
      uint32_t v = load_le16(p);
      sym[0] = uint8_t(v >> 7);
      sym[1] = uint8_t(((v >> 8) & 0x80) | (v & 0x7F));
    } else if (d == Dtype::F16) {
      uint32_t v = load_le16(p);
      sym[0] = uint8_t((v >> 10) & 0x1F);
      sym[1] = uint8_t(v);
      sym[2] = uint8_t(((v >> 13) & 4) | ((v >> 8) & 3));
    } else {
      uint32_t v = load_le32(p);
      sym[0] = uint8_t(v >> 23);
      sym[1] = uint8_t(v);
      sym[2] = uint8_t(v >> 8);
      sym[3] = uint8_t(((v >> 24) & 0x80) | ((v >> 16) & 0x7F));
    }
  } else {
    uint32_t w = dtype_size(d);
    for (uint32_t j = 0; j < w; ++j) sym[j] = p[j];
  }
}

/// Inverse of split_element: writes element bytes at `p` from one symbol per stream.
TZIP_HD void merge_element(Dtype d, Codec c, const uint8_t* sym, uint8_t* p) {
  if ((c == Codec::FAST || c == Codec::MAX) && dtype_is_split_float(d)) {
    if (d == Dtype::BF16) {
      uint32_t v = (uint32_t(sym[1] & 0x80) << 8) | (uint32_t(sym[0]) << 7) | (sym[1] & 0x7F);
      store_le16(p, uint16_t(v));
    } else if (d == Dtype::F16) {
      uint32_t v = (uint32_t(sym[2] & 4) << 13) | (uint32_t(sym[0] & 0x1F) << 10) | (uint32_t(sym[2] & 3) << 8) | sym[1];
      store_le16(p, uint16_t(v));
    } else {
      uint32_t v = (uint32_t(sym[3] & 0x80) << 24) | (uint32_t(sym[0]) << 23) | (uint32_t(sym[3] & 0x7F) << 16) |
                   (uint32_t(sym[2]) << 8) | sym[1];
      store_le32(p, v);
    }
  } else {
    uint32_t w = dtype_size(d);
    for (uint32_t j = 0; j < w; ++j) p[j] = sym[j];
  }
}

// ---- Coded chunk layout (docs/format.md, "Coded chunk") ----
constexpr uint8_t kChunkKindCoded = 1;
constexpr uint32_t kChunkHeaderBytes = 8;       // u8 kind, u8 n_streams, u16 reserved, u32 n_elements
constexpr uint32_t kStreamDescriptorBytes = 8;  // u8 mode, u8 param, u16 reserved, u32 section bytes
TZIP_HD uint32_t chunk_sections_offset(uint32_t n_streams) {
  return uint32_t(align16(kChunkHeaderBytes + kStreamDescriptorBytes * n_streams));
}

/// Bytes of `n` symbols of `bits` each packed LSB-first (RAW mode for bits < 8, LUT codes).
TZIP_HD uint64_t packed_bytes(uint64_t n, uint32_t bits) { return (n * bits + 7) / 8; }

// ---- LUT mode (the fast codec's exponent coding) ----
// Section: u32 exception count, then (2^k - 1) LUT bytes, padding to 16; k-bit codes LSB-first, padding to 16;
// then the exception symbols, one byte each, in element order. Code 2^k - 1 is the escape.
TZIP_HD uint32_t lut_codes_offset(uint32_t k) { return uint32_t(align16(4u + ((1u << k) - 1u))); }
TZIP_HD uint64_t lut_exceptions_offset(uint32_t k, uint64_t n) { return align16(lut_codes_offset(k) + packed_bytes(n, k)); }

}  // namespace tzip
