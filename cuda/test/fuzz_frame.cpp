// libFuzzer target for the frame decoder (every decoder entry point: header parse, header prefix parse, chunk table,
// each stream mode), for encode->decode round trips, and for the chunk digest against its definition written out the
// slow way.
// Built and run by scripts/fuzz.sh with ASan and UBSan.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "errors.h"
#include "frame.h"
#include "tzip/xxhash32.h"

using namespace tzip;

namespace {

void decode_hostile(const uint8_t* data, size_t size) {
  try {
    const FrameHeader h = parse_frame_header(data, size);
    if (h.nbytes > (16u << 20)) return;  // keep allocations small; bounds are checked before any write anyway
    std::vector<uint8_t> out(h.nbytes);
    decode_frame(data, size, out.data(), out.size(), true, 1);
  } catch (const Error&) {
  }
}

/// parse_frame_prefix (what the GPU path parses on the host from the frames' first bytes) on hostile bytes: it reads
/// nothing past `avail` (ASan: the prefix is copied into a buffer of exactly that size), agrees with
/// parse_frame_header wherever that one succeeds, and needs no more than kMaxFramePrefixBytes.
void prefix_hostile(const uint8_t* data, size_t size) {
  const size_t avail = std::min<size_t>(size, kMaxFramePrefixBytes);
  const std::vector<uint8_t> prefix(data, data + avail);
  bool prefix_ok = false;
  FrameHeader p;
  try {
    p = parse_frame_prefix(prefix.data(), prefix.size());
    prefix_ok = true;
  } catch (const Error& e) {
    if (e.code() == ErrorCode::Truncated && (e.need_bytes() <= avail || e.need_bytes() > kMaxFramePrefixBytes)) __builtin_trap();
  }
  try {
    const FrameHeader h = parse_frame_header(data, size);
    if (!prefix_ok || p.version != h.version || p.dtype != h.dtype || p.codec != h.codec || p.shape != h.shape ||
        p.chunk_bytes != h.chunk_bytes || p.nbytes != h.nbytes || p.payload_bytes != h.payload_bytes ||
        p.n_chunks != h.n_chunks || p.checksum != h.checksum || p.header_bytes != h.header_bytes)
      __builtin_trap();
  } catch (const Error&) {
  }
}

void roundtrip(const uint8_t* data, size_t size) {
  if (size < 2) return;
  const Dtype dtype = Dtype(data[0] % kNumDtypes);
  const Codec codec = Codec((data[0] / kNumDtypes) % kNumCodecs);
  const uint32_t chunk = kMinChunkBytes + kChunkBytesMultiple * (data[1] % 8);
  data += 2;
  size -= 2;
  const uint32_t esize = dtype_size(dtype);
  const uint64_t n = size / esize;
  std::vector<uint8_t> frame(max_frame_bytes(n * esize, 1, chunk));
  EncodeOptions opt;
  opt.codec = codec;
  opt.chunk_bytes = chunk;
  const uint64_t len = encode_frame(data, n * esize, dtype, {n}, opt, frame.data());
  std::vector<uint8_t> back(n * esize);
  decode_frame(frame.data(), len, back.data(), back.size(), true, 1);
  if (!back.empty() && std::memcmp(back.data(), data, back.size()) != 0) __builtin_trap();
}

/// docs/format.md, section 9, literally: lane l = stripes l, l+32, ... concatenated; XXH32 of the 32 lane XXH32s.
/// chunk_digest must agree at every length and alignment (the fuzzer's data is at an arbitrary offset below).
void digest_matches_definition(const uint8_t* data, size_t size) {
  for (const size_t skip : {size_t(0), size_t(1)}) {
    if (size < skip) return;
    const uint8_t* p = data + skip;
    const size_t len = size - skip;
    std::vector<uint8_t> lane[kDigestLanes];
    for (size_t s = 0; 16 * s < len; ++s)
      for (size_t i = 16 * s; i < len && i < 16 * s + 16; ++i) lane[s % kDigestLanes].push_back(p[i]);
    uint8_t le[4 * kDigestLanes];
    for (uint32_t l = 0; l < kDigestLanes; ++l) store_le32(le + 4 * l, xxh32(lane[l].data(), lane[l].size(), 0));
    if (chunk_digest(len ? p : nullptr, len) != xxh32(le, sizeof le, 0)) __builtin_trap();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  decode_hostile(data, size);
  prefix_hostile(data, size);
  roundtrip(data, size);
  digest_matches_definition(data, size);
  return 0;
}
