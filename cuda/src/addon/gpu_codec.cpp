// gpuCompress / gpuDecompress: one batched call of the GPU codec (gpu/codec.h) per JavaScript call.
//
// The JavaScript thread only parses and validates arguments. A libuv worker (AsyncWorker::Execute) then checks that
// every pointer is device memory of options.device, and enqueues on the addon's non-blocking stream of that device:
// [wait options.waitEvent] -> tzip::gpu::encode/decode -> gather of the frames' bytes the host needs (gpu/gather.h:
// the codec byte of each frame whose "auto" the device resolved; the fixed header and shape of each decoded frame) ->
// one copy of all per-item results (frame sizes and codecs / error codes and headers) to pinned host memory ->
// [record options.recordEvent] -> record an event of the addon, which the worker then waits for (polling, then
// asleep: gpu_spin_us(), device.h). The promise settles in OnOK on the JavaScript thread, which never waits for the
// GPU. Scratch memory comes from the stream's cache (gpu/scratch.h), so a call allocates no device memory once the
// cache holds blocks of its sizes.
// With TZIP_TRACE set in the environment, each call prints where its time went to stderr (see GpuWorker::OnOK).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "addon/args.h"
#include "addon/device.h"
#include "addon/frame_header.h"
#include "addon/register.h"
#include "core/frame.h"
#include "gpu/codec.h"
#include "gpu/gather.h"
#include "gpu/scratch.h"

namespace tzip::addon {

namespace {

/// GpuRunOptions (src/native.ts).
struct RunOptions {
  int device = 0;
  int sm_budget = kDefaultSmBudget;
  uint32_t chunk = kDefaultChunkBytes;
  bool verify = true;
  uint64_t wait_event = 0;    // cudaEvent_t, 0: none
  uint64_t record_event = 0;  // cudaEvent_t, 0: none
};

RunOptions run_options(const Napi::Value& v, bool encode) {
  if (!v.IsObject()) invalid("options must be an object with at least { device }");
  const Napi::Object o = v.As<Napi::Object>();
  RunOptions r;
  if (!has_opt(o, "device")) invalid("options.device is required: the ordinal of the GPU that owns every pointer");
  r.device = device_of(o.Get("device"), "options.device");
  if (has_opt(o, "smBudget")) r.sm_budget = i32_of(o.Get("smBudget"), "options.smBudget");
  if (encode && has_opt(o, "chunkSize")) {
    const uint64_t c = u64_of(o.Get("chunkSize"), "options.chunkSize");
    if (c < kMinChunkBytes || c > kMaxChunkBytes || c % kChunkBytesMultiple)
      invalid("options.chunkSize must be a multiple of 256 between 4096 and 65536 bytes");
    r.chunk = uint32_t(c);
  }
  if (!encode && has_opt(o, "verify")) r.verify = o.Get("verify").ToBoolean().Value();
  for (const char* key : {"waitEvent", "recordEvent"}) {
    if (!has_opt(o, key)) continue;
    const uint64_t ev = u64_of(o.Get(key), std::string("options.") + key);
    if (!ev) invalid(std::string("options.") + key + " is a null cudaEvent_t");
    (key[0] == 'w' ? r.wait_event : r.record_event) = ev;
  }
  return r;
}

Napi::Array items_of(const Napi::Value& v, const char* fn) {
  if (!v.IsArray()) invalid(std::string(fn) + "(items, options): items must be an array");
  return v.As<Napi::Array>();
}

Napi::Object item_object(const Napi::Array& items, uint32_t i) {
  const Napi::Value v = items.Get(i);
  if (!v.IsObject()) invalid("item " + std::to_string(i) + " must be an object");
  return v.As<Napi::Object>();
}

uint64_t field_u64(const Napi::Object& o, const char* key, const std::string& who) {
  const Napi::Value v = o.Get(key);
  if (!present(v)) invalid(who + key + " is required");
  uint64_t x = 0;
  return try_u64(v, &x) ? x : u64_of(v, who + key);
}

/// A gpu::Status error as an addon error; CUDA failures get the CUDA error name where the text identifies it, and a
/// failed allocation (cudaErrorMemoryAllocation, also when the GPU codec reports it as a plain CUDA error) is
/// TZIP_OUT_OF_MEMORY.
CodedError status_error(const gpu::Status& st, const char* fn) {
  if (st.code == gpu::kCudaError || st.code == gpu::kOutOfMemory) {
    const std::string name = cuda_error_name_of_text(st.message);
    const bool oom = st.code == gpu::kOutOfMemory || name == "cudaErrorMemoryAllocation";
    return CodedError(oom ? tzip::ErrorCode::OutOfMemory : tzip::ErrorCode::Cuda,
                      std::string(fn) + ": " + st.message + (name.empty() ? "" : " (" + name + ")"));
  }
  return CodedError(from_gpu(st.code), std::string(fn) + ": " + st.message);
}

cudaEvent_t event_of(uint64_t v) { return reinterpret_cast<cudaEvent_t>(static_cast<uintptr_t>(v)); }

using Clock = std::chrono::steady_clock;
/// Waits for `ev`: polls it for gpu_spin_us() first, then sleeps in cudaEventSynchronize.
cudaError_t wait_event_done(cudaEvent_t ev) {
  if (const long us = gpu_spin_us()) {
    const auto until = Clock::now() + std::chrono::microseconds(us);
    do {
      const cudaError_t e = cudaEventQuery(ev);
      if (e != cudaErrorNotReady) return e;
    } while (Clock::now() < until);
  }
  return cudaEventSynchronize(ev);
}

/// When a call's work was on the stream, and when the worker saw it finish (TZIP_TRACE).
struct StageTimes {
  Clock::time_point enqueued, finished;
};

/// Enqueues one call on the device's stream and waits for it in the calling (worker) thread:
/// [wait o.wait_event] enqueue(stream, d_result) [copy result_bytes of d_result to the host] [record o.record_event].
/// d_result is stream-ordered scratch of result_bytes (the stream's cached scratch memory) for the per-item results;
/// host_result receives them.
void run_on_stream(const RunOptions& o, size_t result_bytes, void* host_result,
                   const std::function<void(cudaStream_t, void*)>& enqueue, StageTimes* times) {
  const cudaStream_t s = device_stream(o.device);
  PinnedBuffer pinned(result_bytes);
  CompletionEvent done(o.device);
  bool copy_pending = false, queued_pending = false;
  try {
    std::lock_guard<std::mutex> lock(enqueue_mutex(o.device));
    if (o.wait_event) cuda_check(cudaStreamWaitEvent(s, event_of(o.wait_event), 0), "cudaStreamWaitEvent(options.waitEvent)");
    void* d_result = nullptr;
    if (result_bytes) {
      const gpu::Status st = gpu::scratch_alloc(&d_result, result_bytes, s);
      if (!st.ok()) throw status_error(st, "scratch memory for the results");
    }
    try {
      enqueue(s, d_result);
    } catch (...) {
      // The codec may have queued some of its kernels before one failed to launch: they still read and write the
      // caller's memory, so the promise must not settle (and the caller reuse that memory) before they are done.
      queued_pending = true;
      gpu::scratch_free(d_result, s);
      throw;
    }
    if (result_bytes) {
      const cudaError_t e = cudaMemcpyAsync(pinned.data(), d_result, result_bytes, cudaMemcpyDeviceToHost, s);
      copy_pending = e == cudaSuccess;
      gpu::scratch_free(d_result, s);
      cuda_check(e, "cudaMemcpyAsync of the results to the host");
    }
    if (o.record_event) cuda_check(cudaEventRecord(event_of(o.record_event), s), "cudaEventRecord(options.recordEvent)");
    cuda_check(cudaEventRecord(done.get(), s), "cudaEventRecord");
  } catch (...) {
    // Work already queued may still write into `pinned` or the caller's buffers: wait for it, or never reuse `pinned`.
    if ((copy_pending || queued_pending) && cudaStreamSynchronize(s) != cudaSuccess) {
      cudaGetLastError();
      pinned.poison();
    }
    throw;
  }
  if (times) times->enqueued = Clock::now();
  const cudaError_t e = wait_event_done(done.get());
  if (times) times->finished = Clock::now();
  if (e != cudaSuccess) {
    pinned.poison();
    cuda_check(e, "the GPU work of this call failed (cudaEventSynchronize)");
  }
  if (result_bytes) std::memcpy(host_result, pinned.data(), result_bytes);
}

/// Base of the two workers: a promise, the run options, and an error caught in Execute.
class GpuWorker : public Napi::AsyncWorker {
 public:
  GpuWorker(Napi::Env env, const RunOptions& o, const char* name)
      : Napi::AsyncWorker(env), deferred_(Napi::Promise::Deferred::New(env)), opt_(o), name_(name) {}
  Napi::Promise Promise() { return deferred_.Promise(); }

  void Execute() override {
    started_ = Clock::now();
    try {
      DeviceScope scope(opt_.device);
      Run();
    } catch (const std::exception&) {
      error_ = std::make_unique<CodedError>(current_error());
    }
  }
  void OnOK() override {
    if (trace_on() && times_.finished != Clock::time_point{}) {
      // Stages of the call (a call that failed before its GPU work prints nothing): in the libuv pool's queue, pointer
      // checks and enqueue (worker), GPU work as the worker saw it (cudaEventSynchronize of a blocking-sync event), and
      // back on the JavaScript thread.
      const auto us = [](Clock::time_point a, Clock::time_point b) {
        return std::chrono::duration<double, std::micro>(b - a).count();
      };
      const Clock::time_point now = Clock::now();
      std::fprintf(stderr,
                   "tzip addon trace: %s device %d: queue %.1f us, checks+enqueue %.1f us, GPU %.1f us, to JS %.1f us "
                   "(called at %lld ns)\n",
                   name_, opt_.device, us(queued_, started_), us(started_, times_.enqueued),
                   us(times_.enqueued, times_.finished), us(times_.finished, now),
                   static_cast<long long>(std::chrono::duration_cast<std::chrono::nanoseconds>(queued_.time_since_epoch()).count()));
    }
    Napi::Env env = Env();
    if (error_) deferred_.Reject(make_error(env, *error_).Value());
    else deferred_.Resolve(Result(env));
  }

 protected:
  virtual void Run() = 0;
  virtual Napi::Value Result(Napi::Env env) = 0;
  Napi::Promise::Deferred deferred_;
  RunOptions opt_;
  std::unique_ptr<CodedError> error_;
  const char* name_;
  Clock::time_point queued_ = Clock::now(), started_;
  StageTimes times_;  // filled by run_on_stream (TZIP_TRACE)
};

/// A promise rejected with the error that `f` throws, or `f`'s promise.
template <class F>
Napi::Value promise_of(Napi::Env env, F&& f) {
  try {
    return f();
  } catch (const Napi::Error&) {
    throw;
  } catch (const std::exception&) {
    auto d = Napi::Promise::Deferred::New(env);
    d.Reject(make_error(env, current_error()).Value());
    return d.Promise();
  }
}

// ---------------------------------------------------------------- gpuCompress

struct EncodeSpec {
  uint64_t data = 0, nbytes = 0, frame = 0, capacity = 0;
  Dtype dtype = Dtype::U8;
  uint8_t codec = gpu::kCodecAuto;
  std::vector<uint64_t> shape;
};

EncodeSpec encode_spec(const Napi::Object& o, uint32_t i, uint32_t chunk) {
  const std::string who = "item " + std::to_string(i) + ": ";
  EncodeSpec s;
  s.data = field_u64(o, "data", who);
  s.nbytes = field_u64(o, "nbytes", who);
  const Napi::Value dv = o.Get("dtype");
  if (!dv.IsString()) invalid(who + "dtype must be a safetensors dtype name");
  const std::string dname = dv.As<Napi::String>().Utf8Value();
  if (!parse_dtype_name(dname, &s.dtype)) invalid(who + "unknown dtype '" + dname + "' (pass U8 for opaque bytes)");
  if (const Napi::Value cv = o.Get("codec"); present(cv)) {
    const std::string cname = cv.ToString().Utf8Value();
    Codec c = Codec::RAW;
    bool is_auto = false;
    if (!parse_codec_name(cname, &c, &is_auto)) invalid(who + "unknown codec '" + cname + "' (auto, fast, max, bytes, raw)");
    s.codec = is_auto ? gpu::kCodecAuto : uint8_t(c);
  }
  const Napi::Value shv = o.Get("shape");
  if (!shv.IsArray()) invalid(who + "shape must be an array of dimensions");
  const Napi::Array sa = shv.As<Napi::Array>();
  if (sa.Length() > kMaxNdim) invalid(who + "at most 32 dimensions are supported");
  using u128 = unsigned __int128;
  const u128 kTooBig = u128(~uint64_t(0)) + 1;  // saturated product: can never match nbytes
  u128 expect = dtype_size(s.dtype);
  const uint32_t ndim = sa.Length();
  s.shape.reserve(ndim);
  for (uint32_t k = 0; k < ndim; ++k) {
    const Napi::Value d = sa.Get(k);
    uint64_t x = 0;
    s.shape.push_back(try_u64(d, &x) ? x : u64_of(d, who + "shape entries"));
    expect = std::min<u128>(expect * s.shape.back(), kTooBig);
  }
  if (expect != s.nbytes)
    invalid(who + "nbytes is " + std::to_string(s.nbytes) + " but dtype " + dname + " and the shape need " +
            (expect > ~uint64_t(0) ? std::string("more than 2^64") : std::to_string(uint64_t(expect))));
  if (s.nbytes && !s.data) invalid(who + "data is a null pointer");
  s.frame = field_u64(o, "frame", who);
  if (!s.frame) invalid(who + "frame is a null pointer");
  s.capacity = field_u64(o, "frameCapacity", who);
  const uint64_t need = max_frame_bytes(s.nbytes, uint32_t(s.shape.size()), chunk);
  if (s.capacity < need)
    invalid(who + "frameCapacity " + std::to_string(s.capacity) + " is below maxCompressedSize(" +
            std::to_string(s.nbytes) + ", " + std::to_string(s.shape.size()) + ", " + std::to_string(chunk) +
            ") = " + std::to_string(need) + " bytes");
  return s;
}

/// The codec a frame of `s` records when the host can tell (as tzip::gpu::encode resolves it: "auto" on a non-float
/// dtype is bytes, on an empty float tensor fast; fast/max on a non-float dtype are bytes), or kCodecAuto when only
/// the device can ("auto" on a non-empty bf16/fp16/fp32 tensor picks fast or max from the data).
uint8_t host_known_codec(const EncodeSpec& s) {
  const bool split = dtype_is_split_float(s.dtype);
  if (s.codec == gpu::kCodecAuto) {
    if (!split) return uint8_t(Codec::BYTES);
    return s.nbytes < dtype_size(s.dtype) ? uint8_t(Codec::FAST) : gpu::kCodecAuto;
  }
  if ((s.codec == uint8_t(Codec::FAST) || s.codec == uint8_t(Codec::MAX)) && !split) return uint8_t(Codec::BYTES);
  return s.codec;
}

class GpuCompressWorker : public GpuWorker {
 public:
  GpuCompressWorker(Napi::Env env, const RunOptions& o, std::vector<EncodeSpec> specs)
      : GpuWorker(env, o, "gpuCompress"), specs_(std::move(specs)) {}

 protected:
  void Run() override {
    const size_t n = specs_.size();
    std::vector<gpu::EncodeItem> items(n);
    codecs_.assign(n, 0);
    // Frames whose codec the device picks: their codec byte (header offset 7) is gathered after the encode.
    std::vector<size_t> on_device;
    std::vector<gpu::FrameSpan> spans;
    DeviceRangeChecker checker(opt_.device);
    for (size_t i = 0; i < n; ++i) {
      const EncodeSpec& s = specs_[i];
      const std::string who = "gpuCompress: item " + std::to_string(i) + ": ";
      if (s.nbytes) checker.check(s.data, s.nbytes, who, "data");
      checker.check(s.frame, s.capacity, who, "frame");
      gpu::EncodeItem& it = items[i];
      it.data = reinterpret_cast<const void*>(static_cast<uintptr_t>(s.data));
      it.nbytes = s.nbytes;
      it.dtype = uint8_t(s.dtype);
      it.codec = s.codec;
      it.ndim = uint32_t(s.shape.size());
      it.shape = s.shape.data();
      it.frame = reinterpret_cast<void*>(static_cast<uintptr_t>(s.frame));
      codecs_[i] = host_known_codec(s);
      if (codecs_[i] == gpu::kCodecAuto) {
        on_device.push_back(i);
        spans.push_back(gpu::FrameSpan{it.frame, s.capacity});  // capacity >= the frame's 48-byte fixed header
      }
    }
    // Results: n frame sizes (u64), then one codec byte per frame in `on_device`: one copy brings both back.
    const size_t sizes_bytes = 8 * n;
    std::vector<uint8_t> results(sizes_bytes + on_device.size());
    run_on_stream(opt_, results.size(), results.data(), [&](cudaStream_t stream, void* d_results) {
      if (n == 0) return;
      gpu::EncodeOptions eo;
      eo.chunk_bytes = opt_.chunk;
      eo.sm_budget = opt_.sm_budget;
      eo.stream = stream;
      eo.device = opt_.device;  // every range passed the checker above
      gpu::Status st = gpu::encode(items.data(), n, eo, static_cast<uint64_t*>(d_results));
      if (!st.ok()) throw status_error(st, "gpuCompress");
      st = gpu::gather_frame_bytes(spans.data(), spans.size(), kOffCodec, 1,
                                   static_cast<uint8_t*>(d_results) + sizes_bytes, opt_.sm_budget, stream);
      if (!st.ok()) throw status_error(st, "gpuCompress: reading back the codecs of the frames");
    }, trace_on() ? &times_ : nullptr);
    sizes_.assign(n, 0);
    if (n) std::memcpy(sizes_.data(), results.data(), sizes_bytes);
    for (size_t k = 0; k < on_device.size(); ++k) {
      const size_t i = on_device[k];
      const uint8_t c = results[sizes_bytes + k];
      // The encoder resolves "auto" on a float tensor to fast or max; anything else means the frame's memory was
      // written by someone else during the call.
      if (c != uint8_t(Codec::FAST) && c != uint8_t(Codec::MAX)) {
        CodedError err(tzip::ErrorCode::Corrupt, "gpuCompress: item " + std::to_string(i) + ": the frame written at item.frame "
                                       "records codec id " + std::to_string(c) + " instead of fast or max: its memory "
                                       "was changed during the call");
        err.item_errors.assign(n, 0);
        err.item_errors[i] = int32_t(tzip::ErrorCode::Corrupt);
        throw err;
      }
      codecs_[i] = c;
    }
  }
  Napi::Value Result(Napi::Env env) override {
    Napi::Array out = Napi::Array::New(env, sizes_.size());
    for (uint32_t i = 0; i < sizes_.size(); ++i) {
      Napi::Object r = Napi::Object::New(env);
      r.Set("frameBytes", Napi::BigInt::New(env, sizes_[i]));
      r.Set("codec", codec_name(Codec(codecs_[i])));
      out.Set(i, r);
    }
    return out;
  }

 private:
  std::vector<EncodeSpec> specs_;
  std::vector<uint64_t> sizes_;
  std::vector<uint8_t> codecs_;  // tzip::Codec per item
};

Napi::Value GpuCompress(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  return promise_of(env, [&]() -> Napi::Value {
    require_gpu();
    if (info.Length() < 2) invalid("gpuCompress(items, options) needs items and options");
    const Napi::Array items = items_of(info[0], "gpuCompress");
    const RunOptions o = run_options(info[1], true);
    std::vector<EncodeSpec> specs;
    specs.reserve(items.Length());
    for (uint32_t i = 0; i < items.Length(); ++i) specs.push_back(encode_spec(item_object(items, i), i, o.chunk));
    auto* w = new GpuCompressWorker(env, o, std::move(specs));
    Napi::Promise p = w->Promise();
    w->Queue();
    return p;
  });
}

// ---------------------------------------------------------------- gpuDecompress

struct DecodeSpec {
  uint64_t frame = 0, frame_bytes = 0, out = 0, out_bytes = 0;
};

DecodeSpec decode_spec(const Napi::Object& o, uint32_t i) {
  const std::string who = "item " + std::to_string(i) + ": ";
  DecodeSpec s;
  s.frame = field_u64(o, "frame", who);
  s.frame_bytes = field_u64(o, "frameBytes", who);
  s.out = field_u64(o, "out", who);
  s.out_bytes = field_u64(o, "outBytes", who);
  if (!s.frame) invalid(who + "frame is a null pointer");
  if (!s.out && s.out_bytes) invalid(who + "out is a null pointer");
  return s;
}

/// What a per-frame error code of the GPU decoder means, for messages.
const char* decode_error_text(tzip::ErrorCode code) {
  switch (code) {
    case tzip::ErrorCode::Corrupt: return "corrupt frame";
    case tzip::ErrorCode::Truncated: return "truncated frame (frameBytes is less than the frame's size)";
    case tzip::ErrorCode::Checksum: return "checksum mismatch: the decoded bytes do not match the frame's digests";
    case tzip::ErrorCode::Unsupported:
      return "unsupported frame: a newer format version, a pre-release version-1 frame (re-compress the original "
             "tensor), or unknown flags";
    case tzip::ErrorCode::InvalidArgument: return "outBytes differs from the frame's nbytes";
    default: return "the GPU decoder failed";
  }
}

class GpuDecompressWorker : public GpuWorker {
 public:
  GpuDecompressWorker(Napi::Env env, const RunOptions& o, std::vector<DecodeSpec> specs)
      : GpuWorker(env, o, "gpuDecompress"), specs_(std::move(specs)) {}

 protected:
  void Run() override {
    const size_t n = specs_.size();
    std::vector<gpu::DecodeItem> items(n);
    DeviceRangeChecker checker(opt_.device);
    for (size_t i = 0; i < n; ++i) {
      const DecodeSpec& s = specs_[i];
      const std::string who = "gpuDecompress: item " + std::to_string(i) + ": ";
      checker.check(s.frame, s.frame_bytes, who, "frame");
      if (s.out_bytes) checker.check(s.out, s.out_bytes, who, "out");
      gpu::DecodeItem& it = items[i];
      it.frame = reinterpret_cast<const void*>(static_cast<uintptr_t>(s.frame));
      it.frame_bytes = s.frame_bytes;
      it.out = reinterpret_cast<void*>(static_cast<uintptr_t>(s.out));
      it.out_bytes = s.out_bytes;
    }
    // Results: n error codes (i32), then, 16-byte aligned, the first kMaxFramePrefixBytes bytes of every frame (fewer
    // when the frame is shorter; zeros after): one copy brings both back, and the headers are parsed here.
    constexpr uint64_t kPrefix = kMaxFramePrefixBytes;
    const size_t prefix_off = size_t(align16(4 * uint64_t(n)));
    std::vector<gpu::FrameSpan> spans(n);
    for (size_t i = 0; i < n; ++i) spans[i] = gpu::FrameSpan{items[i].frame, items[i].frame_bytes};
    // gather_frame_bytes takes fewer than 2^32 bytes: refuse a larger batch before anything is queued.
    if (uint64_t(n) * kPrefix >= uint64_t(UINT32_MAX))
      throw CodedError(tzip::ErrorCode::InvalidArgument, "gpuDecompress: " + std::to_string(n) + " frames in one call; at most " +
                                                    std::to_string(UINT32_MAX / kPrefix) + " (the headers read back)");
    std::vector<uint8_t> results(n ? prefix_off + kPrefix * n : 0);
    run_on_stream(opt_, results.size(), results.data(), [&](cudaStream_t stream, void* d_results) {
      if (n == 0) return;
      gpu::DecodeOptions dopt;
      dopt.sm_budget = opt_.sm_budget;
      dopt.verify = opt_.verify;
      dopt.stream = stream;
      dopt.device = opt_.device;  // every range passed the checker above
      gpu::Status st = gpu::decode(items.data(), n, dopt, static_cast<int32_t*>(d_results));
      if (!st.ok()) throw status_error(st, "gpuDecompress");
      st = gpu::gather_frame_bytes(spans.data(), n, 0, uint32_t(kPrefix), static_cast<uint8_t*>(d_results) + prefix_off,
                                   opt_.sm_budget, stream);
      if (!st.ok()) throw status_error(st, "gpuDecompress: reading back the headers of the frames");
    }, trace_on() ? &times_ : nullptr);
    std::vector<int32_t> codes(n, 0);
    if (n) std::memcpy(codes.data(), results.data(), 4 * n);
    std::vector<int32_t> item_codes(n, 0);
    std::vector<size_t> failed;
    for (size_t i = 0; i < n; ++i) {
      if (codes[i] == gpu::kOk) continue;
      item_codes[i] = int32_t(from_gpu(codes[i]));
      failed.push_back(i);
    }
    if (failed.empty()) {
      headers_ = parse_headers(results.data() + prefix_off, kPrefix);
      return;
    }
    const size_t first = failed.front();
    const tzip::ErrorCode first_code = tzip::ErrorCode(item_codes[first]);
    std::string msg = "gpuDecompress: item " + std::to_string(first) + " of " + std::to_string(n) + ": " +
                      tzip::error_code_name(first_code) + ": " + decode_error_text(first_code);
    if (failed.size() > 1) {
      msg += " (" + std::to_string(failed.size()) + " items failed:";
      for (size_t k = 0; k < failed.size() && k < 16; ++k) msg += " " + std::to_string(failed[k]);
      msg += failed.size() > 16 ? " ...)" : ")";
    }
    CodedError err(first_code, msg);
    err.item_errors = std::move(item_codes);
    throw err;
  }
  Napi::Value Result(Napi::Env env) override {
    Napi::Array out = Napi::Array::New(env, headers_.size());
    const FrameHeaderKeys keys(env);
    for (uint32_t i = 0; i < headers_.size(); ++i) out.Set(i, frame_header_object(env, headers_[i], keys));
    return out;
  }

 private:
  /// The headers of the decoded frames from their first bytes (`stride` bytes per frame at `prefixes`, of which
  /// min(frameBytes, stride) are the frame's). The decoder checked each frame (header digest and chunk table included)
  /// on the device; parse_frame_prefix checks these bytes again, as they are client memory that may have changed
  /// since, reading none past what each frame has. A failure is reported like a failed decode of that item.
  std::vector<FrameHeader> parse_headers(const uint8_t* prefixes, uint64_t stride) const {
    const size_t n = specs_.size();
    std::vector<FrameHeader> headers(n);
    for (size_t i = 0; i < n; ++i) {
      try {
        headers[i] = parse_frame_prefix(prefixes + stride * i, std::min<uint64_t>(specs_[i].frame_bytes, stride));
      } catch (const tzip::Error& e) {
        const std::string code = tzip::error_code_name(e.code());
        CodedError err(e.code(), "gpuDecompress: item " + std::to_string(i) + " of " + std::to_string(n) + ": " +
                                     code + ": the frame's header, read back after the decode: " + e.what());
        err.item_errors.assign(n, 0);
        err.item_errors[i] = int32_t(e.code());
        throw err;
      }
    }
    return headers;
  }

  std::vector<DecodeSpec> specs_;
  std::vector<FrameHeader> headers_;
};

Napi::Value GpuDecompress(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  return promise_of(env, [&]() -> Napi::Value {
    require_gpu();
    if (info.Length() < 2) invalid("gpuDecompress(items, options) needs items and options");
    const Napi::Array items = items_of(info[0], "gpuDecompress");
    const RunOptions o = run_options(info[1], false);
    std::vector<DecodeSpec> specs;
    specs.reserve(items.Length());
    for (uint32_t i = 0; i < items.Length(); ++i) specs.push_back(decode_spec(item_object(items, i), i));
    auto* w = new GpuDecompressWorker(env, o, std::move(specs));
    Napi::Promise p = w->Promise();
    w->Queue();
    return p;
  });
}

}  // namespace

void register_gpu_codec(Napi::Env env, Napi::Object exports) {
  exports.Set("gpuCompress", Napi::Function::New(env, GpuCompress));
  exports.Set("gpuDecompress", Napi::Function::New(env, GpuDecompress));
  // The streams' cached scratch memory lives as long as an environment (the main thread's, a worker thread's) holds
  // the addon, and is freed when the last one is torn down.
  hold_scratch_cache();
  env.AddCleanupHook([]() { drop_scratch_cache(); });
}

}  // namespace tzip::addon
