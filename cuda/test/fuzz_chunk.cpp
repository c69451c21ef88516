// libFuzzer target: the chunk codec alone, decode_chunk (cuda/src/core/chunk_codec.h), on a hostile stored chunk.
// Input: [dtype u8][codec u8][raw field u16 LE][stored chunk ...]; dtype = byte % 15, codec = byte % 4 (fast/max on a
// non-float dtype mean bytes, as in a frame), raw size = 65536 - (field rounded down to the element size), so every
// element-aligned size from one element to 64 KiB is reachable; the stored size is what follows.
// Properties on a success: a reused scratch (state left by earlier chunks) decodes the same bytes as a fresh one; the
// chunk re-encodes (encode_chunk) to a stored form no larger than its raw size that decodes to the same bytes; and the
// chunk wrapped in a valid one-chunk frame with its true digest decodes through decode_frame to the same bytes.
#include "fuzz_support.h"

using namespace tzip_fuzz;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Input in{data, size};
  const Dtype dtype = Dtype(in.u8() % kNumDtypes);
  Codec codec = Codec(in.u8() % kNumCodecs);
  if ((codec == Codec::FAST || codec == Codec::MAX) && !dtype_is_split_float(dtype)) codec = Codec::BYTES;
  const uint32_t esize = dtype_size(dtype);
  const uint64_t raw_len = kMaxChunkBytes - in.u16() / esize * esize;
  const std::vector<uint8_t> stored = in.take(in.n);
  if (stored.empty()) return 0;

  static ChunkScratch reused;  // carries whatever earlier inputs left in it
  std::vector<uint8_t> out(raw_len);
  try {
    decode_chunk(stored.data(), stored.size(), raw_len, dtype, codec, out.data(), reused);
  } catch (const Error& e) {
    FUZZ_CHECK(e.code() == ErrorCode::Corrupt, "decode_chunk refuses with TZIP_CORRUPT");
    return 0;
  }
  ChunkScratch fresh;
  std::vector<uint8_t> again(raw_len);
  decode_chunk(stored.data(), stored.size(), raw_len, dtype, codec, again.data(), fresh);
  FUZZ_CHECK(std::memcmp(out.data(), again.data(), raw_len) == 0, "a reused scratch decodes as a fresh one");

  std::vector<uint8_t> coded(raw_len);
  const uint64_t coded_len = encode_chunk(out.data(), raw_len, dtype, codec, coded.data(), fresh);
  FUZZ_CHECK(coded_len <= raw_len && (coded_len == raw_len || align16(coded_len) < raw_len),
             "encode_chunk stores raw or strictly smaller after padding");
  std::vector<uint8_t> back(raw_len);
  decode_chunk(coded.data(), coded_len, raw_len, dtype, codec, back.data(), fresh);
  FUZZ_CHECK(std::memcmp(out.data(), back.data(), raw_len) == 0, "the re-encoded chunk decodes to the same bytes");

  ChunkBody body{stored, raw_len, chunk_digest(out.data(), raw_len)};
  const std::vector<uint8_t> frame = build_frame(dtype, codec, kMaxChunkBytes, {body});
  std::vector<uint8_t> framed(raw_len);
  decode_frame(frame.data(), frame.size(), framed.data(), framed.size(), true, 1);
  FUZZ_CHECK(std::memcmp(out.data(), framed.data(), raw_len) == 0, "the chunk decodes the same inside a frame");
  return 0;
}
