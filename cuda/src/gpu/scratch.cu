// Scratch memory of the codec's launch sequences, cached per stream (see gpu/scratch.h). Also the definitions of
// detail::alloc_async / detail::free_async (gpu/codec.h), through which encode.cu and decode.cu take their workspaces.
#include <cuda_runtime.h>

#include <algorithm>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "gpu/codec.h"
#include "gpu/scratch.h"

namespace tzip {
namespace gpu {

namespace {

constexpr size_t kMinBlockBytes = size_t(64) << 10;
constexpr size_t kMaxCachedBlockBytes = size_t(256) << 20;
constexpr size_t kMaxIdleBlocks = 8;

struct Block {
  void* ptr = nullptr;
  size_t bytes = 0;
};

/// The cached blocks of one stream.
struct StreamScratch {
  std::vector<Block> idle;                       // free for the stream's next scratch_alloc
  std::unordered_map<void*, size_t> handed_out;  // block -> size, until scratch_free gives it back
};

std::mutex g_mu;
// Never destroyed: worker threads may still give blocks back while the process exits.
auto* g_streams = new std::unordered_map<void*, StreamScratch>;

Status cuda_status(cudaError_t e, const std::string& what) {
  Status s;
  if (e != cudaSuccess) {
    cudaGetLastError();  // clear a non-sticky error
    s.code = e == cudaErrorMemoryAllocation ? kOutOfMemory : kCudaError;
    s.message = what + ": " + cudaGetErrorString(e);
  }
  return s;
}

/// Size of a new cached block for a request of `bytes`: a power of two, at least kMinBlockBytes.
size_t block_bytes(size_t bytes) {
  size_t b = kMinBlockBytes;
  while (b < bytes && b <= (~size_t(0) >> 1)) b <<= 1;
  return std::max(b, bytes);
}

/// Frees every idle block of `s` on `stream` (stream-ordered). Caller holds g_mu.
void free_idle(StreamScratch& s, void* stream) {
  for (const Block& b : s.idle) cudaFreeAsync(b.ptr, cudaStream_t(stream));
  s.idle.clear();
}

}  // namespace

void keep_scratch(void* stream) {
  std::lock_guard<std::mutex> lock(g_mu);
  g_streams->emplace(stream, StreamScratch{});
}

void release_scratch(void* stream) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = g_streams->find(stream);
  if (it == g_streams->end()) return;
  free_idle(it->second, stream);
  // Blocks still handed out are freed by scratch_free, which no longer finds the stream.
  g_streams->erase(it);
}

Status scratch_alloc(void** p, size_t bytes, void* stream) {
  *p = nullptr;
  if (bytes == 0) bytes = 16;
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = g_streams->find(stream);
  if (it == g_streams->end() || bytes > kMaxCachedBlockBytes) {
    const cudaError_t e = cudaMallocAsync(p, bytes, cudaStream_t(stream));
    if (e != cudaSuccess) *p = nullptr;
    return cuda_status(e, "cudaMallocAsync(" + std::to_string(bytes) + " bytes)");
  }
  StreamScratch& s = it->second;
  // The smallest idle block that fits.
  auto best = s.idle.end();
  for (auto b = s.idle.begin(); b != s.idle.end(); ++b)
    if (b->bytes >= bytes && (best == s.idle.end() || b->bytes < best->bytes)) best = b;
  if (best != s.idle.end()) {
    *p = best->ptr;
    s.handed_out.emplace(best->ptr, best->bytes);
    s.idle.erase(best);
    return Status{};
  }
  const size_t size = block_bytes(bytes);
  cudaError_t e = cudaMallocAsync(p, size, cudaStream_t(stream));
  if (e == cudaErrorMemoryAllocation && !s.idle.empty()) {
    // Give the idle blocks back to the pool (it reuses memory freed on the same stream at once) and try again.
    cudaGetLastError();
    free_idle(s, stream);
    e = cudaMallocAsync(p, size, cudaStream_t(stream));
  }
  if (e != cudaSuccess) {
    *p = nullptr;
    return cuda_status(e, "cudaMallocAsync(" + std::to_string(size) + " bytes)");
  }
  s.handed_out.emplace(*p, size);
  return Status{};
}

void scratch_free(void* p, void* stream) {
  if (!p) return;
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = g_streams->find(stream);
  if (it != g_streams->end()) {
    StreamScratch& s = it->second;
    auto h = s.handed_out.find(p);
    if (h != s.handed_out.end()) {
      s.idle.push_back(Block{p, h->second});
      s.handed_out.erase(h);
      if (s.idle.size() > kMaxIdleBlocks) {
        auto smallest = std::min_element(s.idle.begin(), s.idle.end(),
                                         [](const Block& a, const Block& b) { return a.bytes < b.bytes; });
        cudaFreeAsync(smallest->ptr, cudaStream_t(stream));
        s.idle.erase(smallest);
      }
      return;
    }
  }
  cudaFreeAsync(p, cudaStream_t(stream));
}

namespace detail {

Status alloc_async(void** p, size_t bytes, void* stream) { return scratch_alloc(p, bytes, stream); }
void free_async(void* p, void* stream) { scratch_free(p, stream); }

}  // namespace detail

}  // namespace gpu
}  // namespace tzip
