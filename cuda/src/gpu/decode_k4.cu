// Decode kernel class 4 (decode_kernel.cuh), in a translation unit of its own so that the kernels build in parallel:
// bf16 max frames: 32 warps x 64 registers, no ring (the RAW sign+mantissa bytes are read ahead from global memory),
// 32 x 5376 bytes of shared memory: the RANS table and two LUT tables, so that every chunk class 2 took stays here
// (chunks with LUT exponents take the step path: the tile path needs the ring).
#include "gpu/decode_kernel.cuh"

namespace tzip {
namespace gpu {
namespace dec {

Status run_part4(const DecArgs& a, int sm_budget, int sm_count, cudaStream_t s, uint32_t tile_ok, uint32_t defer_all) {
  return launch_decode<1, 2, 32, 0, 4>(a, sm_budget, sm_count, s, tile_ok, defer_all);  // C, L, W, RING, class
}

}  // namespace dec
}  // namespace gpu
}  // namespace tzip
