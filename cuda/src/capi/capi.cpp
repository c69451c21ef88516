// The C ABI of libtzip.so (cuda/include/tzip/capi.h): the codec core and the GPU codec behind extern "C" functions
// that catch every exception and turn it into the error table's code plus a per-thread message, the one error
// conversion at this boundary.
#include "tzip/capi.h"

#include <cstring>
#include <new>
#include <string>
#include <vector>

#include "core/errors.h"
#include "core/frame.h"
#include "gpu/codec.h"
#include "gpu/probe.h"
#include "tzip/format.h"

namespace {

thread_local std::string g_last_error;

int fail(int code, std::string message) {
  g_last_error = std::move(message);
  return code;
}

/// Runs `fn`, mapping what it throws to a return code (tzip::Error keeps its code; bad_alloc is OutOfMemory; anything
/// else is Internal, a bug).
template <class Fn>
int guarded(const char* who, Fn&& fn) {
  try {
    return fn();
  } catch (const tzip::Error& e) {
    return fail(int(e.code()), std::string(who) + ": " + e.what());
  } catch (const std::bad_alloc&) {
    return fail(int(tzip::ErrorCode::OutOfMemory), std::string(who) + ": out of host memory");
  } catch (const std::exception& e) {
    return fail(int(tzip::ErrorCode::Internal), std::string(who) + ": " + e.what());
  } catch (...) {
    return fail(int(tzip::ErrorCode::Internal), std::string(who) + ": unknown exception");
  }
}

int from_status(const tzip::gpu::Status& st, const char* who) {
  if (st.ok()) return 0;
  return fail(st.code, std::string(who) + ": " + st.message);
}

int invalid(const std::string& message) { return fail(int(tzip::ErrorCode::InvalidArgument), message); }

std::vector<tzip::gpu::DecodeItem> decode_items(size_t count, const void* const* frames, const uint64_t* frame_bytes,
                                                void* const* outs, const uint64_t* out_bytes) {
  std::vector<tzip::gpu::DecodeItem> items(count);
  for (size_t i = 0; i < count; ++i) {
    items[i].frame = frames[i];
    items[i].frame_bytes = frame_bytes[i];
    items[i].out = outs[i];
    items[i].out_bytes = out_bytes[i];
  }
  return items;
}

}  // namespace

extern "C" {

int tzip_abi_version(void) { return 1; }

int tzip_format_version(void) { return tzip::kFormatVersion; }

const char* tzip_last_error(void) { return g_last_error.c_str(); }

uint64_t tzip_max_frame_bytes(uint64_t nbytes, uint32_t ndim, uint32_t chunk_bytes) {
  if (ndim > tzip::kMaxNdim || chunk_bytes < tzip::kMinChunkBytes || chunk_bytes > tzip::kMaxChunkBytes ||
      chunk_bytes % tzip::kChunkBytesMultiple != 0)
    return 0;
  return tzip::max_frame_bytes(nbytes, ndim, chunk_bytes);
}

int tzip_gpu_count(void) {
  const tzip::gpu::Probe p = tzip::gpu::probe();
  return p.available ? int(p.devices.size()) : 0;
}

int tzip_cpu_encode(const void* data, uint64_t nbytes, uint8_t dtype, uint8_t codec, uint32_t ndim,
                    const uint64_t* shape, uint32_t chunk_bytes, uint32_t threads, void* out, uint64_t out_capacity,
                    uint64_t* frame_bytes) {
  return guarded("tzip_cpu_encode", [&]() -> int {
    if ((!data && nbytes) || !out || !frame_bytes || (!shape && ndim)) return invalid("tzip_cpu_encode: null pointer");
    if (dtype >= tzip::kNumDtypes) return invalid("tzip_cpu_encode: unknown dtype code " + std::to_string(dtype));
    if (ndim > tzip::kMaxNdim) return invalid("tzip_cpu_encode: at most 32 dimensions, got " + std::to_string(ndim));
    const uint64_t bound = tzip_max_frame_bytes(nbytes, ndim, chunk_bytes);
    if (bound == 0) return invalid("tzip_cpu_encode: chunk size " + std::to_string(chunk_bytes) + " out of range");
    if (out_capacity < bound)
      return invalid("tzip_cpu_encode: output room " + std::to_string(out_capacity) + " is below the frame bound " +
                     std::to_string(bound));
    const auto* bytes = static_cast<const uint8_t*>(data);
    tzip::EncodeOptions opt;
    opt.chunk_bytes = chunk_bytes;
    opt.threads = threads ? threads : 1;
    if (codec == tzip::gpu::kCodecAuto) {
      opt.codec = tzip::resolve_auto(bytes, nbytes, tzip::Dtype(dtype), chunk_bytes, opt.threads);
    } else if (codec < tzip::kNumCodecs) {
      opt.codec = tzip::Codec(codec);
    } else {
      return invalid("tzip_cpu_encode: unknown codec id " + std::to_string(codec));
    }
    *frame_bytes = tzip::encode_frame(bytes, nbytes, tzip::Dtype(dtype), std::vector<uint64_t>(shape, shape + ndim),
                                      opt, static_cast<uint8_t*>(out));
    return 0;
  });
}

int tzip_cpu_decode(const void* frame, uint64_t frame_bytes, void* out, uint64_t out_bytes, int verify,
                    uint32_t threads) {
  return guarded("tzip_cpu_decode", [&]() -> int {
    if (!frame || (!out && out_bytes)) return invalid("tzip_cpu_decode: null pointer");
    tzip::decode_frame(static_cast<const uint8_t*>(frame), frame_bytes, static_cast<uint8_t*>(out), out_bytes,
                       verify != 0, threads ? threads : 1);
    return 0;
  });
}

int tzip_frame_info(const void* frame, uint64_t avail, uint8_t* dtype, uint8_t* codec, uint32_t* ndim,
                    uint64_t* shape, uint64_t* nbytes, uint64_t* frame_bytes) {
  return guarded("tzip_frame_info", [&]() -> int {
    if (!frame) return invalid("tzip_frame_info: null frame");
    const tzip::FrameHeader h = tzip::parse_frame_header(static_cast<const uint8_t*>(frame), avail);
    if (dtype) *dtype = uint8_t(h.dtype);
    if (codec) *codec = uint8_t(h.codec);
    if (ndim) *ndim = uint32_t(h.shape.size());
    if (shape && !h.shape.empty()) std::memcpy(shape, h.shape.data(), 8 * h.shape.size());
    if (nbytes) *nbytes = h.nbytes;
    if (frame_bytes) *frame_bytes = h.frame_bytes();
    return 0;
  });
}

int tzip_gpu_encode(size_t count, const void* const* data, const uint64_t* nbytes, const uint8_t* dtypes,
                    const uint8_t* codecs, const uint32_t* ndims, const uint64_t* const* shapes, void* const* frames,
                    uint64_t* d_frame_bytes, uint32_t chunk_bytes, int sm_budget, void* stream) {
  return guarded("tzip_gpu_encode", [&]() -> int {
    if (count == 0) return 0;
    if (!data || !nbytes || !dtypes || !codecs || !ndims || !shapes || !frames || !d_frame_bytes)
      return invalid("tzip_gpu_encode: null array");
    std::vector<tzip::gpu::EncodeItem> items(count);
    for (size_t i = 0; i < count; ++i) {
      tzip::gpu::EncodeItem& it = items[i];
      it.data = data[i];
      it.nbytes = nbytes[i];
      it.dtype = dtypes[i];
      it.codec = codecs[i];
      it.ndim = ndims[i];
      it.shape = shapes[i];
      it.frame = frames[i];
    }
    tzip::gpu::EncodeOptions opt;
    opt.chunk_bytes = chunk_bytes;
    opt.sm_budget = sm_budget;
    opt.stream = stream;
    return from_status(tzip::gpu::encode(items.data(), count, opt, d_frame_bytes), "tzip_gpu_encode");
  });
}

int tzip_gpu_decode(size_t count, const void* const* frames, const uint64_t* frame_bytes, void* const* outs,
                    const uint64_t* out_bytes, int32_t* d_errors, int sm_budget, int verify, void* stream) {
  return guarded("tzip_gpu_decode", [&]() -> int {
    if (count == 0) return 0;
    if (!frames || !frame_bytes || !outs || !out_bytes || !d_errors) return invalid("tzip_gpu_decode: null array");
    std::vector<tzip::gpu::DecodeItem> items = decode_items(count, frames, frame_bytes, outs, out_bytes);
    tzip::gpu::DecodeOptions opt;
    opt.sm_budget = sm_budget;
    opt.verify = verify != 0;
    opt.stream = stream;
    return from_status(tzip::gpu::decode(items.data(), count, opt, d_errors), "tzip_gpu_decode");
  });
}

int tzip_gpu_decode_plan(size_t count, const void* const* frames, const uint64_t* frame_bytes, void* const* outs,
                         const uint64_t* out_bytes, int32_t* d_errors, int sm_budget, int verify,
                         tzip_decode_plan** plan) {
  return guarded("tzip_gpu_decode_plan", [&]() -> int {
    if (!plan) return invalid("tzip_gpu_decode_plan: null result pointer");
    *plan = nullptr;
    if (!frames || !frame_bytes || !outs || !out_bytes || !d_errors)
      return invalid("tzip_gpu_decode_plan: null array");
    std::vector<tzip::gpu::DecodeItem> items = decode_items(count, frames, frame_bytes, outs, out_bytes);
    tzip::gpu::DecodeOptions opt;
    opt.sm_budget = sm_budget;
    opt.verify = verify != 0;
    tzip::gpu::DecodePlan* p = nullptr;
    const int rc = from_status(tzip::gpu::decode_plan_create(items.data(), count, opt, d_errors, &p),
                               "tzip_gpu_decode_plan");
    if (rc == 0) *plan = reinterpret_cast<tzip_decode_plan*>(p);
    return rc;
  });
}

int tzip_gpu_decode_run(tzip_decode_plan* plan, void* stream) {
  return guarded("tzip_gpu_decode_run", [&]() -> int {
    return from_status(tzip::gpu::decode_plan_run(reinterpret_cast<tzip::gpu::DecodePlan*>(plan), stream),
                       "tzip_gpu_decode_run");
  });
}

void tzip_gpu_decode_plan_free(tzip_decode_plan* plan) {
  tzip::gpu::decode_plan_destroy(reinterpret_cast<tzip::gpu::DecodePlan*>(plan));
}

}  // extern "C"
