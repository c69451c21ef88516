/* tzip's in-process library (libtzip.so): the codec of cuda/src for a process that is not the daemon, through a plain
 * C ABI. No Node, no ZeroMQ: an inference server loads it with ctypes (python-bridge/tzip/_native.py) and decodes
 * weights on its own CUDA streams (DESIGN.md, "Inference decodes in-process"). Same kernels, same bytes as the daemon:
 * every frame is one of docs/format.md, whoever wrote it.
 *
 * Every function returns 0 on success or a code of the one error table (src/errors.json: 1 TZIP_INVALID_ARGUMENT,
 * 2 TZIP_CORRUPT, 3 TZIP_TRUNCATED, 4 TZIP_CHECKSUM, 5 TZIP_UNSUPPORTED, 6 TZIP_CUDA, 7 TZIP_OUT_OF_MEMORY,
 * 8 TZIP_INTERNAL); tzip_last_error() then holds the message, per calling thread. No function throws or aborts.
 *
 * Pointers named d_* and the GPU calls' tensors and frames are device memory of one device; `stream` is a
 * cudaStream_t of that device (0: the legacy default stream), for example torch.cuda.current_stream().cuda_stream.
 * GPU calls are asynchronous: they return once the work is queued on `stream`. */
#ifndef TZIP_CAPI_H_
#define TZIP_CAPI_H_

#include <stddef.h>
#include <stdint.h>

#if defined(__GNUC__)
#define TZIP_API __attribute__((visibility("default")))
#else
#define TZIP_API
#endif

#ifdef __cplusplus
extern "C" {
#endif

/** The ABI's version: 1. A caller built for another version must not use the library. */
TZIP_API int tzip_abi_version(void);

/** The frame format version the encoders write (docs/format.md). */
TZIP_API int tzip_format_version(void);

/** The message of the calling thread's last failed call ("" before any). Valid until its next call. */
TZIP_API const char* tzip_last_error(void);

/** Exact upper bound of a frame's size in bytes for `nbytes` bytes of input with `ndim` dimensions and chunks of
 * `chunk_bytes` (docs/format.md, "Bound"); 0 when ndim or chunk_bytes is out of range. */
TZIP_API uint64_t tzip_max_frame_bytes(uint64_t nbytes, uint32_t ndim, uint32_t chunk_bytes);

/** Number of CUDA devices the library sees (0 without a driver or GPU; never an error). */
TZIP_API int tzip_gpu_count(void);

/* ---------------------------------------------------------------------------------------------- CPU (host memory) */

/** Encodes one tensor of `nbytes` bytes at `data` (dtype a tzip dtype code, docs/format.md "Dtypes"; shape `ndim`
 * u64s whose product times the dtype size is nbytes) with `codec` (0 raw, 1 fast, 2 max, 3 bytes, 255 auto) into
 * `out`, which has room for `out_capacity` bytes (at least tzip_max_frame_bytes). `threads` workers (0: one).
 * *frame_bytes receives the frame's size. */
TZIP_API int tzip_cpu_encode(const void* data, uint64_t nbytes, uint8_t dtype, uint8_t codec, uint32_t ndim,
                             const uint64_t* shape, uint32_t chunk_bytes, uint32_t threads, void* out,
                             uint64_t out_capacity, uint64_t* frame_bytes);

/** Decodes the frame of exactly `frame_bytes` bytes at `frame` into `out` (exactly the frame's nbytes:
 * `out_bytes`). Verifies every chunk digest when `verify` is nonzero (the header digest and, after decoding, the
 * checksum of the original bytes always). Never writes outside out[0, out_bytes). */
TZIP_API int tzip_cpu_decode(const void* frame, uint64_t frame_bytes, void* out, uint64_t out_bytes, int verify,
                             uint32_t threads);

/** Parses and checks a frame's header (fixed header, shape, chunk table, header digest) from its first `avail` bytes:
 * the checks every decoder makes before it writes anything. On success *dtype, *codec, *ndim, shape[0..ndim)
 * (room for 32), *nbytes (original bytes) and *frame_bytes (the whole frame's size) are set; any may be NULL. */
TZIP_API int tzip_frame_info(const void* frame, uint64_t avail, uint8_t* dtype, uint8_t* codec, uint32_t* ndim,
                             uint64_t* shape, uint64_t* nbytes, uint64_t* frame_bytes);

/* ---------------------------------------------------------------------------------------------- GPU (device memory) */

/** Encodes `count` tensors in one launch sequence on at most `sm_budget` SMs (<= 0: every SM). Tensor i: data[i],
 * nbytes[i], dtypes[i], codecs[i] (as tzip_cpu_encode), shape shapes[i][0..ndims[i]) (host memory), written to
 * frames[i] (room for tzip_max_frame_bytes). d_frame_bytes: device array of `count` u64 that receives each frame's
 * size when the stream gets there. Byte for byte what the CPU encoder writes. */
TZIP_API int tzip_gpu_encode(size_t count, const void* const* data, const uint64_t* nbytes, const uint8_t* dtypes,
                             const uint8_t* codecs, const uint32_t* ndims, const uint64_t* const* shapes,
                             void* const* frames, uint64_t* d_frame_bytes, uint32_t chunk_bytes, int sm_budget,
                             void* stream);

/** Decodes `count` frames in one launch sequence: frames[i] (exactly frame_bytes[i] bytes) into outs[i] (exactly the
 * frame's nbytes, out_bytes[i]). d_errors: device array of `count` int32 that receives, per frame, 0 or the error code
 * the CPU decoder would give for the same bytes; a frame with an error may leave its output partly written, never
 * anything outside it. `verify` nonzero checks every chunk digest (the header digest and checksum always). The return
 * value covers what the host checks before queuing (null pointers, mixed devices, CUDA failures). */
TZIP_API int tzip_gpu_decode(size_t count, const void* const* frames, const uint64_t* frame_bytes, void* const* outs,
                             const uint64_t* out_bytes, int32_t* d_errors, int sm_budget, int verify, void* stream);

/** A prepared decode (tzip::gpu::DecodePlan): the decode of fixed frames into fixed outputs, described once in device
 * memory of its own, then run many times with no allocation, no host-to-device copy and no pointer look-up; a run can
 * be captured in a CUDA graph. Inference decodes each block's weights before every forward through one. */
typedef struct tzip_decode_plan tzip_decode_plan;

/** Prepares the decode tzip_gpu_decode would queue for the same arguments (the pointers must stay valid while the
 * plan lives). Synchronous. *plan receives the plan (free it with tzip_gpu_decode_plan_free). */
TZIP_API int tzip_gpu_decode_plan(size_t count, const void* const* frames, const uint64_t* frame_bytes,
                                  void* const* outs, const uint64_t* out_bytes, int32_t* d_errors, int sm_budget,
                                  int verify, tzip_decode_plan** plan);

/** Queues one run of `plan` on `stream`: the same bytes and per-frame error codes as tzip_gpu_decode. Runs of one plan
 * must not overlap (order them on one stream, or with events). */
TZIP_API int tzip_gpu_decode_run(tzip_decode_plan* plan, void* stream);

/** Frees a plan whose runs have finished. NULL is a no-op. */
TZIP_API void tzip_gpu_decode_plan_free(tzip_decode_plan* plan);

#ifdef __cplusplus
}
#endif

#endif /* TZIP_CAPI_H_ */
