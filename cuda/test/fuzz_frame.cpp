// libFuzzer target: the whole-frame decoder, decode_frame (cuda/src/core/frame.h), on hostile bytes. Every input must
// decode or throw tzip::Error, never read or write outside its buffers (ASan), and what decodes must be consistent:
// the same bytes without digest checks, and again after re-encoding with the frame's codec and chunk size.
// Seeds: the golden frames (test/golden/*.tzf) and frames of the bundled MiniLM model (fuzz/make-seeds.mjs).
#include "fuzz_support.h"

using namespace tzip_fuzz;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FrameHeader h;
  try {
    h = parse_frame_header(data, size);
  } catch (const Error&) {
    return 0;
  }
  if (h.nbytes > kMaxDecodedBytes) return 0;
  std::vector<uint8_t> out(h.nbytes);
  try {
    decode_frame(data, size, out.data(), out.size(), true, 1);
  } catch (const Error& e) {
    // Without digest checks a frame fails exactly where it failed before, unless only a digest was wrong.
    if (e.code() != ErrorCode::Checksum) {
      bool threw = false;
      try {
        decode_frame(data, size, out.data(), out.size(), false, 1);
      } catch (const Error& e2) {
        threw = true;
        FUZZ_CHECK(e2.code() == e.code(), "verify=false fails with the same code as verify=true");
      }
      FUZZ_CHECK(threw, "a frame refused for a reason other than a digest is refused without digest checks too");
    }
    return 0;
  }
  std::vector<uint8_t> unchecked(h.nbytes);
  decode_frame(data, size, unchecked.data(), unchecked.size(), false, 1);
  FUZZ_CHECK(h.nbytes == 0 || std::memcmp(out.data(), unchecked.data(), h.nbytes) == 0,
             "verify=false decodes the same bytes");
  check_reencode(out.data(), h.nbytes, h.dtype, h.codec, h.chunk_bytes, h.shape);
  return 0;
}
