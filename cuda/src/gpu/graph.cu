// Launch sequences of small codec calls replayed from CUDA graphs (see gpu/graph.h).
#include "gpu/graph.h"

#include <cuda_runtime.h>

#include <cstring>
#include <map>
#include <mutex>
#include <string>

namespace tzip {
namespace gpu {

namespace {

/// Graphs kept per stream: a ring's calls need a few (compress and decompress of each batch size it sees); beyond
/// this, new keys run without a graph, so that a stream whose pointers keep changing cannot grow the cache.
constexpr size_t kMaxGraphsPerStream = 16;

struct Entry {
  bool seen = false;    // a call of this key ran without a graph
  bool failed = false;  // capturing or instantiating failed: never tried again
  cudaGraphExec_t exec = nullptr;
  void* host = nullptr;  // pinned: the descriptor image the graph's first node copies
};

struct StreamGraphs {
  std::map<detail::GraphKey, Entry> entries;
  size_t graphs = 0;
};

std::mutex g_mu;
// Never destroyed: worker threads may still launch while the process exits.
auto* g_streams = new std::map<void*, StreamGraphs>;

Status cuda_status(cudaError_t e, const char* what) {
  Status s;
  if (e != cudaSuccess) {
    cudaGetLastError();
    s.code = e == cudaErrorMemoryAllocation ? kOutOfMemory : kCudaError;
    s.message = std::string(what) + ": " + cudaGetErrorString(e);
  }
  return s;
}

/// Captures `enqueue` on `s` into an executable graph of `e` (its pinned image allocated first); false on failure.
bool capture(Entry& e, size_t image_bytes, cudaStream_t s, const std::function<Status(const void*)>& enqueue) {
  if (cudaHostAlloc(&e.host, image_bytes, cudaHostAllocPortable) != cudaSuccess) {  // (pinned for every device)
    cudaGetLastError();
    e.host = nullptr;
    return false;
  }
  cudaGraph_t graph = nullptr;
  if (cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  const Status st = enqueue(e.host);
  const cudaError_t end = cudaStreamEndCapture(s, &graph);  // always: the stream leaves capture mode
  bool ok = st.ok() && end == cudaSuccess && graph != nullptr;
  if (ok) ok = cudaGraphInstantiate(&e.exec, graph, 0) == cudaSuccess;
  if (graph) cudaGraphDestroy(graph);
  if (!ok) {
    cudaGetLastError();
    e.exec = nullptr;
  }
  return ok;
}

}  // namespace

void release_graphs(void* stream) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = g_streams->find(stream);
  if (it == g_streams->end()) return;
  for (auto& kv : it->second.entries) {
    if (kv.second.exec) cudaGraphExecDestroy(kv.second.exec);
    if (kv.second.host) cudaFreeHost(kv.second.host);
  }
  g_streams->erase(it);
  cudaGetLastError();
}

namespace detail {

Status launch_graph(const GraphKey& key, const void* image, size_t image_bytes, void* stream,
                    const std::function<Status(const void* h_image)>& enqueue, bool* launched) {
  *launched = false;
  const cudaStream_t s = cudaStream_t(stream);
  // One lock for the lookup, the capture and the launch: a stream's calls are serialised by their caller anyway.
  std::lock_guard<std::mutex> lock(g_mu);
  StreamGraphs& sg = (*g_streams)[stream];
  auto it = sg.entries.find(key);
  if (it == sg.entries.end()) {
    if (sg.entries.size() >= 4 * kMaxGraphsPerStream) return Status{};  // (keys seen once, bounded too)
    sg.entries[key].seen = true;
    return Status{};
  }
  Entry& e = it->second;
  if (e.failed) return Status{};
  if (!e.exec) {
    if (sg.graphs >= kMaxGraphsPerStream) return Status{};
    if (!capture(e, image_bytes, s, enqueue)) {
      e.failed = true;
      return Status{};
    }
    ++sg.graphs;
  }
  std::memcpy(e.host, image, image_bytes);
  const cudaError_t r = cudaGraphLaunch(e.exec, s);
  if (r != cudaSuccess) return cuda_status(r, "cudaGraphLaunch");
  *launched = true;
  return Status{};
}

}  // namespace detail

}  // namespace gpu
}  // namespace tzip
