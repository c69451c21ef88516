// Launch sequences of small codec calls replayed from CUDA graphs (see gpu/graph.h).
#include "gpu/graph.h"

#include <cuda_runtime.h>

#include <cstring>
#include <iterator>
#include <map>
#include <mutex>
#include <string>

namespace tzip {
namespace gpu {

namespace {

/// Graphs kept per stream: a ring's calls need a few (compress and decompress of each batch shape it sees); beyond
/// this, new keys run without a graph, so that a stream whose pointers keep changing cannot grow the cache.
constexpr size_t kMaxGraphsPerStream = 16;
/// Keys remembered per stream that have no graph yet (seen once): when full, they are forgotten, the graphs kept.
constexpr size_t kMaxSeenPerStream = 64;

struct Entry {
  bool failed = false;  // capturing, instantiating or launching failed: never tried again
  cudaGraphExec_t exec = nullptr;
  void* host = nullptr;  // pinned: the descriptor image the graph's first node copies
};

struct StreamGraphs {
  std::mutex mu;  // a stream's calls are serialised by their caller; this guards against any other
  std::map<detail::GraphKey, Entry> entries;
  size_t graphs = 0;
};

std::mutex g_mu;  // the map of streams only
// Never destroyed: worker threads may still launch while the process exits.
auto* g_streams = new std::map<void*, StreamGraphs>;

void drop(Entry& e) {
  if (e.exec) cudaGraphExecDestroy(e.exec);
  if (e.host) cudaFreeHost(e.host);
  e.exec = nullptr;
  e.host = nullptr;
}

/// Captures the image's upload to `d_image` and `kernels` on `s` into an executable graph of `e` (its pinned image
/// allocated first); false on failure (then nothing is queued and the stream is out of capture mode).
bool capture(Entry& e, size_t image_bytes, void* d_image, cudaStream_t s, const std::function<Status()>& kernels) {
  if (cudaHostAlloc(&e.host, image_bytes, cudaHostAllocPortable) != cudaSuccess) {  // (pinned for every device)
    cudaGetLastError();
    e.host = nullptr;
    return false;
  }
  return detail::capture_exec(s, [&]() -> Status {
    const cudaError_t copy = cudaMemcpyAsync(d_image, e.host, image_bytes, cudaMemcpyHostToDevice, s);
    return copy == cudaSuccess ? kernels() : Status{kCudaError, "cudaMemcpyAsync"};
  }, &e.exec);
}

}  // namespace

void release_graphs(void* stream) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = g_streams->find(stream);
  if (it == g_streams->end()) return;
  {
    std::lock_guard<std::mutex> held(it->second.mu);
    for (auto& kv : it->second.entries) drop(kv.second);
  }
  g_streams->erase(it);
  cudaGetLastError();
}

namespace detail {

bool capture_exec(void* stream, const std::function<Status()>& ops, cudaGraphExec_t* exec) {
  const cudaStream_t s = cudaStream_t(stream);
  cudaGraph_t graph = nullptr;
  if (cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  Status st;
  try {
    st = ops();
  } catch (...) {  // (an allocation failing in the launch geometry's caches): the stream must leave capture mode
    st = Status{kOutOfMemory, "capture"};
  }
  const cudaError_t end = cudaStreamEndCapture(s, &graph);  // always: the stream leaves capture mode
  bool ok = st.ok() && end == cudaSuccess && graph != nullptr;
  if (ok) ok = cudaGraphInstantiate(exec, graph, 0) == cudaSuccess;
  if (graph) cudaGraphDestroy(graph);
  if (!ok) {
    cudaGetLastError();
    *exec = nullptr;
  }
  return ok;
}

bool launch_graph(const GraphKey& key, const void* image, size_t image_bytes, void* d_image, void* stream,
                  const std::function<Status()>& kernels) {
  const cudaStream_t s = cudaStream_t(stream);
  StreamGraphs* sg;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    sg = &(*g_streams)[stream];  // (std::map: the element stays where it is until release_graphs erases it)
  }
  std::lock_guard<std::mutex> lock(sg->mu);
  auto it = sg->entries.find(key);
  if (it == sg->entries.end()) {
    if (sg->entries.size() >= sg->graphs + kMaxSeenPerStream) {
      for (auto e = sg->entries.begin(); e != sg->entries.end();)  // forget the keys seen once, keep the graphs
        e = e->second.exec || e->second.failed ? std::next(e) : sg->entries.erase(e);
      if (sg->entries.size() >= sg->graphs + kMaxSeenPerStream) return false;  // (only failed ones left)
    }
    sg->entries.emplace(key, Entry{});  // seen once: this call runs as usual (and fills the geometry's caches)
    return false;
  }
  Entry& e = it->second;
  if (e.failed) return false;
  if (!e.exec) {
    // Not with an error pending on this thread: the capture's launch checks would take it for their own.
    if (sg->graphs >= kMaxGraphsPerStream || cudaPeekAtLastError() != cudaSuccess) return false;
    if (!capture(e, image_bytes, d_image, s, kernels)) {
      e.failed = true;
      drop(e);
      return false;
    }
    ++sg->graphs;
  }
  std::memcpy(e.host, image, image_bytes);
  if (cudaGraphLaunch(e.exec, s) != cudaSuccess) {
    cudaGetLastError();  // nothing queued: the caller queues the call as usual, and sees a lasting failure itself
    e.failed = true;
    return false;
  }
  return true;
}

}  // namespace detail

}  // namespace gpu
}  // namespace tzip
