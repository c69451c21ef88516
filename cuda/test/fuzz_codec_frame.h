// The per-codec frame targets (fuzz_codec_fast/max/bytes/raw.cpp): fuzzed chunk bodies inside a valid frame header
// of one codec, so that every input reaches the chunk decoders through decode_frame.
// Input: [dtype u8][chunk u8] then up to 4 chunk records [stored size u16 LE][raw field u16 LE][stored bytes].
//   dtype: fast/max: BF16, F16, F32 by byte % 3; bytes, raw: any dtype, byte % 15.
//   chunk_size = 4096 + 256 * (byte % 241), so every valid chunk size.
//   Every chunk but the last has chunk_size raw bytes; the last has chunk_size - (raw field % chunk_size, rounded
//   down to the element size). A stored size above the raw size is cut to it; missing stored bytes are zeros.
// The frame's digests are first zero; a frame that decodes without digest checks gets its true chunk digests,
// checksum and header digest and must then decode with them to the same bytes, and re-encode consistently.
#pragma once
#include "fuzz_support.h"

namespace tzip_fuzz {

constexpr uint32_t kMaxFuzzChunks = 4;

inline void fuzz_codec_frame(Codec codec, const uint8_t* data, size_t size) {
  Input in{data, size};
  static const Dtype kFloats[3] = {Dtype::BF16, Dtype::F16, Dtype::F32};
  const uint8_t dsel = in.u8();
  const Dtype dtype = codec == Codec::FAST || codec == Codec::MAX ? kFloats[dsel % 3] : Dtype(dsel % kNumDtypes);
  const uint32_t chunk_bytes = kMinChunkBytes + kChunkBytesMultiple * (in.u8() % 241);
  const uint32_t esize = dtype_size(dtype);
  std::vector<ChunkBody> chunks;
  while (in.n > 0 && chunks.size() < kMaxFuzzChunks) {
    const uint64_t want = in.u16();
    const uint64_t field = in.u16();
    const bool last = chunks.size() + 1 == kMaxFuzzChunks || in.n <= want;
    ChunkBody c;
    c.raw_len = last ? chunk_bytes - (field % chunk_bytes) / esize * esize : chunk_bytes;
    c.stored = in.take(std::min<uint64_t>(want, c.raw_len));
    c.stored.resize(std::min<uint64_t>(want, c.raw_len));
    chunks.push_back(std::move(c));
    if (last) break;
  }
  if (chunks.empty()) return;
  std::vector<uint8_t> frame = build_frame(dtype, codec, chunk_bytes, chunks);
  FrameHeader h;
  try {
    h = parse_frame_header(frame.data(), frame.size());
  } catch (const Error&) {
    return;  // a stored size of 0: refused by the chunk table check
  }
  std::vector<uint8_t> out(h.nbytes);
  try {
    decode_frame(frame.data(), frame.size(), out.data(), out.size(), false, 1);
  } catch (const Error& e) {
    FUZZ_CHECK(e.code() == ErrorCode::Corrupt, "a bad chunk is TZIP_CORRUPT");
    return;
  }
  uint64_t begin = 0;
  for (ChunkBody& c : chunks) {
    c.digest = chunk_digest(out.data() + begin, c.raw_len);
    begin += c.raw_len;
  }
  frame = build_frame(dtype, codec, chunk_bytes, chunks);
  std::vector<uint8_t> checked(h.nbytes);
  decode_frame(frame.data(), frame.size(), checked.data(), checked.size(), true, 1);
  FUZZ_CHECK(std::memcmp(out.data(), checked.data(), h.nbytes) == 0, "digest-checked decode gives the same bytes");
  check_reencode(out.data(), h.nbytes, dtype, codec, chunk_bytes, h.shape);
}

}  // namespace tzip_fuzz
