// Native test and benchmark of the GPU codec (cuda/src/gpu/codec.h) against the CPU core (frame.cpp).
//
//   gpu_test [--small] [--no-bench] [--bench-only] [--bench-mib N] [--runs N] [--no-cpu-check] [--golden DIR]
//            [--profile] [--codecs LIST] [FILE[:DTYPE]...]
//   --codecs: benchmark only these codecs (comma-separated labels, e.g. fast,raw).
//   --profile: one encode + decode (fast and max) of a bf16 tensor, nothing else (for ncu); --profile-sms N gives
//              them N SMs (0: the whole GPU) instead of the default SM budget.
//   --small-calls: the fixed cost of one call, nothing else: per size (one bf16 element to 25 MB) and codec, the
//     host's enqueue time, the round trip (enqueue, then poll an event until the GPU is done: what the daemon's ring
//     thread does) and the device time, for encode() and decode(); next to an empty kernel and an 8-byte copy.
//   TZIP_GPU_DEBUG=1: the corrupt-frame decode prints (device printf) each rejected chunk and the failing check.
//   TZIP_GPU_BF16_KERNEL=0: bf16 fast frames decode in the fp32 kernel (Tuning::bf16_kernel off), for comparisons.
//   TZIP_GPU_RING_PAIRS=0: the bf16 kernel fills its ring one tile at a time (Tuning::ring_pairs off).
//   TZIP_GPU_FAST_ENCODER=0: every tensor encodes in the general kernel (Tuning::fast_encoder off).
//   TZIP_GPU_DECODE_WARPS=N: the decode kernels run at most N warps per block (Tuning::decode_warps), for measuring.
//
// Correctness (exits non-zero on any mismatch):
//   * every dtype x codec (raw, fast, max, bytes, auto) x data pattern x length (empty, 1, 17 elements, chunk-1,
//     chunk+1, multi-chunk with 4 KiB chunks, several 64 KiB chunks), encoded by the GPU in batches: the frame must
//     equal the CPU's byte for byte; the GPU decodes the CPU frames, the CPU decodes the GPU frames;
//   * views: inputs, frames and outputs at odd offsets;
//   * golden vectors (test/golden, if present): GPU decode of every .tzf, GPU re-encode of every .bin;
//   * corrupt frames (flipped bytes, truncations, trailing bytes, wrong output size): the GPU must report the error code
//     the CPU raises, frame by frame, and must not touch bytes outside the outputs.
//   * data files (raw little-endian tensors, NAME.DTYPE.bin or FILE:DTYPE): same checks on the first 64 MiB.
// Benchmark (unless --no-bench): each file (or synthetic weight-like tensors when none) tiled to >= 2 GiB (--small:
// 64 MiB), for each codec: encode and decode times (cudaEvent, median of --runs (default 10; fewer, at least 3, when
// one run takes over 150 ms) after a warm-up) with sm_budget 10 and
// with all SMs, next to a copy kernel with the same grid sizing. A table is printed last.
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <dirent.h>
#include <fstream>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "core/entropy.h"
#include "core/errors.h"
#include "core/frame.h"
#include "gpu/codec.h"
#include "gpu/scratch.h"
#include "tzip/format.h"

using namespace tzip;

namespace {

int g_fail = 0;
bool g_verbose = false;

#define CK(x)                                                                                     \
  do {                                                                                            \
    cudaError_t e_ = (x);                                                                         \
    if (e_ != cudaSuccess) {                                                                      \
      std::fprintf(stderr, "CUDA error %s at %s:%d: %s\n", cudaGetErrorString(e_), __FILE__, __LINE__, #x); \
      std::exit(2);                                                                               \
    }                                                                                             \
  } while (0)

void fail(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  std::fprintf(stdout, "FAIL: ");
  std::vfprintf(stdout, fmt, ap);
  std::fprintf(stdout, "\n");
  va_end(ap);
  ++g_fail;
}

void check_status(const gpu::Status& s, const char* what) {
  if (!s.ok()) {
    std::fprintf(stderr, "%s failed: %s (%s)\n", what, s.message.c_str(), gpu::error_code_name(s.code));
    std::exit(2);
  }
}

// ---------------------------------------------------------------- data

struct Lcg {
  uint64_t s;
  explicit Lcg(uint64_t seed) : s(seed * 0x9E3779B97F4A7C15ull + 1) {}
  uint32_t next() {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    return uint32_t(s >> 32);
  }
};

uint32_t clz32(uint32_t x) { return x ? uint32_t(__builtin_clz(x)) : 32u; }

enum Pattern { kRandom, kWeights, kZeros, kOnes, kSpecial, kSmall, kSkewed, kSpread, kPow2, kNumPatterns };
const char* kPatternNames[] = {"random", "weights", "zeros", "ones", "special", "small", "skewed", "spread", "pow2"};

/// Weight-like floats: geometric exponents around E0, random mantissas (as cuda/test/make_golden.cpp).
void fill(std::vector<uint8_t>& v, Dtype d, Pattern p, uint64_t seed) {
  Lcg r(seed);
  const uint32_t es = dtype_size(d);
  const uint64_t n = v.size() / es;
  switch (p) {
    case kRandom:
      for (auto& b : v) b = uint8_t(r.next() >> 24);
      break;
    case kZeros: std::fill(v.begin(), v.end(), 0); break;
    case kOnes: std::fill(v.begin(), v.end(), 0xFF); break;
    case kWeights:
      for (uint64_t i = 0; i < n; ++i) {
        const uint32_t a = r.next(), b = r.next(), c = r.next();
        uint64_t bits;
        if (d == Dtype::BF16) bits = (uint64_t(c >> 31) << 15) | (uint64_t(125 - std::min(clz32(b), 20u)) << 7) | (a >> 25);
        else if (d == Dtype::F16) bits = (uint64_t(c >> 31) << 15) | (uint64_t(14 - std::min(clz32(b), 12u)) << 10) | (a >> 22);
        else if (d == Dtype::F32) bits = (uint64_t(c >> 31) << 31) | (uint64_t(125 - std::min(clz32(b), 20u)) << 23) | (a >> 9);
        else bits = uint64_t(int64_t(int32_t(a) >> std::min<uint32_t>(31, 20 + clz32(b))));
        for (uint32_t k = 0; k < es; ++k) v[i * es + k] = uint8_t(bits >> (8 * k));
      }
      break;
    case kSpecial: {
      // NaN, +-Inf, +-0, denormals, ones, all-ones, mixed in runs.
      static const uint64_t bf16[] = {0x7FC0, 0xFFC0, 0x7F80, 0xFF80, 0x0000, 0x8000, 0x0001, 0x807F, 0x3F80, 0xFFFF, 0x7FFF};
      static const uint64_t f16[] = {0x7E00, 0xFE00, 0x7C00, 0xFC00, 0x0000, 0x8000, 0x0001, 0x83FF, 0x3C00, 0xFFFF, 0x7FFF};
      static const uint64_t f32[] = {0x7FC00000, 0xFFC00000, 0x7F800000, 0xFF800000, 0, 0x80000000, 1, 0x807FFFFF,
                                     0x3F800000, 0xFFFFFFFF, 0x7FFFFFFF};
      const uint64_t* tab = d == Dtype::BF16 ? bf16 : d == Dtype::F16 ? f16 : f32;
      for (uint64_t i = 0; i < n; ++i) {
        uint64_t bits = tab[(i / (1 + r.next() % 7)) % 11];
        if (es == 8) bits |= bits << 32;
        for (uint32_t k = 0; k < es; ++k) v[i * es + k] = uint8_t(bits >> (8 * k));
      }
      break;
    }
    case kSmall:
      for (uint64_t i = 0; i < n; ++i) {
        const uint64_t bits = (r.next() % 13) * ((i % 97) == 0 ? 77 : 1);
        for (uint32_t k = 0; k < es; ++k) v[i * es + k] = uint8_t(bits >> (8 * k));
      }
      break;
    case kSkewed:
      for (auto& b : v) {
        const uint32_t x = r.next();
        b = uint8_t(clz32(x | 1) * 7 + (x & 3));  // a few dozen values, geometric
      }
      break;
    case kSpread:
      // Floats whose exponents are one of 6 common values 70% of the time and any of the 2^w values otherwise:
      // `fast` then codes them with a small LUT and about 30% escapes (about 10,000 exceptions per 64 KiB chunk of
      // bf16), far more than one tile's window of them (decode_tile.cuh).
      for (uint64_t i = 0; i < n; ++i) {
        const uint32_t a = r.next(), b = r.next();
        const uint32_t ew = d == Dtype::F16 ? 5 : 8, mw = d == Dtype::F16 ? 10 : d == Dtype::BF16 ? 7 : 23;
        const uint32_t e = (b % 10) < 7 ? (1u << (ew - 1)) - 4 + (b >> 8) % 6 : (b >> 8) & ((1u << ew) - 1);
        const uint64_t bits = (uint64_t(a >> 31) << (ew + mw)) | (uint64_t(e) << mw) | (a & ((1u << mw) - 1));
        for (uint32_t k = 0; k < es; ++k) v[i * es + k] = uint8_t(bits >> (8 * k));
      }
      break;
    case kPow2:
      // -2^k with geometric k: the exponents vary (max codes them with RANS) while sign and mantissa are one value
      // (a CONST stream), the one case of decode_chunk.cuh's bf16 RANS step loop that real weights do not reach.
      for (uint64_t i = 0; i < n; ++i) {
        const uint32_t b = r.next();
        const uint32_t ew = d == Dtype::F16 ? 5 : 8, mw = d == Dtype::F16 ? 10 : d == Dtype::BF16 ? 7 : 23;
        const uint32_t e = ((1u << (ew - 1)) - 2) - std::min(clz32(b | 1), (1u << (ew - 1)) - 3);
        const uint64_t bits = (uint64_t(1) << (ew + mw)) | (uint64_t(e) << mw);
        for (uint32_t k = 0; k < es; ++k) v[i * es + k] = uint8_t(bits >> (8 * k));
      }
      break;
    default: break;
  }
}

const char* codec_label(int c) {
  switch (c) {
    case 0: return "raw";
    case 1: return "fast";
    case 2: return "max";
    case 3: return "bytes";
    default: return "auto";
  }
}

struct Case {
  std::string name;
  Dtype dtype;
  int codec;  // 0..3 or gpu::kCodecAuto
  uint32_t chunk;
  std::vector<uint64_t> shape;
  std::vector<uint8_t> data;
  std::vector<uint8_t> cpu_frame;
};

std::vector<uint8_t> cpu_encode(const Case& c) {
  EncodeOptions o;
  o.chunk_bytes = c.chunk;
  o.threads = 4;
  Codec codec;
  if (c.codec == gpu::kCodecAuto) codec = resolve_auto(c.data.data(), c.data.size(), c.dtype, c.chunk, 4);
  else codec = Codec(c.codec);
  o.codec = codec;
  std::vector<uint8_t> out(max_frame_bytes(c.data.size(), uint32_t(c.shape.size()), c.chunk));
  const uint64_t n = encode_frame(c.data.data(), c.data.size(), c.dtype, c.shape, o, out.data());
  out.resize(n);
  return out;
}

/// CPU decode; returns 0 or the gpu::ErrorCode matching the exception (tzip::ErrorCode has the same values).
int cpu_decode(const uint8_t* f, uint64_t len, uint8_t* out, uint64_t out_len, bool verify) {
  try {
    decode_frame(f, len, out, out_len, verify, 2);
    return 0;
  } catch (const Error& e) {
    return int(e.code());
  }
}

uint64_t first_diff(const uint8_t* a, const uint8_t* b, uint64_t n) {
  for (uint64_t i = 0; i < n; ++i)
    if (a[i] != b[i]) return i;
  return n;
}

std::string describe(const Case& c) {
  char buf[256];
  std::snprintf(buf, sizeof buf, "%s [%s %s %llu bytes chunk %u]", c.name.c_str(), dtype_name(c.dtype),
                codec_label(c.codec), (unsigned long long)c.data.size(), c.chunk);
  return buf;
}

// ---------------------------------------------------------------- device buffers

struct DevBuf {
  uint8_t* p = nullptr;
  size_t n = 0;
  explicit DevBuf(size_t bytes) : n(bytes) { CK(cudaMalloc(&p, std::max<size_t>(bytes, 256))); }
  ~DevBuf() { cudaFree(p); }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
};

uint64_t align_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

/// Encodes the cases on the GPU in one batch (inputs at in_skew bytes past 256-aligned slots, frames at
/// frame_skew), checks each frame against the CPU frame, then decodes both the GPU frames (GPU) and checks the CPU can
/// decode the GPU frames. Returns the GPU frames.
void run_batch(std::vector<Case>& cases, const char* label, uint32_t in_skew, uint32_t frame_skew, uint32_t out_skew,
               int sm_budget) {
  const size_t n = cases.size();
  std::vector<uint64_t> in_off(n), fr_off(n), out_off(n);
  uint64_t in_total = 0, fr_total = 0, out_total = 0;
  for (size_t i = 0; i < n; ++i) {
    const Case& c = cases[i];
    in_off[i] = in_total + in_skew;
    in_total = align_up(in_off[i] + c.data.size() + 1, 256);
    fr_off[i] = fr_total + frame_skew;
    fr_total = align_up(fr_off[i] + max_frame_bytes(c.data.size(), uint32_t(c.shape.size()), c.chunk) + 1, 256);
    out_off[i] = out_total + out_skew;
    out_total = align_up(out_off[i] + c.data.size() + 64, 256);
  }
  DevBuf din(in_total), dfr(fr_total), dout(out_total), dsizes(8 * n), derr(4 * n);
  std::vector<uint8_t> hin(in_total, 0);
  for (size_t i = 0; i < n; ++i) std::memcpy(hin.data() + in_off[i], cases[i].data.data(), cases[i].data.size());
  CK(cudaMemcpy(din.p, hin.data(), in_total, cudaMemcpyHostToDevice));
  CK(cudaMemset(dfr.p, 0xA5, fr_total));  // poison: every frame byte must be written

  // Frames are encoded in groups of equal chunk size (one call per chunk size).
  std::map<uint32_t, std::vector<size_t>> by_chunk;
  for (size_t i = 0; i < n; ++i) by_chunk[cases[i].chunk].push_back(i);
  std::vector<uint64_t> sizes(n);
  for (auto& kv : by_chunk) {
    std::vector<gpu::EncodeItem> items;
    for (size_t i : kv.second) {
      gpu::EncodeItem it;
      it.data = din.p + in_off[i];
      it.nbytes = cases[i].data.size();
      it.dtype = uint8_t(cases[i].dtype);
      it.codec = uint8_t(cases[i].codec);
      it.ndim = uint32_t(cases[i].shape.size());
      it.shape = cases[i].shape.data();
      it.frame = dfr.p + fr_off[i];
      items.push_back(it);
    }
    gpu::EncodeOptions o;
    o.chunk_bytes = kv.first;
    o.sm_budget = sm_budget;
    DevBuf ds(8 * items.size());
    check_status(gpu::encode(items.data(), items.size(), o, reinterpret_cast<uint64_t*>(ds.p)), "gpu::encode");
    CK(cudaDeviceSynchronize());
    std::vector<uint64_t> s(items.size());
    CK(cudaMemcpy(s.data(), ds.p, 8 * s.size(), cudaMemcpyDeviceToHost));
    for (size_t k = 0; k < kv.second.size(); ++k) sizes[kv.second[k]] = s[k];
  }
  std::vector<uint8_t> hfr(fr_total);
  CK(cudaMemcpy(hfr.data(), dfr.p, fr_total, cudaMemcpyDeviceToHost));
  int mism = 0;
  for (size_t i = 0; i < n; ++i) {
    const Case& c = cases[i];
    const std::vector<uint8_t>& ref = c.cpu_frame;
    const uint8_t* g = hfr.data() + fr_off[i];
    if (sizes[i] != ref.size() || std::memcmp(g, ref.data(), ref.size()) != 0) {
      const uint64_t d = first_diff(g, ref.data(), std::min<uint64_t>(sizes[i], ref.size()));
      if (mism++ < 12)
        fail("%s: %s: GPU frame %llu bytes, CPU %llu bytes, first difference at byte %llu (gpu %02x cpu %02x)", label,
             describe(c).c_str(), (unsigned long long)sizes[i], (unsigned long long)ref.size(), (unsigned long long)d,
             d < sizes[i] ? g[d] : 0, d < ref.size() ? ref[d] : 0);
      else ++g_fail;
      continue;
    }
    // CPU decodes the GPU frame.
    std::vector<uint8_t> back(c.data.size() + 1);
    const int rc = cpu_decode(g, sizes[i], back.data(), c.data.size(), true);
    if (rc != 0 || std::memcmp(back.data(), c.data.data(), c.data.size()) != 0)
      fail("%s: %s: CPU decode of the GPU frame failed (code %d)", label, describe(c).c_str(), rc);
  }
  // GPU decodes the CPU frames (uploaded into the frame slots, at the same skew).
  for (size_t i = 0; i < n; ++i) std::memcpy(hfr.data() + fr_off[i], cases[i].cpu_frame.data(), cases[i].cpu_frame.size());
  CK(cudaMemcpy(dfr.p, hfr.data(), fr_total, cudaMemcpyHostToDevice));
  CK(cudaMemset(dout.p, 0x5A, out_total));
  std::vector<gpu::DecodeItem> ditems(n);
  for (size_t i = 0; i < n; ++i) {
    ditems[i].frame = dfr.p + fr_off[i];
    ditems[i].frame_bytes = cases[i].cpu_frame.size();
    ditems[i].out = dout.p + out_off[i];
    ditems[i].out_bytes = cases[i].data.size();
  }
  gpu::DecodeOptions dopt;
  dopt.sm_budget = sm_budget;
  check_status(gpu::decode(ditems.data(), n, dopt, reinterpret_cast<int32_t*>(derr.p)), "gpu::decode");
  CK(cudaDeviceSynchronize());
  std::vector<int32_t> errs(n);
  CK(cudaMemcpy(errs.data(), derr.p, 4 * n, cudaMemcpyDeviceToHost));
  std::vector<uint8_t> hout(out_total);
  CK(cudaMemcpy(hout.data(), dout.p, out_total, cudaMemcpyDeviceToHost));
  mism = 0;
  for (size_t i = 0; i < n; ++i) {
    const Case& c = cases[i];
    const uint8_t* o = hout.data() + out_off[i];
    bool bad = errs[i] != 0 || std::memcmp(o, c.data.data(), c.data.size()) != 0;
    // Guard bytes after the output must be untouched.
    for (uint32_t k = 0; k < 64 && !bad; ++k)
      if (o[c.data.size() + k] != 0x5A) bad = true;
    if (bad) {
      if (mism++ < 12)
        fail("%s: %s: GPU decode of the CPU frame: error %s, first difference at byte %llu", label,
             describe(c).c_str(), gpu::error_code_name(errs[i]),
             (unsigned long long)first_diff(o, c.data.data(), c.data.size()));
      else ++g_fail;
    }
  }
}

std::vector<Case> make_cases(bool small) {
  std::vector<Case> cases;
  const int codecs[] = {0, 1, 2, 3, gpu::kCodecAuto};
  uint64_t seed = 1;
  for (uint32_t di = 0; di < kNumDtypes; ++di) {
    const Dtype d = Dtype(di);
    // --small (sanitizer runs): a few dtypes of each width.
    if (small && !(d == Dtype::BF16 || d == Dtype::F16 || d == Dtype::F32 || d == Dtype::U8 || d == Dtype::I32 ||
                   d == Dtype::I64))
      continue;
    const uint32_t es = dtype_size(d);
    const bool is_float = dtype_is_split_float(d);
    struct Len { const char* name; uint64_t elems; uint32_t chunk; };
    std::vector<Len> lens = {
        {"empty", 0, 65536},
        {"1", 1, 65536},
        {"17", 17, 65536},
        {"chunk-1", 65536 / es - 1, 65536},
        {"chunk+1", 65536 / es + 1, 65536},
        {"4k-multi", (5 * 4096 + 1000) / es, 4096},
        {"3chunks+", (3 * 65536 + 4242) / es, 65536},
    };
    if (small) lens = {lens[1], lens[2], lens[4], lens[5]};
    for (int pi = 0; pi < kNumPatterns; ++pi) {
      const Pattern p = Pattern(pi);
      if (small && !(p == kRandom || p == kWeights || p == kSkewed || p == kSpecial || p == kSpread || p == kPow2)) continue;
      if ((p == kSpecial || p == kWeights) && !is_float && pi != kWeights) continue;
      if ((p == kSpecial || p == kSpread || p == kPow2) && !is_float) continue;
      for (const Len& L : lens) {
        if (p != kRandom && p != kWeights && L.elems < 1000 && L.elems > 1) continue;  // small sizes: two patterns
        for (int codec : codecs) {
          if (!is_float && (codec == 1 || codec == 2) && p != kWeights) continue;  // fast/max == bytes there
          Case c;
          c.name = std::string(kPatternNames[pi]) + "/" + L.name;
          c.dtype = d;
          c.codec = codec;
          c.chunk = L.chunk;
          c.data.resize(L.elems * es);
          fill(c.data, d, p, seed++);
          c.shape = {L.elems};
          if (L.elems == 0 && pi == 0) c.shape = {3, 0, 7};
          if (L.elems == 17 * 0 + 17 && pi == 1) c.shape = {1, 17};
          cases.push_back(std::move(c));
        }
      }
    }
  }
  return cases;
}

// ---------------------------------------------------------------- corrupt frames

void corrupt_tests(const std::vector<Case>& base, int sm_budget, bool small) {
  // Variants: header flips, table flips, payload flips, truncations, trailing byte, wrong output size.
  struct Variant {
    std::vector<uint8_t> frame;
    uint64_t out_len;
    std::string what;
    int expect;
    std::vector<uint8_t> expect_out;
  };
  std::vector<Variant> vs;
  Lcg r(99);
  for (const Case& c : base) {
    const std::vector<uint8_t>& f = c.cpu_frame;
    auto add = [&](std::vector<uint8_t> fr, uint64_t out_len, std::string what) {
      Variant v;
      v.frame = std::move(fr);
      v.out_len = out_len;
      v.what = describe(c) + " " + what;
      std::vector<uint8_t> out(out_len + 1);
      v.expect = cpu_decode(v.frame.data(), v.frame.size(), out.data(), out_len, true);
      if (v.expect == 0) v.expect_out.assign(out.begin(), out.begin() + out_len);
      vs.push_back(std::move(v));
    };
    const uint64_t hdr = parse_frame_header(f.data(), f.size()).header_bytes;
    for (int k = 0; k < 12; ++k) {
      std::vector<uint8_t> g = f;
      const uint64_t pos = r.next() % std::min<uint64_t>(hdr, 48);
      g[pos] ^= uint8_t(1u << (r.next() % 8));
      add(g, c.data.size(), "flip header byte " + std::to_string(pos));
    }
    for (int k = 0; k < 6 && hdr > 64; ++k) {
      std::vector<uint8_t> g = f;
      const uint64_t pos = 48 + r.next() % (hdr - 48);
      g[pos] ^= uint8_t(1u << (r.next() % 8));
      add(g, c.data.size(), "flip shape/table byte " + std::to_string(pos));
    }
    for (int k = 0; k < (small ? 10 : 40) && f.size() > hdr; ++k) {
      std::vector<uint8_t> g = f;
      const uint64_t pos = hdr + r.next() % (f.size() - hdr);
      g[pos] ^= uint8_t(1u << (r.next() % 8));
      add(g, c.data.size(), "flip payload byte " + std::to_string(pos - hdr));
    }
    for (uint64_t cut : {uint64_t(0), uint64_t(20), uint64_t(47), hdr - 1, f.size() / 2, f.size() - 1}) {
      if (cut >= f.size()) continue;
      add(std::vector<uint8_t>(f.begin(), f.begin() + cut), c.data.size(), "truncated to " + std::to_string(cut));
    }
    {
      std::vector<uint8_t> g = f;
      g.push_back(0);
      add(g, c.data.size(), "one trailing byte");
    }
    add(f, c.data.size() + 1, "output one byte too long");
  }
  const size_t n = vs.size();
  std::vector<uint64_t> fo(n), oo(n);
  uint64_t ft = 0, ot = 0;
  for (size_t i = 0; i < n; ++i) {
    fo[i] = ft + (i % 3);  // misaligned frames too
    ft = align_up(fo[i] + vs[i].frame.size() + 1, 256);
    oo[i] = ot;
    ot = align_up(oo[i] + vs[i].out_len + 64, 256);
  }
  DevBuf dfr(ft), dout(ot), derr(4 * n);
  std::vector<uint8_t> h(ft, 0);
  for (size_t i = 0; i < n; ++i) std::memcpy(h.data() + fo[i], vs[i].frame.data(), vs[i].frame.size());
  CK(cudaMemcpy(dfr.p, h.data(), ft, cudaMemcpyHostToDevice));
  CK(cudaMemset(dout.p, 0x5A, ot));
  std::vector<gpu::DecodeItem> items(n);
  for (size_t i = 0; i < n; ++i) {
    items[i].frame = dfr.p + fo[i];
    items[i].frame_bytes = vs[i].frame.size();
    items[i].out = dout.p + oo[i];
    items[i].out_bytes = vs[i].out_len;
  }
  gpu::DecodeOptions o;
  o.sm_budget = sm_budget;
  gpu::Tuning tune = gpu::get_tuning();
  tune.debug = std::getenv("TZIP_GPU_DEBUG") != nullptr;
  gpu::set_tuning(tune);
  check_status(gpu::decode(items.data(), n, o, reinterpret_cast<int32_t*>(derr.p)), "gpu::decode (corrupt)");
  tune.debug = false;
  gpu::set_tuning(tune);
  CK(cudaDeviceSynchronize());
  std::vector<int32_t> errs(n);
  CK(cudaMemcpy(errs.data(), derr.p, 4 * n, cudaMemcpyDeviceToHost));
  std::vector<uint8_t> ho(ot);
  CK(cudaMemcpy(ho.data(), dout.p, ot, cudaMemcpyDeviceToHost));
  int mism = 0, detected = 0, clean = 0;
  for (size_t i = 0; i < n; ++i) {
    const Variant& v = vs[i];
    const uint8_t* o2 = ho.data() + oo[i];
    bool bad = errs[i] != v.expect;
    if (!bad && v.expect == 0 && std::memcmp(o2, v.expect_out.data(), v.out_len) != 0) bad = true;
    for (uint32_t k = 0; k < 64; ++k)
      if (o2[v.out_len + k] != 0x5A) bad = true;
    if (v.expect) ++detected; else ++clean;
    if (bad) {
      if (mism++ < 15)
        fail("corrupt: frame %zu: %s: CPU says %s, GPU says %s", i, v.what.c_str(), gpu::error_code_name(v.expect),
             gpu::error_code_name(errs[i]));
      else ++g_fail;
    }
  }
  std::printf("corrupt frames: %zu variants (%d rejected by the CPU, %d still valid), %d GPU mismatches\n", n,
              detected, clean, mism);
}

// ---------------------------------------------------------------- golden vectors

std::vector<uint8_t> read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::vector<uint8_t>((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}

void golden_tests(const std::string& dir, int sm_budget) {
  DIR* d = opendir(dir.c_str());
  if (!d) {
    std::printf("golden: %s not found, skipped\n", dir.c_str());
    return;
  }
  std::vector<std::string> names;
  while (dirent* e = readdir(d)) {
    std::string s = e->d_name;
    if (s.size() > 4 && s.substr(s.size() - 4) == ".tzf") names.push_back(s.substr(0, s.size() - 4));
  }
  closedir(d);
  std::sort(names.begin(), names.end());
  std::vector<Case> cases;
  for (const std::string& nm : names) {
    Case c;
    c.cpu_frame = read_file(dir + "/" + nm + ".tzf");
    c.data = read_file(dir + "/" + nm + ".bin");
    FrameHeader h;
    try {
      h = parse_frame_header(c.cpu_frame.data(), c.cpu_frame.size());
    } catch (const Error& e) {
      fail("golden %s: CPU cannot parse: %s", nm.c_str(), e.what());
      continue;
    }
    c.name = "golden/" + nm;
    c.dtype = h.dtype;
    c.codec = int(h.codec);
    c.chunk = h.chunk_bytes;
    c.shape = h.shape;
    cases.push_back(std::move(c));
  }
  const int before = g_fail;
  run_batch(cases, "golden", 0, 0, 0, sm_budget);
  std::printf("golden: %zu vectors, %s\n", cases.size(), g_fail == before ? "all match" : "MISMATCHES");
}

// ---------------------------------------------------------------- benchmark

struct BenchRow {
  std::string data, codec;
  double ratio, bound;  // bound: order-0 entropy bound / original bytes (entropy.h), 0 where not computed
  double enc10, dec10, decnv10, enc_all, dec_all, decnv_all, copy10, copy_all;
  // fast and raw rows: 10-SM encode of one 25 MB and one 256 MiB call (fixed costs), and of the whole tensor by the
  // general kernel (Tuning::fast_encoder off); 0 elsewhere
  double enc10_25mb = 0, enc10_256mib = 0, enc10_general = 0, dec10_25mb = 0;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

/// Keeps the GPU busy for about `ns` nanoseconds, so that a measurement started behind it excludes the host's time to
/// enqueue the work (device_ms below).
__global__ void delay_kernel(uint64_t ns) {
  uint64_t t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  } while (t - t0 < ns);
}

/// Median device time of f() (enqueued while a delay kernel runs, so host enqueue time is not counted) and, in
/// *host_us, the median host time of the call that enqueues it.
template <typename F>
double device_ms(F f, int runs, cudaStream_t s, double* host_us) {
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  std::vector<double> t, h;
  for (int i = 0; i < runs + 1; ++i) {
    delay_kernel<<<1, 1, 0, s>>>(2000000);
    CK(cudaEventRecord(a, s));
    const auto h0 = std::chrono::steady_clock::now();
    f();
    const auto h1 = std::chrono::steady_clock::now();
    CK(cudaEventRecord(b, s));
    CK(cudaEventSynchronize(b));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, a, b));
    if (i) {
      t.push_back(ms);
      h.push_back(std::chrono::duration<double, std::micro>(h1 - h0).count());
    }
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  *host_us = median(h);
  return median(t);
}

template <typename F>
double time_ms(F f, int runs, cudaStream_t s) {
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  CK(cudaEventRecord(a, s));
  f();  // warm-up, also sizes the run count: at most ~1.5 s per measurement, at least 3 runs
  CK(cudaEventRecord(b, s));
  CK(cudaEventSynchronize(b));
  float warm = 0;
  CK(cudaEventElapsedTime(&warm, a, b));
  if (warm > 0 && runs * warm > 1500) runs = std::max(3, int(1500 / warm));
  std::vector<double> t;
  for (int i = 0; i < runs; ++i) {
    CK(cudaEventRecord(a, s));
    f();
    CK(cudaEventRecord(b, s));
    CK(cudaEventSynchronize(b));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, a, b));
    t.push_back(ms);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return median(t);
}

__global__ void empty_kernel() {}

/// --small-calls (see the header comment). Synthetic weight-like bf16 data; sizes 2 bytes (one element) to 25 MB.
void small_calls(int runs) {
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  gpu::keep_scratch(s);
  cudaEvent_t done;
  CK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
  void* pinned = nullptr;
  CK(cudaHostAlloc(&pinned, 4096, cudaHostAllocPortable));
  using Clk = std::chrono::steady_clock;
  auto us = [](Clk::time_point a, Clk::time_point b) { return std::chrono::duration<double, std::micro>(b - a).count(); };
  auto spin = [&]() {
    CK(cudaEventRecord(done, s));
    while (cudaEventQuery(done) == cudaErrorNotReady) {
    }
  };
  // f() enqueues; returns {host enqueue us, round trip us, device us} medians.
  auto measure = [&](auto f) {
    for (int i = 0; i < 20; ++i) { f(); spin(); }
    std::vector<double> h, rt;
    for (int i = 0; i < runs; ++i) {
      const auto t0 = Clk::now();
      f();
      const auto t1 = Clk::now();
      spin();
      const auto t2 = Clk::now();
      h.push_back(us(t0, t1));
      rt.push_back(us(t0, t2));
    }
    double host_us = 0;
    const double dev = device_ms(f, std::min(runs, 200), s, &host_us) * 1e3;
    return std::array<double, 3>{median(h), median(rt), dev};
  };
  std::printf("\nsmall calls (stream of its own, sm_budget 10, medians of %d; us):\n", runs);
  std::printf("%-28s %10s %10s %10s\n", "call", "enqueue", "round trip", "device");
  auto row = [](const std::string& name, std::array<double, 3> r) {
    std::printf("%-28s %10.1f %10.1f %10.1f\n", name.c_str(), r[0], r[1], r[2]);
  };
  row("empty kernel", measure([&] { empty_kernel<<<1, 32, 0, s>>>(); }));
  DevBuf d8(8);
  row("8-byte copy to pinned", measure([&] { CK(cudaMemcpyAsync(pinned, d8.p, 8, cudaMemcpyDeviceToHost, s)); }));
  for (uint64_t nb : {2ull, 4096ull, 65536ull, 1ull << 20, 25000000ull}) {
    std::vector<uint8_t> h(nb);
    fill(h, Dtype::BF16, kWeights, 11);
    DevBuf din(nb), dfr(max_frame_bytes(nb, 1, 65536)), dout(nb), dsz(8), derr(4);
    CK(cudaMemcpy(din.p, h.data(), nb, cudaMemcpyHostToDevice));
    const uint64_t shape[1] = {nb / 2};
    for (int codec : {1, 0, 2}) {
      if (codec == 2 && nb > (1u << 20)) continue;
      gpu::EncodeItem it;
      it.data = din.p; it.nbytes = nb; it.dtype = uint8_t(Dtype::BF16); it.codec = uint8_t(codec); it.ndim = 1;
      it.shape = shape; it.frame = dfr.p;
      gpu::EncodeOptions eo;
      eo.sm_budget = 10;
      eo.stream = s;
      auto enc = [&] { check_status(gpu::encode(&it, 1, eo, reinterpret_cast<uint64_t*>(dsz.p)), "encode"); };
      const std::string label = std::string(codec_label(codec)) + " " + std::to_string(nb) + " B";
      row("encode " + label, measure(enc));
      // What the ring thread does around it (addon/ring_gpu.cpp): a scratch block for the sizes, the copy back.
      row("  + ring steps", measure([&] {
        void* d_res = nullptr;
        check_status(gpu::scratch_alloc(&d_res, 8, s), "scratch_alloc");
        check_status(gpu::encode(&it, 1, eo, static_cast<uint64_t*>(d_res)), "encode");
        CK(cudaMemcpyAsync(pinned, d_res, 8, cudaMemcpyDeviceToHost, s));
        gpu::scratch_free(d_res, s);
      }));
      enc();
      CK(cudaStreamSynchronize(s));
      uint64_t fb = 0;
      CK(cudaMemcpy(&fb, dsz.p, 8, cudaMemcpyDeviceToHost));
      gpu::DecodeItem di;
      di.frame = dfr.p; di.frame_bytes = fb; di.out = dout.p; di.out_bytes = nb;
      gpu::DecodeOptions dopt;
      dopt.sm_budget = 10;
      dopt.stream = s;
      row("decode " + label, measure([&] { check_status(gpu::decode(&di, 1, dopt, reinterpret_cast<int32_t*>(derr.p)), "decode"); }));
      int32_t err = -1;
      CK(cudaMemcpy(&err, derr.p, 4, cudaMemcpyDeviceToHost));
      if (err != 0) fail("small calls: decode %s: %d", label.c_str(), err);
      std::vector<uint8_t> back(nb);
      CK(cudaMemcpy(back.data(), dout.p, nb, cudaMemcpyDeviceToHost));
      if (back != h) fail("small calls: %s round trip differs", label.c_str());
    }
  }
  gpu::release_scratch(s);
  CK(cudaStreamSynchronize(s));
  cudaFreeHost(pinned);
  cudaEventDestroy(done);
  cudaStreamDestroy(s);
}

/// Host threads coding at once, each on a stream of its own, as the daemon's ring threads do for two clients of one
/// GPU: every call uploads its descriptors through the codec's shared pinned staging buffers (gpu/common.cu, upload),
/// so a buffer handed to a second thread before its first user's copy was recorded shows here as a frame or tensor of
/// another thread's call (on an H100 it showed as cudaErrorIllegalAddress in the daemon, 2026-12-07). Each thread
/// encodes and decodes tensors of its own sizes and contents and checks both round trips byte for byte.
void concurrent_calls(int threads, int iterations) {
  std::vector<std::thread> pool;
  std::vector<int> bad(threads, 0);
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([t, iterations, &bad] {
      cudaStream_t s;
      CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
      gpu::keep_scratch(s);
      const uint64_t sizes[3] = {uint64_t(65536) * (t + 1) + 2 * t, uint64_t(1) << (19 + t % 3), 4096u + 64u * t};
      const uint64_t most = uint64_t(1) << 21;
      // (allocated once: cudaFree synchronises the device, which would keep the threads' calls apart)
      DevBuf din(most), dfr(max_frame_bytes(most, 1, 65536)), dout(most), dsz(8), derr(4);
      for (int i = 0; i < iterations && !bad[t]; ++i) {
        const uint64_t nb = sizes[i % 3] & ~uint64_t(1);
        std::vector<uint8_t> h(nb);
        fill(h, Dtype::BF16, kWeights, 1000 * uint64_t(t) + uint64_t(i));
        CK(cudaMemcpyAsync(din.p, h.data(), nb, cudaMemcpyHostToDevice, s));
        const uint64_t shape[1] = {nb / 2};
        gpu::EncodeItem it;
        it.data = din.p; it.nbytes = nb; it.dtype = uint8_t(Dtype::BF16); it.codec = uint8_t(i % 2 ? 1 : 0);
        it.ndim = 1; it.shape = shape; it.frame = dfr.p;
        gpu::EncodeOptions eo;
        eo.sm_budget = 4;
        eo.stream = s;
        check_status(gpu::encode(&it, 1, eo, reinterpret_cast<uint64_t*>(dsz.p)), "concurrent encode");
        uint64_t fb = 0;
        CK(cudaMemcpyAsync(&fb, dsz.p, 8, cudaMemcpyDeviceToHost, s));
        CK(cudaStreamSynchronize(s));
        if (fb == 0 || fb > dfr.n) { bad[t] = 1; break; }
        gpu::DecodeItem di;
        di.frame = dfr.p; di.frame_bytes = fb; di.out = dout.p; di.out_bytes = nb;
        gpu::DecodeOptions dopt;
        dopt.sm_budget = 4;
        dopt.stream = s;
        check_status(gpu::decode(&di, 1, dopt, reinterpret_cast<int32_t*>(derr.p)), "concurrent decode");
        int32_t err = -1;
        std::vector<uint8_t> back(nb);
        CK(cudaMemcpyAsync(&err, derr.p, 4, cudaMemcpyDeviceToHost, s));
        CK(cudaMemcpyAsync(back.data(), dout.p, nb, cudaMemcpyDeviceToHost, s));
        CK(cudaStreamSynchronize(s));
        if (err != 0 || back != h) bad[t] = 2 + i;
      }
      gpu::release_scratch(s);
      CK(cudaStreamSynchronize(s));
      cudaStreamDestroy(s);
    });
  }
  for (std::thread& th : pool) th.join();
  for (int t = 0; t < threads; ++t)
    if (bad[t]) fail("concurrent calls: thread %d: %s", t, bad[t] == 1 ? "bad frame size" : "a round trip differs");
}

struct DataSrc {
  std::string name;
  Dtype dtype;
  std::vector<uint8_t> bytes;
};

std::string g_bench_codecs;  // --codecs: comma-separated labels; empty = all

void bench(std::vector<DataSrc>& srcs, uint64_t target, int runs, std::vector<BenchRow>& rows, bool cpu_check) {
  int dev = 0, sms = 0;
  CK(cudaGetDevice(&dev));
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  for (DataSrc& src : srcs) {
    const uint32_t es = dtype_size(src.dtype);
    uint64_t unit = src.bytes.size() / es * es;
    if (unit == 0) continue;
    const uint64_t reps = (target + unit - 1) / unit;
    const uint64_t nbytes = unit * reps;
    std::printf("\nbench %s (%s): %.1f MiB tiled x%llu -> %.2f GiB\n", src.name.c_str(), dtype_name(src.dtype),
                unit / 1048576.0, (unsigned long long)reps, nbytes / 1073741824.0);
    DevBuf din(nbytes), dout(nbytes), dfr(max_frame_bytes(nbytes, 1, 65536)), dsz(8), derr(4);
    for (uint64_t k = 0; k < reps; ++k) CK(cudaMemcpy(din.p + k * unit, src.bytes.data(), unit, cudaMemcpyHostToDevice));
    const uint64_t shape[1] = {nbytes / es};
    // The tiled tensor repeats the block, so its order-0 bound per original byte is the block's.
    const double bound = entropy_report(src.bytes.data(), unit, src.dtype).bound_bytes / double(unit);
    std::vector<int> codecs = {1, 2, 3, 0, gpu::kCodecAuto};
    if (!dtype_is_split_float(src.dtype)) codecs = {3, 0};
    if (!g_bench_codecs.empty()) {
      const std::string list = "," + g_bench_codecs + ",";
      codecs.erase(std::remove_if(codecs.begin(), codecs.end(),
                                  [&](int c) { return list.find("," + std::string(codec_label(c)) + ",") == std::string::npos; }),
                   codecs.end());
    }
    const double copy10 = time_ms([&] { check_status(gpu::copy_bytes(dout.p, din.p, nbytes, 10, s), "copy"); }, runs, s);
    const double copy_all = time_ms([&] { check_status(gpu::copy_bytes(dout.p, din.p, nbytes, 0, s), "copy"); }, runs, s);
    for (int codec : codecs) {
      gpu::EncodeItem it;
      it.data = din.p;
      it.nbytes = nbytes;
      it.dtype = uint8_t(src.dtype);
      it.codec = uint8_t(codec);
      it.ndim = 1;
      it.shape = shape;
      it.frame = dfr.p;
      auto enc = [&](int budget) {
        gpu::EncodeOptions o;
        o.sm_budget = budget;
        o.stream = s;
        check_status(gpu::encode(&it, 1, o, reinterpret_cast<uint64_t*>(dsz.p)), "encode");
      };
      enc(10);
      CK(cudaStreamSynchronize(s));
      uint64_t fbytes = 0;
      CK(cudaMemcpy(&fbytes, dsz.p, 8, cudaMemcpyDeviceToHost));
      gpu::DecodeItem di;
      di.frame = dfr.p;
      di.frame_bytes = fbytes;
      di.out = dout.p;
      di.out_bytes = nbytes;
      auto dec = [&](int budget, bool verify) {
        gpu::DecodeOptions o;
        o.sm_budget = budget;
        o.verify = verify;
        o.stream = s;
        check_status(gpu::decode(&di, 1, o, reinterpret_cast<int32_t*>(derr.p)), "decode");
      };
      // Correctness of the benchmark data: round trip, and the frame against the CPU encoder.
      CK(cudaMemset(dout.p, 0, nbytes));
      dec(0, true);
      CK(cudaStreamSynchronize(s));
      int32_t err = -1;
      CK(cudaMemcpy(&err, derr.p, 4, cudaMemcpyDeviceToHost));
      {
        std::vector<uint8_t> back(nbytes);
        CK(cudaMemcpy(back.data(), dout.p, nbytes, cudaMemcpyDeviceToHost));
        bool same = err == 0;
        for (uint64_t k = 0; k < reps && same; ++k) same = std::memcmp(back.data() + k * unit, src.bytes.data(), unit) == 0;
        if (!same) fail("bench %s %s: GPU round trip differs (decode error %s)", src.name.c_str(), codec_label(codec), gpu::error_code_name(err));
        if (cpu_check) {
          Case c;
          c.dtype = src.dtype;
          c.codec = codec;
          c.chunk = 65536;
          c.shape = {nbytes / es};
          c.data.swap(back);
          const auto t0 = std::chrono::steady_clock::now();
          EncodeOptions o;
          o.chunk_bytes = 65536;
          o.threads = std::max(1u, std::thread::hardware_concurrency());
          o.codec = codec == gpu::kCodecAuto ? resolve_auto(c.data.data(), nbytes, src.dtype, 65536, o.threads) : Codec(codec);
          std::vector<uint8_t> ref(max_frame_bytes(nbytes, 1, 65536));
          const uint64_t rn = encode_frame(c.data.data(), nbytes, src.dtype, c.shape, o, ref.data());
          const double cpu_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
          std::vector<uint8_t> g(fbytes);
          CK(cudaMemcpy(g.data(), dfr.p, fbytes, cudaMemcpyDeviceToHost));
          if (rn != fbytes || std::memcmp(g.data(), ref.data(), rn) != 0)
            fail("bench %s %s: GPU frame (%llu bytes) differs from the CPU frame (%llu bytes) at byte %llu",
                 src.name.c_str(), codec_label(codec), (unsigned long long)fbytes, (unsigned long long)rn,
                 (unsigned long long)first_diff(g.data(), ref.data(), std::min(rn, fbytes)));
          else
            std::printf("  %s: GPU frame == CPU frame (%llu bytes; CPU encode %.2f s on %u threads)\n", codec_label(codec),
                        (unsigned long long)rn, cpu_s, o.threads);
        }
      }
      BenchRow row;
      row.data = src.name;
      row.codec = codec_label(codec);
      row.ratio = double(fbytes) / double(nbytes);
      row.bound = bound;
      row.copy10 = copy10;
      row.copy_all = copy_all;
      row.enc10 = time_ms([&] { enc(10); }, runs, s);
      row.enc_all = time_ms([&] { enc(0); }, runs, s);
      row.dec10 = time_ms([&] { dec(10, true); }, runs, s);
      row.dec_all = time_ms([&] { dec(0, true); }, runs, s);
      row.decnv10 = time_ms([&] { dec(10, false); }, runs, s);
      row.decnv_all = time_ms([&] { dec(0, false); }, runs, s);
      auto gbs = [&](double ms) { return nbytes / (ms * 1e6); };
      if (codec == 0 || codec == 1) {
        // Smaller calls on a prefix of the same data: a 25 MB bucket and a 256 MiB call.
        auto part = [&](uint64_t want, bool decode_too, double* dec_gbs) {
          const uint64_t nb = std::min<uint64_t>(want / es * es, nbytes);
          const uint64_t sh[1] = {nb / es};
          gpu::EncodeItem p = it;
          p.nbytes = nb;
          p.shape = sh;
          auto e = [&] {
            gpu::EncodeOptions o;
            o.sm_budget = 10;
            o.stream = s;
            check_status(gpu::encode(&p, 1, o, reinterpret_cast<uint64_t*>(dsz.p)), "encode");
          };
          const double ms = time_ms(e, std::max(runs, 20), s);
          double host_us = 0;
          const double gpu_ms = device_ms(e, std::max(runs, 20), s, &host_us);
          std::printf("  %s %.1f MB call: %.1f us per call with its host enqueue (%.1f GB/s), %.1f us of device time"
                      " (%.1f GB/s), host enqueue %.1f us\n", codec_label(codec), nb / 1e6, ms * 1e3, nb / (ms * 1e6),
                      gpu_ms * 1e3, nb / (gpu_ms * 1e6), host_us);
          if (decode_too) {
            e();
            CK(cudaStreamSynchronize(s));
            uint64_t fb = 0;
            CK(cudaMemcpy(&fb, dsz.p, 8, cudaMemcpyDeviceToHost));
            gpu::DecodeItem d2{dfr.p, fb, dout.p, nb};
            const double dms = time_ms([&] {
              gpu::DecodeOptions o;
              o.sm_budget = 10;
              o.stream = s;
              check_status(gpu::decode(&d2, 1, o, reinterpret_cast<int32_t*>(derr.p)), "decode");
            }, std::max(runs, 20), s);
            *dec_gbs = nb / (dms * 1e6);
          }
          return nb / (ms * 1e6);
        };
        double d25 = 0;
        row.enc10_25mb = part(25000000, true, &d25);
        row.dec10_25mb = d25;
        row.enc10_256mib = part(256ull << 20, false, nullptr);
        gpu::Tuning t = gpu::get_tuning(), g = t;
        g.fast_encoder = false;
        gpu::set_tuning(g);
        row.enc10_general = gbs(time_ms([&] { enc(10); }, runs, s));
        gpu::set_tuning(t);
        std::printf("  %-5s encode, 10 SMs: 25 MB call %.1f GB/s, 256 MiB call %.1f GB/s, general kernel %.1f GB/s;"
                    " decode of the 25 MB call %.1f GB/s\n",
                    codec_label(codec), row.enc10_25mb, row.enc10_256mib, row.enc10_general, row.dec10_25mb);
      }
      std::printf("  %-5s ratio %.4f | encode %7.1f GB/s (10 SMs) %7.1f GB/s (%d SMs) | decode %7.1f / %7.1f GB/s"
                  " (verify off: %7.1f / %7.1f) | copy %7.1f / %7.1f GB/s\n",
                  row.codec.c_str(), row.ratio, gbs(row.enc10), gbs(row.enc_all), sms, gbs(row.dec10), gbs(row.dec_all),
                  gbs(row.decnv10), gbs(row.decnv_all), gbs(copy10) * 2, gbs(copy_all) * 2);
      std::fflush(stdout);
      row.enc10 = gbs(row.enc10);
      row.enc_all = gbs(row.enc_all);
      row.dec10 = gbs(row.dec10);
      row.dec_all = gbs(row.dec_all);
      row.decnv10 = gbs(row.decnv10);
      row.decnv_all = gbs(row.decnv_all);
      row.copy10 = gbs(copy10);
      row.copy_all = gbs(copy_all);
      rows.push_back(row);
    }
  }
  cudaStreamDestroy(s);
}

bool dtype_from_name(const std::string& s, Dtype* d) {
  std::string u;
  for (char c : s) u += char(std::toupper(c));
  if (u == "FP16" || u == "FLOAT16" || u == "HALF") u = "F16";
  if (u == "FP32" || u == "FLOAT32" || u == "FLOAT") u = "F32";
  if (u == "BFLOAT16") u = "BF16";
  return parse_dtype_name(u, d);
}

}  // namespace

int main(int argc, char** argv) {
  bool small = false, do_bench = true, only_bench = false, cpu_check = true, profile = false, small_only = false;
  int profile_sms = -1;  // --profile-sms: < 0 keeps the options' default SM budget
  uint64_t bench_mib = 0;
  int runs = 10;
  std::string golden = "test/golden";
  std::vector<DataSrc> files;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--small") small = true;
    else if (a == "--no-bench") do_bench = false;
    else if (a == "--bench-only") only_bench = true;
    else if (a == "--no-cpu-check") cpu_check = false;
    else if (a == "--profile") profile = true;
    else if (a == "--profile-sms" && i + 1 < argc) profile_sms = std::atoi(argv[++i]);
    else if (a == "--small-calls") small_only = true;
    else if (a == "--verbose") g_verbose = true;
    else if (a == "--bench-mib" && i + 1 < argc) bench_mib = std::strtoull(argv[++i], nullptr, 10);
    else if (a == "--runs" && i + 1 < argc) runs = std::atoi(argv[++i]);
    else if (a == "--golden" && i + 1 < argc) golden = argv[++i];
    else if (a == "--codecs" && i + 1 < argc) g_bench_codecs = argv[++i];
    else {
      std::string path = a, dt;
      const size_t colon = a.rfind(':');
      if (colon != std::string::npos && colon > 0) { path = a.substr(0, colon); dt = a.substr(colon + 1); }
      else {
        // NAME.DTYPE.bin
        const std::string base = path.substr(path.find_last_of('/') + 1);
        const size_t e = base.rfind(".bin"), d2 = base.rfind('.', e == std::string::npos ? std::string::npos : e - 1);
        if (e != std::string::npos && d2 != std::string::npos) dt = base.substr(d2 + 1, e - d2 - 1);
      }
      DataSrc s;
      if (!dtype_from_name(dt, &s.dtype)) {
        std::fprintf(stderr, "%s: cannot tell the dtype (name it NAME.DTYPE.bin or pass FILE:DTYPE)\n", a.c_str());
        return 2;
      }
      s.name = path.substr(path.find_last_of('/') + 1);
      s.bytes = read_file(path);
      if (s.bytes.empty()) {
        std::fprintf(stderr, "%s: empty or unreadable\n", path.c_str());
        return 2;
      }
      s.bytes.resize(s.bytes.size() / dtype_size(s.dtype) * dtype_size(s.dtype));
      files.push_back(std::move(s));
    }
  }
  {
    gpu::Tuning t = gpu::get_tuning();
    auto off = [](const char* name) { const char* e = std::getenv(name); return e && std::strcmp(e, "0") == 0; };
    if (off("TZIP_GPU_BF16_KERNEL")) t.bf16_kernel = false;
    if (off("TZIP_GPU_RING_PAIRS")) t.ring_pairs = false;
    if (off("TZIP_GPU_FAST_ENCODER")) t.fast_encoder = false;
    if (const char* w = std::getenv("TZIP_GPU_DECODE_WARPS")) t.decode_warps = std::atoi(w);
    gpu::set_tuning(t);
  }
  int dev = 0;
  CK(cudaGetDevice(&dev));
  cudaDeviceProp prop{};
  CK(cudaGetDeviceProperties(&prop, dev));
  std::printf("device %d: %s, %d SMs, %.1f GiB, L2 %d MiB, cc %d.%d\n", dev, prop.name, prop.multiProcessorCount,
              prop.totalGlobalMem / 1073741824.0, prop.l2CacheSize >> 20, prop.major, prop.minor);

  if (small_only) {
    small_calls(runs > 100 ? runs : 2000);
    std::printf("%s\n", g_fail ? "RESULT: FAIL" : "RESULT: PASS");
    return g_fail ? 1 : 0;
  }
  if (profile) {
    // One encode and one decode (fast, then max) for ncu: of the first data file tiled to --bench-mib MiB (default
    // 256), or of a weight-like bf16 tensor when no file is given.
    const uint64_t nb = (bench_mib ? bench_mib : 256) << 20;
    std::vector<uint8_t> h(nb);
    const Dtype pdt = files.empty() ? Dtype::BF16 : files[0].dtype;
    if (files.empty()) {
      fill(h, Dtype::BF16, kWeights, 3);
    } else {
      const std::vector<uint8_t>& f = files[0].bytes;
      for (uint64_t o = 0; o < nb; o += f.size()) std::memcpy(h.data() + o, f.data(), std::min<uint64_t>(f.size(), nb - o));
    }
    DevBuf din(nb), dfr(max_frame_bytes(nb, 1, 65536)), dout(nb), dsz(8), derr(4);
    CK(cudaMemcpy(din.p, h.data(), nb, cudaMemcpyHostToDevice));
    const uint64_t shape[1] = {nb / dtype_size(pdt)};
    for (int codec : {1, 2}) {
      gpu::EncodeItem it;
      it.data = din.p; it.nbytes = nb; it.dtype = uint8_t(pdt); it.codec = uint8_t(codec); it.ndim = 1;
      it.shape = shape; it.frame = dfr.p;
      gpu::EncodeOptions eo;
      if (profile_sms >= 0) eo.sm_budget = profile_sms;
      check_status(gpu::encode(&it, 1, eo, reinterpret_cast<uint64_t*>(dsz.p)), "encode");
      uint64_t fb = 0;
      CK(cudaMemcpy(&fb, dsz.p, 8, cudaMemcpyDeviceToHost));
      gpu::DecodeItem di;
      di.frame = dfr.p; di.frame_bytes = fb; di.out = dout.p; di.out_bytes = nb;
      gpu::DecodeOptions dopt;
      if (profile_sms >= 0) dopt.sm_budget = profile_sms;
      check_status(gpu::decode(&di, 1, dopt, reinterpret_cast<int32_t*>(derr.p)), "decode");
      CK(cudaDeviceSynchronize());
      int32_t e = 0;
      CK(cudaMemcpy(&e, derr.p, 4, cudaMemcpyDeviceToHost));
      std::printf("profile %s: frame %llu bytes, decode %s\n", codec_label(codec), (unsigned long long)fb, gpu::error_code_name(e));
    }
    return 0;
  }
  if (!only_bench) {
    // ---- correctness
    auto t0 = std::chrono::steady_clock::now();
    std::vector<Case> cases = make_cases(small);
    for (Case& c : cases) c.cpu_frame = cpu_encode(c);
    std::printf("cases: %zu (CPU frames built in %.1f s)\n", cases.size(),
                std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    int before = g_fail;
    run_batch(cases, "batch", 0, 0, 0, 10);
    std::printf("batch (aligned, sm_budget 10): %s\n", g_fail == before ? "all match" : "MISMATCHES");
    before = g_fail;
    run_batch(cases, "views", 2 * 3, 7, 4 * 5 + 2, 0);
    std::printf("views (inputs at +6, frames at +7, outputs at +22 bytes, all SMs): %s\n",
                g_fail == before ? "all match" : "MISMATCHES");
    // Odd element offsets per dtype: one case each, input at an odd element.
    {
      std::vector<Case> odd;
      for (const Case& c : cases)
        if (c.name == "weights/chunk+1" || c.name == "random/4k-multi") odd.push_back(c);
      before = g_fail;
      for (uint32_t es : {1u, 2u, 4u, 8u}) {
        std::vector<Case> sel;
        for (const Case& c : odd)
          if (dtype_size(c.dtype) == es) sel.push_back(c);
        if (!sel.empty()) run_batch(sel, "odd-element views", es * 3, 1, es * 5, 10);
      }
      std::printf("odd-element views: %s\n", g_fail == before ? "all match" : "MISMATCHES");
    }
    // Tuning variants: decoder without the tile path, and everything through the fallback decoder.
    {
      std::vector<Case> sub;
      for (size_t i = 0; i < cases.size(); i += 3) sub.push_back(cases[i]);
      gpu::Tuning t;
      t.use_tile_decode = false;
      gpu::set_tuning(t);
      before = g_fail;
      run_batch(sub, "no-tile", 0, 0, 0, 10);
      t.use_tile_decode = true;
      t.defer_all = true;
      gpu::set_tuning(t);
      run_batch(sub, "fallback-only", 0, 0, 0, 10);
      t.defer_all = false;
      t.ring_pairs = false;
      gpu::set_tuning(t);
      run_batch(sub, "ring of single tiles", 0, 0, 0, 10);
      t.bf16_kernel = false;
      gpu::set_tuning(t);
      run_batch(sub, "bf16 in the fp32 kernel", 0, 0, 0, 10);
      gpu::set_tuning(gpu::Tuning{});
      std::printf("decoder variants (no tile path, fallback only, single-tile ring, bf16 in the fp32 kernel): %s\n",
                  g_fail == before ? "all match" : "MISMATCHES");
      // Encoder variants: everything through the general kernel (the fast kernel off), on all cases, and the fast
      // kernel with one SM (its two groups then depend on each other's look-back most often).
      before = g_fail;
      gpu::Tuning e;
      e.fast_encoder = false;
      gpu::set_tuning(e);
      run_batch(cases, "general encoder only", 0, 0, 0, 10);
      gpu::set_tuning(gpu::Tuning{});
      run_batch(cases, "one SM", 0, 0, 0, 1);
      std::printf("encoder variants (general kernel only, one SM): %s\n", g_fail == before ? "all match" : "MISMATCHES");
    }
    golden_tests(golden, 10);
    before = g_fail;
    concurrent_calls(4, small ? 40 : 150);
    std::printf("concurrent calls (4 host threads, a stream each): %s\n", g_fail == before ? "all match" : "MISMATCHES");
    // Corrupt frames from a selection of cases.
    {
      std::vector<Case> sel;
      for (const Case& c : cases)
        if ((c.name == "weights/4k-multi" || c.name == "weights/chunk+1" || c.name == "skewed/4k-multi") &&
            (dtype_is_split_float(c.dtype) || c.dtype == Dtype::U8 || c.dtype == Dtype::I32 || c.dtype == Dtype::I64))
          sel.push_back(c);
      corrupt_tests(sel, 10, small);
    }
    // Data files: the first 64 MiB of each, all codecs.
    if (!files.empty()) {
      std::vector<Case> fc;
      for (const DataSrc& s : files) {
        const uint32_t es = dtype_size(s.dtype);
        const uint64_t nb = std::min<uint64_t>(s.bytes.size(), small ? (4 << 20) : (64 << 20)) / es * es;
        for (int codec : {0, 1, 2, 3, int(gpu::kCodecAuto)}) {
          Case c;
          c.name = "file/" + s.name;
          c.dtype = s.dtype;
          c.codec = codec;
          c.chunk = 65536;
          c.data.assign(s.bytes.begin(), s.bytes.begin() + nb);
          c.shape = {nb / es};
          c.cpu_frame = cpu_encode(c);
          fc.push_back(std::move(c));
        }
      }
      before = g_fail;
      run_batch(fc, "files", 0, 0, 0, 10);
      std::printf("data files: %s\n", g_fail == before ? "all match" : "MISMATCHES");
    }
    std::printf("correctness: %s (%d failures)\n", g_fail ? "FAILED" : "PASSED", g_fail);
  }

  if (do_bench) {
    std::vector<DataSrc> srcs = files;
    if (srcs.empty()) {
      for (Dtype d : {Dtype::BF16, Dtype::F16, Dtype::F32}) {
        DataSrc s;
        s.name = std::string("synthetic-weights.") + dtype_name(d);
        s.dtype = d;
        s.bytes.resize(32 << 20);
        fill(s.bytes, d, kWeights, 7);
        srcs.push_back(std::move(s));
      }
    }
    const uint64_t target = bench_mib ? bench_mib << 20 : small ? (64ull << 20) : (2ull << 30);
    std::vector<BenchRow> rows;
    bench(srcs, target, small ? 3 : runs, rows, cpu_check);
    std::printf("\n%-34s %-5s %6s %6s | %9s %9s | %9s %9s %9s %9s | %7s %7s | %8s %8s | %6s %6s\n", "data", "codec",
                "ratio", "bound", "enc10", "encAll", "dec10", "decAll", "dec10nv", "decAllnv", "enc10c", "dec10c",
                "copy10", "copyAll", "%cpE", "%cpD");
    for (const BenchRow& r : rows)
      std::printf("%-34s %-5s %6.4f %6.4f | %9.1f %9.1f | %9.1f %9.1f %9.1f %9.1f | %7.1f %7.1f | %8.1f %8.1f |"
                  " %5.0f%% %5.0f%%\n",
                  r.data.c_str(), r.codec.c_str(), r.ratio, r.bound, r.enc10, r.enc_all, r.dec10, r.dec_all, r.decnv10,
                  r.decnv_all, r.enc10 * r.ratio, r.dec10 * r.ratio, r.copy10, r.copy_all, 100 * r.enc10 / r.copy10,
                  100 * r.dec10 / r.copy10);
    std::printf("\n%-34s %-5s | %9s %9s %9s %9s %9s\n", "data", "codec", "enc10", "enc10@25MB", "enc10@256M",
                "enc10gen", "dec10@25MB");
    for (const BenchRow& r : rows)
      if (r.enc10_25mb > 0)
        std::printf("%-34s %-5s | %9.1f %9.1f %9.1f %9.1f %9.1f\n", r.data.c_str(), r.codec.c_str(), r.enc10,
                    r.enc10_25mb, r.enc10_256mib, r.enc10_general, r.dec10_25mb);
    std::printf("(GB/s of original bytes, except enc10c/dec10c: the 10-SM figures on the compressed-bytes basis, i.e."
                " x ratio; bound = order-0 entropy bound per original byte of the streams the float codecs code (of"
                " the byte planes for other dtypes); copy = bytes copied per second, i.e. half the read+write traffic;"
                " %%cp = 10-SM encode/decode vs 10-SM copy)\n");
  }
  std::printf("%s\n", g_fail ? "RESULT: FAIL" : "RESULT: PASS");
  return g_fail ? 1 : 0;
}
