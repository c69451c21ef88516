// Decode kernel class 3 (decode_kernel.cuh), in a translation unit of its own so that the kernels build in parallel:
// bf16 fast frames: 24 warps x 80 registers (ptxas: 16 bytes spilled, outside the tile loop) and 24 x 9680 bytes of
// shared memory (of 232448): the ring holds 4 one-tile slots of 3-bit codes and RAW mantissas (2 of anything wider), or
// 2 slots of tile pairs (ring_pairs).
#include "gpu/decode_kernel.cuh"

namespace tzip {
namespace gpu {
namespace dec {

Status run_part3(const DecArgs& a, int sm_budget, int sm_count, cudaStream_t s, uint32_t tile_ok, uint32_t defer_all) {
  return launch_decode<0, 1, 24, 5920, 3>(a, sm_budget, sm_count, s, tile_ok, defer_all);  // C, L, W, RING, class
}

}  // namespace dec
}  // namespace gpu
}  // namespace tzip
