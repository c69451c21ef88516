// Launch sequences of small codec calls replayed from CUDA graphs. Plain C++ header (streams are void*, as in codec.h).
//
// A small call's time on the host is mostly its stream operations: a 1-element decode queues ten (the descriptor
// upload, seven kernels, the ring's event), each a few microseconds of driver time, more under MPS. A CUDA graph of the
// same sequence is queued by one cudaGraphLaunch. The graph bakes every kernel argument in, so one is kept per
// GraphKey: everything its arguments are made of besides the data the descriptor image carries (the workspace and
// result pointers, the counts that size the workspace, the launch geometry's inputs, the stream). A call replays a
// graph only when its key is equal, so every pointer the graph uses is one the call owns, and every size the same.
//
// The descriptor image (what the call's upload would copy) is written into a pinned buffer of the graph, which the
// graph's first node copies to the device. The caller therefore must not queue a call of the same key on the stream
// before the previous one has run (the submission ring waits for each batch before it takes the next one): only
// calls that set EncodeOptions::graphs / DecodeOptions::graphs come here.
#pragma once
#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>

#include "gpu/codec.h"

struct CUgraphExec_st;  // the CUDA runtime's cudaGraphExec_t is a pointer to it (this header stays free of CUDA's)

namespace tzip {
namespace gpu {

/// Frees the graphs kept for `stream` (its work must have finished: the caller synchronises it first). Call it before
/// destroying a stream whose calls set `graphs`, with that stream's device current. No effect on other streams.
void release_graphs(void* stream);

namespace detail {

/// What a kept graph depends on besides its descriptor image (see the header comment); unused words stay 0.
struct GraphKey {
  std::array<uint64_t, 16> w{};
  bool operator<(const GraphKey& o) const { return w < o.w; }
};

/// Calls of at most this many tensors (encode) or frames (decode), and of at most kGraphMaxBytes of input (encode) or
/// output (decode), may be replayed from a graph: the calls whose time is mostly their fixed cost (a graph saves
/// 5-25 us of enqueue per call, docs/benchmarks.md), and few launch shapes per stream.
constexpr size_t kGraphMaxItems = 8;
constexpr uint64_t kGraphMaxBytes = uint64_t(4) << 20;

/// Captures what `ops` queues on `stream` (stream work only: no allocation, no synchronisation) into `*exec`, an
/// executable graph that the caller destroys. False when beginning, queueing (an error Status or an exception),
/// ending or instantiating fails: then *exec is null, nothing was queued and the stream is out of capture mode.
bool capture_exec(void* stream, const std::function<Status()>& ops, CUgraphExec_st** exec);

/// Queues on `stream`, from a graph kept for `key`, the copy of `image`'s `image_bytes` bytes (the call's descriptor
/// image) to `d_image`, then what `kernels()` queues. `kernels` must queue only stream work on `stream` (memsets and
/// kernels), and make no allocation or synchronisation.
///
/// `d_image` and every pointer `kernels` passes to a kernel must be functions of `key` (the capture bakes in those of
/// the call that captures).
///
/// True when it queued the sequence; false when the caller must queue it itself as usual. That is the
/// case the first time a key is seen (the launch geometry's caches are then filled by a normal call), when the
/// stream already keeps its most graphs (16), when an error is pending on the calling thread, and when capturing,
/// instantiating or launching failed (then never again for that key).
bool launch_graph(const GraphKey& key, const void* image, size_t image_bytes, void* d_image, void* stream,
                  const std::function<Status()>& kernels);

}  // namespace detail

}  // namespace gpu
}  // namespace tzip
