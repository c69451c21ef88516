// Decode kernel class 2 (decode_kernel.cuh), in a translation unit of its own so that the kernels build in parallel:
// max and bytes frames: 16 warps x 13.3 KB (one RANS table, two LUT tables, the ring) fit in 227 KB.
#include "gpu/decode_kernel.cuh"

namespace tzip {
namespace gpu {
namespace dec {

Status run_part2(const DecArgs& a, int sm_budget, int sm_count, cudaStream_t s, uint32_t tile_ok, uint32_t defer_all) {
  return launch_decode<1, 2, 16, 7168, 2>(a, sm_budget, sm_count, s, tile_ok, defer_all);  // C, L, W, RING, class
}

}  // namespace dec
}  // namespace gpu
}  // namespace tzip
