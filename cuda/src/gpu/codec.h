// tzip on the GPU: batched encode and decode of whole frames with the frame format of docs/format.md, byte for byte
// what the CPU backend (cuda/src/core/frame.cpp, chunk_codec.cpp) writes and reads. Plain C++ header: no CUDA headers,
// streams are passed as void* (a cudaStream_t).
//
// Everything runs on the device, in one launch sequence per batch: "auto" codec resolution, per-chunk digests,
// histograms, mode decisions, coding, the scan of chunk sizes (a decoupled look-back inside the coding kernel),
// compaction (chunks are written straight to their final offsets), chunk table, checksum and header digest. Frame sizes
// land in a device array the caller can copy back asynchronously. Decode parses and validates every frame on the
// device and reports one error code per frame in a device array; it never writes outside the output buffers.
//
// SM budget: every kernel is a persistent grid of sm_budget * blocks_per_sm blocks, where blocks_per_sm comes from
// cudaOccupancyMaxActiveBlocksPerMultiprocessor and every kernel is built so that it is 1 (a block is sized to fill one
// SM: up to 1024 threads, and, where registers alone would not prevent it, enough shared memory that a second block
// of the same kernel cannot share the SM). Blocks loop over the work (chunks, tensors) with an atomic ticket or a grid
// stride, so at no time are more than sm_budget SMs running tzip work, whatever the size of the batch. The hardware may
// place other kernels' blocks beside ours; for a hard partition of the GPU use MPS or green contexts on top of this.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

#include "tzip/generated/constants.h"

namespace tzip {
namespace gpu {

/// Error codes, per frame (decode) or per call: the native codes of the one error table (src/errors.json) with its
/// numeric values, which are those of tzip::ErrorCode (cuda/src/core/errors.h; the addon static_asserts that they agree and
/// test/error-codes.test.ts checks this enum against the table). 0 = success. Values are stable: never renumber.
// enum ErrorCode (kOk = 0, then the native codes the GPU codec raises) and status_code_name: generated/constants.h.
const char* error_code_name(int32_t code);

/// Codec value meaning "auto" (resolved per tensor on the device with the integer rule of tzip::resolve_auto).
using tzip::kCodecAuto;

/// Outcome of a host call. Device-side per-frame outcomes of decode are in the caller's error array.
struct Status {
  int32_t code = kOk;
  std::string message;
  bool ok() const { return code == kOk; }
};

// ------------------------------------------------------------------------------------------------ encode

struct EncodeItem {
  const void* data = nullptr;     // device pointer to the tensor's bytes (any alignment; 16-byte aligned is fastest)
  uint64_t nbytes = 0;            // must equal prod(shape) * dtype size
  uint8_t dtype = 0;              // tzip::Dtype
  uint8_t codec = kCodecAuto;     // tzip::Codec (0 raw, 1 fast, 2 max, 3 bytes) or kCodecAuto; fast/max on a
                                  // non-float dtype mean bytes, as on the CPU
  uint32_t ndim = 0;
  const uint64_t* shape = nullptr;  // host pointer, ndim entries
  void* frame = nullptr;          // device pointer, room for max_frame_bytes(nbytes, ndim, chunk_bytes) bytes
};

struct EncodeOptions {
  uint32_t chunk_bytes = 65536;  // multiple of 256 in [4096, 65536]
  int sm_budget = kDefaultSmBudget;            // SMs the launch sequence may occupy at a time (<= 0: all SMs of the device)
  void* stream = nullptr;        // cudaStream_t on the device that owns the pointers (nullptr: legacy default stream)
  int device = -1;               // >= 0: the caller has checked that every pointer of the call (the items' and
                                 // d_frame_bytes) is device memory of this device, as the addon does for each range
                                 // (addon/device.h, check_device_range): no cudaPointerGetAttributes per pointer (two
                                 // per tensor otherwise). -1: the pointers are looked up.
  bool graphs = false;           // a small call may be replayed from a CUDA graph kept for the stream (gpu/graph.h):
                                 // only for a caller that never queues a call on the stream before its previous one
                                 // has run, and that calls release_graphs(stream) before destroying the stream
};

/// Encodes a batch of tensors into one frame each. All pointers must be on the same device (that device is made
/// current for the call and the previous current device restored). Asynchronous with respect to the host: on return
/// the work is queued on opt.stream; frame sizes appear in d_frame_bytes[i] (device array of `count` u64) when the
/// stream reaches that point. Host-side validation errors (bad dtype, shape mismatch, null pointers...) are returned
/// before anything is queued.
Status encode(const EncodeItem* items, size_t count, const EncodeOptions& opt, uint64_t* d_frame_bytes);

// ------------------------------------------------------------------------------------------------ decode

struct DecodeItem {
  const void* frame = nullptr;  // device pointer to a frame (any alignment; 16-byte aligned is fastest)
  uint64_t frame_bytes = 0;     // bytes available at `frame`: must be exactly the frame's size, as on the CPU
  void* out = nullptr;          // device pointer, exactly the frame's nbytes
  uint64_t out_bytes = 0;
};

struct DecodeOptions {
  int sm_budget = kDefaultSmBudget;
  bool verify = true;  // check each chunk's digest (the header digest and the checksum are always checked)
  void* stream = nullptr;
  int device = -1;     // as EncodeOptions::device (the items' pointers and d_errors)
  bool graphs = false;  // as EncodeOptions::graphs
};

/// Decodes a batch of frames. Per frame, d_errors[i] (device array of `count` int32) receives kOk or the error code the
/// CPU decoder would raise for the same bytes (TZIP_CORRUPT, TZIP_TRUNCATED, TZIP_CHECKSUM, TZIP_UNSUPPORTED,
/// TZIP_INVALID_ARGUMENT when out_bytes differs from the frame's nbytes). A frame with an error may leave its output
/// partly written, never anything outside it. Asynchronous like encode.
Status decode(const DecodeItem* items, size_t count, const DecodeOptions& opt, int32_t* d_errors);

// ------------------------------------------------------------------------------------------------ decode plans

/// A decode of fixed frames into fixed outputs, prepared once and run many times (weights kept compressed for
/// inference: the same block decoded before every forward). Its descriptors live in device memory of its own, so a run
/// queues only two memsets and the kernels: no allocation, no host-to-device copy, no pointer look-up, and it can be
/// captured in a CUDA graph (torch.cuda.graph). Runs of one plan must not overlap (they share its workspace): order
/// them on one stream, or with events.
struct DecodePlan;

/// Prepares the decode of `items` (as decode(); their pointers must stay valid for the plan's life) reporting into
/// `d_errors`. Synchronous (allocates and copies); on success *plan owns device memory until decode_plan_destroy.
Status decode_plan_create(const DecodeItem* items, size_t count, const DecodeOptions& opt, int32_t* d_errors,
                          DecodePlan** plan);
/// Queues one run of the plan on `stream` (a cudaStream_t of the plan's device): what decode() would do with the same
/// items, byte for byte, errors included. From the second run outside a stream capture on, one launch of a CUDA graph
/// of the run (captured then); inside a capture, the operations themselves.
Status decode_plan_run(DecodePlan* plan, void* stream);
/// Frees the plan's device memory (its runs must have finished). Null is a no-op.
void decode_plan_destroy(DecodePlan* plan);

// ------------------------------------------------------------------------------------------------ tuning / tests

/// Knobs for benchmarks and tests; defaults are the production settings.
struct Tuning {
  bool use_tile_decode = true;  // vectorized decode path for float chunks without RANS streams
  bool defer_all = false;       // route every coded chunk through the general (fallback) decoder
  bool debug = false;           // decode: print (device printf) each rejected chunk and the check that failed
  bool bf16_kernel = true;      // decode: bf16 fast frames in a kernel of their own (24 warps per SM), bf16 max frames
                                // in another (32 warps per SM); off: in the fp32 fast and the max/bytes kernels
  bool ring_pairs = true;       // decode: the bf16 fast kernel fills its ring two tiles at a time (half the bulk copies)
  int decode_warps = 0;         // decode: warps per block of the class kernels, at most each class's own (0: its own);
                                // for measuring how the warp count trades per-SM speed against HBM traffic
  bool fast_encoder = true;     // encode: fast and raw tensors (16-byte aligned) in the fast encoder (encode_fast.cu);
                                // off: all in the general encode_kernel
};
void set_tuning(const Tuning& t);
Tuning get_tuning();

/// Launches a plain device-to-device copy with the same grid sizing as the codec kernels (sm_budget SMs), for
/// benchmarks: the bandwidth ceiling a kernel confined to those SMs can reach.
Status copy_bytes(void* dst, const void* src, uint64_t nbytes, int sm_budget, void* stream);


// ------------------------------------------------------------------------------------------------ internals
// Shared by the .cu files of this directory; not part of the API.
namespace detail {

/// Makes the device that owns `ptrs` current (all must be on one device; null pointers are skipped) and restores the
/// previously current device when destroyed.
class DeviceGuard {
 public:
  DeviceGuard() = default;
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;
  Status bind(const void* const* ptrs, size_t n);
  /// bind() for pointers the caller has checked are all on `device` (EncodeOptions::device): makes it current.
  Status bind_device(int device);
  int device() const { return dev_; }
  int sm_count() const { return sms_; }

 private:
  int prev_ = -1, dev_ = -1, sms_ = 0;
};

/// Grid of a persistent kernel: min(want, sm_budget * blocks_per_sm) blocks. blocks_per_sm is the occupancy of
/// `kernel` with `threads` threads and *dyn_smem bytes; when it is above 1, *dyn_smem is raised until it is 1, so that
/// the grid never spreads over more than sm_budget SMs. Also raises the kernel's dynamic shared memory limit. The
/// occupancy query is made once per (kernel, device, threads, *dyn_smem) and remembered; later calls only reset the
/// kernel's shared memory limit when another size was set for it in between (through this function: a process that
/// resets a device, cudaDeviceReset, and launches the codec on it again is not supported).
Status persistent_grid(const void* kernel, int threads, size_t* dyn_smem, int sm_budget, int sm_count,
                       uint64_t want, int* grid);

/// Copies host bytes to device memory on `stream` through a pinned staging buffer (so the call never waits for the
/// stream); the host bytes may be reused as soon as this returns.
Status upload(void* d_dst, const void* h_src, size_t bytes, void* stream);

/// Stream-ordered device allocation and release of scratch memory: scratch_alloc / scratch_free of gpu/scratch.h
/// (cudaMallocAsync / cudaFreeAsync, blocks cached per stream for streams registered with keep_scratch).
Status alloc_async(void** p, size_t bytes, void* stream);
void free_async(void* p, void* stream);
Status memset_async(void* p, int value, size_t bytes, void* stream);
Status check_launch(const char* what);
/// The Status of a CUDA runtime error code (a cudaError_t): kOutOfMemory for cudaErrorMemoryAllocation, else
/// kCudaError with "what: <CUDA's text>"; ok for cudaSuccess.
Status cuda_status(int cuda_error, const char* what);

}  // namespace detail

}  // namespace gpu
}  // namespace tzip
