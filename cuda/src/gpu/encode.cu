// GPU frame encoder: the same bytes as tzip::encode_frame (cuda/src/core/frame.cpp + chunk_codec.cpp) for a batch of
// tensors, all on the device.
//
// Launch sequence (one stream, every grid sized by the SM budget, see codec.h):
//   1. auto_hist_kernel + auto_resolve_kernel   (only when some tensor asks for "auto"): the exponent histogram of each
//      such tensor and the integer rule of tzip::resolve_auto, written into the tensor's descriptor.
//   2. the fast encoder (encode_fast.cu), for fast and raw tensors whose input and frame are 16-byte aligned:
//      fast_plan_kernel when any is `fast` (each chunk's plan and offset), then fast_code_kernel for each kind present
//      (raw, bf16, fp16, fp32: coded or copied chunks and their digests).
//   3. digest_kernel (only when encode_kernel has tensors): the digest of each of its chunks' input (format version
//      2), one warp per chunk; the fast encoder's chunks are skipped.
//   4. encode_kernel: one group of 256 threads per chunk (4 groups per 1024-thread block, named barriers). Per chunk:
//      pass 1 reads the chunk (16-byte loads), splits it into streams 4 elements at a time (warp.h, Fam<>::split4) and
//      builds the stream histograms in shared memory (32-way replicated u16 counters: lane-private columns, so the
//      atomics of one warp never collide); one warp per stream then takes the CPU's decisions (CONST / RAW / LUT with
//      the (count desc, symbol asc) ranking by a warp bitonic sort / RANS gate, normalisation and a trial encode);
//      the chunk's stored size is then known, and a decoupled look-back over the chunks of the tensor gives its final
//      offset in the payload; pass 2 re-reads the chunk (now in L2) and writes the sections straight to that offset,
//      exceptions placed with a group-wide scan, RANS words by the stream's warp walking the steps backwards with a
//      ballot per step (same word order as the CPU's rans_encode). The group's code: encode_group.cuh (shared memory,
//      RANS on one warp, planning) and encode_chunk.cuh (one chunk).
//   5. finalize_kernel: per tensor, chunk table, header, checksum and header digest; frame size to the caller's array.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "gpu/codec.h"
#include "gpu/graph.h"
#include "gpu/encode_args.cuh"
#include "gpu/encode_chunk.cuh"
#include "tzip/bitpack.h"
#include "tzip/format.h"
#include "tzip/rans.h"
#include "tzip/warp.h"
#include "tzip/xxhash32.h"

namespace tzip {
namespace gpu {
namespace {

using namespace tzip::dev;
using namespace tzip::gpu::enc;

// ---------------------------------------------------------------- kernels

__global__ void __launch_bounds__(kGroups * kGroupThreads, 1) encode_kernel(EncArgs a) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const uint32_t grp = threadIdx.x / kGroupThreads, tid = threadIdx.x % kGroupThreads;
  GroupSmem& S = reinterpret_cast<GroupSmem*>(smem_raw)[grp];
  const uint32_t bar = 1 + grp;
  for (;;) {
    if (tid == 0) {
      uint32_t t = 0;
      const uint64_t g = draw_chunk<uint32_t(Share::kGeneral)>(a, a.tickets + kTicketEncode, &t);
      S.ticket = g;
      if (g < a.total_chunks) {
        S.tensor = t;
        S.chunk = uint32_t(g - a.tensors[t].chunk_base);
      }
    }
    named_sync(bar, kGroupThreads);
    const uint64_t g = S.ticket;
    if (g >= a.total_chunks) break;
    const EncTensor* t = a.tensors + S.tensor;
    ChunkJob job;
    job.t = t;
    job.g = g;
    job.i = S.chunk;
    const uint64_t begin = uint64_t(job.i) * a.chunk_bytes;
    job.in = t->in + begin;
    job.raw_len = uint32_t(umin64(a.chunk_bytes, t->nbytes - begin));
    job.codec = Codec(t->codec);
    job.last = job.i + 1 == t->n_chunks;
    if (job.codec == Codec::RAW) {
      if (tid < 32) {
        const uint64_t o = warp_look_back(a, job.g, job.i, job.raw_len);
        if (tid == 0) {
          S.offset = o;
          a.offsets[g] = o;
          a.sizes[g] = job.raw_len;
        }
      }
      named_sync(bar, kGroupThreads);
      threads_copy<kGroupThreads>(t->out + t->header_bytes + S.offset, job.in, job.raw_len, tid);
    } else {
      switch (family_of(Dtype(t->dtype), job.codec)) {
        case kFamBF16: encode_chunk<kFamBF16>(S, a, job, tid, bar); break;
        case kFamF16: encode_chunk<kFamF16>(S, a, job, tid, bar); break;
        case kFamF32: encode_chunk<kFamF32>(S, a, job, tid, bar); break;
        case kFamP1: encode_chunk<kFamP1>(S, a, job, tid, bar); break;
        case kFamP2: encode_chunk<kFamP2>(S, a, job, tid, bar); break;
        case kFamP4: encode_chunk<kFamP4>(S, a, job, tid, bar); break;
        default: encode_chunk<kFamP8>(S, a, job, tid, bar); break;
      }
    }
    named_sync(bar, kGroupThreads);
  }
}

/// Digest of each chunk's input (format version 2: xxhash32.h, chunk_digest), one warp per chunk, coalesced 16-byte
/// loads; consecutive chunks go to different blocks so that every SM of the grid gets work even when there are few.
__global__ void __launch_bounds__(1024, 1) digest_kernel(EncArgs a) {
  const uint32_t warps = blockDim.x / 32, w = threadIdx.x / 32;
  const uint64_t stride = uint64_t(gridDim.x) * warps;
  for (uint64_t g = uint64_t(w) * gridDim.x + blockIdx.x; g < a.total_chunks; g += stride) {
    const uint32_t t = find_tensor(a.tensors, a.n_tensors, g);
    const EncTensor& T = a.tensors[t];
    if (fast_kernel_takes(a, T)) continue;  // the fast encoder digests its chunks as it codes them
    const ChunkSpan c = chunk_span(a, T, g);
    const uint32_t d = warp_chunk_digest(T.in + c.begin, c.len);
    if (lane_id() == 0) a.digests[g] = d;
  }
}

/// Per tensor: chunk table, header (with checksum and header digest), frame size. Warp 0 computes the checksum while
/// the block writes the table, then the header digest over what the block wrote.
__global__ void __launch_bounds__(1024, 1) finalize_kernel(EncArgs a) {
  __shared__ uint32_t s_checksum;
  const uint32_t lane = lane_id();
  for (uint32_t ti = blockIdx.x; ti < a.n_tensors; ti += gridDim.x) {
    const EncTensor& T = a.tensors[ti];
    uint8_t* f = T.out;
    const uint32_t ndim = T.ndim;
    const uint64_t table = chunk_table_offset(ndim);
    const uint64_t nd = T.n_chunks;
    const uint32_t* dg = a.digests + T.chunk_base;
    if (threadIdx.x < 32) {
      Xxh32 cs;
      warp_stripes(cs, nd / 4, [&](uint64_t i) { return make_uint4(dg[4 * i], dg[4 * i + 1], dg[4 * i + 2], dg[4 * i + 3]); });
      if (lane == 0) {
        uint8_t tail[16];
        const uint64_t i0 = nd / 4 * 4;
        for (uint64_t k = i0; k < nd; ++k) store_le32(tail + 4 * (k - i0), dg[k]);
        s_checksum = cs.finish(tail, uint32_t(4 * (nd - i0)));
      }
    }
    for (uint64_t i = threadIdx.x; i < nd; i += blockDim.x) {
      const uint64_t g = T.chunk_base + i;
      uint8_t* e = f + table + kChunkEntryBytes * i;
      if (aligned16(e)) {
        const uint64_t o = a.offsets[g];
        *reinterpret_cast<uint4*>(e) = make_uint4(uint32_t(o), uint32_t(o >> 32), a.sizes[g], a.digests[g]);
      } else {
        st_bytes(e, a.offsets[g], 8);
        st_bytes(e + 8, a.sizes[g], 4);
        st_bytes(e + 12, a.digests[g], 4);
      }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      const uint64_t payload = nd ? a.offsets[T.chunk_base + nd - 1] + a.sizes[T.chunk_base + nd - 1] : 0;
      uint8_t h[kFixedHeaderBytes];
      for (uint32_t k = 0; k < kFixedHeaderBytes; ++k) h[k] = 0;
      store_le32(h + kOffMagic, kFrameMagic);
      store_le16(h + kOffVersion, kFormatVersion);
      h[kOffDtype] = T.dtype;
      h[kOffCodec] = T.codec;
      h[kOffNdim] = uint8_t(ndim);
      store_le32(h + kOffChunkBytes, a.chunk_bytes);
      store_le64(h + kOffNbytes, T.nbytes);
      store_le64(h + kOffPayloadBytes, payload);
      store_le32(h + kOffNumChunks, T.n_chunks);
      store_le32(h + kOffChecksum, s_checksum);
      for (uint32_t k = 0; k < kFixedHeaderBytes; ++k) f[k] = h[k];
      for (uint32_t d = 0; d < ndim; ++d) st_bytes(f + kOffShape + 8 * d, a.shapes[T.shape_off + d], 8);
      zero_bytes(f + kOffShape + 8 * ndim, table - (kOffShape + 8 * ndim));
      a.frame_bytes[ti] = T.header_bytes + payload;
    }
    __syncthreads();
    if (threadIdx.x < 32) {
      Xxh32 hd;
      warp_stripes(hd, T.header_bytes / 16, [&](uint64_t i) { return ld_stripe(f + 16 * i); });
      if (lane == 0) st_bytes(f + kOffHeaderDigest, hd.finish(f, 0), 4);
    }
    __syncthreads();
  }
}

// ---------------------------------------------------------------- auto

/// Exponent histogram (the FAST split's stream 0) of every auto tensor: one block per chunk at a time, replicated
/// u16 counters per chunk, accumulated per block in u64 and flushed to the tensor's global histogram.
__global__ void __launch_bounds__(1024, 1) auto_hist_kernel(EncArgs a) {
  __shared__ uint32_t rep[128 * 32];
  __shared__ unsigned long long acc[256];
  __shared__ unsigned long long s_g;
  __shared__ uint32_t s_t;
  uint32_t cur = 0xFFFFFFFFu;
  const uint32_t tid = threadIdx.x, lane = tid & 31;
  for (uint32_t i = tid; i < 256; i += blockDim.x) acc[i] = 0;
  for (;;) {
    for (uint32_t i = tid; i < 128 * 32; i += blockDim.x) rep[i] = 0;
    if (tid == 0) {
      unsigned long long g;
      uint32_t t = 0;
      for (;;) {  // next chunk of an auto tensor
        g = atomicAdd(a.tickets + kTicketAutoHist, 1ull);
        if (g >= a.total_chunks) break;
        t = find_tensor(a.tensors, a.n_tensors, g);
        if (a.tensors[t].is_auto) break;
      }
      s_g = g;
      s_t = t;
    }
    __syncthreads();
    const unsigned long long g = s_g;
    const uint32_t t = g < a.total_chunks ? s_t : 0xFFFFFFFFu;
    if (t != cur) {  // flush the block's histogram of the previous tensor
      if (cur != 0xFFFFFFFFu)
        for (uint32_t i = tid; i < 256; i += blockDim.x) {
          if (acc[i]) atomicAdd(a.auto_hist + 256ull * a.tensors[cur].auto_slot + i, acc[i]);
          acc[i] = 0;
        }
      cur = t;
    }
    if (g >= a.total_chunks) break;
    const EncTensor& T = a.tensors[t];
    const ChunkSpan c = chunk_span(a, T, g);
    const uint64_t begin = c.begin;
    const uint32_t len = c.len;
    const Dtype d = Dtype(T.dtype);
    const uint32_t es = dtype_size(d);
    const uint32_t n = len / es;
    __syncthreads();
    for (uint32_t s = tid; s * 64 < len; s += blockDim.x) {
      uint32_t wd[16];
      load_slice(T.in + begin + s * 64, min(64u, len - s * 64), wd);
      const uint32_t ept = 64 / es, nvalid = min(ept, n - s * ept);
      for (uint32_t q = 0; q * 4 < nvalid; ++q) {
        uint32_t sy[4];
        if (d == Dtype::BF16) Fam<kFamBF16>::split4(wd + 2 * q, sy);
        else if (d == Dtype::F16) Fam<kFamF16>::split4(wd + 2 * q, sy);
        else Fam<kFamF32>::split4(wd + 4 * q, sy);
        const uint32_t vc = min(4u, nvalid - 4 * q);
        for (uint32_t e = 0; e < vc; ++e) {
          const uint32_t b = byte_of(sy[0], e);
          atomicAdd(&rep[(b >> 1) * 32 + lane], 1u << ((b & 1) << 4));
        }
      }
    }
    __syncthreads();
    for (uint32_t b = tid; b < 256; b += blockDim.x) {
      const uint32_t row = b >> 1, sh = (b & 1) << 4;
      uint32_t c = 0;
      for (uint32_t r = 0; r < 32; ++r) c += (rep[row * 32 + ((r + row) & 31)] >> sh) & 0xFFFFu;
      acc[b] += c;
    }
    __syncthreads();
  }
}

/// One warp per auto tensor: tzip::resolve_auto's rule on the histogram.
__global__ void __launch_bounds__(256, 1) auto_resolve_kernel(EncArgs a) {
  const uint32_t lane = lane_id();
  const uint32_t warps = gridDim.x * (blockDim.x / 32);
  for (uint32_t ti = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; ti < a.n_tensors; ti += warps) {
    EncTensor& T = a.tensors[ti];
    if (!T.is_auto) continue;
    const Dtype d = Dtype(T.dtype);
    const uint64_t n = T.nbytes / dtype_size(d);
    Codec c = Codec::FAST;
    if (n > 0) {
      const unsigned long long* h = a.auto_hist + 256ull * T.auto_slot;
      unsigned long long key[8];
      const uint32_t ln = log2_fixed16(n);
      uint64_t cost = 0;
#pragma unroll
      for (int r = 0; r < 8; ++r) {
        const unsigned long long v = h[lane * 8 + r];
        key[r] = (v << 8) | (255u - (lane * 8 + r));
        if (v) cost += v * (ln - log2_fixed16(v));
      }
      cost = warp_sum(cost);
      warp_sort256_desc(key);
      unsigned long long pre[8], run = 0;
#pragma unroll
      for (int r = 0; r < 8; ++r) { run += key[r] >> 8; pre[r] = run; }
      const unsigned long long base = warp_inclusive_sum(run) - run;
      const uint32_t w = d == Dtype::F16 ? 5 : 8;
      uint64_t fast_bits = uint64_t(w) * n;
      for (uint32_t k = 1; k < w; ++k) {
        const uint32_t idx = (1u << k) - 2;
        unsigned long long v = 0;
#pragma unroll
        for (int r = 0; r < 8; ++r) if (uint32_t(r) == (idx & 7)) v = pre[r];
        const uint64_t covered = __shfl_sync(kFull, base + v, idx >> 3);
        fast_bits = umin64(fast_bits, uint64_t(k) * n + 8 * (n - covered));
      }
      const uint64_t max_bits = cost >> 16;
      if (fast_bits > max_bits && (fast_bits - max_bits) * 100 >= 2ull * 8 * T.nbytes) c = Codec::MAX;
    }
    if (lane == 0) T.codec = uint8_t(c);
  }
}

/// Zeroed workspace (tickets, look-back words) up to this size goes up with the descriptors instead of a memset.
constexpr size_t kZeroUploadBytes = size_t(64) << 10;

Status invalid(const std::string& m) {
  Status s;
  s.code = kInvalidArgument;
  s.message = m;
  return s;
}

}  // namespace

Status encode(const EncodeItem* items, size_t count, const EncodeOptions& opt, uint64_t* d_frame_bytes) {
  using namespace detail;
  if (count == 0) return Status{};
  if (!items || !d_frame_bytes) return invalid("encode: null items or frame size array");
  const uint32_t cs = opt.chunk_bytes;
  if (cs < kMinChunkBytes || cs > kMaxChunkBytes || cs % kChunkBytesMultiple != 0)
    return invalid("chunk size " + std::to_string(cs) + " must be a multiple of 256 between 4096 and 65536 bytes");
  if (count > UINT32_MAX) return invalid("too many tensors in one call");

  std::vector<EncTensor> tensors(count);
  std::vector<uint64_t> shapes;
  std::vector<const void*> ptrs;
  ptrs.push_back(d_frame_bytes);
  uint64_t total_chunks = 0, in_total = 0;
  uint32_t n_auto = 0;
  const bool use_fast = get_tuning().fast_encoder;
  bool need_general = false;
  uint32_t fast_kinds = 0;  // CodeKind bits of the fast encoder's tensors (none: it is not launched)
  for (size_t i = 0; i < count; ++i) {
    const EncodeItem& it = items[i];
    const std::string who = "tensor " + std::to_string(i) + ": ";
    if (it.dtype >= kNumDtypes) return invalid(who + "unknown dtype code " + std::to_string(it.dtype));
    if (it.codec >= kNumCodecs && it.codec != kCodecAuto) return invalid(who + "unknown codec id");
    if (it.ndim > kMaxNdim) return invalid(who + "at most 32 dimensions are supported");
    if (it.ndim && !it.shape) return invalid(who + "null shape");
    const Dtype d = Dtype(it.dtype);
    unsigned __int128 total = dtype_size(d);
    bool overflow = false, zero = false;
    for (uint32_t k = 0; k < it.ndim; ++k) {
      if (it.shape[k] == 0) zero = true;
      total *= it.shape[k];
      if (total > UINT64_MAX) overflow = true;
    }
    const uint64_t expect = zero ? 0 : overflow ? ~0ull : uint64_t(total);
    if ((overflow && !zero) || expect != it.nbytes)
      return invalid(who + "input is " + std::to_string(it.nbytes) + " bytes but the shape needs " +
                     std::to_string(expect));
    if (!it.frame) return invalid(who + "null frame pointer");
    if (it.nbytes && !it.data) return invalid(who + "null data pointer");
    const uint64_t nch = num_chunks(it.nbytes, cs);
    if (nch > UINT32_MAX) return invalid(who + "tensor too large for one frame");
    EncTensor& t = tensors[i];
    std::memset(&t, 0, sizeof t);
    t.in = static_cast<const uint8_t*>(it.data);
    t.out = static_cast<uint8_t*>(it.frame);
    t.nbytes = it.nbytes;
    t.chunk_base = total_chunks;
    t.n_chunks = uint32_t(nch);
    t.header_bytes = frame_header_bytes(it.ndim, nch);
    t.shape_off = shapes.size();
    t.dtype = it.dtype;
    t.ndim = uint8_t(it.ndim);
    Codec c = it.codec == kCodecAuto ? Codec::MAX : Codec(it.codec);
    if (it.codec == kCodecAuto) {
      if (!dtype_is_split_float(d)) c = Codec::BYTES;
      else if (it.nbytes < dtype_size(d)) c = Codec::FAST;
      else { t.is_auto = 1; t.auto_slot = n_auto++; c = Codec::FAST; }
    }
    if ((c == Codec::FAST || c == Codec::MAX) && !dtype_is_split_float(d)) c = Codec::BYTES;
    t.codec = uint8_t(c);
    t.aligned = ((reinterpret_cast<uintptr_t>(it.data) | reinterpret_cast<uintptr_t>(it.frame)) & 15) == 0;
    // Which coding kernels the batch needs: an auto tensor may resolve to fast or max on the device.
    if (nch) {
      const bool fast_able = use_fast && t.aligned && (c == Codec::FAST || c == Codec::RAW);
      if (fast_able) fast_kinds |= 1u << code_kind(t.dtype, t.codec);
      need_general |= !fast_able || t.is_auto;
    }
    for (uint32_t k = 0; k < it.ndim; ++k) shapes.push_back(it.shape[k]);
    total_chunks += nch;
    in_total += it.nbytes;
    ptrs.push_back(it.frame);
    if (it.nbytes) ptrs.push_back(it.data);
  }

  DeviceGuard guard;
  Status st = opt.device >= 0 ? guard.bind_device(opt.device) : guard.bind(ptrs.data(), ptrs.size());
  if (!st.ok()) return st;
  void* stream = opt.stream;

  // Workspace: descriptors, shapes, tickets, look-back words, offsets, sizes, digests, auto histograms, fast plans.
  auto al = [](size_t x) { return (x + 255) & ~size_t(255); };
  const size_t b_tensors = al(sizeof(EncTensor) * count), b_shapes = al(8 * std::max<size_t>(1, shapes.size())),
               b_tickets = al(8 * kNumTickets), b_status = al(8 * total_chunks), b_offsets = al(8 * total_chunks),
               b_sizes = al(4 * total_chunks), b_digests = al(4 * total_chunks), b_hist = al(8 * 256ull * n_auto),
               b_plans = (fast_kinds & ~(1u << kCodeRaw)) ? al(sizeof(FastPlan) * total_chunks) : 0;
  const size_t total = b_tensors + b_shapes + b_tickets + b_status + b_offsets + b_sizes + b_digests + b_hist + b_plans;
  void* ws = nullptr;
  st = alloc_async(&ws, total, stream);
  if (!st.ok()) return st;
  uint8_t* p = static_cast<uint8_t*>(ws);
  EncArgs a{};
  a.tensors = reinterpret_cast<EncTensor*>(p); p += b_tensors;
  uint64_t* d_shapes = reinterpret_cast<uint64_t*>(p); p += b_shapes;
  a.tickets = reinterpret_cast<unsigned long long*>(p); p += b_tickets;
  a.status = reinterpret_cast<unsigned long long*>(p); p += b_status;
  a.offsets = reinterpret_cast<unsigned long long*>(p); p += b_offsets;
  a.sizes = reinterpret_cast<uint32_t*>(p); p += b_sizes;
  a.digests = reinterpret_cast<uint32_t*>(p); p += b_digests;
  a.auto_hist = reinterpret_cast<unsigned long long*>(p); p += b_hist;
  a.plans = b_plans ? reinterpret_cast<FastPlan*>(p) : nullptr; p += b_plans;
  a.shapes = d_shapes;
  a.n_tensors = uint32_t(count);
  a.chunk_bytes = cs;
  a.total_chunks = total_chunks;
  a.frame_bytes = d_frame_bytes;
  a.use_fast = use_fast;

  auto fail = [&](Status s) {
    free_async(ws, stream);
    return s;
  };
  // Descriptors, shapes, tickets and look-back words are contiguous. One upload brings the descriptors and shapes and,
  // when they are few (kZeroUploadBytes), the zeroed tickets and look-back words too: a small call's fixed cost is
  // mostly its stream operations (gpu_test --small-calls), and this saves two of them.
  const bool zeros_too = b_tickets + b_status <= kZeroUploadBytes;
  const cudaStream_t s = cudaStream_t(stream);
  const int sms = guard.sm_count();
  // The memsets and kernels of the call, in order (queued after the descriptors' upload).
  auto kernels = [&]() -> Status {
    Status r;
    if (!zeros_too && !(r = memset_async(a.tickets, 0, b_tickets + b_status, stream)).ok()) return r;
    if (n_auto && !(r = memset_async(a.auto_hist, 0, 8 * 256ull * n_auto, stream)).ok()) return r;
    int grid = 0;
    size_t smem = 0;
    if (n_auto) {
      if (!(r = persistent_grid(reinterpret_cast<const void*>(auto_hist_kernel), 1024, &smem, opt.sm_budget, sms,
                                total_chunks, &grid)).ok())
        return r;
      auto_hist_kernel<<<grid, 1024, smem, s>>>(a);
      if (!(r = check_launch("auto_hist_kernel")).ok()) return r;
      smem = 0;
      if (!(r = persistent_grid(reinterpret_cast<const void*>(auto_resolve_kernel), 256, &smem, opt.sm_budget, sms,
                                (count + 7) / 8, &grid)).ok())
        return r;
      auto_resolve_kernel<<<grid, 256, smem, s>>>(a);
      if (!(r = check_launch("auto_resolve_kernel")).ok()) return r;
    }
    if (fast_kinds && !(r = launch_fast_encode(a, fast_kinds, opt.sm_budget, sms, s)).ok()) return r;
    if (need_general) {
      smem = 0;
      if (!(r = persistent_grid(reinterpret_cast<const void*>(digest_kernel), 1024, &smem, opt.sm_budget, sms,
                                total_chunks, &grid)).ok())
        return r;
      digest_kernel<<<grid, 1024, smem, s>>>(a);
      if (!(r = check_launch("digest_kernel")).ok()) return r;
      smem = sizeof(GroupSmem) * kGroups;
      if (!(r = persistent_grid(reinterpret_cast<const void*>(encode_kernel), kGroups * kGroupThreads, &smem,
                                opt.sm_budget, sms, (total_chunks + kGroups - 1) / kGroups, &grid)).ok())
        return r;
      encode_kernel<<<grid, kGroups * kGroupThreads, smem, s>>>(a);
      if (!(r = check_launch("encode_kernel")).ok()) return r;
    }
    smem = 0;
    if (!(r = persistent_grid(reinterpret_cast<const void*>(finalize_kernel), 1024, &smem, opt.sm_budget, sms, count,
                              &grid)).ok())
      return r;
    finalize_kernel<<<grid, 1024, smem, s>>>(a);
    return check_launch("finalize_kernel");
  };
  {
    std::vector<uint8_t> image(b_tensors + b_shapes + (zeros_too ? b_tickets + b_status : 0), 0);
    std::memcpy(image.data(), tensors.data(), sizeof(EncTensor) * count);
    if (!shapes.empty()) std::memcpy(image.data() + b_tensors, shapes.data(), 8 * shapes.size());
    // A small call of a caller that allows it (opt.graphs) is replayed from a CUDA graph of the whole sequence, kept
    // per stream and everything the kernels' arguments are made of (gpu/graph.h).
    if (opt.graphs && count <= kGraphMaxItems && in_total <= kGraphMaxBytes) {
      GraphKey key;
      key.w = {2, uint64_t(guard.device()), uint64_t(reinterpret_cast<uintptr_t>(stream)), count, cs, total_chunks,
               shapes.size(), n_auto, uint64_t(need_general << 1 | use_fast << 2 | zeros_too << 3 | fast_kinds << 4),
               uint64_t(int64_t(opt.sm_budget)), uint64_t(reinterpret_cast<uintptr_t>(ws)),
               uint64_t(reinterpret_cast<uintptr_t>(d_frame_bytes)), image.size(), uint64_t(sms)};
      if (launch_graph(key, image.data(), image.size(), a.tensors, stream, kernels)) {
        free_async(ws, stream);
        return Status{};
      }
    }
    if (!(st = upload(a.tensors, image.data(), image.size(), stream)).ok()) return fail(st);
  }
  if (!(st = kernels()).ok()) return fail(st);
  free_async(ws, stream);
  return Status{};
}

}  // namespace gpu
}  // namespace tzip

