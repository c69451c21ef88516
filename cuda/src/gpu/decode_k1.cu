// Decode kernel class 1 (decode_kernel.cuh), in a translation unit of its own so that the kernels build in parallel:
// fast and raw frames of fp16 and fp32 (and bf16 when Tuning::bf16_kernel is off): 16 warps, no RANS tables.
#include "gpu/decode_kernel.cuh"

namespace tzip {
namespace gpu {
namespace dec {

Status run_part1(const DecArgs& a, int sm_budget, int sm_count, cudaStream_t s, uint32_t tile_ok, uint32_t defer_all) {
  return launch_decode<0, 1, 16, 8192, 1>(a, sm_budget, sm_count, s, tile_ok, defer_all);  // C, L, W, RING, class
}

}  // namespace dec
}  // namespace gpu
}  // namespace tzip
