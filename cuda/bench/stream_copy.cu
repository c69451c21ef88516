// Copy-pattern benchmark: what HBM gives a kernel that, like the decoder, moves data as one sequential stream per warp
// (a warp takes a chunk by atomic ticket and walks it), against the grid-stride copy kernel that gpu_test reports as
// the ceiling. Question it answers (docs/benchmarks.md, issue 32 goal 4): is the whole-GPU decode's cap (660-750 GB/s
// for every codec, raw included, against a 1436 GB/s copy on an H100) the per-warp-chunk access pattern or the ring?
//
//   nvcc -O3 -std=c++17 -arch=sm_90 -I cuda/include cuda/bench/stream_copy.cu -o build/stream_copy
//   build/stream_copy [MiB=1024]
//
// Prints one row per variant: GB/s of bytes copied (each byte read once and written once) on 10 SMs and on all SMs.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "tzip/async_copy.h"

using namespace tzip::dev;

#define CK(x)                                                                                 \
  do {                                                                                        \
    cudaError_t e_ = (x);                                                                     \
    if (e_ != cudaSuccess) {                                                                  \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                           \
    }                                                                                         \
  } while (0)

__global__ void __launch_bounds__(1024, 1) grid_copy(uint4* d, const uint4* s, uint64_t nvec, unsigned long long*) {
  const uint64_t stride = uint64_t(gridDim.x) * blockDim.x;
  uint64_t i = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  for (; i + 3 * stride < nvec; i += 4 * stride) {
    const uint4 a = s[i], b = s[i + stride], c = s[i + 2 * stride], e = s[i + 3 * stride];
    d[i] = a, d[i + stride] = b, d[i + 2 * stride] = c, d[i + 3 * stride] = e;
  }
  for (; i < nvec; i += stride) d[i] = s[i];
}

/// One warp per chunk of CS bytes (ticketed), 16-byte loads, U loads in flight per lane.
template <uint32_t CS, uint32_t U>
__global__ void warp_copy(uint4* d, const uint4* s, uint64_t nvec, unsigned long long* ticket) {
  const uint32_t lane = threadIdx.x & 31;
  const uint64_t nch = nvec * 16 / CS;
  for (;;) {
    unsigned long long c = 0;
    if (lane == 0) c = atomicAdd(ticket, 1ull);
    c = __shfl_sync(~0u, c, 0);
    if (c >= nch) break;
    const uint4* src = s + c * (CS / 16);
    uint4* dst = d + c * (CS / 16);
    for (uint32_t v = lane; v < CS / 16; v += 32 * U) {
      uint4 x[U];
#pragma unroll
      for (uint32_t u = 0; u < U; ++u) x[u] = src[v + 32 * u];
#pragma unroll
      for (uint32_t u = 0; u < U; ++u) dst[v + 32 * u] = x[u];
    }
  }
}

/// One warp per chunk, through a per-warp shared-memory ring of S slots of TB bytes filled by bulk copies (one lane
/// issues, the slot's mbarrier completes): the decoder's ring_copy pattern.
template <uint32_t CS, uint32_t TB, uint32_t S>
__global__ void ring_copy(uint4* d, const uint4* s, uint64_t nvec, unsigned long long* ticket) {
  extern __shared__ __align__(16) unsigned char smem[];
  const uint32_t warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  uint8_t* ring = smem + warp * (S * TB + 64);
  uint64_t* bars = reinterpret_cast<uint64_t*>(ring + S * TB);
  if (lane == 0) {
    for (uint32_t i = 0; i < S; ++i) mbar_init(bars + i);
    mbar_init_fence();
  }
  __syncwarp();
  uint32_t phase = 0;
  const uint64_t nch = nvec * 16 / CS;
  constexpr uint32_t T = CS / TB;
  for (;;) {
    unsigned long long c = 0;
    if (lane == 0) c = atomicAdd(ticket, 1ull);
    c = __shfl_sync(~0u, c, 0);
    if (c >= nch) break;
    const uint8_t* src = reinterpret_cast<const uint8_t*>(s) + c * CS;
    uint4* dst = d + c * (CS / 16);
    if (lane == 0)
      for (uint32_t t = 0; t + 1 < S && t < T; ++t) {
        mbar_arrive_expect_tx(bars + t % S, TB);
        bulk_copy(ring + (t % S) * TB, src + t * TB, TB, bars + t % S);
      }
    for (uint32_t t = 0; t < T; ++t) {
      const uint32_t n = t + S - 1;
      if (lane == 0 && n < T) {
        mbar_arrive_expect_tx(bars + n % S, TB);
        bulk_copy(ring + (n % S) * TB, src + n * TB, TB, bars + n % S);
      }
      const uint32_t si = t % S;
      while (!mbar_try_wait(bars + si, (phase >> si) & 1u)) {
      }
      phase ^= 1u << si;
      __syncwarp();
      const uint4* slot = reinterpret_cast<const uint4*>(ring + si * TB);
#pragma unroll 4
      for (uint32_t v = lane; v < TB / 16; v += 32) dst[t * (TB / 16) + v] = slot[v];
      __syncwarp();
    }
  }
}

/// One block per chunk (all its warps together, grid-stride inside the chunk): fewer, wider streams.
template <uint32_t CS, uint32_t U>
__global__ void block_copy(uint4* d, const uint4* s, uint64_t nvec, unsigned long long* ticket) {
  __shared__ unsigned long long cc;
  const uint64_t nch = nvec * 16 / CS;
  for (;;) {
    if (threadIdx.x == 0) cc = atomicAdd(ticket, 1ull);
    __syncthreads();
    const unsigned long long c = cc;
    __syncthreads();
    if (c >= nch) break;
    const uint4* src = s + c * (CS / 16);
    uint4* dst = d + c * (CS / 16);
    for (uint32_t v = threadIdx.x; v < CS / 16; v += blockDim.x * U) {
      uint4 x[U];
#pragma unroll
      for (uint32_t u = 0; u < U; ++u)
        if (v + blockDim.x * u < CS / 16) x[u] = src[v + blockDim.x * u];
#pragma unroll
      for (uint32_t u = 0; u < U; ++u)
        if (v + blockDim.x * u < CS / 16) dst[v + blockDim.x * u] = x[u];
    }
  }
}

using Kernel = void (*)(uint4*, const uint4*, uint64_t, unsigned long long*);

struct Variant {
  const char* name;
  Kernel k;
  int threads;
  size_t smem;
};

int main(int argc, char** argv) {
  const size_t mib = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 1024;
  const size_t n = mib << 20;
  int dev = 0, sms = 0;
  CK(cudaGetDevice(&dev));
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, dev));
  uint8_t *src, *dst;
  unsigned long long* ticket;
  CK(cudaMalloc(&src, n));
  CK(cudaMalloc(&dst, n));
  CK(cudaMalloc(&ticket, 8));
  CK(cudaMemset(src, 0x5a, n));
  constexpr uint32_t K64 = 65536, K4 = 4096;
  std::vector<Variant> vs = {
      {"grid-stride copy, 32 warps", grid_copy, 1024, 0},
      {"warp/64K chunk, 8 warps, 4 loads", warp_copy<K64, 4>, 256, 0},
      {"warp/64K chunk, 16 warps, 4 loads", warp_copy<K64, 4>, 512, 0},
      {"warp/64K chunk, 24 warps, 4 loads", warp_copy<K64, 4>, 768, 0},
      {"warp/64K chunk, 32 warps, 4 loads", warp_copy<K64, 4>, 1024, 0},
      {"warp/64K chunk, 16 warps, 8 loads", warp_copy<K64, 8>, 512, 0},
      {"warp/4K chunk, 24 warps, 4 loads", warp_copy<K4, 4>, 768, 0},
      {"warp/4K chunk, 32 warps, 4 loads", warp_copy<K4, 4>, 1024, 0},
      {"ring 64K, 16 warps, 4x2K slots", ring_copy<K64, 2048, 4>, 512, 16 * (4 * 2048 + 64)},
      {"ring 64K, 24 warps, 4x1K slots", ring_copy<K64, 1024, 4>, 768, 24 * (4 * 1024 + 64)},
      {"ring 64K, 8 warps, 8x2K slots", ring_copy<K64, 2048, 8>, 256, 8 * (8 * 2048 + 64)},
      {"ring 64K, 8 warps, 4x4K slots", ring_copy<K64, 4096, 4>, 256, 8 * (4 * 4096 + 64)},
      {"ring 64K, 4 warps, 8x4K slots", ring_copy<K64, 4096, 8>, 128, 4 * (8 * 4096 + 64)},
      {"block/64K chunk, 32 warps", block_copy<K64, 4>, 1024, 0},
      {"block/64K chunk, 8 warps", block_copy<K64, 4>, 256, 0},
  };
  std::printf("stream_copy: %s, %d SMs, %zu MiB, GB/s of bytes copied (median of 7)\n", prop.name, sms, mib);
  std::printf("%-36s %10s %10s\n", "variant", "10 SMs", "all SMs");
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  for (const Variant& v : vs) {
    if (v.smem > 48 * 1024) CK(cudaFuncSetAttribute(v.k, cudaFuncAttributeMaxDynamicSharedMemorySize, int(v.smem)));
    double gbs[2];
    const int grids[2] = {10, sms};
    for (int g = 0; g < 2; ++g) {
      std::vector<float> ms;
      for (int r = 0; r < 9; ++r) {
        CK(cudaMemset(ticket, 0, 8));
        CK(cudaMemset(dst, 0, 4096));
        CK(cudaEventRecord(e0));
        v.k<<<grids[g], v.threads, v.smem>>>(reinterpret_cast<uint4*>(dst), reinterpret_cast<const uint4*>(src), n / 16,
                                              ticket);
        CK(cudaEventRecord(e1));
        CK(cudaEventSynchronize(e1));
        CK(cudaGetLastError());
        float t;
        CK(cudaEventElapsedTime(&t, e0, e1));
        if (r >= 2) ms.push_back(t);
      }
      std::sort(ms.begin(), ms.end());
      gbs[g] = n / (ms[ms.size() / 2] * 1e6);
    }
    // Every variant must have copied every byte.
    std::vector<uint8_t> probe(4096);
    CK(cudaMemcpy(probe.data(), dst + n - 4096, 4096, cudaMemcpyDeviceToHost));
    bool ok = std::all_of(probe.begin(), probe.end(), [](uint8_t b) { return b == 0x5a; });
    CK(cudaMemcpy(probe.data(), dst, 4096, cudaMemcpyDeviceToHost));
    ok = ok && std::all_of(probe.begin(), probe.end(), [](uint8_t b) { return b == 0x5a; });
    std::printf("%-36s %10.1f %10.1f%s\n", v.name, gbs[0], gbs[1], ok ? "" : "  COPY WRONG");
    CK(cudaMemset(dst, 0, n));
  }
  return 0;
}
