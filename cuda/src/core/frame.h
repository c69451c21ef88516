// A frame: one tensor's compressed bytes, self-describing (docs/format.md, "Frame").
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "tzip/format.h"

namespace tzip {

/// Parsed and validated frame header.
struct FrameHeader {
  uint16_t version = kFormatVersion;
  Dtype dtype = Dtype::U8;
  Codec codec = Codec::RAW;
  std::vector<uint64_t> shape;
  uint32_t chunk_bytes = kDefaultChunkBytes;
  uint64_t nbytes = 0;
  uint64_t payload_bytes = 0;
  uint64_t n_chunks = 0;
  uint32_t checksum = 0;
  uint64_t header_bytes = 0;  // fixed header + shape + chunk table
  uint64_t frame_bytes() const { return header_bytes + payload_bytes; }
};

struct EncodeOptions {
  Codec codec = Codec::RAW;  // already resolved (see resolve_codec)
  uint32_t chunk_bytes = kDefaultChunkBytes;
  uint32_t threads = 1;
};

/// Codec names as used by the CLI and addon: "auto", "fast", "max", "bytes", "raw".
/// "auto" is resolved per tensor by resolve_codec; other names map to their codec, with "fast"/"max" on a
/// non-float dtype meaning "bytes".
bool parse_codec_name(const std::string& name, Codec* out, bool* is_auto);
const char* codec_name(Codec c);
bool parse_dtype_name(const std::string& name, Dtype* out);
const char* dtype_name(Dtype d);

/// The codec "auto" picks for a tensor (docs/format.md, "auto"): integer-only, so every backend agrees.
/// Non-float dtypes -> BYTES; bf16/fp16/fp32 -> MAX when its estimated exponent cost saves at least 2% of the input
/// bytes over FAST's exact exponent cost, else FAST.
Codec resolve_auto(const uint8_t* data, uint64_t nbytes, Dtype dtype, uint32_t chunk_bytes, uint32_t threads);

/// Encodes a tensor of `nbytes` bytes into a frame. `out` must have room for max_frame_bytes(); returns the frame size.
/// Throws Error(InvalidArgument) when nbytes does not match the shape or options are out of range.
uint64_t encode_frame(const uint8_t* data, uint64_t nbytes, Dtype dtype, const std::vector<uint64_t>& shape,
                      const EncodeOptions& opt, uint8_t* out);

/// Parses and validates a frame header from the first `avail` bytes of a frame (fixed header, shape, chunk table and
/// the header digest). Throws Error(Truncated, need_bytes) when `avail` is too short, Error(Corrupt) when invalid,
/// Error(Unsupported) for a format version other than kFormatVersion (version 1, pre-release, is no longer read).
FrameHeader parse_frame_header(const uint8_t* frame, uint64_t avail);

/// Bytes of a frame that parse_frame_prefix can need: the fixed header and the largest shape with its padding,
/// chunk_table_offset(kMaxNdim) = 304.
constexpr uint64_t kMaxFramePrefixBytes = (kFixedHeaderBytes + 8ull * kMaxNdim + 15) & ~15ull;

/// The first part of parse_frame_header: every check of the fixed header, the shape and its padding (the first
/// chunk_table_offset(ndim) <= kMaxFramePrefixBytes bytes), in the same order and with the same errors, and every field
/// of FrameHeader (header_bytes and frame_bytes() included), but neither the chunk table nor the header digest. For a
/// frame whose digest and chunk table are checked elsewhere (the GPU decoder checks them on the device and returns the
/// frames' first bytes, addon/gpu_codec.cpp). Reads nothing at or past `avail`: throws Error(Truncated, need_bytes)
/// when `avail` is too short for the fixed header or the shape.
FrameHeader parse_frame_prefix(const uint8_t* frame, uint64_t avail);

/// Decodes a whole frame of `len` bytes into `out` (exactly header.nbytes bytes). Verifies each chunk's digest
/// (chunk_digest, tzip/xxhash32.h) when `verify`. Throws Error on truncated, corrupt or mismatching input; never
/// writes outside out[0, nbytes).
void decode_frame(const uint8_t* frame, uint64_t len, uint8_t* out, uint64_t out_len, bool verify, uint32_t threads);

/// The chunk decoding of decode_frame, for chunks [first, last) only: `h` is parse_frame_header(frame, len) of a
/// frame whose len == h.frame_bytes() (decode_frame's other checks are the caller's), and `out` receives the bytes of
/// those chunks (out[0] is byte first * h.chunk_bytes of the tensor). Same checks and errors per chunk as decode_frame;
/// lets a caller decode a large frame piece by piece (the native CLI streams its output so).
void decode_frame_chunks(const uint8_t* frame, const FrameHeader& h, uint64_t first, uint64_t last, uint8_t* out,
                         bool verify, uint32_t threads);

}  // namespace tzip
