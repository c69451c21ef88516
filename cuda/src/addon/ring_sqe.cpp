// The submission ring's records and checks (ring_sqe.h, docs/ring.md).
#include "ring_sqe.h"

#include <algorithm>
#include <cstring>

#include "tzip/format.h"

namespace tzip::ring {
namespace {

std::string num(uint64_t v) { return std::to_string(v); }

Check fail(int32_t status, std::string message) { return Check{status, std::move(message)}; }

/// Region `id` of generation `gen` for `what` ("src"/"dst"), or the TZIP_HANDLE failure.
Check region_of(const RegionTable& t, uint32_t id, uint32_t gen, const Region** out) {
  if (id == 0 || id >= t.size() || !t[id].registered) return fail(kHandle, "region " + num(id) + " is not registered");
  const Region& r = t[id];
  if (gen < r.generation || (gen == r.generation && r.released))
    return fail(kHandle, "region " + num(id) + " generation " + num(gen) + " was released");
  if (gen != r.generation) return fail(kHandle, "region " + num(id) + " has no generation " + num(gen));
  if (r.faulted) return fail(kHandle, "region " + num(id) + ": its file shrank");
  *out = &r;
  return {};
}

/// [off, off + len) inside a region of `bytes` bytes, without forming off + len.
bool in_bounds(uint64_t off, uint64_t len, uint64_t bytes) { return off <= bytes && len <= bytes - off; }

bool same_space(const Resolved& a, const Resolved& b) {
  return a.kind == b.kind && (a.kind == RegionKind::Host || a.device == b.device);
}

/// Whether the non-empty address ranges [a, a + na) and [b, b + nb) (both inside regions, so no wrap) intersect.
bool overlap(uint64_t a, uint64_t na, uint64_t b, uint64_t nb) { return na && nb && a < b + nb && b < a + na; }

}  // namespace

Sqe decode_sqe(const uint8_t* p) {
  Sqe s;
  s.user_data = load_le64(p + 0);
  s.op = p[8];
  s.flags = p[9];
  s.codec = p[10];
  s.dtype = p[11];
  s.ndim = p[12];
  s.sm_budget = p[13];
  s.stream = p[14];
  s.reserved = p[15];
  s.src_id = load_le32(p + 16);
  s.src_gen = load_le32(p + 20);
  s.src_off = load_le64(p + 24);
  s.src_bytes = load_le64(p + 32);
  s.dst_id = load_le32(p + 40);
  s.dst_gen = load_le32(p + 44);
  s.dst_off = load_le64(p + 48);
  s.dst_bytes = load_le64(p + 56);
  for (uint32_t k = 0; k < kMaxNdim; ++k) s.shape[k] = load_le64(p + 64 + 8 * k);
  s.wait_value = load_le64(p + 112);
  s.signal_value = load_le64(p + 120);
  return s;
}

void encode_sqe(const Sqe& s, uint8_t* p) {
  store_le64(p + 0, s.user_data);
  p[8] = s.op;
  p[9] = s.flags;
  p[10] = s.codec;
  p[11] = s.dtype;
  p[12] = s.ndim;
  p[13] = s.sm_budget;
  p[14] = s.stream;
  p[15] = s.reserved;
  store_le32(p + 16, s.src_id);
  store_le32(p + 20, s.src_gen);
  store_le64(p + 24, s.src_off);
  store_le64(p + 32, s.src_bytes);
  store_le32(p + 40, s.dst_id);
  store_le32(p + 44, s.dst_gen);
  store_le64(p + 48, s.dst_off);
  store_le64(p + 56, s.dst_bytes);
  for (uint32_t k = 0; k < kMaxNdim; ++k) store_le64(p + 64 + 8 * k, s.shape[k]);
  store_le64(p + 112, s.wait_value);
  store_le64(p + 120, s.signal_value);
}

Sqe copy_sqe(const void* slot) {
  // Word by word with relaxed atomic loads: the client may store into the slot meanwhile, and a plain memcpy of memory
  // another thread writes is a data race. The copy may mix old and new words; the checks below see only the copy.
  uint64_t words[kSqeBytes / 8];
  const uint64_t* src = static_cast<const uint64_t*>(slot);
  for (size_t i = 0; i < kSqeBytes / 8; ++i) words[i] = __atomic_load_n(src + i, __ATOMIC_RELAXED);
  uint8_t raw[kSqeBytes];
  std::memcpy(raw, words, sizeof raw);
  return decode_sqe(raw);
}

uint64_t frame_bound(uint64_t nbytes, uint32_t ndim) { return max_frame_bytes(nbytes, ndim, kDefaultChunkBytes); }

uint8_t known_frame_codec(uint8_t codec, uint8_t dtype, uint64_t nbytes) {
  const Dtype d = Dtype(dtype);
  const bool split = dtype_is_split_float(d);
  if (codec == kCodecAuto) {
    if (!split) return uint8_t(Codec::BYTES);
    return nbytes < dtype_size(d) ? uint8_t(Codec::FAST) : kCodecAuto;
  }
  if ((codec == uint8_t(Codec::FAST) || codec == uint8_t(Codec::MAX)) && !split) return uint8_t(Codec::BYTES);
  return codec;
}

Check check_sqe(const Sqe& s, const RegionTable& regions, Resolved* out) {
  if (s.op > kDecompress) return fail(kInvalidArgument, "unknown op " + num(s.op));
  if (s.flags & ~kKnownFlags) return fail(kInvalidArgument, "unknown flags " + num(s.flags));
  if (s.reserved != 0) return fail(kInvalidArgument, "reserved byte 15 is " + num(s.reserved));
  if (s.stream > kMaxStreamTag) return fail(kInvalidArgument, "unknown stream tag " + num(s.stream));
  Resolved r;
  if (s.op == kNop) {
    *out = r;
    return {};
  }
  const Region* src = nullptr;
  const Region* dst = nullptr;
  if (Check c = region_of(regions, s.src_id, s.src_gen, &src); !c.ok()) return c;
  if (Check c = region_of(regions, s.dst_id, s.dst_gen, &dst); !c.ok()) return c;
  if (!in_bounds(s.src_off, s.src_bytes, src->bytes))
    return fail(kInvalidArgument, "src range past region " + num(s.src_id) + "'s " + num(src->bytes) + " bytes");
  if (!in_bounds(s.dst_off, s.dst_bytes, dst->bytes))
    return fail(kInvalidArgument, "dst range past region " + num(s.dst_id) + "'s " + num(dst->bytes) + " bytes");
  if (s.op == kCompress) {
    if (s.codec > uint8_t(Codec::BYTES) && s.codec != kCodecAuto) return fail(kInvalidArgument, "unknown codec " + num(s.codec));
    if (s.dtype >= kNumDtypes) return fail(kInvalidArgument, "unknown dtype " + num(s.dtype));
    if (s.ndim > kMaxNdim) return fail(kInvalidArgument, "ndim " + num(s.ndim) + " is above 6");
    for (uint32_t k = s.ndim; k < kMaxNdim; ++k)
      if (s.shape[k] != 0) return fail(kInvalidArgument, "shape[" + num(k) + "] past ndim is not 0");
    using u128 = unsigned __int128;
    const u128 kTooBig = u128(~uint64_t(0)) + 1;  // saturated: never equals a u64
    u128 expect = dtype_size(Dtype(s.dtype));
    for (uint32_t k = 0; k < s.ndim; ++k) expect = std::min<u128>(expect * s.shape[k], kTooBig);
    if (expect != s.src_bytes) return fail(kInvalidArgument, "src bytes " + num(s.src_bytes) + " != shape * dtype size");
    const uint64_t bound = frame_bound(s.src_bytes, s.ndim);
    if (s.dst_bytes < bound) return fail(kInvalidArgument, "dst bytes below the frame bound " + num(bound));
  }
  r.kind = src->kind;
  r.device = src->kind == RegionKind::Device ? src->device : -1;
  r.src = src->base + s.src_off;
  r.dst = dst->base + s.dst_off;
  r.src_id = s.src_id;
  r.dst_id = s.dst_id;
  const int32_t dst_device = dst->kind == RegionKind::Device ? dst->device : -1;
  if (dst->kind != src->kind || dst_device != r.device)
    return fail(kInvalidArgument, "src and dst are on different devices");
  if (overlap(r.src, s.src_bytes, r.dst, s.dst_bytes)) return fail(kInvalidArgument, "src and dst overlap");
  if (!dst->writable) return fail(kInvalidArgument, "dst region " + num(s.dst_id) + " is read-only");
  *out = r;
  return {};
}

Check check_batch(const Sqe* sqes, const Resolved* res, size_t n, const RingCaps& caps, size_t* bad) {
  *bad = 0;
  if (n == 0) return {};
  const uint8_t op = sqes[0].op;
  bool ordered = false;  // WAIT or SIGNAL somewhere in the batch
  for (size_t i = 0; i < n; ++i) {
    *bad = i;
    if (sqes[i].op != op) return fail(kInvalidArgument, "a batch mixes ops (SQE " + num(i) + ")");
    if ((sqes[i].flags & kWait) && i != 0) return fail(kInvalidArgument, "WAIT on SQE " + num(i) + ", not the first");
    if ((sqes[i].flags & kSignal) && i + 1 != n) return fail(kInvalidArgument, "SIGNAL on SQE " + num(i) + ", not the last");
    ordered = ordered || (sqes[i].flags & (kWait | kSignal));
    if (op == kNop) continue;
    if (!same_space(res[i], res[0])) return fail(kInvalidArgument, "a batch mixes devices (SQE " + num(i) + ")");
  }
  *bad = 0;
  if (op != kNop && res[0].kind == RegionKind::Device && res[0].device != caps.device) {
    return fail(kInvalidArgument, caps.device < 0 ? std::string("GPU regions on a ring without a device")
                                                  : "device " + num(uint64_t(res[0].device)) + " is not the ring's");
  }
  if (ordered) {
    if (caps.device < 0) return fail(kInvalidArgument, "WAIT/SIGNAL need a GPU ring");
    if (op != kNop && res[0].kind == RegionKind::Host) return fail(kInvalidArgument, "WAIT/SIGNAL on a CPU batch");
  }
  if (op == kNop || n < 2) return {};
  // No two destinations of the batch overlap: sorted by address, each starts at or after the previous one's end.
  std::vector<size_t> order;
  order.reserve(n);
  for (size_t i = 0; i < n; ++i)
    if (sqes[i].dst_bytes) order.push_back(i);
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return res[a].dst < res[b].dst; });
  for (size_t k = 1; k < order.size(); ++k) {
    const size_t a = order[k - 1], b = order[k];
    if (overlap(res[a].dst, sqes[a].dst_bytes, res[b].dst, sqes[b].dst_bytes)) {
      *bad = std::max(a, b);
      return fail(kInvalidArgument, "dst of SQE " + num(std::max(a, b)) + " overlaps SQE " + num(std::min(a, b)) + "'s");
    }
  }
  return {};
}

void encode_cqe(const Cqe& c, uint8_t* p) {
  std::memset(p, 0, kCqeBytes);
  store_le64(p + 0, c.user_data);
  store_le32(p + 8, uint32_t(c.status));
  p[12] = c.codec;
  store_le64(p + 16, c.result);
  const size_t n = std::min(c.message.size(), kMessageBytes);
  for (size_t i = 0; i < n; ++i) {
    const unsigned char ch = static_cast<unsigned char>(c.message[i]);
    p[24 + i] = ch >= 0x20 && ch < 0x7f ? ch : '?';
  }
}

Cqe decode_cqe(const uint8_t* p) {
  Cqe c;
  c.user_data = load_le64(p + 0);
  c.status = int32_t(load_le32(p + 8));
  c.codec = p[12];
  c.result = load_le64(p + 16);
  size_t n = 0;
  while (n < kMessageBytes && p[24 + n] != 0) ++n;
  c.message.assign(reinterpret_cast<const char*>(p + 24), n);
  return c;
}

}  // namespace tzip::ring
