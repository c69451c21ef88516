// libFuzzer target: the encoders' inverse property on arbitrary tensors (encode_frame -> decode_frame gives the
// input back, for every dtype x codec and chunk size), the chunk digest against its definition written out the slow
// way (docs/format.md, section 9), and entropy_report's bounds. Not a decoder target: it keeps the decoders'
// counterpart, the encoder, under the same sanitizers.
#include <cmath>

#include "core/entropy.h"
#include "fuzz_support.h"

using namespace tzip_fuzz;

namespace {

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
  FUZZ_CHECK(back.empty() || std::memcmp(back.data(), data, back.size()) == 0, "encode -> decode is the identity");
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
    FUZZ_CHECK(chunk_digest(len ? p : nullptr, len) == xxh32(le, sizeof le, 0), "chunk_digest as specified");
  }
}

/// Each plane's order-0 entropy lies in [0, its width]; the bound is their sum over the elements.
void entropy_bounds(const uint8_t* data, size_t size) {
  if (size < 1) return;
  const Dtype dtype = Dtype(data[0] % kNumDtypes);
  const uint64_t nbytes = (size - 1) / dtype_size(dtype) * dtype_size(dtype);
  const EntropyReport r = entropy_report(data + 1, nbytes, dtype);
  double sum = 0;
  for (const PlaneEntropy& p : r.planes) {
    FUZZ_CHECK(p.entropy_bits >= -1e-9 && p.entropy_bits <= p.bits + 1e-9, "plane entropy within [0, width]");
    sum += p.entropy_bits;
  }
  const double n = double(nbytes / dtype_size(dtype));
  FUZZ_CHECK(std::fabs(r.bound_bytes - n * sum / 8) <= 1e-6 * (1 + r.bound_bytes), "bound = n * sum(H) / 8");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  roundtrip(data, size);
  digest_matches_definition(data, size);
  entropy_bounds(data, size);
  return 0;
}
