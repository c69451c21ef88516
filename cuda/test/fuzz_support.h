// Shared pieces of the libFuzzer targets cuda/test/fuzz_*.cpp (built by scripts/fuzz.sh with ASan and UBSan):
// a property check that names what failed, a frame builder that wraps fuzzed chunk bodies in a valid header (so the
// fuzzer spends its time in the chunk decoders, not on the header digest), and the re-encode property every target
// checks on what it decoded.
#pragma once
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "core/chunk_codec.h"
#include "core/errors.h"
#include "core/frame.h"
#include "tzip/xxhash32.h"

namespace tzip_fuzz {

using namespace tzip;

/// A broken property is a crash with its name on stderr: libFuzzer keeps the input as a reproducer.
#define FUZZ_CHECK(cond, what)                                                     \
  do {                                                                             \
    if (!(cond)) {                                                                 \
      std::fprintf(stderr, "fuzz property failed: %s (%s:%d)\n", what, __FILE__, __LINE__); \
      std::abort();                                                                \
    }                                                                              \
  } while (0)

/// Larger decoded tensors are skipped before allocation: the decoders check bounds before any write, so size alone
/// finds nothing, and libFuzzer's malloc limit would report a huge but legal nbytes as a crash.
constexpr uint64_t kMaxDecodedBytes = 4u << 20;

/// One chunk of a frame under construction: its stored bytes and its original size.
struct ChunkBody {
  std::vector<uint8_t> stored;
  uint64_t raw_len = 0;
  uint32_t digest = 0;  // chunk digest of the original bytes (docs/format.md, section 9)
};

/// A frame of `dtype`/`codec`/`chunk_bytes` with shape [nbytes / esize] holding `chunks` in order, every field,
/// the chunk table, the frame checksum and the header digest as docs/format.md requires (sections 3, 5, 9). The
/// chunks' raw sizes must be those of the format (all chunk_bytes but the last) for the frame to parse.
inline std::vector<uint8_t> build_frame(Dtype dtype, Codec codec, uint32_t chunk_bytes,
                                        const std::vector<ChunkBody>& chunks) {
  uint64_t nbytes = 0;
  for (const ChunkBody& c : chunks) nbytes += c.raw_len;
  const uint32_t ndim = 1;
  const uint64_t table = chunk_table_offset(ndim);
  const uint64_t hdr = frame_header_bytes(ndim, chunks.size());
  std::vector<uint8_t> f(hdr);
  uint64_t off = 0;
  std::vector<uint8_t> le(4 * chunks.size());
  for (size_t i = 0; i < chunks.size(); ++i) {
    const ChunkBody& c = chunks[i];
    f.resize(hdr + off);
    f.insert(f.end(), c.stored.begin(), c.stored.end());
    store_le64(f.data() + table + kChunkEntryBytes * i, off);
    store_le32(f.data() + table + kChunkEntryBytes * i + 8, uint32_t(c.stored.size()));
    store_le32(f.data() + table + kChunkEntryBytes * i + 12, c.digest);
    store_le32(le.data() + 4 * i, c.digest);
    off += c.stored.size();
    if (i + 1 < chunks.size()) off = align16(off);
  }
  f.resize(hdr + off);
  uint8_t* h = f.data();
  store_le32(h + kOffMagic, kFrameMagic);
  store_le16(h + kOffVersion, kFormatVersion);
  h[kOffDtype] = uint8_t(dtype);
  h[kOffCodec] = uint8_t(codec);
  h[kOffNdim] = uint8_t(ndim);
  store_le32(h + kOffChunkBytes, chunk_bytes);
  store_le64(h + kOffNbytes, nbytes);
  store_le64(h + kOffPayloadBytes, off);
  store_le32(h + kOffNumChunks, uint32_t(chunks.size()));
  store_le32(h + kOffChecksum, xxh32(le.data(), le.size(), 0));
  store_le64(h + kOffShape, nbytes / dtype_size(dtype));
  store_le32(h + kOffHeaderDigest, 0);
  store_le32(h + kOffHeaderDigest, xxh32(h, hdr, 0));
  return f;
}

/// The property every decoder target checks on a success: the decoded tensor, encoded again with the frame's
/// codec and chunk size, decodes to the same bytes (with and without digest checks), the new frame's header says
/// what the old one said, and it is no larger than the bound of docs/format.md, section 10.
inline void check_reencode(const uint8_t* raw, uint64_t nbytes, Dtype dtype, Codec codec, uint32_t chunk_bytes,
                           const std::vector<uint64_t>& shape) {
  std::vector<uint8_t> frame(max_frame_bytes(nbytes, uint32_t(shape.size()), chunk_bytes));
  EncodeOptions opt;
  opt.codec = codec;
  opt.chunk_bytes = chunk_bytes;
  const uint64_t len = encode_frame(raw, nbytes, dtype, shape, opt, frame.data());
  FUZZ_CHECK(len <= frame.size(), "re-encoded frame within max_frame_bytes");
  const FrameHeader h = parse_frame_header(frame.data(), len);
  FUZZ_CHECK(h.nbytes == nbytes && h.dtype == dtype && h.codec == codec && h.shape == shape &&
                 h.chunk_bytes == chunk_bytes && h.frame_bytes() == len,
             "re-encoded header describes the decoded tensor");
  std::vector<uint8_t> back(nbytes);
  decode_frame(frame.data(), len, back.data(), back.size(), true, 1);
  FUZZ_CHECK(nbytes == 0 || std::memcmp(back.data(), raw, nbytes) == 0, "re-encoded frame decodes to the same bytes");
}

/// Little-endian reader over the fuzzer's bytes that yields zeros once they run out.
struct Input {
  const uint8_t* p;
  size_t n;
  uint8_t u8() {
    if (!n) return 0;
    --n;
    return *p++;
  }
  uint16_t u16() { const uint16_t lo = u8(); return uint16_t(lo | (u8() << 8)); }
  /// Up to `want` bytes (fewer when the input ends).
  std::vector<uint8_t> take(size_t want) {
    const size_t k = want < n ? want : n;
    std::vector<uint8_t> out(p, p + k);
    p += k;
    n -= k;
    return out;
  }
};

}  // namespace tzip_fuzz
