// Generates the golden vectors of test/golden/ (see test/golden/README.md): deterministic inputs built from the
// formulas below, the frames the CPU encoder makes of them, and manifest.json (names, options, sha256 of both, and
// the chunk digests of a fixed pattern at a few lengths: docs/format.md, section 9).
// Build and run from the repository root (no Node, no addon needed):
//   g++ -std=c++17 -O2 -Icuda/include -Icuda/src cuda/test/make_golden.cpp cuda/src/core/frame.cpp
//       cuda/src/core/chunk_codec.cpp cuda/src/core/entropy.cpp -lpthread -o /tmp/make_golden
//   /tmp/make_golden test/golden
// The frames are pinned: regenerating must give byte-identical files unless the format version is bumped on purpose.
#include <algorithm>
#include <cctype>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "core/errors.h"
#include "core/frame.h"
#include "tzip/xxhash32.h"

using namespace tzip;

namespace {

// ---------------------------------------------------------------- SHA-256 (FIPS 180-4), for the manifest
struct Sha256 {
  static constexpr uint32_t K[64] = {
      0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5, 0xd807aa98,
      0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786,
      0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da, 0x983e5152, 0xa831c66d, 0xb00327c8,
      0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967, 0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13,
      0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85, 0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819,
      0xd6990624, 0xf40e3585, 0x106aa070, 0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a,
      0x5b9cca4f, 0x682e6ff3, 0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7,
      0xc67178f2};
  static uint32_t rotr(uint32_t x, int r) { return (x >> r) | (x << (32 - r)); }
  static std::string hex(const std::vector<uint8_t>& data) {
    uint32_t h[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
    std::vector<uint8_t> m(data);
    const uint64_t bits = uint64_t(data.size()) * 8;
    m.push_back(0x80);
    while (m.size() % 64 != 56) m.push_back(0);
    for (int i = 7; i >= 0; --i) m.push_back(uint8_t(bits >> (8 * i)));
    for (size_t blk = 0; blk < m.size(); blk += 64) {
      uint32_t w[64];
      for (int i = 0; i < 16; ++i)
        w[i] = uint32_t(m[blk + 4 * i]) << 24 | uint32_t(m[blk + 4 * i + 1]) << 16 | uint32_t(m[blk + 4 * i + 2]) << 8 |
               m[blk + 4 * i + 3];
      for (int i = 16; i < 64; ++i) {
        const uint32_t s0 = rotr(w[i - 15], 7) ^ rotr(w[i - 15], 18) ^ (w[i - 15] >> 3);
        const uint32_t s1 = rotr(w[i - 2], 17) ^ rotr(w[i - 2], 19) ^ (w[i - 2] >> 10);
        w[i] = w[i - 16] + s0 + w[i - 7] + s1;
      }
      uint32_t a = h[0], b = h[1], c = h[2], d = h[3], e = h[4], f = h[5], g = h[6], hh = h[7];
      for (int i = 0; i < 64; ++i) {
        const uint32_t t1 = hh + (rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25)) + ((e & f) ^ (~e & g)) + K[i] + w[i];
        const uint32_t t2 = (rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
        hh = g; g = f; f = e; e = d + t1; d = c; c = b; b = a; a = t1 + t2;
      }
      h[0] += a; h[1] += b; h[2] += c; h[3] += d; h[4] += e; h[5] += f; h[6] += g; h[7] += hh;
    }
    std::string out;
    char buf[9];
    for (uint32_t v : h) { std::snprintf(buf, sizeof buf, "%08x", v); out += buf; }
    return out;
  }
};
constexpr uint32_t Sha256::K[64];

// ---------------------------------------------------------------- deterministic inputs
/// The LCG of Numerical Recipes: s <- s * 1664525 + 1013904223 (mod 2^32); next() returns the new state.
struct Lcg {
  uint32_t s;
  explicit Lcg(uint32_t seed) : s(seed) {}
  uint32_t next() { return s = s * 1664525u + 1013904223u; }
};

uint32_t clz32(uint32_t x) { return x ? uint32_t(__builtin_clz(x)) : 32u; }

void put16(std::vector<uint8_t>& v, uint16_t x) { v.push_back(uint8_t(x)); v.push_back(uint8_t(x >> 8)); }
void put32(std::vector<uint8_t>& v, uint32_t x) { put16(v, uint16_t(x)); put16(v, uint16_t(x >> 16)); }
void put64(std::vector<uint8_t>& v, uint64_t x) { put32(v, uint32_t(x)); put32(v, uint32_t(x >> 32)); }

/// "Weight-like" floats: per element a = next(), b = next(), c = next(); sign = c >> 31,
/// g = min(clz32(b), G) (geometric: P(g = k) = 2^-(k+1)), exponent = E0 - g, mantissa = a >> (32 - M).
/// bf16: E0 = 125, G = 20, M = 7; fp16: E0 = 14, G = 14, M = 10; fp32: E0 = 126, G = 24, M = 23.
std::vector<uint8_t> weights(Dtype d, uint64_t n, uint32_t seed) {
  Lcg r(seed);
  std::vector<uint8_t> v;
  for (uint64_t i = 0; i < n; ++i) {
    const uint32_t a = r.next(), b = r.next(), c = r.next();
    const uint32_t s = c >> 31;
    if (d == Dtype::BF16) {
      const uint32_t g = std::min(clz32(b), 20u);
      put16(v, uint16_t(s << 15 | (125 - g) << 7 | a >> 25));
    } else if (d == Dtype::F16) {
      const uint32_t g = std::min(clz32(b), 14u);
      put16(v, uint16_t(s << 15 | (14 - g) << 10 | a >> 22));
    } else {
      const uint32_t g = std::min(clz32(b), 24u);
      put32(v, s << 31 | (126 - g) << 23 | a >> 9);
    }
  }
  return v;
}

struct Vector {
  std::string name, dtype;
  std::vector<uint64_t> shape;
  std::string codec;
  uint32_t chunk;  // 0: default chunk size (not passed to the encoder options in the manifest)
  std::string formula;
  std::vector<uint8_t> input;
};

std::vector<Vector> vectors() {
  std::vector<Vector> out;
  const char* codecs[] = {"fast", "max", "bytes", "raw", "auto"};
  const std::string wdesc =
      "weights(seed): LCG s<-s*1664525+1013904223 mod 2^32, per element a,b,c = three next() values; sign=c>>31, "
      "g=min(clz32(b),G), exponent=E0-g, mantissa=a>>(32-M); ";
  struct W { const char* dt; Dtype d; std::vector<uint64_t> shape; uint32_t seed; const char* params; };
  const W ws[] = {{"BF16", Dtype::BF16, {32, 64}, 1, "bf16 E0=125 G=20 M=7, seed=1"},
                  {"F16", Dtype::F16, {32, 64}, 2, "fp16 E0=14 G=14 M=10, seed=2"},
                  {"F32", Dtype::F32, {16, 64}, 3, "fp32 E0=126 G=24 M=23, seed=3"}};
  for (const W& w : ws) {
    uint64_t n = 1;
    for (uint64_t x : w.shape) n *= x;
    std::string lower = w.dt;
    for (char& ch : lower) ch = char(std::tolower(static_cast<unsigned char>(ch)));
    for (const char* c : codecs)
      out.push_back({"weights_" + lower + "_" + c, w.dt, w.shape, c, 0, wdesc + w.params, weights(w.d, n, w.seed)});
  }
  {
    std::vector<uint8_t> v;
    for (uint32_t i = 1; i <= 16; ++i) {
      float f = float(i);
      uint32_t u;
      std::memcpy(&u, &f, 4);
      put16(v, uint16_t(u >> 16));
    }
    out.push_back({"count_bf16_fast", "BF16", {16}, "fast", 0, "bf16 1.0, 2.0, ..., 16.0 (exact)", v});
  }
  {
    std::vector<uint8_t> v;
    for (int i = 0; i < 64; ++i) put16(v, 0x3F80);
    out.push_back({"ones_bf16_fast", "BF16", {64}, "fast", 0, "bf16 1.0 (0x3F80) x 64", v});
  }
  {
    std::vector<uint8_t> v(2000, 0xFF);
    out.push_back({"ffff_bf16_fast", "BF16", {1000}, "fast", 0, "bf16 bit pattern 0xFFFF (NaN) x 1000", v});
    out.push_back({"ffff_bf16_max", "BF16", {1000}, "max", 0, "bf16 bit pattern 0xFFFF (NaN) x 1000", v});
  }
  {
    std::vector<uint8_t> v;
    for (int i = 0; i < 1024; ++i) put32(v, i % 2 ? 0x3F800000u : 0u);
    for (const char* c : {"fast", "max", "auto"})
      out.push_back({std::string("alt01_f32_") + c, "F32", {1024}, c, 0, "fp32 element i = 0.0 if i even else 1.0", v});
  }
  {
    // fp16 with a uniform 5-bit exponent (packed RAW), mantissa low byte 0 (CONST), sign+m[9:8] random (packed RAW).
    Lcg r(4);
    std::vector<uint8_t> v;
    for (int i = 0; i < 2048; ++i) {
      const uint32_t a = r.next();
      put16(v, uint16_t((a >> 31) << 15 | ((a >> 26) & 31) << 10 | ((a >> 24) & 3) << 8));
    }
    const std::string f = "fp16, LCG seed=4, a=next() per element: sign=a>>31, exponent=(a>>26)&31, mantissa=((a>>24)&3)<<8";
    out.push_back({"uexp_f16_fast", "F16", {2048}, "fast", 0, f, v});
    out.push_back({"uexp_f16_max", "F16", {2048}, "max", 0, f, v});
    out.push_back({"uexp_f16_auto", "F16", {2048}, "auto", 0, f, v});
  }
  {
    const std::string f = wdesc + "bf16 E0=125 G=20 M=7, seed=5; chunkSize 4096: chunks of 4096, 4096, 1808 bytes";
    const std::vector<uint8_t> v = weights(Dtype::BF16, 5000, 5);
    for (const char* c : {"fast", "max", "bytes"})
      out.push_back({std::string("multi_bf16_") + c, "BF16", {5000}, c, 4096, f, v});
  }
  {
    Lcg r(6);
    std::vector<uint8_t> v;
    for (int i = 0; i < 4096; ++i) {
      const uint32_t a = r.next(), b = r.next();  // sequenced: a first
      v.push_back(uint8_t(clz32(a | 1u) + 3 * (b >> 31)));
    }
    for (int i = 0; i < 4096; ++i) v.push_back(uint8_t(r.next() >> 24));
    for (int i = 0; i < 3808; ++i) v.push_back(0x5A);
    const std::string f =
        "u8, LCG seed=6: bytes [0,4096): a=next(), b=next(), byte = clz32(a|1) + 3*(b>>31); [4096,8192): next()>>24; "
        "[8192,12000): 0x5A. chunkSize 4096: coded, raw-stored, CONST chunks";
    out.push_back({"mixed_u8_bytes", "U8", {12000}, "bytes", 4096, f, v});
    out.push_back({"mixed_u8_auto", "U8", {12000}, "auto", 4096, f, v});
  }
  {
    // A small RANS section (the worked example of docs/format.md).
    Lcg r(7);
    std::vector<uint8_t> v;
    for (int i = 0; i < 4096; ++i) {
      const uint32_t a = r.next() >> 27;
      v.push_back(uint8_t(a == 0 ? 1 : a == 1 ? 2 : 0));
    }
    out.push_back({"rans_u8_bytes", "U8", {4096}, "bytes", 0,
                   "u8, LCG seed=7: a=next()>>27; element = 1 if a==0, 2 if a==1, else 0", v});
  }
  out.push_back({"empty_bf16_fast", "BF16", {0}, "fast", 0, "empty", {}});
  out.push_back({"empty_f32_max_2x0", "F32", {2, 0}, "max", 0, "empty", {}});
  out.push_back({"empty_u8_auto", "U8", {0}, "auto", 0, "empty", {}});
  {
    std::vector<uint8_t> v;
    for (uint32_t i = 0; i < 33; ++i) v.push_back(uint8_t((i * i + 3) % 251));
    out.push_back({"u8_33_bytes", "U8", {33}, "bytes", 0, "u8 element i = (i*i + 3) mod 251", v});
  }
  {
    std::vector<uint8_t> v;
    for (uint32_t i = 0; i < 100; ++i) v.push_back(i % 3 == 0);
    out.push_back({"bool_100_auto", "BOOL", {100}, "auto", 0, "bool element i = (i mod 3 == 0)", v});
  }
  {
    std::vector<uint8_t> v;
    for (int64_t i = 0; i < 300; ++i) put64(v, uint64_t(i * i - 1000));
    out.push_back({"i64_300_max", "I64", {300}, "max", 0, "int64 element i = i*i - 1000 (two's complement)", v});
  }
  {
    std::vector<uint8_t> v;
    for (int i = 0; i < 256; ++i) {
      const double x = (i - 128) / 8.0;
      uint64_t u;
      std::memcpy(&u, &x, 8);
      put64(v, u);
    }
    out.push_back({"f64_256_bytes", "F64", {4, 64}, "bytes", 0, "float64 element i = (i - 128) / 8 (exact)", v});
  }
  {
    std::vector<uint8_t> v;
    for (int i = 0; i < 512; ++i) put16(v, uint16_t(i * 37));
    out.push_back({"u16_ramp_fast", "U16", {8, 8, 8}, "fast", 0, "uint16 element i = i*37 mod 65536; codec fast on a "
                                                                   "non-float dtype is recorded as bytes", v});
  }
  return out;
}

// ---------------------------------------------------------------- test vectors of the chunk digest alone
/// The fixed pattern the chunk-digest vectors hash: byte i = (31*i + 7) mod 256.
std::vector<uint8_t> digest_pattern(uint64_t len) {
  std::vector<uint8_t> v(len);
  for (uint64_t i = 0; i < len; ++i) v[i] = uint8_t(31 * i + 7);
  return v;
}
/// Lengths chosen to hit every case: no stripe, one short stripe, one whole stripe, a whole and a short one, one
/// stripe per lane, lane 0 with a second (short) stripe, eight stripes per lane, a full 64 KiB chunk.
const uint64_t kDigestLengths[] = {0, 1, 16, 17, 512, 513, 4096, 65536};

// ---------------------------------------------------------------- summary of a frame (for the log)
std::string summarize(const std::vector<uint8_t>& f, const FrameHeader& h) {
  static const char* modes[] = {"CONST", "RAW", "LUT", "RANS"};
  std::string s;
  const uint8_t* table = f.data() + chunk_table_offset(uint32_t(h.shape.size()));
  for (uint64_t i = 0; i < h.n_chunks; ++i) {
    const uint64_t off = load_le64(table + 16 * i), size = load_le32(table + 16 * i + 8);
    const uint64_t raw_len = std::min<uint64_t>(h.chunk_bytes, h.nbytes - i * h.chunk_bytes);
    s += " [" + std::to_string(size) + "/" + std::to_string(raw_len);
    if (size == raw_len) {
      s += " raw]";
      continue;
    }
    const uint8_t* c = f.data() + h.header_bytes + off;
    for (uint32_t j = 0; j < c[1]; ++j) {
      const uint8_t* d = c + 8 + 8 * j;
      s += std::string(" ") + modes[d[0]];
      if (d[0] == 0 || d[0] == 2) s += ":" + std::to_string(d[1]);
    }
    s += "]";
  }
  return s;
}

std::string json_str(const std::string& x) {
  std::string o = "\"";
  for (char c : x) {
    if (c == '"' || c == '\\') o += '\\';
    o += c;
  }
  return o + "\"";
}

bool write_file(const std::string& path, const std::vector<uint8_t>& data) {
  FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) return false;
  const bool ok = std::fwrite(data.data(), 1, data.size(), f) == data.size();
  return std::fclose(f) == 0 && ok;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: make_golden OUT_DIR\n");
    return 2;
  }
  const std::string dir = argv[1];
  std::string manifest = "{\n  \"formatVersion\": " + std::to_string(kFormatVersion) + ",\n";
  manifest += "  \"chunkDigests\": {\"pattern\": \"byte i = (31*i + 7) mod 256\", \"vectors\": [\n";
  for (size_t k = 0; k < sizeof kDigestLengths / sizeof kDigestLengths[0]; ++k) {
    const uint64_t len = kDigestLengths[k];
    const std::vector<uint8_t> b = digest_pattern(len);
    char hex[9];
    std::snprintf(hex, sizeof hex, "%08x", chunk_digest(len ? b.data() : nullptr, len));
    std::printf("chunk_digest(pattern, %6llu) = 0x%s\n", static_cast<unsigned long long>(len), hex);
    manifest += "    {\"length\": " + std::to_string(len) + ", \"digest\": " + json_str(hex) + "}" +
                (k + 1 < sizeof kDigestLengths / sizeof kDigestLengths[0] ? "," : "") + "\n";
  }
  manifest += "  ]},\n  \"vectors\": [\n";
  const std::vector<Vector> vs = vectors();
  for (size_t k = 0; k < vs.size(); ++k) {
    const Vector& v = vs[k];
    Dtype dtype;
    Codec codec;
    bool is_auto;
    if (!parse_dtype_name(v.dtype, &dtype) || !parse_codec_name(v.codec, &codec, &is_auto)) {
      std::fprintf(stderr, "%s: bad dtype or codec\n", v.name.c_str());
      return 1;
    }
    EncodeOptions opt;
    opt.chunk_bytes = v.chunk ? v.chunk : kDefaultChunkBytes;
    opt.threads = 1;
    std::vector<uint8_t> frame;
    try {
      // Same steps as the addon's compress(): resolve "auto", then encode.
      opt.codec = is_auto ? resolve_auto(v.input.data(), v.input.size(), dtype, opt.chunk_bytes, 1) : codec;
      frame.resize(max_frame_bytes(v.input.size(), uint32_t(v.shape.size()), opt.chunk_bytes));
      frame.resize(encode_frame(v.input.data(), v.input.size(), dtype, v.shape, opt, frame.data()));
      std::vector<uint8_t> back(v.input.size());
      decode_frame(frame.data(), frame.size(), back.data(), back.size(), true, 1);
      if (back != v.input) throw Error(ErrorCode::Corrupt, "round trip mismatch");
    } catch (const Error& e) {
      std::fprintf(stderr, "%s: %s\n", v.name.c_str(), e.what());
      return 1;
    }
    const FrameHeader h = parse_frame_header(frame.data(), frame.size());
    if (!write_file(dir + "/" + v.name + ".bin", v.input) || !write_file(dir + "/" + v.name + ".tzf", frame)) {
      std::fprintf(stderr, "cannot write %s/%s.*\n", dir.c_str(), v.name.c_str());
      return 1;
    }
    std::printf("%-22s %-5s %-5s -> %-5s %6zu -> %6zu%s\n", v.name.c_str(), v.dtype.c_str(), v.codec.c_str(),
                codec_name(h.codec), v.input.size(), frame.size(), summarize(frame, h).c_str());
    std::string shape = "[";
    for (size_t i = 0; i < v.shape.size(); ++i) shape += (i ? ", " : "") + std::to_string(v.shape[i]);
    shape += "]";
    manifest += "    {\"name\": " + json_str(v.name) + ", \"dtype\": " + json_str(v.dtype) + ", \"shape\": " + shape +
                ", \"codec\": " + json_str(v.codec) +
                (v.chunk ? ", \"chunkSize\": " + std::to_string(v.chunk) : std::string()) +
                ",\n     \"frameCodec\": " + json_str(codec_name(h.codec)) +
                ", \"nbytes\": " + std::to_string(v.input.size()) + ", \"frameBytes\": " + std::to_string(frame.size()) +
                ",\n     \"input\": " + json_str(v.name + ".bin") + ", \"frame\": " + json_str(v.name + ".tzf") +
                ",\n     \"inputSha256\": " + json_str(Sha256::hex(v.input)) +
                ",\n     \"frameSha256\": " + json_str(Sha256::hex(frame)) +
                ",\n     \"formula\": " + json_str(v.formula) + "}" + (k + 1 < vs.size() ? "," : "") + "\n";
  }
  manifest += "  ]\n}\n";
  if (!write_file(dir + "/manifest.json", std::vector<uint8_t>(manifest.begin(), manifest.end()))) {
    std::fprintf(stderr, "cannot write manifest\n");
    return 1;
  }
  return 0;
}
