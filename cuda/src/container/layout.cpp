#include "container/layout.h"

#include <cstring>
#include <string>

#include "core/errors.h"
#include "tzip/hostdevice.h"

namespace tzip::container {

namespace {

[[noreturn]] void corrupt(const std::string& what) { throw Error(ErrorCode::Corrupt, what); }

uint64_t safe_u64(const uint8_t* p, const char* what) {
  const uint64_t v = load_le64(p);
  if (v > kMaxSafeInteger) corrupt(std::string(what) + " " + std::to_string(v) + " is out of range");
  return v;
}

}  // namespace

void encode_prefix(const Prefix& p, uint8_t out[kPrefixBytes]) {
  std::memcpy(out, kMagic, sizeof kMagic);
  store_le16(out + 8, kContainerVersion);
  store_le16(out + 10, kFlagHeaderDigest);
  store_le32(out + 12, p.header_digest);
  store_le64(out + 16, p.original_size);
}

void encode_index(const std::vector<IndexEntry>& entries, uint8_t* out) {
  for (const IndexEntry& e : entries) {
    store_le64(out, e.data_begin);
    store_le64(out + 8, e.data_end);
    store_le64(out + 16, e.frame_offset);
    store_le64(out + 24, e.frame_bytes);
    out += kIndexEntryBytes;
  }
}

void encode_trailer(const Trailer& t, uint8_t out[kTrailerBytes]) {
  store_le64(out, t.index_offset);
  store_le32(out + 8, t.entry_count);
  store_le32(out + 12, t.index_digest);
  store_le64(out + 16, t.original_size);
  std::memcpy(out + 24, kTrailerMagic, sizeof kTrailerMagic);
  store_le32(out + 28, 0);
}

Prefix decode_prefix(const uint8_t* p) {
  if (std::memcmp(p, kMagic, sizeof kMagic) != 0) corrupt("not a .tzip file (bad magic bytes)");
  const uint16_t version = load_le16(p + 8);
  if (version > kContainerVersion)
    throw Error(ErrorCode::Unsupported, "container version " + std::to_string(version) + " is newer than the supported " +
                                            std::to_string(kContainerVersion));
  if (version != kContainerVersion) corrupt("bad container version " + std::to_string(version));
  const uint16_t flags = load_le16(p + 10);
  if (flags & ~kFlagHeaderDigest) throw Error(ErrorCode::Unsupported, "unknown container flags " + std::to_string(flags));
  Prefix r;
  r.has_header_digest = (flags & kFlagHeaderDigest) != 0;
  r.header_digest = load_le32(p + 12);
  // Without the flag the field is reserved and zero; a non-zero one there also catches a flip that cleared the flag.
  if (!r.has_header_digest && r.header_digest != 0)
    corrupt("reserved prefix field is not zero (and the header digest flag is not set)");
  r.original_size = safe_u64(p + 16, "original file size");
  return r;
}

Trailer decode_trailer(const uint8_t* p, uint64_t file_size) {
  if (std::memcmp(p + 24, kTrailerMagic, sizeof kTrailerMagic) != 0)
    corrupt("no 'TZIX' trailer at the end of the file (truncated or incompletely written?)");
  if (load_le32(p + 28) != 0) corrupt("reserved trailer field is not zero");
  Trailer t;
  t.index_offset = safe_u64(p, "index offset");
  t.entry_count = load_le32(p + 8);
  t.index_digest = load_le32(p + 12);
  t.original_size = safe_u64(p + 16, "original file size");
  // No overflow: index_offset < 2^53 and entry_count * 32 < 2^37.
  if (t.index_offset % kAlignment != 0 ||
      t.index_offset + uint64_t(t.entry_count) * kIndexEntryBytes + kTrailerBytes != file_size)
    corrupt("trailer places " + std::to_string(t.entry_count) + " index entries at offset " +
            std::to_string(t.index_offset) + ", which does not end at the trailer of this " + std::to_string(file_size) +
            "-byte file");
  return t;
}

std::vector<IndexEntry> decode_index(const uint8_t* p, uint32_t count) {
  std::vector<IndexEntry> entries(count);
  for (IndexEntry& e : entries) {
    e.data_begin = safe_u64(p, "index data_begin");
    e.data_end = safe_u64(p + 8, "index data_end");
    e.frame_offset = safe_u64(p + 16, "index frame_offset");
    e.frame_bytes = safe_u64(p + 24, "index frame_bytes");
    p += kIndexEntryBytes;
  }
  return entries;
}

}  // namespace tzip::container
