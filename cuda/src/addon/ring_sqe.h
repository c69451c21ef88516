// The submission ring's binary records and their checks (docs/ring.md): the ring file's layout, submission queue
// entries (SQE, 128 bytes) copied out of shared memory and validated against a snapshot of the ring's regions, the
// batch rules, and completion queue entries (CQE, 64 bytes). Plain C++: no N-API, no CUDA, so that the fuzz target
// cuda/test/fuzz_ring.cpp drives exactly what the ring thread (cuda/src/addon/ring.cpp) runs.
//
// Nothing here trusts a byte of the ring file: an SQE is copied into local memory first (the client may rewrite it
// while it is read) and only the copy is looked at; every offset and size is checked with overflow-safe arithmetic
// against the region it names before any address is formed.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "core/errors.h"
#include "tzip/generated/constants.h"  // tzip::ring: the ring file's layout, an SQE's ops and flags

namespace tzip::ring {

// ---- the ring file (docs/ring.md, "The ring file") -------------------------------------------------------------
// Its sizes, the header's word offsets, the state word's values (kHeaderBytes, kOffProduced, State, ...) and an SQE's
// ops and flags are in generated/constants.h (from src/errors.json, "ring"), shared with the Python client.

/// Whether `entries` is a power of two in [kMinEntries, kMaxEntries].
constexpr bool valid_entries(uint64_t entries) {
  return entries >= kMinEntries && entries <= kMaxEntries && (entries & (entries - 1)) == 0;
}
/// Bytes of a ring file of `entries` entries: 4096 + entries * 128 + entries * 64.
constexpr uint64_t ring_bytes(uint64_t entries) { return kHeaderBytes + entries * kSqeBytes + entries * kCqeBytes; }
/// Offset of SQ entry `i` (free-running index) and of CQ entry `i`.
constexpr uint64_t sqe_offset(uint32_t entries, uint32_t i) { return kHeaderBytes + uint64_t(i & (entries - 1)) * kSqeBytes; }
constexpr uint64_t cqe_offset(uint32_t entries, uint32_t i) {
  return kHeaderBytes + uint64_t(entries) * kSqeBytes + uint64_t(i & (entries - 1)) * kCqeBytes;
}

// ---- status codes of a CQE: numeric values of src/errors.json (test/ring-native.test.ts compares them); the native
// ones are tzip::ErrorCode's, the protocol ones tzip::ProtocolErrorCode's (both generated/constants.h) ------------
enum Status : int32_t {
  kOk = 0,
  kInvalidArgument = int32_t(ErrorCode::InvalidArgument),
  kCorrupt = int32_t(ErrorCode::Corrupt),
  kTruncated = int32_t(ErrorCode::Truncated),
  kChecksum = int32_t(ErrorCode::Checksum),
  kUnsupported = int32_t(ErrorCode::Unsupported),
  kCuda = int32_t(ErrorCode::Cuda),
  kOutOfMemory = int32_t(ErrorCode::OutOfMemory),
  kInternal = int32_t(ErrorCode::Internal),
  kSession = int32_t(ProtocolErrorCode::Session),  // TZIP_SESSION: the ring closed while a batch waited for its inputs
  kHandle = int32_t(ProtocolErrorCode::Handle),    // TZIP_HANDLE: a region not registered, of another generation, released or faulted
  kLimit = int32_t(ProtocolErrorCode::Limit),      // TZIP_LIMIT: the batch would take the session's tensor bytes in flight above its limit
};

// ---- SQE (docs/ring.md, "Submission queue entry"; Op, Flag, kKnownFlags and kMaxNdim: generated/constants.h) -----
using tzip::kCodecAuto;     // 255 (generated/constants.h)
using tzip::kMaxStreamTag;  // 4: 0 other, 1 gradients, 2 optimizer, 3 checkpoint, 4 sendrecv (generated/constants.h)

/// One SQE as the thread's own copy (decoded from little-endian bytes).
struct Sqe {
  uint64_t user_data = 0;
  uint8_t op = 0, flags = 0, codec = 0, dtype = 0, ndim = 0, sm_budget = 0, stream = 0, reserved = 0;
  uint32_t src_id = 0, src_gen = 0;
  uint64_t src_off = 0, src_bytes = 0;
  uint32_t dst_id = 0, dst_gen = 0;
  uint64_t dst_off = 0, dst_bytes = 0;
  uint64_t shape[kMaxNdim] = {0, 0, 0, 0, 0, 0};
  uint64_t wait_value = 0, signal_value = 0;
};

/// Copies the 128 bytes of an SQE slot of shared memory into `raw` with relaxed atomic 8-byte loads (the slot is
/// 8-byte aligned; the client may be writing it at the same time: the copy may be torn, never undefined behaviour),
/// then decodes the copy. Only the result is looked at afterwards.
Sqe copy_sqe(const void* slot);
/// Decodes 128 bytes (little-endian) into an Sqe; encode_sqe is its inverse (tests, fuzzing).
Sqe decode_sqe(const uint8_t* raw);
void encode_sqe(const Sqe& s, uint8_t* raw);

// ---- regions ---------------------------------------------------------------------------------------------------
enum class RegionKind : uint8_t { Host = 0, Device = 1 };

/// One region of a ring, as the validator sees it: a snapshot of the ring's table entry.
struct Region {
  bool registered = false;  // the id is in use (registered and not yet removed)
  bool released = false;    // remove() was asked: SQEs naming it fail TZIP_HANDLE
  bool faulted = false;     // host: its mapping took a SIGBUS (the file shrank): TZIP_HANDLE
  bool writable = true;     // host: its pages may be written (a read-only mapping cannot be a destination)
  uint32_t generation = 0;
  RegionKind kind = RegionKind::Host;
  int32_t device = -1;      // device regions: the CUDA ordinal
  uint64_t base = 0;        // address of the region's first byte in this process
  uint64_t bytes = 0;
};

/// The validator's view of a ring's regions: entry `id` (id 0 is never registered).
using RegionTable = std::vector<Region>;

// ---- checks -----------------------------------------------------------------------------------------------------
/// The outcome of a check: status 0 or an error code, and a short ASCII message (at most 40 bytes go to the CQE).
struct Check {
  int32_t status = kOk;
  std::string message;
  bool ok() const { return status == kOk; }
};

/// What the ring may serve: `device` is the ring's GPU ordinal (-1: CPU only; WAIT and SIGNAL need a GPU ring).
struct RingCaps {
  int32_t device = -1;
};

/// A validated SQE: its resolved addresses (inside its regions) and the frame bound it was checked against.
struct Resolved {
  RegionKind kind = RegionKind::Host;
  int32_t device = -1;
  uint64_t src = 0, dst = 0;  // addresses: region base + offset
  uint32_t src_id = 0, dst_id = 0;
};

/// The checks of one SQE that need no other SQE, in the contract's order: op, flags, reserved byte, stream tag;
/// region ids, generations, release and faults (TZIP_HANDLE); bounds without overflow; compress: codec, dtype, ndim,
/// shape entries past ndim 0, shape product times the dtype size = src bytes, dst bytes >= the frame bound; src and
/// dst not overlapping; a destination region writable. Fills `out` when it passes. A nop passes on the first four
/// checks alone (it names no region).
Check check_sqe(const Sqe& s, const RegionTable& regions, Resolved* out);

/// Checks of a whole batch (`n` SQEs, each already passing check_sqe and resolved into `res`): the same op, regions of
/// one kind and device (and a device batch on the ring's device), WAIT only on the first, SIGNAL only on the last,
/// WAIT/SIGNAL only where the ring has a device and the batch is not a host one, no two destinations of
/// the batch overlapping. Returns the first failure and the index of the SQE it names in *bad.
Check check_batch(const Sqe* sqes, const Resolved* res, size_t n, const RingCaps& caps, size_t* bad);

/// The codec a compress SQE's frame records, when known before encoding: fast/max on a non-float dtype are bytes;
/// auto is bytes on a non-float dtype, fast on an empty float tensor; else kCodecAuto (the data decides).
uint8_t known_frame_codec(uint8_t codec, uint8_t dtype, uint64_t nbytes);

/// Frame bound of a compress SQE: max_frame_bytes(src bytes, ndim, default chunk).
uint64_t frame_bound(uint64_t nbytes, uint32_t ndim);

// ---- CQE (docs/ring.md, "Completion queue entry") -------------------------------------------------------------
constexpr size_t kMessageBytes = 40;

struct Cqe {
  uint64_t user_data = 0;
  int32_t status = kOk;
  uint8_t codec = 0;
  uint64_t result = 0;
  std::string message;  // ASCII; truncated to 40 bytes, non-printable bytes as '?'
};

/// The 64 bytes of a CQE (little-endian; reserved bytes 0, message NUL-padded).
void encode_cqe(const Cqe& c, uint8_t* raw);
Cqe decode_cqe(const uint8_t* raw);

}  // namespace tzip::ring
