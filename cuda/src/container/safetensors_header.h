// The safetensors header as the native CLI reads it: the C++ twin of src/safetensors.ts (parseHeaderLength,
// parseSafetensorsHeader) for the headers real writers produce. It accepts a header only when the TypeScript parser
// accepts it and reads it to the same tensors; anything else (a header that parser refuses, and a valid one outside
// the JSON subset of json_subset.h: escapes, duplicate keys, extra fields, fractions) throws NotHandled, for a caller
// that hands such files to the TypeScript parser and its exact error messages.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "container/json_subset.h"
#include "tzip/format.h"

namespace tzip::container {

/// Largest JSON header accepted, in bytes (MAX_HEADER_BYTES in src/safetensors.ts).
inline constexpr uint64_t kMaxHeaderBytes = 100000000;
/// Bytes of the little-endian u64 header length.
inline constexpr uint64_t kLengthPrefixBytes = 8;

/// One tensor. Offsets in bytes, relative to the data section.
struct Tensor {
  std::string name;             ///< UTF-8, escapes decoded
  std::string dtype;            ///< as written in the file
  std::vector<uint64_t> shape;  ///< as written in the file
  uint64_t begin = 0, end = 0;
  Dtype codec_dtype = Dtype::U8;      ///< dtype when known and prod(shape) * size == end - begin; F32 for such a
                                      ///< C64 tensor; else U8 (docs/container.md, "Entries")
  std::vector<uint64_t> codec_shape;  ///< shape (C64: shape + [2]; 1-D past 32 dimensions), or [end - begin] with U8
};

struct SafetensorsHeader {
  uint64_t header_length = 0;  ///< N
  uint64_t data_offset = 0;    ///< 8 + N
  uint64_t data_length = 0;    ///< file size - 8 - N
  /// Sorted by (begin, end, name as UTF-8 bytes); they do not overlap.
  std::vector<Tensor> tensors;
};

/// N from the first 8 bytes of a safetensors file of `file_size` bytes. Throws NotHandled when there are fewer than 8
/// bytes, N > kMaxHeaderBytes or N > file_size - 8 (which src/safetensors.ts refuses).
uint64_t parse_header_length(const uint8_t* first8, uint64_t file_size);

/// Parses and checks a header: `prefix` holds the file's first 8 + N bytes (at least), `file_size` is the whole
/// file's size. Throws NotHandled for any header the TypeScript parser refuses and for valid ones outside the subset.
SafetensorsHeader parse_safetensors_header(const uint8_t* prefix, uint64_t prefix_len, uint64_t file_size);

}  // namespace tzip::container
