// Encoder (encode.cu, step 4): one chunk coded by one group, pass 1 (split, histograms, plans, the chunk's offset by
// decoupled look-back) and pass 2 (sections written at that offset).
#pragma once

#include "gpu/encode_group.cuh"

namespace tzip {
namespace gpu {
namespace {

using namespace tzip::dev;
using namespace tzip::gpu::enc;

// ---------------------------------------------------------------- one chunk, one group

struct ChunkJob {
  const EncTensor* t;
  uint64_t g;          // global chunk index
  uint32_t i;          // chunk index in the tensor
  const uint8_t* in;
  uint32_t raw_len;
  Codec codec;
  bool last;
};

template <uint32_t FID>
__device__ void encode_chunk(GroupSmem& S, const EncArgs& a, const ChunkJob job, uint32_t tid, uint32_t bar) {
  using F = Fam<FID>;
  constexpr uint32_t E = F::kEsize, NS = F::kCount, EPT = 64 / E, G4 = EPT / 4;
  const uint32_t warp = tid / 32, lane = tid % 32;
  const uint32_t n = job.raw_len / E;
  const Codec codec = job.codec;
  const bool fast = codec == Codec::FAST;
  const uint32_t nh = fast ? 1 : NS;
  // u32 counters, R replicas per bin (lane % R picks the replica: one warp's atomics never collide when R == 32).
  const uint32_t R = nh <= 1 ? 32 : nh <= 2 ? 16 : nh <= 4 ? 8 : 4;
  const uint32_t nslices = (job.raw_len + 63) / 64;

  // ---- pass 1: histograms (and the all-equal test of streams that only choose CONST or RAW)
  for (uint32_t w = tid; w < nh * 256 * R; w += kGroupThreads) S.hist[w] = 0;
  uint32_t first[NS];
  {
    uint32_t w0[16];
    load_slice(job.in, E, w0);
    uint32_t s0[NS];
    F::split4(w0, s0);
#pragma unroll
    for (uint32_t j = 0; j < NS; ++j) first[j] = s0[j] & 0xFFu;
  }
  named_sync(bar, kGroupThreads);
  uint32_t neq = 0;
  for (uint32_t s = tid; s < nslices; s += kGroupThreads) {
    uint32_t wd[16];
    const uint32_t off = s * 64;
    load_slice(job.in + off, min(64u, job.raw_len - off), wd);
    const uint32_t nvalid = min(EPT, n - s * EPT);
#pragma unroll
    for (uint32_t q = 0; q < G4; ++q) {
      uint32_t sy[NS];
      F::split4(wd + q * E, sy);
      const uint32_t vc = nvalid > 4 * q ? min(4u, nvalid - 4 * q) : 0u;
      const uint32_t bmask = vc >= 4 ? 0xFFFFFFFFu : (1u << (8 * vc)) - 1u;
#pragma unroll
      for (uint32_t j = 0; j < NS; ++j) {
        if (fast && j > 0) {
          if ((sy[j] ^ rep4(first[j])) & bmask) neq |= 1u << j;
        } else {
          uint32_t* h = S.hist + j * 256 * R + (lane & (R - 1));
          if (vc == 4) {
#pragma unroll
            for (uint32_t e = 0; e < 4; ++e) atomicAdd(h + byte_of(sy[j], e) * R, 1u);
          } else {
            for (uint32_t e = 0; e < vc; ++e) atomicAdd(h + byte_of(sy[j], e) * R, 1u);
          }
        }
      }
    }
  }
  neq = warp_or(neq);
  if (lane == 0) S.warp_or[warp] = neq;
  named_sync(bar, kGroupThreads);
  {
    uint32_t cnt[NS];
    const uint32_t b = tid;
#pragma unroll
    for (uint32_t j = 0; j < NS; ++j) {
      cnt[j] = 0;
      if (j < nh) {
        const uint32_t* h = S.hist + (j * 256 + b) * R;
        for (uint32_t r = 0; r < R; ++r) cnt[j] += h[(r + b) & (R - 1)];
      }
    }
    named_sync(bar, kGroupThreads);
#pragma unroll
    for (uint32_t j = 0; j < NS; ++j)
      if (j < nh) S.hist[kCountsOff + 256 * j + b] = cnt[j];
  }
  named_sync(bar, kGroupThreads);

  // ---- decisions
  if (warp < NS) {
#pragma unroll
    for (uint32_t j = 0; j < NS; ++j)
      if (j == warp) plan_stream<F>(S, job.in, n, codec, j, first[j]);
  }
  named_sync(bar, kGroupThreads);

  // ---- layout, size, look-back
  if (tid == 0) {
    uint64_t off = chunk_sections_offset(NS);
    for (uint32_t j = 0; j < NS; ++j) {
      off = align16(off);
      S.plan[j].sec = uint32_t(off);
      off += S.plan[j].bytes;
    }
    const bool raw = align16(off) >= job.raw_len;
    S.raw = raw;
    S.size = raw ? job.raw_len : uint32_t(off);
  }
  if (warp == 0) {
    __syncwarp();
    const uint64_t o = warp_look_back(a, job.g, job.i, S.size);
    if (tid == 0) {
      S.offset = o;
      a.offsets[job.g] = o;
      a.sizes[job.g] = S.size;
    }
  }
  named_sync(bar, kGroupThreads);
  uint8_t* dst = job.t->out + job.t->header_bytes + S.offset;
  if (S.raw) {
    threads_copy<kGroupThreads>(dst, job.in, job.raw_len, tid);
    return;
  }
  const uint32_t size = S.size;

  // ---- pass 2: chunk header, section headers and paddings (thread 0), then the data
  if (tid == 0) {
    put_chunk_header(dst, NS, n);
    uint32_t end = kChunkHeaderBytes;
    for (uint32_t j = 0; j < NS; ++j) {
      const StreamPlan& p = S.plan[j];
      put_descriptor(dst, j, p.mode, p.param, p.bytes);
      end += kStreamDescriptorBytes;
    }
    for (uint32_t j = 0; j < NS; ++j) {
      const StreamPlan& p = S.plan[j];
      zero_bytes(dst + end, p.sec - end);
      end = p.sec + p.bytes;
      uint8_t* sec = dst + p.sec;
      if (p.mode == uint32_t(StreamMode::LUT)) {
        const uint32_t k = p.param, cap = (1u << k) - 1;
        st_bytes(sec, p.n_exc, 4);
        const uint8_t* lut = reinterpret_cast<const uint8_t*>(S.hist + kLutOff) + 128 * j;
        for (uint32_t i = 0; i < cap; ++i) sec[4 + i] = lut[i];
        zero_bytes(sec + 4 + cap, lut_codes_offset(k) - 4 - cap);
        const uint64_t codes_end = lut_codes_offset(k) + packed_bytes(n, k);
        zero_bytes(sec + codes_end, lut_exceptions_offset(k, n) - codes_end);
      }
    }
    if (!job.last) zero_bytes(dst + size, align16(size) - size);
  }

  bool any_data = false, any_lut = false, any_rans = false;
#pragma unroll
  for (uint32_t j = 0; j < NS; ++j) {
    const uint32_t m = S.plan[j].mode;
    any_data |= m == uint32_t(StreamMode::RAW) || m == uint32_t(StreamMode::LUT);
    any_lut |= m == uint32_t(StreamMode::LUT);
    any_rans |= m == uint32_t(StreamMode::RANS);
  }
  if (any_data) {
    uint32_t exc_base[NS];
#pragma unroll
    for (uint32_t j = 0; j < NS; ++j) exc_base[j] = 0;
    const uint32_t iters = (nslices + kGroupThreads - 1) / kGroupThreads;
    for (uint32_t it = 0; it < iters; ++it) {
      const uint32_t s = it * kGroupThreads + tid;
      const bool active = s < nslices;
      uint32_t wd[16];
      const uint32_t off = s * 64;
      if (active) load_slice(job.in + off, min(64u, job.raw_len - off), wd);
      else {
#pragma unroll
        for (int i = 0; i < 16; ++i) wd[i] = 0;
      }
      const uint32_t nvalid = active ? min(EPT, n - s * EPT) : 0u;
      uint32_t sy[NS][G4];
#pragma unroll
      for (uint32_t q = 0; q < G4; ++q) {
        uint32_t t4[NS];
        F::split4(wd + q * E, t4);
        const uint32_t vc = nvalid > 4 * q ? min(4u, nvalid - 4 * q) : 0u;
        const uint32_t bmask = vc >= 4 ? 0xFFFFFFFFu : (1u << (8 * vc)) - 1u;
#pragma unroll
        for (uint32_t j = 0; j < NS; ++j) sy[j][q] = t4[j] & bmask;
      }
      uint32_t ecnt[NS], emine = 0;
#pragma unroll
      for (uint32_t j = 0; j < NS; ++j) {
        ecnt[j] = 0;
        const StreamPlan& p = S.plan[j];
        if (!active) continue;
        const uint32_t w = F::width(j);
        if (p.mode == uint32_t(StreamMode::RAW)) {
          if (w == 8) {
            uint8_t* o = dst + p.sec + s * EPT;
            if (nvalid == EPT && (reinterpret_cast<uintptr_t>(o) & 15) == 0) {
#pragma unroll
              for (uint32_t q = 0; q < G4; q += 4) {
                if constexpr (G4 >= 4) {
                  *reinterpret_cast<uint4*>(o + 4 * q) = make_uint4(sy[j][q], sy[j][q + 1], sy[j][q + 2], sy[j][q + 3]);
                }
              }
              if constexpr (G4 < 4) {
#pragma unroll
                for (uint32_t q = 0; q < G4; ++q) st_bytes(o + 4 * q, sy[j][q], 4);
              }
            } else {
#pragma unroll
              for (uint32_t q = 0; q < G4; ++q) {
                const uint32_t vc = nvalid > 4 * q ? min(4u, nvalid - 4 * q) : 0u;
                if (vc) st_bytes(o + 4 * q, sy[j][q], vc);
              }
            }
          } else {
            BitWriter bw(dst + p.sec + s * EPT * w / 8, (nvalid * w + 7) / 8);
#pragma unroll
            for (uint32_t q = 0; q < G4; ++q) bw.put(pack4(sy[j][q], w), 4 * w);
            bw.flush();
          }
        } else if (p.mode == uint32_t(StreamMode::LUT)) {
          const uint32_t k = p.param, esc = (1u << k) - 1;
          const uint8_t* code_of = reinterpret_cast<const uint8_t*>(S.hist + kCodeOfOff) + 256 * j;
          BitWriter bw(dst + p.sec + lut_codes_offset(k) + s * EPT * k / 8, (nvalid * k + 7) / 8);
#pragma unroll
          for (uint32_t q = 0; q < G4; ++q) {
            uint32_t codes = 0;
#pragma unroll
            for (uint32_t e = 0; e < 4; ++e) {
              const bool valid = 4 * q + e < nvalid;
              const uint32_t c = valid ? code_of[byte_of(sy[j][q], e)] : 0u;
              ecnt[j] += valid && c == esc;
              codes |= c << (e * k);
            }
            bw.put(codes, 4 * k);
          }
          bw.flush();
        }
      }
      if (any_lut) {
        const uint32_t par = it & 1;
#pragma unroll
        for (uint32_t j = 0; j < NS; ++j) {
          if (S.plan[j].mode != uint32_t(StreamMode::LUT)) continue;
          const uint32_t incl = warp_inclusive_sum(ecnt[j]);
          if (lane == 31) S.scan[par][j][warp] = incl;
          emine |= uint32_t(ecnt[j] != 0) << j;
          ecnt[j] = incl - ecnt[j];  // exclusive within the warp
        }
        named_sync(bar, kGroupThreads);
#pragma unroll
        for (uint32_t j = 0; j < NS; ++j) {
          const StreamPlan& p = S.plan[j];
          if (p.mode != uint32_t(StreamMode::LUT)) continue;
          uint32_t before = 0, total = 0;
#pragma unroll
          for (uint32_t q = 0; q < kGroupWarps; ++q) {
            const uint32_t v = S.scan[par][j][q];
            if (q < warp) before += v;
            total += v;
          }
          uint32_t idx = exc_base[j] + before + ecnt[j];
          exc_base[j] += total;
          if (!active || !((emine >> j) & 1)) continue;
          const uint32_t k = p.param, esc = (1u << k) - 1;
          const uint8_t* code_of = reinterpret_cast<const uint8_t*>(S.hist + kCodeOfOff) + 256 * j;
          uint8_t* exc = dst + p.sec + lut_exceptions_offset(k, n);
#pragma unroll
          for (uint32_t q = 0; q < G4; ++q) {
#pragma unroll
            for (uint32_t e = 0; e < 4; ++e) {
              const uint32_t sym = byte_of(sy[j][q], e);
              if (4 * q + e < nvalid && code_of[sym] == esc) exc[idx++] = uint8_t(sym);
            }
          }
        }
      }
    }
  }
  if (any_rans && warp < NS) {
#pragma unroll
    for (uint32_t j = 0; j < NS; ++j) {
      if (j != warp) continue;
      const StreamPlan& p = S.plan[j];
      if (p.mode != uint32_t(StreamMode::RANS)) continue;
      uint8_t* sec = dst + p.sec;
      const uint32_t* fc = S.hist + kFcOff + 256 * j;
      const uint32_t m = p.n_present;
      uint32_t bits = 0, fl[8];
#pragma unroll
      for (int r = 0; r < 8; ++r) {
        fl[r] = fc[lane * 8 + r] & 0xFFFFu;
        bits |= uint32_t(fl[r] != 0) << r;
      }
      sec[lane] = uint8_t(bits);
      uint32_t idx = warp_inclusive_sum(uint32_t(__popc(bits))) - __popc(bits);
#pragma unroll
      for (int r = 0; r < 8; ++r)
        if (fl[r]) { st_bytes(sec + kRansBitmapBytes + 2 * idx, fl[r], 2); ++idx; }
      const uint32_t so = rans_states_offset(m), wo = rans_words_offset(m);
      if (lane == 0) {
        zero_bytes(sec + kRansBitmapBytes + 2 * m, so - (kRansBitmapBytes + 2 * m));
        st_bytes(sec + so + 4 * kRansLanes, p.n_words, 4);
        zero_bytes(sec + so + 4 * kRansLanes + 4, wo - (so + 4 * kRansLanes + 4));
      }
      st_bytes(sec + so + 4 * lane, S.states[j][lane], 4);
      rans_run<F>(job.in, n, j, fc, 0, sec + wo, p.n_words, S.states[j]);
    }
  }
}

}  // namespace
}  // namespace gpu
}  // namespace tzip
