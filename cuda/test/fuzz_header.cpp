// libFuzzer target: frame header parsing (cuda/src/core/frame.h), the addon's readHeader: parse_frame_header and
// parse_frame_prefix (what the GPU path parses on the host from a frame's first bytes) on hostile bytes.
// Properties: the prefix parser reads nothing past `avail` (the prefix is copied into a buffer of exactly that size),
// asks for no more than kMaxFramePrefixBytes, and agrees with parse_frame_header wherever that one succeeds; a header
// that parses from H bytes parses from exactly H bytes, and every shorter cut is Truncated with a need_bytes that
// makes progress (more than the cut, at most H), so a caller that reads what it is asked for always terminates.
#include <algorithm>

#include "fuzz_support.h"

using namespace tzip_fuzz;

namespace {

void prefix_agrees(const uint8_t* data, size_t size) {
  const size_t avail = std::min<size_t>(size, kMaxFramePrefixBytes);
  const std::vector<uint8_t> prefix(data, data + avail);
  bool prefix_ok = false;
  FrameHeader p;
  try {
    p = parse_frame_prefix(prefix.data(), prefix.size());
    prefix_ok = true;
  } catch (const Error& e) {
    if (e.code() == ErrorCode::Truncated)
      FUZZ_CHECK(e.need_bytes() > avail && e.need_bytes() <= kMaxFramePrefixBytes,
                 "parse_frame_prefix asks for more than it had and at most kMaxFramePrefixBytes");
  }
  try {
    const FrameHeader h = parse_frame_header(data, size);
    FUZZ_CHECK(prefix_ok && p.version == h.version && p.dtype == h.dtype && p.codec == h.codec &&
                   p.shape == h.shape && p.chunk_bytes == h.chunk_bytes && p.nbytes == h.nbytes &&
                   p.payload_bytes == h.payload_bytes && p.n_chunks == h.n_chunks && p.checksum == h.checksum &&
                   p.header_bytes == h.header_bytes,
               "parse_frame_prefix agrees with parse_frame_header");
  } catch (const Error&) {
  }
}

void truncation_makes_progress(const uint8_t* data, size_t size) {
  FrameHeader h;
  try {
    h = parse_frame_header(data, size);
  } catch (const Error&) {
    return;
  }
  FUZZ_CHECK(h.header_bytes <= size && h.payload_bytes <= h.nbytes, "a parsed header lies within its input");
  FUZZ_CHECK(h.header_bytes == frame_header_bytes(uint32_t(h.shape.size()), h.n_chunks), "header_bytes as specified");
  const std::vector<uint8_t> exact(data, data + h.header_bytes);
  (void)parse_frame_header(exact.data(), exact.size());  // must not throw: the header needs only its H bytes
  const uint64_t table = chunk_table_offset(uint32_t(h.shape.size()));
  for (const uint64_t cut : {uint64_t(0), uint64_t(kFixedHeaderBytes - 1), uint64_t(kFixedHeaderBytes), table - 1,
                             table, h.header_bytes - 1}) {
    if (cut >= h.header_bytes) continue;
    const std::vector<uint8_t> part(data, data + cut);
    bool truncated = false;
    try {
      (void)parse_frame_header(part.data(), part.size());
    } catch (const Error& e) {
      truncated = e.code() == ErrorCode::Truncated && e.need_bytes() > cut && e.need_bytes() <= h.header_bytes;
    }
    FUZZ_CHECK(truncated, "a cut header is Truncated and asks for more bytes, at most H");
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  prefix_agrees(data, size);
  truncation_makes_progress(data, size);
  return 0;
}
