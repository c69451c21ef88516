// libFuzzer target: frames of codec raw with fuzzed chunk bodies behind a valid header (input layout and properties:
// fuzz_codec_frame.h). Seeds: the chunks of real raw frames (golden vectors, the MiniLM model; fuzz/make-seeds.mjs).
#include "fuzz_codec_frame.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  tzip_fuzz::fuzz_codec_frame(tzip::Codec::RAW, data, size);
  return 0;
}
