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

/// Queues on `stream` the sequence `enqueue(h_image)` queues, from a graph kept for `key`, with `image`'s
/// `image_bytes` bytes as its descriptor image. `enqueue` must queue only stream work on `stream` (the copy of the
/// `image_bytes` bytes at `h_image`, a pinned host buffer, to the device first, then memsets and kernels), and make
/// no allocation or synchronisation.
///
/// *launched: true when it queued the sequence; false when the caller must queue it itself as usual. That is the
/// case the first time a key is seen (the launch geometry's caches are then filled by a normal call), when the
/// stream already keeps kMaxGraphsPerStream graphs, and when capturing or instantiating failed (then never again for
/// that key). A failure of cudaGraphLaunch itself is returned.
Status launch_graph(const GraphKey& key, const void* image, size_t image_bytes, void* stream,
                    const std::function<Status(const void* h_image)>& enqueue, bool* launched);

}  // namespace detail

}  // namespace gpu
}  // namespace tzip
