// The byte layout of a .tzip container, version 1 (spec: docs/container.md): the 24-byte prefix, the index and the
// 32-byte trailer, encoded and decoded with every check the spec lists for them. The C++ twin of src/container.ts
// (and of python-bridge/tzip/_container.py); the safetensors header and the entry plan are in
// safetensors_header.h and entries.h.
#pragma once
#include <cstdint>
#include <vector>

namespace tzip::container {

/// The 8 magic bytes at offset 0: "\x89TZIP\r\n\x1a".
inline constexpr uint8_t kMagic[8] = {0x89, 0x54, 0x5a, 0x49, 0x50, 0x0d, 0x0a, 0x1a};
/// The 4 magic bytes at trailer offset 24: "TZIX".
inline constexpr uint8_t kTrailerMagic[4] = {0x54, 0x5a, 0x49, 0x58};
inline constexpr uint16_t kContainerVersion = 1;
/// Prefix flag: the u32 at offset 12 is the XXH32 (seed 0) of the 8 + N safetensors header bytes at offset 24.
inline constexpr uint16_t kFlagHeaderDigest = 0x0001;
inline constexpr uint64_t kPrefixBytes = 24;
inline constexpr uint64_t kIndexEntryBytes = 32;
inline constexpr uint64_t kTrailerBytes = 32;
/// Frames and the index start at multiples of this many bytes.
inline constexpr uint64_t kAlignment = 16;
/// Values read as u64 must be at most 2^53 - 1 (JavaScript's largest exact integer).
inline constexpr uint64_t kMaxSafeInteger = (uint64_t(1) << 53) - 1;

/// `offset` rounded up to a multiple of kAlignment.
inline uint64_t align_up(uint64_t offset) { return (offset + kAlignment - 1) & ~(kAlignment - 1); }

struct Prefix {
  uint64_t original_size = 0;  ///< bytes of the original safetensors file
  bool has_header_digest = false;
  uint32_t header_digest = 0;  ///< XXH32 of the 8 + N header bytes, when has_header_digest
};

/// One index entry: which data-section bytes a frame reproduces and where the frame lies (absolute offsets).
struct IndexEntry {
  uint64_t data_begin = 0, data_end = 0, frame_offset = 0, frame_bytes = 0;
};

struct Trailer {
  uint64_t index_offset = 0;
  uint32_t entry_count = 0;
  uint32_t index_digest = 0;  ///< XXH32 (seed 0) of the index bytes
  uint64_t original_size = 0;
};

/// Writes the 24-byte prefix at `out`, always with kFlagHeaderDigest (as every writer of version 1 does).
void encode_prefix(const Prefix& p, uint8_t out[kPrefixBytes]);
/// Writes the index: kIndexEntryBytes per entry at `out` (entries.size() * 32 bytes).
void encode_index(const std::vector<IndexEntry>& entries, uint8_t* out);
/// Writes the 32-byte trailer at `out`.
void encode_trailer(const Trailer& t, uint8_t out[kTrailerBytes]);

/// Decodes and checks the prefix (the first kPrefixBytes of `p`). Throws tzip::Error: Corrupt (bad magic, version 0,
/// a non-zero field at offset 12 without the flag, a size above 2^53 - 1), Unsupported (newer version, unknown flags).
Prefix decode_prefix(const uint8_t* p);
/// Decodes and checks the trailer (the last kTrailerBytes of a file of `file_size` bytes, at `p`): its magic and
/// reserved field, and that the index lies, aligned, right before it. Throws tzip::Error(Corrupt).
Trailer decode_trailer(const uint8_t* p, uint64_t file_size);
/// Decodes `count` index entries at `p` (their digest already checked). Throws tzip::Error(Corrupt) for a field
/// above 2^53 - 1.
std::vector<IndexEntry> decode_index(const uint8_t* p, uint32_t count);

}  // namespace tzip::container
