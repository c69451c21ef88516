#include "container/reader.h"

#include <string>

#include "core/errors.h"
#include "tzip/xxhash32.h"

namespace tzip::container {

namespace {

[[noreturn]] void refuse(const std::string& what) { throw NotHandled("container: " + what); }

}  // namespace

OpenedContainer open_container(const uint8_t* file, uint64_t size) {
  OpenedContainer c;
  if (size < kPrefixBytes + kLengthPrefixBytes + kTrailerBytes) refuse("too short");
  const Prefix prefix = decode_prefix(file);
  c.original_size = prefix.original_size;
  const uint64_t header_length = parse_header_length(file + kPrefixBytes, prefix.original_size);
  const uint64_t header_end = kPrefixBytes + kLengthPrefixBytes + header_length;
  if (header_end + kTrailerBytes > size) refuse("header and trailer past the end of the file");
  c.header_bytes = file + kPrefixBytes;
  if (prefix.has_header_digest &&
      xxh32(c.header_bytes, kLengthPrefixBytes + header_length, 0) != prefix.header_digest)
    refuse("header digest mismatch");

  const Trailer trailer = decode_trailer(file + size - kTrailerBytes, size);
  if (trailer.original_size != prefix.original_size) refuse("the two original sizes differ");
  if (trailer.index_offset < align_up(header_end)) refuse("index inside the header");
  const uint8_t* index_bytes = file + trailer.index_offset;
  if (xxh32(index_bytes, uint64_t(trailer.entry_count) * kIndexEntryBytes, 0) != trailer.index_digest)
    refuse("index digest mismatch");
  const std::vector<IndexEntry> index = decode_index(index_bytes, trailer.entry_count);

  c.header = parse_safetensors_header(c.header_bytes, kLengthPrefixBytes + header_length, prefix.original_size);
  std::vector<PlannedEntry> plan = plan_entries(c.header);
  if (plan.size() != index.size()) refuse("index and header disagree on the entry count");
  uint64_t frames_end = align_up(header_end);
  c.entries.reserve(plan.size());
  for (size_t i = 0; i < plan.size(); ++i) {
    const IndexEntry& e = index[i];
    if (e.data_begin != plan[i].begin || e.data_end != plan[i].end) refuse("index entry range differs from the header's");
    // No overflow: both fields are below 2^53.
    if (e.frame_offset % kAlignment != 0 || e.frame_offset < frames_end || e.frame_offset + e.frame_bytes > trailer.index_offset)
      refuse("frame outside the free, aligned frame area");
    frames_end = e.frame_offset + e.frame_bytes;
    c.entries.push_back({std::move(plan[i]), e});
  }
  return c;
}

}  // namespace tzip::container
