// Scratch memory of the codec's launch sequences: descriptor arrays, tickets, chunk offsets, per-item results. Plain
// C++ header (streams are void*, as in codec.h).
//
// Every scratch block is stream-ordered memory (cudaMallocAsync / cudaFreeAsync). On a stream registered with
// keep_scratch, a block given back is not freed but kept for the next scratch_alloc on the same stream: work queued on
// one stream runs in order, so the next call's kernels cannot start before the previous call's kernels that used the
// block have finished, and the reuse needs no wait on the host. This removes what a fresh stream-ordered allocation
// costs once the memory pool has handed its memory back to the driver (the default pool does that at every stream,
// event or device synchronisation, i.e. after every call the addon waits for): mapping new physical memory per call.
//
// Thread safety: every function may be called from any thread. Blocks are cached per stream, so two streams (or two
// threads each with its own stream) never share a block. One stream used from several threads at once must have its
// calls serialised by the caller (the addon holds a per-device mutex while it queues a call on its stream).
#pragma once
#include <cstddef>

#include "gpu/codec.h"

namespace tzip {
namespace gpu {

/// Caches the scratch blocks of the calls on `stream` (a stream the caller keeps alive until release_scratch): the
/// blocks grow on demand (a request no cached block fits allocates a new one, a power of two of at least 64 KiB) and at
/// most 8 idle blocks are kept (the smallest is freed first). Blocks above 256 MiB are never kept. Idempotent.
void keep_scratch(void* stream);

/// Frees the idle cached blocks of `stream` (cudaFreeAsync on that stream, so after the work queued on it) and stops
/// caching for it: blocks handed out at this point are freed when they are given back. Call it before destroying a
/// stream passed to keep_scratch, with that stream's device current. No effect on a stream that is not cached.
void release_scratch(void* stream);

/// Scratch memory of at least max(bytes, 16) bytes for work queued on `stream` (the current device's memory):
/// a cached block of `stream` when one fits, else cudaMallocAsync. Usable by work queued on `stream` from now on.
/// Returns a kCudaError status when the allocation fails (*p is then nullptr).
Status scratch_alloc(void** p, size_t bytes, void* stream);

/// Gives `p` (from scratch_alloc with the same stream; nullptr is ignored) back: kept for the stream's next
/// scratch_alloc when the stream is cached, else cudaFreeAsync on `stream`. Work already queued on `stream` may still
/// use it; work queued on other streams must not.
void scratch_free(void* p, void* stream);

}  // namespace gpu
}  // namespace tzip
