// libFuzzer target: the submission ring's SQE parser and validator (cuda/src/addon/ring_sqe.h), what the ring thread
// (cuda/src/addon/ring.cpp) runs on every SQE a client writes, on hostile bytes.
//
// Input: 16 bytes describing a table of 4 regions (ids 1-4: sizes up to 64 KiB, generations, released / faulted /
// read-only / device bits), then SQEs of 128 bytes each (at most 64), grouped into batches by their LINK flags as
// the thread groups them. Host regions are separate heap blocks of exactly their size, so ASan reports any byte read
// or written outside them.
// Properties: copy_sqe of the slot and decode_sqe agree, and encode_sqe(decode_sqe(b)) == b; every SQE that passes
// check_sqe names registered, live regions of its generation, its ranges lie inside them, a compress SQE's shape
// matches its src bytes and its dst holds the frame bound, src and dst do not overlap; every batch that passes
// check_batch has one op, one device, WAIT only first, SIGNAL only last, no two dsts overlapping; and the CPU codec
// run on a passing batch's ranges (as run_cpu does) stays inside them (ASan). CQEs encode to 64 bytes with reserved
// bytes 0 and an ASCII message of at most 40 bytes.
#include <algorithm>
#include <cstring>
#include <memory>

#include "fuzz_support.h"
#include "addon/ring_sqe.h"

using namespace tzip_fuzz;
namespace ring = tzip::ring;

namespace {

constexpr size_t kRegions = 4;
constexpr size_t kTableBytes = 16;
constexpr size_t kMaxSqes = 64;

struct Table {
  ring::RegionTable t{kRegions + 1};
  std::vector<std::unique_ptr<uint8_t[]>> blocks;
};

Table make_table(const uint8_t* d) {
  Table tb;
  for (size_t r = 0; r < kRegions; ++r) {
    ring::Region& g = tb.t[r + 1];
    const uint32_t bytes = (uint32_t(d[2 * r]) | uint32_t(d[2 * r + 1]) << 8);
    const uint8_t bits = d[12 + r];
    g.registered = !(bits & 1);
    g.released = bits & 2;
    g.faulted = bits & 4;
    g.writable = !(bits & 8);
    g.generation = 1 + d[8 + r] % 4;
    g.bytes = bytes;
    if (bits & 16) {
      g.kind = ring::RegionKind::Device;
      g.device = (bits >> 5) & 1;
      g.base = 0x100000000ull * (r + 1);  // never dereferenced: only checked
    } else {
      tb.blocks.emplace_back(new uint8_t[bytes ? bytes : 1]);
      std::memset(tb.blocks.back().get(), int(r * 37), bytes);
      g.base = reinterpret_cast<uintptr_t>(tb.blocks.back().get());
    }
  }
  return tb;
}

bool inside(uint64_t addr, uint64_t len, const ring::Region& g) {
  return addr >= g.base && addr - g.base <= g.bytes && len <= g.bytes - (addr - g.base);
}

void check_one(const ring::Sqe& s, const ring::Check& c, const ring::Resolved& r, const ring::RegionTable& t) {
  FUZZ_CHECK(c.message.size() <= 200, "messages are short");
  if (!c.ok()) {
    FUZZ_CHECK(c.status == ring::kInvalidArgument || c.status == ring::kHandle, "a failed check is INVALID or HANDLE");
    return;
  }
  FUZZ_CHECK(s.op <= ring::kDecompress && !(s.flags & ~ring::kKnownFlags) && s.reserved == 0 && s.stream <= 4,
             "a passing SQE has a known op, flags, stream tag and reserved byte 0");
  if (s.op == ring::kNop) return;
  for (const auto& [id, gen, addr, len] : {std::tuple{s.src_id, s.src_gen, r.src, s.src_bytes},
                                           std::tuple{s.dst_id, s.dst_gen, r.dst, s.dst_bytes}}) {
    FUZZ_CHECK(id >= 1 && id < t.size(), "a passing SQE names a region of the table");
    const ring::Region& g = t[id];
    FUZZ_CHECK(g.registered && !g.released && !g.faulted && g.generation == gen, "a live region of its generation");
    FUZZ_CHECK(inside(addr, len, g), "its range lies inside the region");
  }
  FUZZ_CHECK(t[s.dst_id].writable, "a dst region is writable");
  FUZZ_CHECK(r.kind == t[s.src_id].kind && t[s.src_id].kind == t[s.dst_id].kind, "src and dst of one kind");
  if (s.src_bytes && s.dst_bytes) FUZZ_CHECK(r.src + s.src_bytes <= r.dst || r.dst + s.dst_bytes <= r.src, "src and dst apart");
  if (s.op == ring::kCompress) {
    FUZZ_CHECK(s.dtype < kNumDtypes && s.ndim <= 6 && (s.codec <= 3 || s.codec == 255), "known dtype, ndim, codec");
    unsigned __int128 p = dtype_size(Dtype(s.dtype));
    for (uint32_t k = 0; k < s.ndim; ++k) p *= s.shape[k];  // unsigned: may wrap only when a later entry is 0
    FUZZ_CHECK(p == s.src_bytes, "shape times dtype size is the src bytes");
    for (uint32_t k = s.ndim; k < 6; ++k) FUZZ_CHECK(s.shape[k] == 0, "shape entries past ndim are 0");
    FUZZ_CHECK(s.dst_bytes >= ring::frame_bound(s.src_bytes, s.ndim), "dst holds the frame bound");
  }
}

/// What run_cpu does with a passing host batch: ASan reports a byte outside the regions.
void run_cpu(const ring::Sqe& s, const ring::Resolved& r) {
  const auto* src = reinterpret_cast<const uint8_t*>(static_cast<uintptr_t>(r.src));
  auto* dst = reinterpret_cast<uint8_t*>(static_cast<uintptr_t>(r.dst));
  try {
    if (s.op == ring::kCompress) {
      EncodeOptions eo;
      eo.codec = s.codec == ring::kCodecAuto ? resolve_auto(src, s.src_bytes, Dtype(s.dtype), kDefaultChunkBytes, 1)
                                             : Codec(s.codec);
      const std::vector<uint64_t> shape(s.shape, s.shape + s.ndim);
      const uint64_t n = encode_frame(src, s.src_bytes, Dtype(s.dtype), shape, eo, dst);
      FUZZ_CHECK(n <= s.dst_bytes, "the frame fits its dst range");
      const uint8_t known = ring::known_frame_codec(uint8_t(eo.codec), s.dtype, s.src_bytes);
      FUZZ_CHECK(known == dst[kOffCodec], "the CQE's codec is the frame's");
    } else if (s.op == ring::kDecompress) {
      decode_frame(src, s.src_bytes, dst, s.dst_bytes, (s.flags & ring::kVerify) != 0, 1);
    }
  } catch (const Error&) {
  }
}

void check_cqe(const uint8_t* data, size_t size) {
  ring::Cqe c;
  c.user_data = size;
  c.status = int32_t(size % 50);
  c.codec = uint8_t(size);
  c.result = ~uint64_t(size);
  c.message.assign(reinterpret_cast<const char*>(data), std::min<size_t>(size, 60));
  uint8_t raw[ring::kCqeBytes + 8];
  std::memset(raw, 0xee, sizeof raw);
  ring::encode_cqe(c, raw);
  FUZZ_CHECK(raw[ring::kCqeBytes] == 0xee, "encode_cqe writes 64 bytes");
  FUZZ_CHECK(raw[13] == 0 && raw[14] == 0 && raw[15] == 0, "CQE reserved bytes are 0");
  const ring::Cqe d = ring::decode_cqe(raw);
  FUZZ_CHECK(d.user_data == c.user_data && d.status == c.status && d.codec == c.codec && d.result == c.result,
             "CQE fields round-trip");
  FUZZ_CHECK(d.message.size() <= ring::kMessageBytes, "at most 40 message bytes");
  for (const char ch : d.message) FUZZ_CHECK(ch >= 0x20 && ch < 0x7f, "the message is printable ASCII");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  check_cqe(data, size);
  if (size < kTableBytes) return 0;
  Table tb = make_table(data);
  const size_t n = std::min((size - kTableBytes) / ring::kSqeBytes, kMaxSqes);
  std::vector<ring::Sqe> sqes;
  for (size_t i = 0; i < n; ++i) {
    alignas(8) uint8_t slot[ring::kSqeBytes];
    std::memcpy(slot, data + kTableBytes + i * ring::kSqeBytes, sizeof slot);
    const ring::Sqe s = ring::copy_sqe(slot);
    const ring::Sqe d = ring::decode_sqe(slot);
    FUZZ_CHECK(std::memcmp(&s.user_data, &d.user_data, 8) == 0 && s.src_off == d.src_off && s.shape[5] == d.shape[5] &&
                   s.signal_value == d.signal_value && s.flags == d.flags,
               "copy_sqe and decode_sqe agree");
    uint8_t back[ring::kSqeBytes];
    ring::encode_sqe(s, back);
    FUZZ_CHECK(std::memcmp(back, slot, sizeof slot) == 0, "encode_sqe(decode_sqe(b)) == b");
    sqes.push_back(s);
  }
  const ring::RingCaps caps{int32_t(size % 3) - 1};
  // Batches as the thread forms them: a run of LINKed SQEs and the first one after it without LINK.
  for (size_t begin = 0; begin < sqes.size();) {
    size_t end = begin;
    while (end < sqes.size() && (sqes[end].flags & ring::kLink)) ++end;
    if (end == sqes.size()) break;  // its last SQE is not there: the thread waits for it
    ++end;
    const size_t len = end - begin;
    std::vector<ring::Resolved> res(len);
    bool ok = true;
    for (size_t i = 0; i < len; ++i) {
      const ring::Check c = ring::check_sqe(sqes[begin + i], tb.t, &res[i]);
      check_one(sqes[begin + i], c, res[i], tb.t);
      ok = ok && c.ok();
    }
    if (ok) {
      size_t bad = 0;
      const ring::Check c = ring::check_batch(sqes.data() + begin, res.data(), len, caps, &bad);
      FUZZ_CHECK(bad < len, "the failing SQE is one of the batch");
      if (c.ok()) {
        const ring::Sqe* b = sqes.data() + begin;
        bool device = false;
        for (size_t i = 0; i < len; ++i) {
          FUZZ_CHECK(b[i].op == b[0].op, "one op per batch");
          FUZZ_CHECK(!(b[i].flags & ring::kWait) || i == 0, "WAIT only on the first");
          FUZZ_CHECK(!(b[i].flags & ring::kSignal) || i + 1 == len, "SIGNAL only on the last");
          if (b[0].op == ring::kNop) continue;
          FUZZ_CHECK(res[i].kind == res[0].kind && res[i].device == res[0].device, "one device per batch");
          device = res[i].kind == ring::RegionKind::Device;
          if (device) FUZZ_CHECK(res[i].device == caps.device, "device batches on the ring's device");
          for (size_t j = 0; j < i; ++j) {
            if (!b[i].dst_bytes || !b[j].dst_bytes) continue;
            FUZZ_CHECK(res[i].dst + b[i].dst_bytes <= res[j].dst || res[j].dst + b[j].dst_bytes <= res[i].dst,
                       "no two dsts of a batch overlap");
          }
        }
        const bool ordered = std::any_of(b, b + len, [](const ring::Sqe& s) { return s.flags & (ring::kWait | ring::kSignal); });
        if (ordered) FUZZ_CHECK(caps.device >= 0 && (b[0].op == ring::kNop || device), "WAIT/SIGNAL only on GPU rings' GPU batches");
        if (!device && b[0].op != ring::kNop)
          for (size_t i = 0; i < len; ++i) run_cpu(b[i], res[i]);
      }
    }
    begin = end;
  }
  return 0;
}
