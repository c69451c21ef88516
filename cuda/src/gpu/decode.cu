// GPU frame decoder: decodes a batch of frames with the rules of tzip::decode_frame (cuda/src/core/frame.cpp +
// chunk_codec.cpp), validating every byte it uses, and reports per frame the error the CPU would raise.
//
// Launch sequence (one stream, grids sized by the SM budget, see codec.h):
//   1. parse_kernel: one block per frame: fixed header, shape, chunk table (offset chain and sizes, in parallel) and
//      frame/output lengths. A frame whose structure is invalid gets no chunk work.
//   2. scan_kernel: prefix sums of the task counts per decoder class: each frame's two verification tasks (header
//      digest, frame checksum: serial hashes, one warp each, taken first so that they run beside the chunks), then
//      its chunks.
//   3. decode kernels (decode_kernel.cuh, one class per decode_k*.cu), one warp per task, persistent, atomic tickets:
//        class 3 (bf16 fast): 24 warps per block (80 registers each), no RANS tables: the bf16 tile path's dependent
//          chains need more warps per scheduler than the 16 that the fp32 paths' registers allow;
//        class 1 (fp16/fp32 fast, raw): 16 warps per block, no RANS tables;
//        class 2 (max, bytes): 16 warps per block, one RANS table and two LUT tables per warp;
//        class 4 (bf16 max): 32 warps per block (64 registers each), one RANS table and two LUT tables, no ring: the
//          RANS steps are one dependent chain per lane, so what hides their latency is warps;
//        fallback: chunks the class kernels could not take (more RANS/LUT streams than their tables, misaligned frames),
//        4 warps per block with eight of each.
//      The fixed-rate streams (RAW symbols, LUT codes) reach shared memory through a per-warp ring of 1024-element
//      tiles: bulk copies (cp.async.bulk, issued by one lane) that complete on the slot's mbarrier, one to three tiles
//      ahead (2 or 4 slots, as the tile's bytes fit). Chunks stored raw go through the same ring when source and
//      destination are 16-byte aligned (classes 1 and 2). Float chunks without RANS streams take the tile path: each
//      lane 16
//      output bytes per sub-tile (coalesced 16-byte stores), LUT codes looked up four at a time with __byte_perm,
//      escapes placed by one packed warp scan per tile with the chunk's exceptions in shared memory. Everything else
//      takes the step path in the format's RANS order (lane l, element 32g + l): per step one symbol per stream and
//      lane, RANS words fetched through a 256-word window held in the lanes' registers (ballot + popc give each lane
//      its word); bf16 chunks with RANS exponents and RAW or CONST sign+mantissa bytes (what the max encoder writes)
//      take a step loop specialised on those modes.
//      With verify on, each warp checks the chunk digest (format version 2: 32 lane hashes of interleaved 16-byte
//      stripes) of the chunk it wrote: the tile path and raw copies hash the 16-byte vectors they store on the way out,
//      other paths read the chunk back right after writing it (coalesced, from L2).
//   4. errors_kernel: the lowest-ranked error of each frame (the CPU's order of checks, then the lowest chunk) to the
//      caller's array.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "gpu/codec.h"
#include "gpu/decode_args.cuh"
#include "gpu/graph.h"
#include "tzip/async_copy.h"
#include "tzip/bitpack.h"
#include "tzip/format.h"
#include "tzip/rans.h"
#include "tzip/warp.h"
#include "tzip/xxhash32.h"

namespace tzip {
namespace gpu {
namespace dec {
namespace {

// ---------------------------------------------------------------- 1. parse

__global__ void __launch_bounds__(1024, 1) parse_kernel(DecArgs a) {
  __shared__ int s_bad;
  for (uint32_t ti = blockIdx.x; ti < a.n; ti += gridDim.x) {
    DecTensor& T = a.t[ti];
    if (threadIdx.x == 0) {
      s_bad = 1;
      T.header_ok = 0;
      T.n_dec = 0;
      T.n_chunks = 0;
      const uint8_t* f = T.frame;
      const uint64_t avail = T.frame_len;
      uint32_t rank = 0;
      int32_t code = kCorrupt;
      do {
        if (avail < kFixedHeaderBytes) { rank = kRTruncFixed; code = kTruncated; break; }
        if (ld_le32u(f + kOffMagic) != kFrameMagic) { rank = kRMagic; break; }
        const uint32_t version = ld_le16u(f + kOffVersion);
        if (version == 0) { rank = kRVersion0; break; }
        // Version 1 (pre-release, whole-chunk XXH32 digests) is no longer read, as on the CPU.
        if (version != kFormatVersion) { rank = kRVersionNew; code = kUnsupported; break; }
        const uint32_t dt = f[kOffDtype], cd = f[kOffCodec];
        if (dt >= kNumDtypes) { rank = kRDtype; break; }
        if (cd >= kNumCodecs) { rank = kRCodec; break; }
        const Dtype d = Dtype(dt);
        const Codec c = Codec(cd);
        if ((c == Codec::FAST || c == Codec::MAX) && !dtype_is_split_float(d)) { rank = kRNormalize; break; }
        const uint32_t ndim = f[kOffNdim];
        if (ndim > kMaxNdim) { rank = kRNdim; break; }
        if (f[kOffFlags] != 0 || ld_le16u(f + 10) != 0 || ld_le32u(f + 44) != 0) { rank = kRReserved; break; }
        const uint32_t cs = ld_le32u(f + kOffChunkBytes);
        if (cs < kMinChunkBytes || cs > kMaxChunkBytes || cs % kChunkBytesMultiple != 0) { rank = kRChunkSize; break; }
        const uint64_t nbytes = ld_le64u(f + kOffNbytes), payload = ld_le64u(f + kOffPayloadBytes);
        const uint32_t nch = ld_le32u(f + kOffNumChunks);
        if (nch != num_chunks(nbytes, cs)) { rank = kRNumChunks; break; }
        const uint64_t table_off = chunk_table_offset(ndim), hdr = frame_header_bytes(ndim, nch);
        if (avail < table_off) { rank = kRTruncShape; code = kTruncated; break; }
        {
          bool nz = false;
          for (uint64_t q = kOffShape + 8ull * ndim; q < table_off; ++q) nz |= f[q] != 0;
          if (nz) { rank = kRShapePad; break; }
        }
        unsigned __int128 total = dtype_size(d);
        bool ok = true;
        uint64_t expect = 0;
        for (uint32_t k = 0; k < ndim; ++k) {
          total *= ld_le64u(f + kOffShape + 8 * k);
          if (total > UINT64_MAX) {
            ok = false;
            for (uint32_t q = 0; q < ndim; ++q)
              if (ld_le64u(f + kOffShape + 8 * q) == 0) { ok = true; break; }
            total = 0;
            break;
          }
        }
        expect = uint64_t(total);
        if (!ok || expect != nbytes) { rank = kRShape; break; }
        if (payload > nbytes) { rank = kRPayload; break; }
        if (avail < hdr) { rank = kRTruncTable; code = kTruncated; break; }
        T.header_ok = 1;
        T.dtype = uint8_t(dt);
        T.codec = uint8_t(cd);
        T.ndim = uint8_t(ndim);
        T.chunk_bytes = cs;
        T.nbytes = nbytes;
        T.payload_bytes = payload;
        T.n_chunks = nch;
        T.header_bytes = hdr;
        T.checksum = ld_le32u(f + kOffChecksum);
        const bool bf16_own = Dtype(dt) == Dtype::BF16 && a.bf16_class;
        T.cls = (c == Codec::FAST && bf16_own) ? 3 : (c == Codec::MAX && bf16_own) ? 4
              : (c == Codec::FAST || c == Codec::RAW) ? 1 : 2;
        s_bad = 0;
        const uint64_t frame_bytes = hdr + payload;
        if (avail < frame_bytes) { report(a, ti, err_key(kRTruncFrame, 0, 0, kTruncated)); s_bad = 1; }
        else if (avail > frame_bytes) { report(a, ti, err_key(kRTrailing, 0, 0, kCorrupt)); s_bad = 1; }
        else if (T.out_len != nbytes) { report(a, ti, err_key(kROutLen, 0, 0, kInvalidArgument)); s_bad = 1; }
      } while (false);
      if (rank) report(a, ti, err_key(rank, 0, 0, code));
    }
    __syncthreads();
    if (T.header_ok) {
      // Chunk table: each entry against the one before it (see frame.cpp, parse_frame_header).
      const uint8_t* table = T.frame + chunk_table_offset(T.ndim);
      const uint32_t nch = T.n_chunks, cs = T.chunk_bytes;
      bool bad = false;
      for (uint64_t i = threadIdx.x; i < nch; i += blockDim.x) {
        const uint8_t* e = table + kChunkEntryBytes * i;
        const uint64_t o = ld_le64u(e), size = ld_le32u(e + 8);
        const uint64_t raw_len = umin64(cs, T.nbytes - i * cs);
        uint64_t expect = 0;
        if (i > 0) {
          const uint8_t* pe = e - kChunkEntryBytes;
          expect = align16(ld_le64u(pe) + ld_le32u(pe + 8));
        }
        if (o != expect || size > raw_len || size == 0) bad = true;
        if (i + 1 == nch && o + size != T.payload_bytes) {
          if (!bad) report(a, ti, err_key(kRPayloadSum, 0, 0, kCorrupt));
          s_bad = 1;
        }
      }
      if (nch == 0 && T.payload_bytes != 0) {
        report(a, ti, err_key(kRPayloadSum, 0, 0, kCorrupt));
        s_bad = 1;
      }
      if (bad) {
        report(a, ti, err_key(kRTable, 0, 0, kCorrupt));
        s_bad = 1;
      }
    }
    __syncthreads();
    if (threadIdx.x == 0) T.n_dec = s_bad ? 0 : T.n_chunks;
    __syncthreads();
  }
}

// ---------------------------------------------------------------- 2. scan

__global__ void __launch_bounds__(1024, 1) scan_kernel(DecArgs a) {
  __shared__ uint64_t warp_tot[kClasses][32];
  __shared__ uint64_t carry[kClasses];
  const uint32_t tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  if (tid < kClasses) carry[tid] = 0;
  __syncthreads();
  for (uint32_t b0 = 0; b0 < a.n; b0 += blockDim.x) {
    const uint32_t ti = b0 + tid;
    uint64_t v[kClasses] = {};
    if (ti < a.n) {
      const DecTensor& T = a.t[ti];
      v[0] = T.n_dec;
      // A frame whose header parsed has its class (parse_kernel): its verification tasks, then its chunks to decode.
      if (T.cls > 0 && T.cls < kClasses) v[T.cls] = kVerifyTasks + T.n_dec;
    }
    uint64_t incl[kClasses];
#pragma unroll
    for (uint32_t c = 0; c < kClasses; ++c) {
      incl[c] = warp_inclusive_sum(v[c]);
      if (lane == 31) warp_tot[c][warp] = incl[c];
    }
    __syncthreads();
#pragma unroll
    for (uint32_t c = 0; c < kClasses; ++c) {
      uint64_t before = carry[c], tot = 0;
      for (uint32_t q = 0; q < blockDim.x / 32; ++q) {
        if (q < warp) before += warp_tot[c][q];
        tot += warp_tot[c][q];
      }
      if (ti < a.n) a.base[c][ti] = before + incl[c] - v[c];
      if (ti == a.n - 1) a.base[c][a.n] = before + incl[c];
      __syncthreads();
      if (tid == 0) carry[c] += tot;
    }
    __syncthreads();
  }
}


// ---------------------------------------------------------------- 3. decode: decode_kernel.cuh (decode_k0.cu to decode_k4.cu)

// ---------------------------------------------------------------- 4. errors

// ---------------------------------------------------------------- 4. errors

__global__ void errors_kernel(DecArgs a) {
  for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < a.n; i += gridDim.x * blockDim.x) {
    const unsigned long long k = a.err[i];
    a.errors[i] = k == ~0ull ? int32_t(kOk) : int32_t(k & 0xFF);
  }
}

}  // namespace
}  // namespace dec

using namespace dec;

using namespace dec;

namespace {

/// The workspace of a call of `count` frames: descriptors, error keys and tickets first and contiguous (one upload
/// sets all three), then the per-class prefix sums and the queue of deferred chunks.
struct Workspace {
  size_t b_t, b_err, b_base, b_tickets, b_queue;
  size_t bytes() const { return b_t + b_err + kClasses * b_base + b_tickets + b_queue; }
  size_t image_bytes() const { return b_t + b_err + b_tickets; }
};

Workspace workspace_of(size_t count, uint64_t queue_cap) {
  auto al = [](size_t x) { return (x + 255) & ~size_t(255); };
  return Workspace{al(sizeof(DecTensor) * count), al(8 * count), al(8 * (count + 1)), al(64), al(8 * queue_cap)};
}

/// Checks the items, fills their descriptors and makes their device current through `guard` (opt.device, or the
/// device of every pointer); *queue_cap and *out_total get the queue's size and the output bytes.
Status describe(const DecodeItem* items, size_t count, const DecodeOptions& opt, int32_t* d_errors,
                detail::DeviceGuard* guard, std::vector<DecTensor>* tensors, uint64_t* queue_cap,
                uint64_t* out_total) {
  std::vector<const void*> ptrs;
  Status st;
  if (!items || !d_errors) {
    st.code = kInvalidArgument;
    st.message = "decode: null items or error array";
    return st;
  }
  if (count > UINT32_MAX) {
    st.code = kInvalidArgument;
    st.message = "too many frames in one call";
    return st;
  }
  tensors->assign(count, DecTensor{});
  ptrs.push_back(d_errors);
  *queue_cap = 0;
  *out_total = 0;
  for (size_t i = 0; i < count; ++i) {
    const DecodeItem& it = items[i];
    if ((!it.frame && it.frame_bytes) || (!it.out && it.out_bytes)) {
      st.code = kInvalidArgument;
      st.message = "frame " + std::to_string(i) + ": null pointer with a nonzero size";
      return st;
    }
    DecTensor& t = (*tensors)[i];
    std::memset(&t, 0, sizeof t);
    t.frame = static_cast<const uint8_t*>(it.frame);
    t.frame_len = it.frame ? it.frame_bytes : 0;
    t.out = static_cast<uint8_t*>(it.out);
    t.out_len = it.out_bytes;
    *queue_cap += it.out_bytes / kMinChunkBytes + 1;
    *out_total += it.out_bytes;
    if (it.frame) ptrs.push_back(it.frame);
    if (it.out) ptrs.push_back(it.out);
  }
  return opt.device >= 0 ? guard->bind_device(opt.device) : guard->bind(ptrs.data(), ptrs.size());
}

/// The kernels' arguments over a workspace laid out by `w` at `ws`.
DecArgs args_over(void* ws, const Workspace& w, size_t count, uint64_t queue_cap, bool verify, int32_t* d_errors,
                  const Tuning& tune) {
  uint8_t* p = static_cast<uint8_t*>(ws);
  DecArgs a{};
  a.t = reinterpret_cast<DecTensor*>(p); p += w.b_t;
  a.err = reinterpret_cast<unsigned long long*>(p); p += w.b_err;
  a.tickets = reinterpret_cast<unsigned long long*>(p);
  a.queue_len = a.tickets + 3;
  p += w.b_tickets;
  for (uint32_t c = 0; c < kClasses; ++c) { a.base[c] = reinterpret_cast<uint64_t*>(p); p += w.b_base; }
  a.queue = reinterpret_cast<unsigned long long*>(p);
  a.queue_cap = queue_cap;
  a.n = uint32_t(count);
  a.verify = verify ? 1 : 0;
  a.errors = d_errors;
  a.debug = tune.debug ? 1 : 0;
  a.bf16_class = tune.bf16_kernel ? 1 : 0;
  a.ring_pairs = tune.ring_pairs ? 1 : 0;
  a.warps = uint32_t(std::max(0, tune.decode_warps));
  return a;
}

/// The image the upload copies to the start of the workspace: descriptors, error keys at ~0 (no error), tickets at 0.
std::vector<uint8_t> image_of(const std::vector<DecTensor>& tensors, const Workspace& w) {
  std::vector<uint8_t> image(w.image_bytes(), 0);
  std::memcpy(image.data(), tensors.data(), sizeof(DecTensor) * tensors.size());
  std::memset(image.data() + w.b_t, 0xFF, 8 * tensors.size());
  return image;
}

/// The kernels of a call, in order, on `s` (after its descriptors, error keys and tickets are in place).
Status queue_kernels(const DecArgs& a, int sm_budget, int sms, cudaStream_t s, uint32_t tile_ok, uint32_t defer_all) {
  using namespace detail;
  int grid = 0;
  size_t smem = 0;
  Status r = persistent_grid(reinterpret_cast<const void*>(parse_kernel), 1024, &smem, sm_budget, sms, a.n, &grid);
  if (!r.ok()) return r;
  parse_kernel<<<grid, 1024, smem, s>>>(a);
  if (!(r = check_launch("parse_kernel")).ok()) return r;
  scan_kernel<<<1, 1024, 0, s>>>(a);
  if (!(r = check_launch("scan_kernel")).ok()) return r;
  if (!(r = run_part1(a, sm_budget, sms, s, tile_ok, defer_all)).ok()) return r;
  if (!(r = run_part2(a, sm_budget, sms, s, tile_ok, defer_all)).ok()) return r;
  if (a.bf16_class && !(r = run_part3(a, sm_budget, sms, s, tile_ok, defer_all)).ok()) return r;
  if (a.bf16_class && !(r = run_part4(a, sm_budget, sms, s, tile_ok, defer_all)).ok()) return r;
  if (!(r = run_part0(a, sm_budget, sms, s, 0, 0)).ok()) return r;
  errors_kernel<<<(unsigned)std::min<size_t>((a.n + 255) / 256, 1024), 256, 0, s>>>(a);
  return check_launch("errors_kernel");
}

}  // namespace

Status decode(const DecodeItem* items, size_t count, const DecodeOptions& opt, int32_t* d_errors) {
  using namespace detail;
  if (count == 0) return Status{};
  std::vector<DecTensor> tensors;
  uint64_t queue_cap = 0, out_total = 0;
  DeviceGuard guard;
  Status st = describe(items, count, opt, d_errors, &guard, &tensors, &queue_cap, &out_total);
  if (!st.ok()) return st;
  void* stream = opt.stream;
  const Tuning tune = get_tuning();
  const Workspace w = workspace_of(count, queue_cap);
  void* ws = nullptr;
  st = alloc_async(&ws, w.bytes(), stream);
  if (!st.ok()) return st;
  const DecArgs a = args_over(ws, w, count, queue_cap, opt.verify, d_errors, tune);

  auto fail = [&](Status s) {
    free_async(ws, stream);
    return s;
  };
  const cudaStream_t s = cudaStream_t(stream);
  const int sms = guard.sm_count();
  const uint32_t tile_ok = tune.use_tile_decode ? 1 : 0, defer_all = tune.defer_all ? 1 : 0;
  auto kernels = [&]() -> Status { return queue_kernels(a, opt.sm_budget, sms, s, tile_ok, defer_all); };
  // The error keys start at ~0 (no error) and the tickets at 0. For a batch of up to kInitUploadBytes of them, they go
  // up with the descriptors: a small call's fixed cost is mostly its stream operations (gpu_test --small-calls), and
  // this saves two of them. Such a call of a caller that allows it (opt.graphs) is replayed from a CUDA graph of the
  // whole sequence, kept per stream and everything the kernels' arguments are made of (gpu/graph.h).
  if (w.b_err <= kInitUploadBytes) {
    const std::vector<uint8_t> image = image_of(tensors, w);
    if (opt.graphs && count <= kGraphMaxItems && out_total <= kGraphMaxBytes) {
      GraphKey key;
      key.w = {1, uint64_t(guard.device()), uint64_t(reinterpret_cast<uintptr_t>(stream)), count, a.verify,
               uint64_t(int64_t(opt.sm_budget)), queue_cap, uint64_t(reinterpret_cast<uintptr_t>(ws)),
               uint64_t(reinterpret_cast<uintptr_t>(d_errors)), image.size(),
               uint64_t(tile_ok | defer_all << 1 | a.bf16_class << 2 | a.ring_pairs << 3 | a.debug << 4) |
                   uint64_t(a.warps) << 8,
               uint64_t(sms)};
      if (launch_graph(key, image.data(), image.size(), a.t, stream, kernels)) {
        free_async(ws, stream);
        return Status{};
      }
    }
    if (!(st = upload(a.t, image.data(), image.size(), stream)).ok()) return fail(st);
  } else {
    if (!(st = upload(a.t, tensors.data(), sizeof(DecTensor) * count, stream)).ok()) return fail(st);
    if (!(st = memset_async(a.err, 0xFF, 8 * count, stream)).ok()) return fail(st);
    if (!(st = memset_async(a.tickets, 0, 64, stream)).ok()) return fail(st);
  }
  if (!(st = kernels()).ok()) return fail(st);
  free_async(ws, stream);
  return Status{};
}

// ------------------------------------------------------------------------------------------------ decode plans

struct DecodePlan {
  int device = -1;
  int sm_budget = kDefaultSmBudget;
  int sms = 0;
  uint32_t tile_ok = 1, defer_all = 0;
  void* ws = nullptr;  // cudaMalloc'd: lives as long as the plan
  DecArgs args{};
  // A plan's run is the same ten stream operations every time (two memsets, the kernels), about 48 us of driver time
  // (H100, docs/benchmarks.md): a graph of them is captured at the second eager run (the first fills the launch
  // geometry's caches) and replayed by one cudaGraphLaunch. Runs are ordered by the caller (codec.h), so the plan's
  // own state needs no lock.
  cudaGraphExec_t exec = nullptr;
  int eager_runs = 0;
  bool graph_failed = false;
};

namespace {

/// Captures the plan's run on `s` (not capturing, device current) into plan->exec; false (nothing queued, the stream
/// out of capture mode) on failure.
bool capture_plan(DecodePlan* plan, cudaStream_t s) {
  using namespace detail;
  if (cudaPeekAtLastError() != cudaSuccess) return false;  // the capture's launch checks would take it for their own
  const DecArgs& a = plan->args;
  return capture_exec(s, [&]() -> Status {
    Status st = memset_async(a.err, 0xFF, 8 * size_t(a.n), s);
    if (st.ok()) st = memset_async(a.tickets, 0, 64, s);
    return st.ok() ? queue_kernels(a, plan->sm_budget, plan->sms, s, plan->tile_ok, plan->defer_all) : st;
  }, &plan->exec);
}

}  // namespace

Status decode_plan_create(const DecodeItem* items, size_t count, const DecodeOptions& opt, int32_t* d_errors,
                          DecodePlan** out) {
  using namespace detail;
  if (!out) return Status{kInvalidArgument, "decode_plan_create: null result pointer"};
  *out = nullptr;
  if (count == 0) return Status{kInvalidArgument, "decode_plan_create: a plan needs at least one frame"};
  std::vector<DecTensor> tensors;
  uint64_t queue_cap = 0, out_total = 0;
  DeviceGuard guard;
  Status st = describe(items, count, opt, d_errors, &guard, &tensors, &queue_cap, &out_total);
  if (!st.ok()) return st;
  const Tuning tune = get_tuning();
  const Workspace w = workspace_of(count, queue_cap);
  auto plan = std::make_unique<DecodePlan>();
  cudaError_t e = cudaMalloc(&plan->ws, w.bytes());
  if (e != cudaSuccess) {
    cudaGetLastError();
    plan->ws = nullptr;
    return cuda_status(e, "cudaMalloc of a decode plan's workspace");
  }
  // Synchronous: the descriptors are in place before any stream can run the plan.
  const std::vector<uint8_t> image = image_of(tensors, w);
  e = cudaMemcpy(plan->ws, image.data(), image.size(), cudaMemcpyHostToDevice);
  if (e != cudaSuccess) {
    cudaGetLastError();
    cudaFree(plan->ws);
    return cuda_status(e, "cudaMemcpy of a decode plan's descriptors");
  }
  plan->device = guard.device();
  plan->sm_budget = opt.sm_budget;
  plan->sms = guard.sm_count();
  plan->tile_ok = tune.use_tile_decode ? 1 : 0;
  plan->defer_all = tune.defer_all ? 1 : 0;
  plan->args = args_over(plan->ws, w, count, queue_cap, opt.verify, d_errors, tune);
  *out = plan.release();
  return Status{};
}

Status decode_plan_run(DecodePlan* plan, void* stream) {
  using namespace detail;
  if (!plan) return Status{kInvalidArgument, "decode_plan_run: null plan"};
  DeviceGuard guard;
  Status st = guard.bind_device(plan->device);
  if (!st.ok()) return st;
  const cudaStream_t s = cudaStream_t(stream);
  // Inside the caller's own capture (torch.cuda.graph) the operations join that graph as they are: no graph launch.
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(s, &capturing) != cudaSuccess) {
    cudaGetLastError();
    capturing = cudaStreamCaptureStatusActive;  // (unknown: the plain path is right either way)
  }
  if (capturing == cudaStreamCaptureStatusNone && !plan->graph_failed && plan->eager_runs >= 1) {
    if (!plan->exec && !capture_plan(plan, s)) plan->graph_failed = true;
    if (plan->exec) {
      if (cudaGraphLaunch(plan->exec, s) == cudaSuccess) return Status{};
      cudaGetLastError();  // nothing queued: queue the operations as usual, from now on always
      plan->graph_failed = true;
    }
  }
  if (capturing == cudaStreamCaptureStatusNone) ++plan->eager_runs;
  const DecArgs& a = plan->args;
  // The parse kernel rewrites every parsed field of the descriptors, so only the error keys and tickets start over.
  if (!(st = memset_async(a.err, 0xFF, 8 * size_t(a.n), stream)).ok()) return st;
  if (!(st = memset_async(a.tickets, 0, 64, stream)).ok()) return st;
  return queue_kernels(a, plan->sm_budget, plan->sms, cudaStream_t(stream), plan->tile_ok, plan->defer_all);
}

void decode_plan_destroy(DecodePlan* plan) {
  if (!plan) return;
  detail::DeviceGuard guard;
  if (guard.bind_device(plan->device).ok()) {
    if (plan->exec) cudaGraphExecDestroy(plan->exec);
    cudaFree(plan->ws);
  }
  delete plan;
}

}  // namespace gpu
}  // namespace tzip
