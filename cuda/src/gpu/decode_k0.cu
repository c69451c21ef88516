// Decode kernel class 0 (decode_kernel.cuh), in a translation unit of its own so that the kernels build in parallel:
// the fallback queue: chunks the class kernels could not take (more RANS/LUT streams than their tables, misaligned
// frames), 4 warps per block with eight RANS and eight LUT tables each.
#include "gpu/decode_kernel.cuh"

namespace tzip {
namespace gpu {
namespace dec {

Status run_part0(const DecArgs& a, int sm_budget, int sm_count, cudaStream_t s, uint32_t tile_ok, uint32_t defer_all) {
  return launch_decode<8, 8, 4, 0, 0>(a, sm_budget, sm_count, s, tile_ok, defer_all);  // C, L, W, RING, class
}

}  // namespace dec
}  // namespace gpu
}  // namespace tzip
