// Gathers a few bytes of many frames into one device array, so that one device-to-host copy brings back what the host
// needs of every frame of a batch: the codec byte of each frame an encode resolved on the device ("auto"), the fixed
// header and shape of each frame a decode read. Plain C++ header (streams are void*, as in codec.h).
#pragma once
#include <cstddef>
#include <cstdint>

#include "gpu/codec.h"

namespace tzip {
namespace gpu {

/// A frame in device memory and how many of its bytes may be read.
struct FrameSpan {
  const void* frame = nullptr;  // device pointer (any alignment)
  uint64_t bytes = 0;           // readable bytes at `frame`
};

/// For every i < count and k < width: d_out[i * width + k] = byte offset + k of frames[i] when offset + k is below
/// frames[i].bytes, else 0. Reads nothing outside [frame, frame + bytes) of any span. Queued on `stream` (the current
/// device's; the caller has checked that every span is device memory of it); a grid of at most sm_budget blocks
/// (<= 0: one per SM). `frames` is host memory, uploaded through pinned staging: it may be reused when this returns.
/// d_out must hold count * width bytes. Errors: kInvalidArgument (width 0, a null frame with bytes, too large a batch),
/// kCudaError.
Status gather_frame_bytes(const FrameSpan* frames, size_t count, uint64_t offset, uint32_t width, uint8_t* d_out,
                          int sm_budget, void* stream);

}  // namespace gpu
}  // namespace tzip
