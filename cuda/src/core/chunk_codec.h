// CPU coding of one chunk (4 to 64 KiB of input): the unit every tzip decoder can handle independently.
#pragma once
#include <cstdint>
#include <vector>

#include "tzip/format.h"

namespace tzip {

/// Per-thread working memory, reused across chunks to avoid allocations.
struct ChunkScratch {
  std::vector<uint8_t> streams[kMaxStreams];  // one symbol per element per stream
  std::vector<uint16_t> rans_words[kMaxStreams];
  std::vector<uint8_t> tmp;
};

/// Choice and sizes made for one stream of a chunk.
struct StreamPlan {
  StreamMode mode = StreamMode::RAW;
  uint8_t param = 0;       // CONST: the value; LUT: code width k
  uint64_t bytes = 0;      // section bytes (unpadded)
  uint32_t n_present = 0;  // RANS: symbols present
  uint32_t hist[256] = {};
};

/// Encodes `raw_len` bytes (a whole number of `dtype` elements) with `codec` into `out` (capacity >= raw_len).
/// Returns the chunk's stored size: raw_len when the chunk is stored raw (a copy of the input), else the coded size,
/// which is then < raw_len after padding to 16. Deterministic: the bytes depend only on the inputs.
uint64_t encode_chunk(const uint8_t* in, uint64_t raw_len, Dtype dtype, Codec codec, uint8_t* out, ChunkScratch& s);

/// Decodes a chunk of stored size `size` into `raw_len` bytes at `out`. Throws tzip::Error (Corrupt) on any
/// inconsistency; never reads past in[size) or writes past out[raw_len).
void decode_chunk(const uint8_t* in, uint64_t size, uint64_t raw_len, Dtype dtype, Codec codec, uint8_t* out,
                  ChunkScratch& s);

/// Splits `n` elements at `in` into the streams of (dtype, codec) in `s.streams` (each resized to n).
void split_streams(const uint8_t* in, uint64_t n, Dtype dtype, Codec codec, ChunkScratch& s);

}  // namespace tzip
