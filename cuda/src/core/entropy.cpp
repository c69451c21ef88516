#include "entropy.h"

#include <cmath>

#include "chunk_codec.h"

namespace tzip {

EntropyReport entropy_report(const uint8_t* data, uint64_t nbytes, Dtype d) {
  const Codec c = dtype_is_split_float(d) ? Codec::MAX : Codec::BYTES;
  const StreamLayout lay = stream_layout(d, c);
  const uint32_t esize = dtype_size(d);
  const uint64_t n = nbytes / esize;
  std::vector<std::vector<uint64_t>> hist(lay.count, std::vector<uint64_t>(256, 0));
  ChunkScratch s;
  for (uint64_t begin = 0; begin < n; begin += kDefaultChunkBytes) {
    const uint64_t count = std::min<uint64_t>(kDefaultChunkBytes, n - begin);
    split_streams(data + begin * esize, count, d, c, s);
    for (uint32_t j = 0; j < lay.count; ++j)
      for (uint64_t i = 0; i < count; ++i) ++hist[j][s.streams[j][i]];
  }
  static const char* const bf16[] = {"exponent", "sign+mantissa"};
  static const char* const f16[] = {"exponent", "mantissa[7:0]", "sign+mantissa[9:8]"};
  static const char* const f32[] = {"exponent", "mantissa[7:0]", "mantissa[15:8]", "sign+mantissa[22:16]"};
  EntropyReport r;
  for (uint32_t j = 0; j < lay.count; ++j) {
    double h = 0;
    for (uint64_t v : hist[j])
      if (v) h -= double(v) / double(n) * std::log2(double(v) / double(n));
    std::string name = c == Codec::BYTES        ? "byte" + std::to_string(j)
                       : d == Dtype::BF16       ? bf16[j]
                       : d == Dtype::F16        ? f16[j]
                                                : f32[j];
    r.planes.push_back({name, lay.bits[j], h});
    r.bound_bytes += double(n) * h / 8.0;
  }
  return r;
}

}  // namespace tzip
