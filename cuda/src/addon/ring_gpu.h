// The GPU side of a submission ring (docs/ring.md): the ring's own stream on its device, GPU batches through the GPU
// codec (gpu/codec.h) as gpuCompress/gpuDecompress run them (addon/gpu_codec.cpp), and the WAIT/SIGNAL ordering flags
// through stream memory operations (cuStreamWaitValue64 / cuStreamWriteValue64). Used by the ring thread
// (addon/ring.cpp) only; no N-API here.
#pragma once
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>

#include "ring_sqe.h"

namespace tzip::addon {

class RingGpu {
 public:
  /// On the JavaScript thread (errors are ringOpen's): checks that a GPU can be used, that `device` is one, that
  /// `flag` (0: none) is 16 bytes of device memory of it, 8-byte aligned, and that the driver has the stream memory
  /// operations when a flag is given; creates the ring's stream (cudaStreamNonBlocking) on `device`.
  RingGpu(int device, uint64_t flag, long spin_us);
  /// On the ring thread, after its last batch: frees the stream's cached scratch memory and destroys the stream.
  ~RingGpu();
  RingGpu(const RingGpu&) = delete;
  RingGpu& operator=(const RingGpu&) = delete;

  int device() const { return device_; }
  bool has_flag() const { return flag_ != 0; }

  /// Makes the ring's device current on the calling (ring) thread, once at its start.
  void bind_thread();

  /// Runs one validated device batch (`n` SQEs of one op, their regions resolved in `res`): [WAIT] the codec's launch
  /// sequence [SIGNAL], then one copy of the results to pinned memory, and waits for it (polls for spin_us, then sleeps
  /// in short steps). `out[i]` gets SQE i's status, codec and result. While it waits, `stop` set (close) with the
  /// stream still waiting on `produced` makes it write the awaited value to `produced` itself, so that the stream
  /// drains.
  void run(const ring::Sqe* sqes, const ring::Resolved* res, size_t n, int sm_budget, ring::Cqe* out,
           const std::atomic<bool>& stop);

  /// The ordering part of a batch alone (a nop batch, or a batch that failed its checks: its client's stream may wait
  /// on `done`): [WAIT wait_value] [SIGNAL signal_value], waited for like run(). Returns "" or what failed.
  std::string order_only(bool wait, uint64_t wait_value, bool signal, uint64_t signal_value, const std::atomic<bool>& stop);

 private:
  struct Impl;
  Impl* impl_ = nullptr;
  int device_ = -1;
  uint64_t flag_ = 0;
};

}  // namespace tzip::addon
