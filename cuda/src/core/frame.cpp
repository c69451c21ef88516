// Frame encode/decode on the CPU: chunks coded in parallel, then compacted; header and chunk table as in
// docs/format.md. Every read of a frame is bounds-checked before use.
#include "frame.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "chunk_codec.h"
#include "cpu_clones.h"
#include "errors.h"
#include "parallel.h"
#include "tzip/rans.h"
#include "tzip/xxhash32.h"

namespace tzip {
namespace {


[[noreturn]] void corrupt(const std::string& what) { throw Error(ErrorCode::Corrupt, "corrupt frame: " + what); }
[[noreturn]] void invalid(const std::string& what) { throw Error(ErrorCode::InvalidArgument, what); }

/// prod(shape) * esize, or false on overflow past 2^64.
bool shape_bytes(const std::vector<uint64_t>& shape, uint32_t esize, uint64_t* out) {
  unsigned __int128 total = esize;
  for (uint64_t d : shape) {
    total *= d;
    if (total > UINT64_MAX) {
      // A zero later in the shape still makes the product 0.
      for (uint64_t e : shape) if (e == 0) { *out = 0; return true; }
      return false;
    }
  }
  *out = uint64_t(total);
  return true;
}

bool chunk_bytes_valid(uint32_t cs) {
  return cs >= kMinChunkBytes && cs <= kMaxChunkBytes && cs % kChunkBytesMultiple == 0;
}

Codec normalize_codec(Codec c, Dtype d) {
  if ((c == Codec::FAST || c == Codec::MAX) && !dtype_is_split_float(d)) return Codec::BYTES;
  return c;
}

/// chunk_digest, compiled for AVX2 too (its lanes vectorize: half the time of the baseline build on a chunk).
TZIP_CPU_CLONES uint32_t digest_of_chunk(const uint8_t* p, uint64_t len) { return chunk_digest(p, len); }

uint32_t digest_of_digests(const std::vector<uint32_t>& digests) {
  std::vector<uint8_t> le(digests.size() * 4);
  for (size_t i = 0; i < digests.size(); ++i) store_le32(le.data() + 4 * i, digests[i]);
  return xxh32(le.data(), le.size(), 0);
}

/// Adds to h[256] the count of each FAST exponent symbol (split_element's stream 0) of the n elements of dtype D at
/// p (n <= kMaxChunkBytes). Four interleaved tables: gradients are mostly one symbol (zeros), and one table would make
/// every increment wait on the previous one.
template <Dtype D>
void add_exponent_histogram(const uint8_t* p, uint64_t n, uint64_t* h) {
  constexpr uint32_t esize = D == Dtype::F32 ? 4 : 2;
  uint32_t t[4][256] = {};
  const auto sym0 = [](const uint8_t* q) {
    uint8_t sym[kMaxStreams];
    split_element(D, Codec::FAST, q, sym);
    return sym[0];
  };
  uint64_t e = 0;
  for (; e + 4 <= n; e += 4) {
    ++t[0][sym0(p + e * esize)];
    ++t[1][sym0(p + (e + 1) * esize)];
    ++t[2][sym0(p + (e + 2) * esize)];
    ++t[3][sym0(p + (e + 3) * esize)];
  }
  for (; e < n; ++e) ++t[0][sym0(p + e * esize)];
  for (int s = 0; s < 256; ++s) h[s] += uint64_t(t[0][s]) + t[1][s] + t[2][s] + t[3][s];
}

}  // namespace

bool parse_codec_name(const std::string& name, Codec* out, bool* is_auto) {
  *is_auto = name == "auto";
  if (*is_auto) { *out = Codec::MAX; return true; }
  for (uint32_t i = 0; i < kNumCodecs; ++i)
    if (name == kCodecNames[i]) { *out = Codec(i); return true; }
  return false;
}
const char* codec_name(Codec c) { return uint32_t(c) < kNumCodecs ? kCodecNames[uint32_t(c)] : "?"; }
bool parse_dtype_name(const std::string& name, Dtype* out) {
  for (uint32_t i = 0; i < kNumDtypes; ++i)
    if (name == kDtypeNames[i]) { *out = Dtype(i); return true; }
  return false;
}
const char* dtype_name(Dtype d) { return uint32_t(d) < kNumDtypes ? kDtypeNames[uint32_t(d)] : "?"; }

Codec resolve_auto(const uint8_t* data, uint64_t nbytes, Dtype dtype, uint32_t chunk_bytes, uint32_t threads) {
  if (!dtype_is_split_float(dtype)) return Codec::BYTES;
  const uint32_t esize = dtype_size(dtype);
  const uint64_t n = nbytes / esize;
  if (n == 0) return Codec::FAST;
  const uint64_t n_chunks = num_chunks(nbytes, chunk_bytes);
  const uint32_t workers = worker_count(n_chunks, threads);
  std::vector<std::vector<uint64_t>> hist(workers, std::vector<uint64_t>(256, 0));
  parallel_for(n_chunks, workers, [&](uint64_t i, uint32_t w) {
    const uint64_t begin = i * chunk_bytes, len = std::min<uint64_t>(chunk_bytes, nbytes - begin);
    switch (dtype) {
      case Dtype::BF16: add_exponent_histogram<Dtype::BF16>(data + begin, len / esize, hist[w].data()); break;
      case Dtype::F16: add_exponent_histogram<Dtype::F16>(data + begin, len / esize, hist[w].data()); break;
      default: add_exponent_histogram<Dtype::F32>(data + begin, len / esize, hist[w].data()); break;
    }
  });
  std::vector<uint64_t> h(256, 0);
  for (auto& hw : hist) for (int s = 0; s < 256; ++s) h[s] += hw[s];
  const uint32_t w = stream_layout(dtype, Codec::FAST).bits[0];
  // FAST: best fixed width k with escapes (8 bits each), or w bits per symbol.
  uint64_t sorted[256];
  for (int s = 0; s < 256; ++s) sorted[s] = h[s];
  std::sort(sorted, sorted + 256, [](uint64_t a, uint64_t b) { return a > b; });
  uint64_t fast_bits = w * n, covered = 0;
  for (uint32_t k = 1, taken = 0; k < w; ++k) {
    while (taken < (1u << k) - 1) covered += sorted[taken++];
    fast_bits = std::min<uint64_t>(fast_bits, k * n + 8 * (n - covered));
  }
  const uint64_t max_bits = order0_cost_fixed16(h.data(), 256, n) >> 16;
  const bool max_saves_2pct = fast_bits > max_bits && (fast_bits - max_bits) * 100 >= 2ull * 8 * nbytes;
  return max_saves_2pct ? Codec::MAX : Codec::FAST;
}

uint64_t encode_frame(const uint8_t* data, uint64_t nbytes, Dtype dtype, const std::vector<uint64_t>& shape,
                      const EncodeOptions& opt, uint8_t* out) {
  if (uint32_t(dtype) >= kNumDtypes) invalid("unknown dtype code");
  if (uint32_t(opt.codec) >= kNumCodecs) invalid("unknown codec id");
  if (!chunk_bytes_valid(opt.chunk_bytes))
    invalid("chunk size " + std::to_string(opt.chunk_bytes) + " must be a multiple of 256 between 4096 and 65536 bytes");
  if (shape.size() > kMaxNdim) invalid("at most 32 dimensions are supported, got " + std::to_string(shape.size()));
  uint64_t expect;
  if (!shape_bytes(shape, dtype_size(dtype), &expect) || expect != nbytes)
    invalid("input is " + std::to_string(nbytes) + " bytes but shape x " + dtype_name(dtype) + " needs " +
            std::to_string(expect));
  const Codec codec = normalize_codec(opt.codec, dtype);
  const uint32_t cs = opt.chunk_bytes;
  const uint64_t n_chunks = num_chunks(nbytes, cs);
  if (n_chunks > UINT32_MAX) invalid("tensor too large for one frame");
  const uint32_t ndim = uint32_t(shape.size());
  const uint64_t hdr = frame_header_bytes(ndim, n_chunks);
  uint8_t* payload = out + hdr;
  std::vector<uint64_t> sizes(n_chunks);
  std::vector<uint32_t> digests(n_chunks);
  std::vector<ChunkScratch> scratch(worker_count(n_chunks, opt.threads));
  parallel_for(n_chunks, uint32_t(scratch.size()), [&](uint64_t i, uint32_t w) {
    const uint64_t begin = i * cs, len = std::min<uint64_t>(cs, nbytes - begin);
    digests[i] = digest_of_chunk(data + begin, len);
    sizes[i] = encode_chunk(data + begin, len, dtype, codec, payload + begin, scratch[w]);
  });
  // Compact: chunk i moves left from i*cs to its final offset; padding to 16 between chunks is zero.
  std::vector<uint64_t> offsets(n_chunks);
  uint64_t off = 0;
  for (uint64_t i = 0; i < n_chunks; ++i) {
    offsets[i] = off;
    if (off != i * cs) std::memmove(payload + off, payload + i * cs, sizes[i]);
    off += sizes[i];
    if (i + 1 < n_chunks) {
      const uint64_t next = align16(off);
      std::memset(payload + off, 0, next - off);
      off = next;
    }
  }
  const uint64_t payload_bytes = off;

  std::memset(out, 0, chunk_table_offset(ndim));
  store_le32(out + kOffMagic, kFrameMagic);
  store_le16(out + kOffVersion, kFormatVersion);
  out[kOffDtype] = uint8_t(dtype);
  out[kOffCodec] = uint8_t(codec);
  out[kOffNdim] = uint8_t(ndim);
  store_le32(out + kOffChunkBytes, cs);
  store_le64(out + kOffNbytes, nbytes);
  store_le64(out + kOffPayloadBytes, payload_bytes);
  store_le32(out + kOffNumChunks, uint32_t(n_chunks));
  store_le32(out + kOffChecksum, digest_of_digests(digests));
  for (uint32_t d = 0; d < ndim; ++d) store_le64(out + kOffShape + 8 * d, shape[d]);
  uint8_t* table = out + chunk_table_offset(ndim);
  for (uint64_t i = 0; i < n_chunks; ++i) {
    store_le64(table + kChunkEntryBytes * i, offsets[i]);
    store_le32(table + kChunkEntryBytes * i + 8, uint32_t(sizes[i]));
    store_le32(table + kChunkEntryBytes * i + 12, digests[i]);
  }
  store_le32(out + kOffHeaderDigest, xxh32(out, hdr, 0));
  return hdr + payload_bytes;
}

FrameHeader parse_frame_prefix(const uint8_t* f, uint64_t avail) {
  if (avail < kFixedHeaderBytes)
    throw Error(ErrorCode::Truncated, "truncated frame: " + std::to_string(avail) + " bytes, the fixed header needs 48",
                kFixedHeaderBytes);
  if (load_le32(f + kOffMagic) != kFrameMagic) corrupt("bad magic (not a tzip frame)");
  FrameHeader h;
  h.version = load_le16(f + kOffVersion);
  if (h.version == 0) corrupt("format version 0");
  // Version 1 (pre-release): the same layout, but a chunk's digest was the XXH32 of the whole chunk (docs/format.md,
  // "Versioning"). Such frames are refused rather than decoded with a digest check that would fail.
  if (h.version == 1)
    throw Error(ErrorCode::Unsupported,
                "frame format version 1 is a pre-release format that this tzip no longer reads (it reads version " +
                    std::to_string(kFormatVersion) + "): re-compress the original tensor");
  if (h.version > kFormatVersion)
    throw Error(ErrorCode::Unsupported, "frame format version " + std::to_string(h.version) +
                                            " is newer than this tzip (reads version " +
                                            std::to_string(kFormatVersion) + ")");
  if (f[kOffDtype] >= kNumDtypes) corrupt("unknown dtype code " + std::to_string(f[kOffDtype]));
  if (f[kOffCodec] >= kNumCodecs) corrupt("unknown codec id " + std::to_string(f[kOffCodec]));
  h.dtype = Dtype(f[kOffDtype]);
  h.codec = Codec(f[kOffCodec]);
  if (normalize_codec(h.codec, h.dtype) != h.codec) corrupt("float codec on a non-float dtype");
  const uint32_t ndim = f[kOffNdim];
  if (ndim > kMaxNdim) corrupt("ndim " + std::to_string(ndim) + " above 32");
  if (f[kOffFlags] != 0 || load_le16(f + 10) != 0 || load_le32(f + 44) != 0) corrupt("reserved header fields are not zero");
  h.chunk_bytes = load_le32(f + kOffChunkBytes);
  if (!chunk_bytes_valid(h.chunk_bytes)) corrupt("chunk size " + std::to_string(h.chunk_bytes) + " out of range");
  h.nbytes = load_le64(f + kOffNbytes);
  h.payload_bytes = load_le64(f + kOffPayloadBytes);
  h.n_chunks = load_le32(f + kOffNumChunks);
  h.checksum = load_le32(f + kOffChecksum);
  if (h.n_chunks != num_chunks(h.nbytes, h.chunk_bytes)) corrupt("chunk count does not match the tensor size");
  const uint64_t table_off = chunk_table_offset(ndim);
  h.header_bytes = frame_header_bytes(ndim, h.n_chunks);
  if (avail < table_off)
    throw Error(ErrorCode::Truncated, "truncated frame: the shape needs " + std::to_string(table_off) + " bytes", table_off);
  h.shape.resize(ndim);
  for (uint32_t d = 0; d < ndim; ++d) h.shape[d] = load_le64(f + kOffShape + 8 * d);
  for (uint64_t p = kOffShape + 8ull * ndim; p < table_off; ++p)
    if (f[p]) corrupt("non-zero padding between the shape and the chunk table");
  uint64_t expect;
  if (!shape_bytes(h.shape, dtype_size(h.dtype), &expect) || expect != h.nbytes) corrupt("shape does not match the byte count");
  if (h.payload_bytes > h.nbytes) corrupt("payload larger than the tensor");
  return h;
}

FrameHeader parse_frame_header(const uint8_t* f, uint64_t avail) {
  FrameHeader h = parse_frame_prefix(f, avail);
  const uint64_t table_off = chunk_table_offset(uint32_t(h.shape.size()));
  if (avail < h.header_bytes)
    throw Error(ErrorCode::Truncated, "truncated frame: the chunk table needs " + std::to_string(h.header_bytes) + " bytes",
                h.header_bytes);
  {
    // Header digest: XXH32 of the header bytes with the digest field read as zero.
    const uint32_t stored = load_le32(f + kOffHeaderDigest);
    std::vector<uint8_t> copy(f, f + h.header_bytes);
    store_le32(copy.data() + kOffHeaderDigest, 0);
    if (xxh32(copy.data(), copy.size(), 0) != stored) corrupt("header digest mismatch");
  }
  const uint8_t* table = f + table_off;
  uint64_t off = 0;
  std::vector<uint32_t> digests(h.n_chunks);
  for (uint64_t i = 0; i < h.n_chunks; ++i) {
    const uint8_t* e = table + kChunkEntryBytes * i;
    const uint64_t o = load_le64(e), size = load_le32(e + 8);
    const uint64_t raw_len = std::min<uint64_t>(h.chunk_bytes, h.nbytes - i * h.chunk_bytes);
    digests[i] = load_le32(e + 12);
    if (o != off) corrupt("chunk " + std::to_string(i) + " offset is not where the previous chunk ends");
    if (size > raw_len || size == 0) corrupt("chunk " + std::to_string(i) + " size out of range");
    off += size;
    if (i + 1 < h.n_chunks) off = align16(off);
  }
  if (off != h.payload_bytes) corrupt("chunk sizes do not add up to the payload size");
  if (digest_of_digests(digests) != h.checksum) corrupt("checksum does not match the chunk digests");
  return h;
}

void decode_frame(const uint8_t* f, uint64_t len, uint8_t* out, uint64_t out_len, bool verify, uint32_t threads) {
  const FrameHeader h = parse_frame_header(f, len);
  if (len < h.frame_bytes())
    throw Error(ErrorCode::Truncated, "truncated frame: " + std::to_string(len) + " of " + std::to_string(h.frame_bytes()) + " bytes",
                h.frame_bytes());
  if (len > h.frame_bytes()) corrupt(std::to_string(len - h.frame_bytes()) + " trailing bytes after the frame");
  if (out_len != h.nbytes)
    invalid("output buffer is " + std::to_string(out_len) + " bytes, the frame holds " + std::to_string(h.nbytes));
  decode_frame_chunks(f, h, 0, h.n_chunks, out, verify, threads);
}

void decode_frame_chunks(const uint8_t* f, const FrameHeader& h, uint64_t first, uint64_t last, uint8_t* out, bool verify,
                         uint32_t threads) {
  if (first > last || last > h.n_chunks) invalid("chunk range out of the frame");
  const uint8_t* table = f + chunk_table_offset(uint32_t(h.shape.size()));
  const uint8_t* payload = f + h.header_bytes;
  std::vector<ChunkScratch> scratch(worker_count(last - first, threads));
  parallel_for(last - first, uint32_t(scratch.size()), [&](uint64_t k, uint32_t w) {
    const uint64_t i = first + k;
    const uint8_t* e = table + kChunkEntryBytes * i;
    const uint64_t begin = i * h.chunk_bytes, raw_len = std::min<uint64_t>(h.chunk_bytes, h.nbytes - begin);
    uint8_t* dst = out + (begin - first * h.chunk_bytes);
    try {
      const uint64_t off = load_le64(e), size = load_le32(e + 8);
      if (i + 1 < h.n_chunks) {  // padding up to the next chunk must be zero (the stream is canonical)
        for (uint64_t p = off + size; p < align16(off + size); ++p)
          if (payload[p]) throw Error(ErrorCode::Corrupt, "non-zero padding after the chunk");
      }
      decode_chunk(payload + off, size, raw_len, h.dtype, h.codec, dst, scratch[w]);
    } catch (const Error& err) {
      throw Error(err.code(), "chunk " + std::to_string(i) + ": " + err.what());
    }
    if (verify && digest_of_chunk(dst, raw_len) != load_le32(e + 12))
      throw Error(ErrorCode::Checksum, "checksum mismatch in chunk " + std::to_string(i) + " (bytes " + std::to_string(begin) +
                                           ".." + std::to_string(begin + raw_len) + ")");
  });
}

}  // namespace tzip
