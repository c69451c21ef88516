// The GPU side of a submission ring (docs/ring.md): the ring's own stream on its device, GPU batches through the GPU
// codec (gpu/codec.h) as gpuCompress/gpuDecompress run them (addon/gpu_codec.cpp). WAIT and SIGNAL are the ring
// thread's (addon/ring.cpp: host words of the ring file, docs/ring.md "GPU ordering flags"), not the stream's. Used by
// the ring thread only; no N-API here.
#pragma once
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>

#include "ring_sqe.h"

namespace tzip::addon {

class RingGpu {
 public:
  /// On the JavaScript thread (errors are ringOpen's): checks that a GPU can be used and that `device` is one;
  /// creates the ring's stream (cudaStreamNonBlocking) on `device`.
  explicit RingGpu(int device);
  /// On the ring thread, after its last batch: frees the stream's cached scratch memory and destroys the stream.
  ~RingGpu();
  RingGpu(const RingGpu&) = delete;
  RingGpu& operator=(const RingGpu&) = delete;

  int device() const { return device_; }

  /// Makes the ring's device current on the calling (ring) thread, once at its start.
  void bind_thread();

  /// Runs one validated device batch (`n` SQEs of one op, their regions resolved in `res`): the codec's launch
  /// sequence, then one copy of the results to pinned memory, and waits for it (polls for gpu_spin_us(), then
  /// sleeps in short steps). `out[i]` gets SQE i's status, codec and result.
  void run(const ring::Sqe* sqes, const ring::Resolved* res, size_t n, int sm_budget, ring::Cqe* out);

  /// Where the last run()'s time went, in microseconds (for TZIP_TRACE): building the codec's items and queueing its
  /// launch sequence and the copy of the results, then waiting for the GPU to finish them.
  double last_enqueue_us() const { return enqueue_us_; }
  double last_wait_us() const { return wait_us_; }
  /// The part of last_enqueue_us() spent in the codec's call (gpu::encode or gpu::decode, and the gather of codecs).
  double last_codec_us() const { return codec_us_; }

 private:
  struct Impl;
  Impl* impl_ = nullptr;
  int device_ = -1;
  double enqueue_us_ = 0, wait_us_ = 0, codec_us_ = 0;
};

}  // namespace tzip::addon
