// CPU chunk encoder and decoder. The stream formats and decision rules are those of docs/format.md; the
// per-symbol steps come from the shared headers in cuda/include/tzip so the CUDA kernels produce the same bytes.
#include "chunk_codec.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>

#include "cpu_clones.h"
#include "errors.h"
#include "tzip/bitpack.h"
#include "tzip/rans.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__CUDACC__)
#include <immintrin.h>
#define TZIP_RANS_AVX2 1
#endif

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the CPU backend's fast paths assume a little-endian host");

namespace tzip {
namespace {

[[noreturn]] void corrupt(const std::string& what) { throw Error(ErrorCode::Corrupt, "corrupt chunk: " + what); }

/// Padding must be zero: the stream is canonical, so any other byte is corruption.
void expect_zero(const uint8_t* p, uint64_t len, const char* what) {
  for (uint64_t i = 0; i < len; ++i)
    if (p[i]) corrupt(std::string("non-zero padding ") + what);
}

/// Unused high bits of the last byte of n packed k-bit symbols must be zero.
void expect_packed_tail_zero(const uint8_t* packed, uint64_t n, uint32_t k) {
  const uint64_t bits = n * k;
  if (bits % 8 && (packed[bits / 8] >> (bits % 8))) corrupt("non-zero bits after the last packed symbol");
}

bool split_float(Dtype d, Codec c) { return (c == Codec::FAST || c == Codec::MAX) && dtype_is_split_float(d); }

// ---------------------------------------------------------------- split / merge

void merge_streams(const uint8_t* const* st, uint64_t n, Dtype d, Codec c, uint8_t* out) {
  if (split_float(d, c)) {
    if (d == Dtype::BF16) {
      const uint8_t* __restrict e = st[0];
      const uint8_t* __restrict r = st[1];
      for (uint64_t i = 0; i < n; ++i) {
        uint16_t v = uint16_t(((r[i] & 0x80) << 8) | (e[i] << 7) | (r[i] & 0x7F));
        out[2 * i] = uint8_t(v);
        out[2 * i + 1] = uint8_t(v >> 8);
      }
    } else if (d == Dtype::F16) {
      for (uint64_t i = 0; i < n; ++i) {
        const uint8_t sym[kMaxStreams] = {st[0][i], st[1][i], st[2][i]};
        merge_element(d, c, sym, out + 2 * i);
      }
    } else {
      const uint8_t* __restrict e = st[0];
      const uint8_t* __restrict r0 = st[1];
      const uint8_t* __restrict r1 = st[2];
      const uint8_t* __restrict r2 = st[3];
      for (uint64_t i = 0; i < n; ++i) {
        out[4 * i] = r0[i];
        out[4 * i + 1] = r1[i];
        out[4 * i + 2] = uint8_t(((e[i] & 1) << 7) | (r2[i] & 0x7F));
        out[4 * i + 3] = uint8_t((r2[i] & 0x80) | (e[i] >> 1));
      }
    }
  } else {
    const uint32_t w = dtype_size(d);
    if (w == 1) { std::memcpy(out, st[0], n); return; }
    for (uint32_t j = 0; j < w; ++j) {
      const uint8_t* __restrict p = st[j];
      for (uint64_t i = 0; i < n; ++i) out[i * w + j] = p[i];
    }
  }
}

// ---------------------------------------------------------------- packing

void pack_symbols(const uint8_t* sym, uint64_t n, uint32_t k, uint8_t* out) {
  const uint64_t full = n / 8;
  for (uint64_t g = 0; g < full; ++g) store_le_bytes(out + g * k, pack8(sym + 8 * g, k), k);
  const uint64_t rest = n - full * 8;
  if (rest) {
    uint8_t tail[8] = {};
    std::memcpy(tail, sym + full * 8, rest);
    uint64_t v = pack8(tail, k);
    store_le_bytes(out + full * k, v, uint32_t(packed_bytes(rest, k)));
  }
}

/// Unpacks n k-bit symbols from `in` (exactly packed_bytes(n, k) bytes available).
void unpack_symbols(const uint8_t* in, uint64_t n, uint32_t k, uint8_t* sym) {
  const uint64_t full = n / 8;
  for (uint64_t g = 0; g < full; ++g) unpack8(load_le_bytes(in + g * k, k), k, sym + 8 * g);
  const uint64_t rest = n - full * 8;
  if (rest) {
    uint8_t tail[8];
    unpack8(load_le_bytes(in + full * k, uint32_t(packed_bytes(rest, k))), k, tail);
    std::memcpy(sym + full * 8, tail, rest);
  }
}

// ---------------------------------------------------------------- LUT mode

struct LutChoice {
  uint32_t k = 0;
  uint64_t bytes = ~uint64_t(0);
  uint8_t lut[255] = {};
};

/// Symbols ordered by (count desc, symbol asc): the LUT order of docs/format.md.
void rank_symbols(const uint32_t* hist, uint32_t n_symbols, uint8_t* order, uint32_t* n_present) {
  uint32_t m = 0;
  for (uint32_t s = 0; s < n_symbols; ++s) if (hist[s]) order[m++] = uint8_t(s);
  std::stable_sort(order, order + m, [&](uint8_t a, uint8_t b) { return hist[a] > hist[b]; });
  *n_present = m;
}

LutChoice best_lut(const uint32_t* hist, uint32_t w, uint64_t n) {
  LutChoice best;
  uint8_t order[256];
  uint32_t m;
  rank_symbols(hist, 1u << w, order, &m);
  uint64_t covered = 0;
  uint32_t taken = 0;
  for (uint32_t k = 1; k < w; ++k) {
    const uint32_t cap = (1u << k) - 1;
    while (taken < cap && taken < m) covered += hist[order[taken++]];
    const uint64_t bytes = lut_exceptions_offset(k, n) + (n - covered);
    if (bytes < best.bytes) {
      best.bytes = bytes;
      best.k = k;
    }
  }
  if (best.k) {
    const uint32_t cap = (1u << best.k) - 1;
    for (uint32_t j = 0; j < cap; ++j) best.lut[j] = j < m ? order[j] : 0;
  }
  return best;
}

void write_lut_section(const uint8_t* sym, uint64_t n, uint32_t k, const uint8_t* lut, uint8_t* out, ChunkScratch& s) {
  const uint32_t cap = (1u << k) - 1, esc = cap;
  uint8_t code_of[256];
  std::memset(code_of, uint8_t(esc), sizeof code_of);
  for (uint32_t j = cap; j-- > 0;) code_of[lut[j]] = uint8_t(j);
  // Lower LUT index wins, so zero padding past the present symbols never shadows a real symbol 0.
  s.tmp.resize(2 * n + 1);
  uint8_t* codes = s.tmp.data();
  uint8_t* exc = codes + n;  // staged here: the branch-free loop writes one slot past the last exception
  uint32_t n_exc = 0;
  for (uint64_t i = 0; i < n; ++i) {
    const uint8_t c = code_of[sym[i]];
    codes[i] = c;
    exc[n_exc] = sym[i];
    n_exc += c == esc;
  }
  std::memcpy(out + lut_exceptions_offset(k, n), exc, n_exc);
  store_le32(out, n_exc);
  std::memcpy(out + 4, lut, cap);
  std::memset(out + 4 + cap, 0, lut_codes_offset(k) - 4 - cap);
  uint8_t* packed = out + lut_codes_offset(k);
  pack_symbols(codes, n, k, packed);
  const uint64_t codes_end = lut_codes_offset(k) + packed_bytes(n, k);
  std::memset(out + codes_end, 0, lut_exceptions_offset(k, n) - codes_end);
}

/// Decodes n k-bit LUT codes (escape = 2^k - 1 takes the next exception). K is a compile-time width so the
/// shifts unroll; groups of 8 codes are exactly K bytes.
template <uint32_t K>
uint32_t lut_decode(const uint8_t* codes, uint64_t n, const uint8_t* lut, const uint8_t* exc, uint32_t n_exc,
                    uint8_t* sym) {
  constexpr uint32_t esc = (1u << K) - 1;
  uint8_t table[esc + 1];
  std::memcpy(table, lut, esc);
  table[esc] = 0;
  uint32_t e = 0;
  const uint64_t full = n / 8, codes_len = packed_bytes(n, K);
  for (uint64_t g = 0; g < full; ++g) {
    uint64_t v = 0;
    if (g * K + 8 <= codes_len) std::memcpy(&v, codes + g * K, 8);  // whole 8-byte load stays in the codes
    else v = load_le_bytes(codes + g * K, K);
    uint8_t* out = sym + 8 * g;
    uint32_t escapes = 0;
    for (uint32_t j = 0; j < 8; ++j) {
      const uint32_t c = uint32_t(v >> (j * K)) & esc;
      out[j] = table[c];
      escapes |= uint32_t(c == esc) << j;
    }
    while (escapes) {  // rare: symbols outside the LUT
      const uint32_t j = uint32_t(__builtin_ctz(escapes));
      escapes &= escapes - 1;
      if (e >= n_exc) corrupt("more escapes than exceptions");
      out[j] = exc[e++];
    }
  }
  const uint64_t rest = n - full * 8;
  if (rest) {
    const uint64_t v = load_le_bytes(codes + full * K, uint32_t(packed_bytes(rest, K)));
    for (uint32_t j = 0; j < rest; ++j) {
      const uint32_t c = uint32_t(v >> (j * K)) & esc;
      if (c == esc) {
        if (e >= n_exc) corrupt("more escapes than exceptions");
        sym[full * 8 + j] = exc[e++];
      } else {
        sym[full * 8 + j] = table[c];
      }
    }
  }
  return e;
}

void read_lut_section(const uint8_t* in, uint64_t bytes, uint64_t n, uint32_t k, uint32_t w, uint8_t* sym) {
  if (k < 1 || k >= w) corrupt("LUT code width " + std::to_string(k) + " out of range");
  if (bytes < lut_codes_offset(k)) corrupt("LUT section too short");
  const uint32_t n_exc = load_le32(in);
  if (n_exc > n || bytes != lut_exceptions_offset(k, n) + n_exc) corrupt("LUT section size does not match its contents");
  const uint32_t cap = (1u << k) - 1;
  const uint8_t* lut = in + 4;
  for (uint32_t j = 0; j < cap; ++j) if (lut[j] >> w) corrupt("LUT symbol wider than its stream");
  const uint8_t* exc = in + lut_exceptions_offset(k, n);
  for (uint32_t j = 0; j < n_exc; ++j) if (exc[j] >> w) corrupt("exception symbol wider than its stream");
  const uint8_t* codes = in + lut_codes_offset(k);
  expect_zero(lut + cap, lut_codes_offset(k) - 4 - cap, "after the LUT");
  const uint64_t codes_end = lut_codes_offset(k) + packed_bytes(n, k);
  expect_zero(in + codes_end, lut_exceptions_offset(k, n) - codes_end, "after the LUT codes");
  expect_packed_tail_zero(codes, n, k);
  uint32_t used = 0;
  switch (k) {
    case 1: used = lut_decode<1>(codes, n, lut, exc, n_exc, sym); break;
    case 2: used = lut_decode<2>(codes, n, lut, exc, n_exc, sym); break;
    case 3: used = lut_decode<3>(codes, n, lut, exc, n_exc, sym); break;
    case 4: used = lut_decode<4>(codes, n, lut, exc, n_exc, sym); break;
    case 5: used = lut_decode<5>(codes, n, lut, exc, n_exc, sym); break;
    case 6: used = lut_decode<6>(codes, n, lut, exc, n_exc, sym); break;
    default: used = lut_decode<7>(codes, n, lut, exc, n_exc, sym); break;
  }
  if (used != n_exc) corrupt("fewer escapes than exceptions");
}

// ---------------------------------------------------------------- RANS mode

struct RansTable {
  uint32_t freq[256];
  uint32_t cum[257];
};

void build_cum(RansTable& t) {
  t.cum[0] = 0;
  for (uint32_t s = 0; s < 256; ++s) t.cum[s + 1] = t.cum[s] + t.freq[s];
}

/// Encodes n symbols with 32 interleaved lanes; returns the word count (words at buf[0, count)).
/// Encoder step of docs/format.md (renormalise when x >= f << 20, then x = (x / f) << 12 + x % f + cum), with
/// x / f done by a multiply: m = ceil(2^44 / f) gives
/// floor(x / f) = (x * m) >> 44 exactly for every x < 2^32 and f <= 4096 (round-up reciprocal, Granlund and
/// Montgomery 1994: the error x * (m * f - 2^44) / 2^44 stays below 1 / f).
uint32_t rans_encode(const uint8_t* sym, uint64_t n, const RansTable& t, uint32_t* states, std::vector<uint16_t>& buf) {
  struct Enc { uint64_t m; uint32_t freq, cum; } enc[256];
  for (uint32_t s = 0; s < 256; ++s) {
    const uint64_t f = t.freq[s] ? t.freq[s] : 1;
    enc[s] = {((uint64_t(1) << 44) + f - 1) / f, uint32_t(f), t.cum[s]};
  }
  buf.resize(n + kRansLanes);
  uint64_t pos = buf.size();
  uint32_t x[kRansLanes];
  for (uint32_t l = 0; l < kRansLanes; ++l) x[l] = kRansLow;
  const uint64_t steps = (n + kRansLanes - 1) / kRansLanes;
  for (uint64_t g = steps; g-- > 0;) {
    uint16_t words[kRansLanes];
    uint32_t e = 0;
    const uint64_t base = g * kRansLanes;
    const uint32_t active = uint32_t(std::min<uint64_t>(kRansLanes, n - base));
    for (uint32_t l = 0; l < active; ++l) {
      const Enc& c = enc[sym[base + l]];
      uint32_t v = x[l];
      const bool emit = v >= (c.freq << 20);  // x_max = ((L >> 12) << 16) * f
      words[e] = uint16_t(v);                 // branch-free: the slot is kept only when emitting
      e += emit;
      v = emit ? v >> 16 : v;
      const uint32_t q = uint32_t((uint64_t(v) * (unsigned __int128)c.m) >> 44);
      x[l] = (q << kRansProbBits) + (v - q * c.freq) + c.cum;
    }
    pos -= e;
    std::memcpy(&buf[pos], words, e * sizeof(uint16_t));
  }
  const uint32_t count = uint32_t(buf.size() - pos);
  std::memmove(buf.data(), buf.data() + pos, count * sizeof(uint16_t));
  for (uint32_t l = 0; l < kRansLanes; ++l) states[l] = x[l];
  return count;
}

void write_rans_section(const RansTable& t, uint32_t n_present, const uint32_t* states, const uint16_t* words,
                        uint32_t n_words, uint8_t* out) {
  std::memset(out, 0, rans_words_offset(n_present));
  uint32_t j = 0;
  for (uint32_t s = 0; s < 256; ++s) {
    if (!t.freq[s]) continue;
    out[s >> 3] |= uint8_t(1u << (s & 7));
    store_le16(out + kRansBitmapBytes + 2 * j, uint16_t(t.freq[s]));
    ++j;
  }
  uint8_t* st = out + rans_states_offset(n_present);
  for (uint32_t l = 0; l < kRansLanes; ++l) store_le32(st + 4 * l, states[l]);
  store_le32(st + 4 * kRansLanes, n_words);
  uint8_t* w = out + rans_words_offset(n_present);
  for (uint32_t i = 0; i < n_words; ++i) store_le16(w + 2 * i, words[i]);
}

#ifdef TZIP_RANS_AVX2
/// For a mask of 8 lanes, the index of the word each lane that takes one gets: its rank among those lanes.
struct ExpandTable {
  alignas(32) uint32_t idx[256][8];
  ExpandTable() {
    for (uint32_t m = 0; m < 256; ++m)
      for (uint32_t i = 0, r = 0; i < 8; ++i) idx[m][i] = (m >> i & 1) ? r++ : 0;
  }
};
const ExpandTable kExpand;

/// The 32 lanes' steps of read_rans_section with AVX2, eight lanes a vector, for as many whole steps (32 symbols)
/// of `steps` as leave 32 words unread before each starts: within such a step no lane can run out of words, so the
/// checks of the scalar loop cannot fire and a 16-byte load never reads past the section. The same arithmetic as
/// the scalar step, lane by lane and in lane order (the k lanes of a vector that renormalise take the next k words,
/// in lane order), so the same symbols, states and word position. Returns the steps done; x and pos are updated.
__attribute__((target("avx2"), noinline)) uint64_t rans_steps_avx2(const uint32_t* slot_info, const uint8_t* words,
                                                                  uint32_t n_words, uint64_t steps, uint32_t* x,
                                                                  uint32_t& pos, uint8_t* sym) {
  static_assert(kRansLanes == 32, "four vectors of eight lanes");
  __m256i v[4];
  for (int k = 0; k < 4; ++k) v[k] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 8 * k));
  const __m256i slot_mask = _mm256_set1_epi32(kRansProbScale - 1), freq_mask = _mm256_set1_epi32(0xFFF);
  const __m256i byte_mask = _mm256_set1_epi32(0xFF), zero = _mm256_setzero_si256();
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  uint64_t g = 0;
  for (; g < steps && uint64_t(pos) + kRansLanes <= n_words; ++g) {
    __m256i s[4];
    for (int k = 0; k < 4; ++k) {
      const __m256i info = _mm256_i32gather_epi32(reinterpret_cast<const int*>(slot_info), _mm256_and_si256(v[k], slot_mask), 4);
      const __m256i freq = _mm256_and_si256(_mm256_srli_epi32(info, 8), freq_mask);
      __m256i y = _mm256_add_epi32(_mm256_mullo_epi32(freq, _mm256_srli_epi32(v[k], kRansProbBits)), _mm256_srli_epi32(info, 20));
      const __m256i need = _mm256_cmpeq_epi32(_mm256_srli_epi32(y, 16), zero);  // y < 2^16
      const uint32_t m = uint32_t(_mm256_movemask_ps(_mm256_castsi256_ps(need)));
      if (m) {
        const __m256i w8 = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(words + 2ull * pos)));
        const __m256i w = _mm256_permutevar8x32_epi32(w8, _mm256_load_si256(reinterpret_cast<const __m256i*>(kExpand.idx[m])));
        y = _mm256_blendv_epi8(y, _mm256_or_si256(_mm256_slli_epi32(y, 16), w), need);
        pos += uint32_t(__builtin_popcount(m));
      }
      v[k] = y;
      s[k] = _mm256_and_si256(info, byte_mask);
    }
    // 32 symbols in lane order: the packs interleave the vectors by 128-bit halves; one permute puts them back.
    const __m256i p = _mm256_packus_epi16(_mm256_packus_epi32(s[0], s[1]), _mm256_packus_epi32(s[2], s[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(sym + g * kRansLanes), _mm256_permutevar8x32_epi32(p, order));
  }
  for (int k = 0; k < 4; ++k) _mm256_storeu_si256(reinterpret_cast<__m256i*>(x + 8 * k), v[k]);
  return g;
}

/// Whether the AVX2 lane steps run: on a CPU with AVX2, unless TZIP_RANS_SCALAR is set (tests compare the two paths
/// in one machine: python-bridge/tests/test_native.py).
bool have_avx2() {
  static const bool yes = __builtin_cpu_supports("avx2") && std::getenv("TZIP_RANS_SCALAR") == nullptr;
  return yes;
}
#endif

void read_rans_section(const uint8_t* in, uint64_t bytes, uint64_t n, uint32_t w, uint8_t* sym) {
  if (bytes < kRansBitmapBytes) corrupt("RANS section too short");
  RansTable t;
  uint32_t m = 0;
  for (uint32_t s = 0; s < 256; ++s) m += (in[s >> 3] >> (s & 7)) & 1;
  if (m < 2) corrupt("RANS table with fewer than two symbols");
  if (bytes < rans_words_offset(m)) corrupt("RANS section too short for its table");
  uint32_t j = 0, sum = 0;
  for (uint32_t s = 0; s < 256; ++s) {
    t.freq[s] = 0;
    if ((in[s >> 3] >> (s & 7)) & 1) {
      if (s >> w) corrupt("RANS symbol wider than its stream");
      t.freq[s] = load_le16(in + kRansBitmapBytes + 2 * j++);
      if (t.freq[s] == 0 || t.freq[s] >= kRansProbScale) corrupt("RANS frequency out of range");
      sum += t.freq[s];
    }
  }
  if (sum != kRansProbScale) corrupt("RANS frequencies do not sum to 4096");
  build_cum(t);
  // One lookup per symbol: slot -> symbol | freq << 8 | (slot - cum) << 20, so x' = freq * (x >> 12) + (slot - cum).
  uint32_t slot_info[kRansProbScale];
  for (uint32_t s = 0; s < 256; ++s)
    for (uint32_t j = 0; j < t.freq[s]; ++j) slot_info[t.cum[s] + j] = s | (t.freq[s] << 8) | (j << 20);
  const uint8_t* st = in + rans_states_offset(m);
  uint32_t x[kRansLanes];
  for (uint32_t l = 0; l < kRansLanes; ++l) {
    x[l] = load_le32(st + 4 * l);
    if (x[l] < kRansLow) corrupt("RANS lane state below 2^16");
  }
  const uint32_t n_words = load_le32(st + 4 * kRansLanes);
  if (n_words > n || bytes != rans_words_offset(m) + 2ull * n_words) corrupt("RANS section size does not match its word count");
  const uint8_t* words = in + rans_words_offset(m);
  expect_zero(in + kRansBitmapBytes + 2 * m, rans_states_offset(m) - kRansBitmapBytes - 2 * m, "after the RANS frequencies");
  expect_zero(st + 4 * kRansLanes + 4, rans_words_offset(m) - rans_states_offset(m) - 4 * kRansLanes - 4,
              "after the RANS word count");
  uint32_t pos = 0;
  auto step = [&](uint32_t l) -> uint8_t {
    const uint32_t info = slot_info[x[l] & (kRansProbScale - 1)];
    uint32_t y = ((info >> 8) & 0xFFF) * (x[l] >> kRansProbBits) + (info >> 20);
    if (y < kRansLow) {
      if (pos >= n_words) corrupt("RANS word stream exhausted");
      y = (y << 16) | load_le16(words + 2 * pos++);
    }
    x[l] = y;
    return uint8_t(info);
  };
  const uint64_t full_steps = n / kRansLanes;
  uint64_t g = 0;
#ifdef TZIP_RANS_AVX2
  if (have_avx2()) g = rans_steps_avx2(slot_info, words, n_words, full_steps, x, pos, sym);
#endif
  for (; g < full_steps; ++g) {
    uint8_t* out = sym + g * kRansLanes;
    for (uint32_t l = 0; l < kRansLanes; ++l) out[l] = step(l);
  }
  const uint32_t rest = uint32_t(n - full_steps * kRansLanes);
  for (uint32_t l = 0; l < rest; ++l) sym[full_steps * kRansLanes + l] = step(l);
  if (pos != n_words) corrupt("RANS words left over");
  for (uint32_t l = 0; l < kRansLanes; ++l)
    if (x[l] != kRansLow) corrupt("RANS lane did not return to its initial state");
}

// ---------------------------------------------------------------- planning

bool mode_allowed(Codec c, uint32_t stream, StreamMode m) {
  if (m == StreamMode::CONST || m == StreamMode::RAW) return true;
  if (c == Codec::FAST) return stream == 0 && m == StreamMode::LUT;
  return c == Codec::MAX || c == Codec::BYTES;
}

}  // namespace

void split_streams(const uint8_t* in, uint64_t n, Dtype d, Codec c, ChunkScratch& s) {
  const StreamLayout lay = stream_layout(d, c);
  for (uint32_t j = 0; j < lay.count; ++j) s.streams[j].resize(n);
  if (split_float(d, c) && d == Dtype::BF16) {
    uint8_t* __restrict e = s.streams[0].data();
    uint8_t* __restrict r = s.streams[1].data();
    for (uint64_t i = 0; i < n; ++i) {
      const uint8_t lo = in[2 * i], hi = in[2 * i + 1];
      e[i] = uint8_t((hi << 1) | (lo >> 7));
      r[i] = uint8_t((hi & 0x80) | (lo & 0x7F));
    }
  } else if (split_float(d, c) && d == Dtype::F32) {
    uint8_t* __restrict e = s.streams[0].data();
    uint8_t* __restrict r0 = s.streams[1].data();
    uint8_t* __restrict r1 = s.streams[2].data();
    uint8_t* __restrict r2 = s.streams[3].data();
    for (uint64_t i = 0; i < n; ++i) {
      const uint8_t b2 = in[4 * i + 2], b3 = in[4 * i + 3];
      r0[i] = in[4 * i];
      r1[i] = in[4 * i + 1];
      e[i] = uint8_t((b3 << 1) | (b2 >> 7));
      r2[i] = uint8_t((b3 & 0x80) | (b2 & 0x7F));
    }
  } else if (!split_float(d, c)) {
    const uint32_t w = dtype_size(d);
    if (w == 1) {
      std::memcpy(s.streams[0].data(), in, n);
    } else {
      for (uint32_t j = 0; j < w; ++j) {
        uint8_t* __restrict p = s.streams[j].data();
        for (uint64_t i = 0; i < n; ++i) p[i] = in[i * w + j];
      }
    }
  } else {
    uint8_t sym[kMaxStreams];
    const uint32_t w = dtype_size(d);
    for (uint64_t i = 0; i < n; ++i) {
      split_element(d, c, in + i * w, sym);
      for (uint32_t j = 0; j < lay.count; ++j) s.streams[j][i] = sym[j];
    }
  }
}

TZIP_CPU_CLONES uint64_t encode_chunk(const uint8_t* in, uint64_t raw_len, Dtype d, Codec c, uint8_t* out, ChunkScratch& s) {
  const uint32_t esize = dtype_size(d);
  const uint64_t n = raw_len / esize;
  if (c == Codec::RAW || n == 0) {
    std::memcpy(out, in, raw_len);
    return raw_len;
  }
  split_streams(in, n, d, c, s);
  const StreamLayout lay = stream_layout(d, c);
  StreamPlan plan[kMaxStreams];
  LutChoice luts[kMaxStreams];
  RansTable tables[kMaxStreams];
  uint32_t states[kMaxStreams][kRansLanes];
  uint32_t n_words[kMaxStreams] = {};

  for (uint32_t j = 0; j < lay.count; ++j) {
    StreamPlan& p = plan[j];
    const uint32_t w = lay.bits[j];
    const uint8_t* sym = s.streams[j].data();
    const bool need_hist = mode_allowed(c, j, StreamMode::LUT) || mode_allowed(c, j, StreamMode::RANS);
    if (!need_hist) {
      // Only CONST or RAW: CONST when every symbol equals the first.
      const uint8_t first = sym[0];
      uint64_t i = 1;
      while (i < n && sym[i] == first) ++i;
      if (i == n) { p.mode = StreamMode::CONST; p.param = first; p.bytes = 0; }
      else { p.mode = StreamMode::RAW; p.bytes = packed_bytes(n, w); }
      continue;
    }
    uint32_t* h = p.hist;
    {
      // Four sub-histograms break the store-to-load dependency on repeated symbols.
      uint32_t h4[4][256] = {};
      uint64_t i = 0;
      for (; i + 4 <= n; i += 4) { ++h4[0][sym[i]]; ++h4[1][sym[i + 1]]; ++h4[2][sym[i + 2]]; ++h4[3][sym[i + 3]]; }
      for (; i < n; ++i) ++h4[0][sym[i]];
      for (uint32_t v = 0; v < 256; ++v) h[v] = h4[0][v] + h4[1][v] + h4[2][v] + h4[3][v];
    }
    uint32_t m = 0;
    for (uint32_t v = 0; v < 256; ++v) m += h[v] != 0;
    p.n_present = m;
    if (m == 1) {
      p.mode = StreamMode::CONST;
      p.param = sym[0];
      p.bytes = 0;
      continue;
    }
    p.mode = StreamMode::RAW;
    p.bytes = packed_bytes(n, w);
    if (mode_allowed(c, j, StreamMode::LUT) && w > 1) {
      luts[j] = best_lut(h, w, n);
      if (luts[j].bytes < p.bytes) { p.mode = StreamMode::LUT; p.param = uint8_t(luts[j].k); p.bytes = luts[j].bytes; }
    }
    if (mode_allowed(c, j, StreamMode::RANS)) {
      // Try RANS only when its order-0 estimate plus table beats the best so far (integer rule, docs/format.md).
      const uint64_t est = ((order0_cost_fixed16(h, 256, uint32_t(n)) >> 16) + 7) / 8 + rans_words_offset(m);
      if (est < p.bytes) {
        rans_normalize(h, n, tables[j].freq);
        build_cum(tables[j]);
        n_words[j] = rans_encode(sym, n, tables[j], states[j], s.rans_words[j]);
        const uint64_t bytes = rans_words_offset(m) + 2ull * n_words[j];
        if (bytes < p.bytes) { p.mode = StreamMode::RANS; p.param = 0; p.bytes = bytes; }
      }
    }
  }

  // Layout: header, descriptors, then sections each starting 16-aligned.
  uint64_t off = chunk_sections_offset(lay.count);
  uint64_t section_off[kMaxStreams];
  for (uint32_t j = 0; j < lay.count; ++j) {
    off = align16(off);
    section_off[j] = off;
    off += plan[j].bytes;
  }
  const uint64_t coded = off;
  if (align16(coded) >= raw_len) {
    std::memcpy(out, in, raw_len);
    return raw_len;
  }
  std::memset(out, 0, chunk_sections_offset(lay.count));
  out[0] = kChunkKindCoded;
  out[1] = uint8_t(lay.count);
  store_le32(out + 4, uint32_t(n));
  for (uint32_t j = 0; j < lay.count; ++j) {
    uint8_t* dsc = out + kChunkHeaderBytes + kStreamDescriptorBytes * j;
    dsc[0] = uint8_t(plan[j].mode);
    dsc[1] = plan[j].param;
    store_le32(dsc + 4, uint32_t(plan[j].bytes));
    if (j) std::memset(out + section_off[j - 1] + plan[j - 1].bytes, 0, section_off[j] - section_off[j - 1] - plan[j - 1].bytes);
    uint8_t* sec = out + section_off[j];
    const uint8_t* sym = s.streams[j].data();
    switch (plan[j].mode) {
      case StreamMode::CONST: break;
      case StreamMode::RAW:
        if (lay.bits[j] == 8) std::memcpy(sec, sym, n);
        else pack_symbols(sym, n, lay.bits[j], sec);
        break;
      case StreamMode::LUT: write_lut_section(sym, n, luts[j].k, luts[j].lut, sec, s); break;
      case StreamMode::RANS:
        write_rans_section(tables[j], plan[j].n_present, states[j], s.rans_words[j].data(), n_words[j], sec);
        break;
    }
  }
  return coded;
}

TZIP_CPU_CLONES void decode_chunk(const uint8_t* in, uint64_t size, uint64_t raw_len, Dtype d, Codec c, uint8_t* out,
                                  ChunkScratch& s) {
  if (size == raw_len) {
    std::memcpy(out, in, raw_len);
    return;
  }
  if (size > raw_len) corrupt("stored size " + std::to_string(size) + " exceeds raw size " + std::to_string(raw_len));
  if (c == Codec::RAW) corrupt("coded chunk in a raw frame");
  const uint32_t esize = dtype_size(d);
  const uint64_t n = raw_len / esize;
  const StreamLayout lay = stream_layout(d, c);
  if (size < chunk_sections_offset(lay.count)) corrupt("chunk shorter than its header");
  if (in[0] != kChunkKindCoded) corrupt("unknown chunk kind " + std::to_string(in[0]));
  if (in[1] != lay.count) corrupt("stream count " + std::to_string(in[1]) + " does not match the dtype");
  if (load_le16(in + 2) != 0) corrupt("reserved chunk field is not zero");
  if (load_le32(in + 4) != n) corrupt("element count does not match the chunk size");
  const uint8_t* ptr[kMaxStreams];
  uint64_t off = chunk_sections_offset(lay.count);
  expect_zero(in + kChunkHeaderBytes + kStreamDescriptorBytes * lay.count,
              off - kChunkHeaderBytes - kStreamDescriptorBytes * lay.count, "after the stream descriptors");
  for (uint32_t j = 0; j < lay.count; ++j) {
    const uint8_t* dsc = in + kChunkHeaderBytes + kStreamDescriptorBytes * j;
    const uint32_t w = lay.bits[j];
    const auto mode = StreamMode(dsc[0]);
    const uint32_t param = dsc[1];
    const uint64_t bytes = load_le32(dsc + 4);
    if (load_le16(dsc + 2) != 0) corrupt("reserved stream field is not zero");
    const uint64_t aligned = align16(off);
    if (aligned > size) corrupt("stream section runs past the chunk");
    expect_zero(in + off, aligned - off, "between stream sections");
    off = aligned;
    if (bytes > size - off) corrupt("stream section runs past the chunk");
    const uint8_t* sec = in + off;
    off += bytes;
    s.streams[j].resize(n);
    uint8_t* sym = s.streams[j].data();
    ptr[j] = sym;
    switch (mode) {
      case StreamMode::CONST:
        if (bytes != 0 || (param >> w)) corrupt("bad CONST stream");
        std::memset(sym, int(param), n);
        break;
      case StreamMode::RAW:
        if (bytes != packed_bytes(n, w) || param != 0) corrupt("RAW stream size does not match");
        if (w == 8) {
          ptr[j] = sec;
        } else {
          expect_packed_tail_zero(sec, n, w);
          unpack_symbols(sec, n, w, sym);
        }
        break;
      case StreamMode::LUT: read_lut_section(sec, bytes, n, param, w, sym); break;
      case StreamMode::RANS:
        if (param != 0) corrupt("bad RANS parameter");
        read_rans_section(sec, bytes, n, w, sym);
        break;
      default: corrupt("unknown stream mode " + std::to_string(dsc[0]));
    }
  }
  if (off != size) corrupt("chunk size does not match its sections");
  merge_streams(ptr, n, d, c, out);
}

}  // namespace tzip
