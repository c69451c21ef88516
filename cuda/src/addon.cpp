// N-API binding of the codec core (node-addon-api). Codec work runs on libuv worker threads (AsyncWorker) and
// fans out to its own threads per chunk, so the JavaScript event loop never waits on a codec call.
// The JavaScript surface is documented in src/native.ts and docs/addon.md; the GPU codec and CUDA IPC entry points are
// registered from addon/gpu_codec.cpp, addon/gpu_memory.cpp and addon/cuda_ipc.cpp, the submission ring (ringOpen) from
// addon/ring_napi.cpp.
#include <napi.h>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>

#include "addon/args.h"
#include "addon/device.h"
#include "addon/frame_header.h"
#include "addon/register.h"
#include "addon/shared_guard.h"
#include "core/entropy.h"
#include "core/errors.h"
#include "core/frame.h"
#include "gpu/probe.h"

namespace {

using tzip::Codec;
using tzip::Dtype;
using tzip::Error;
using tzip::ErrorCode;
using tzip::addon::Bytes;
using tzip::addon::bytes_of;
using tzip::addon::invalid;
using tzip::addon::make_error;
using tzip::addon::options_of;
using tzip::addon::u64_of;

uint32_t default_threads() {
  const unsigned hc = std::thread::hardware_concurrency();
  return hc ? hc : 1;
}

bool inline_requested(const Napi::Object& o) { return o.Has("inline") && o.Get("inline").ToBoolean().Value(); }

// options.threads, or all cores; 1 with options.inline (the work then runs on the event loop: no threads started).
uint32_t threads_opt(const Napi::Object& o) {
  if (inline_requested(o)) return 1;
  if (!o.Has("threads") || o.Get("threads").IsUndefined()) return default_threads();
  const uint64_t t = u64_of(o.Get("threads"), "threads");
  if (t < 1 || t > 1024) invalid("threads must be between 1 and 1024");
  return uint32_t(t);
}

Napi::Value bigsafe(Napi::Env env, uint64_t v) { return Napi::Number::New(env, double(v)); }

// Queues `w` on libuv's thread pool, or with options.inline runs it here, on the calling (event loop) thread: its
// promise is then settled on return. For small inputs the thread-pool hop (two thread wake-ups, 15-45 us measured on a
// 2-vCPU VM) costs more than the work.
template <typename Worker>
Napi::Promise start(Worker* w, const Napi::Object& o) {
  Napi::Promise p = w->Promise();
  if (inline_requested(o)) {
    w->Execute();
    w->OnOK();
    delete w;
  } else {
    w->Queue();
  }
  return p;
}

// ---------------------------------------------------------------- compress

class CompressWorker : public Napi::AsyncWorker {
 public:
  // `out` empty: the frame goes into new memory (shrunk to its size). Otherwise it is written at the start of `out`
  // (checked to hold max_frame_bytes) and the promise resolves to out.subarray(0, frame bytes).
  CompressWorker(Napi::Env env, Napi::Value input, Bytes in, Dtype dtype, std::vector<uint64_t> shape, Codec codec,
                 bool is_auto, uint32_t threads, uint32_t chunk, Napi::Uint8Array out)
      : Napi::AsyncWorker(env), deferred_(Napi::Promise::Deferred::New(env)), in_(in), dtype_(dtype),
        shape_(std::move(shape)), codec_(codec), auto_(is_auto), threads_(threads), chunk_(chunk) {
    input_ref_ = Napi::Persistent(input.As<Napi::Object>());
    if (!out.IsEmpty()) {
      out_ref_ = Napi::Persistent(out.As<Napi::Object>());
      given_ = out.Data();
    }
  }
  Napi::Promise Promise() { return deferred_.Promise(); }

  void Execute() override {
    try {
      uint8_t* dst = given_;
      if (dst == nullptr) {
        const uint64_t cap = tzip::max_frame_bytes(in_.size, uint32_t(shape_.size()), chunk_);
        out_ = static_cast<uint8_t*>(std::malloc(cap ? cap : 1));
        if (!out_) throw tzip::addon::out_of_memory(cap, "the frame");
        dst = out_;
      }
      tzip::EncodeOptions opt;
      opt.codec = auto_ ? tzip::resolve_auto(in_.data, in_.size, dtype_, chunk_, threads_) : codec_;
      opt.threads = threads_;
      opt.chunk_bytes = chunk_;
      len_ = tzip::encode_frame(in_.data, in_.size, dtype_, shape_, opt, dst);
      if (out_ != nullptr) {
        if (uint8_t* shrunk = static_cast<uint8_t*>(std::realloc(out_, len_ ? len_ : 1))) out_ = shrunk;
      }
    } catch (const std::exception&) {
      error_ = std::make_unique<tzip::addon::CodedError>(tzip::addon::current_error());
    }
  }
  void OnOK() override {
    Napi::Env env = Env();
    if (error_) {
      std::free(out_);
      out_ = nullptr;
      deferred_.Reject(make_error(env, *error_).Value());
      return;
    }
    if (given_ != nullptr) {
      Napi::Object out = out_ref_.Value();
      deferred_.Resolve(out.Get("subarray").As<Napi::Function>().Call(out, {Napi::Number::New(env, 0), bigsafe(env, len_)}));
      return;
    }
    uint8_t* data = out_;
    out_ = nullptr;
    try {
      deferred_.Resolve(tzip::addon::external_buffer(env, data, len_, tzip::addon::free_external, nullptr, "the frame"));
    } catch (const std::exception&) {
      deferred_.Reject(make_error(env, tzip::addon::current_error()).Value());
    }
  }

 private:
  Napi::Promise::Deferred deferred_;
  Napi::ObjectReference input_ref_, out_ref_;
  Bytes in_;
  Dtype dtype_;
  std::vector<uint64_t> shape_;
  Codec codec_;
  bool auto_;
  uint32_t threads_, chunk_;
  uint8_t* given_ = nullptr;  // options.out's bytes
  uint8_t* out_ = nullptr;    // or the frame's own memory
  uint64_t len_ = 0;
  std::unique_ptr<tzip::addon::CodedError> error_;
};

Napi::Value Compress(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  try {
    if (info.Length() < 1) invalid("compress(input, options) needs an input");
    const Bytes in = bytes_of(info[0], "input");
    const Napi::Object o = options_of(info, 1);
    if (!o.Has("dtype") || !o.Get("dtype").IsString()) invalid("options.dtype must be a safetensors dtype name");
    Dtype dtype;
    const std::string dname = o.Get("dtype").As<Napi::String>().Utf8Value();
    if (!tzip::parse_dtype_name(dname, &dtype)) invalid("unknown dtype '" + dname + "' (pass U8 for opaque bytes)");
    std::vector<uint64_t> shape;
    if (!o.Has("shape") || !o.Get("shape").IsArray()) invalid("options.shape must be an array of dimensions");
    const Napi::Array sa = o.Get("shape").As<Napi::Array>();
    if (sa.Length() > tzip::kMaxNdim) invalid("at most 32 dimensions are supported");
    for (uint32_t i = 0; i < sa.Length(); ++i) shape.push_back(u64_of(sa.Get(i), "shape entries"));
    Codec codec = Codec::MAX;
    bool is_auto = true;
    if (o.Has("codec") && !o.Get("codec").IsUndefined()) {
      const std::string cname = o.Get("codec").ToString().Utf8Value();
      if (!tzip::parse_codec_name(cname, &codec, &is_auto))
        invalid("unknown codec '" + cname + "' (auto, fast, max, bytes, raw)");
    }
    uint32_t chunk = tzip::kDefaultChunkBytes;
    if (o.Has("chunkSize") && !o.Get("chunkSize").IsUndefined()) {
      const uint64_t c = u64_of(o.Get("chunkSize"), "chunkSize");
      if (c < tzip::kMinChunkBytes || c > tzip::kMaxChunkBytes || c % tzip::kChunkBytesMultiple)
        invalid("chunkSize must be a multiple of 256 between 4096 and 65536 bytes");
      chunk = uint32_t(c);
    }
    Napi::Uint8Array out;
    if (o.Has("out") && !o.Get("out").IsUndefined()) {
      const Bytes ob = bytes_of(o.Get("out"), "options.out");
      const uint64_t cap = tzip::max_frame_bytes(in.size, uint32_t(shape.size()), chunk);
      if (ob.size < cap)
        invalid("options.out is " + std::to_string(ob.size) + " bytes, maxCompressedSize is " + std::to_string(cap));
      if (in.size > 0 && ob.data < in.data + in.size && in.data < ob.data + ob.size)
        invalid("options.out overlaps the input");
      out = o.Get("out").As<Napi::Uint8Array>();
    }
    return start(new CompressWorker(env, info[0], in, dtype, std::move(shape), codec, is_auto, threads_opt(o), chunk, out), o);
  } catch (const Napi::Error&) {
    throw;
  } catch (const std::exception&) {
    auto d = Napi::Promise::Deferred::New(env);
    d.Reject(make_error(env, tzip::addon::current_error()).Value());
    return d.Promise();
  }
}

// ---------------------------------------------------------------- decompress

class DecompressWorker : public Napi::AsyncWorker {
 public:
  DecompressWorker(Napi::Env env, Napi::Value frame, Bytes f, Napi::Uint8Array out, bool verify, uint32_t threads)
      : Napi::AsyncWorker(env), deferred_(Napi::Promise::Deferred::New(env)), f_(f), verify_(verify),
        threads_(threads) {
    frame_ref_ = Napi::Persistent(frame.As<Napi::Object>());
    out_ref_ = Napi::Persistent(out.As<Napi::Object>());
    out_ = out.Data();
    out_len_ = out.ByteLength();
  }
  Napi::Promise Promise() { return deferred_.Promise(); }
  void Execute() override {
    try {
      tzip::decode_frame(f_.data, f_.size, out_, out_len_, verify_, threads_);
    } catch (const std::exception&) {
      error_ = std::make_unique<tzip::addon::CodedError>(tzip::addon::current_error());
    }
  }
  void OnOK() override {
    if (error_) deferred_.Reject(make_error(Env(), *error_).Value());
    else deferred_.Resolve(out_ref_.Value());
  }

 private:
  Napi::Promise::Deferred deferred_;
  Napi::ObjectReference frame_ref_, out_ref_;
  Bytes f_;
  uint8_t* out_ = nullptr;
  uint64_t out_len_ = 0;
  bool verify_;
  uint32_t threads_;
  std::unique_ptr<tzip::addon::CodedError> error_;
};

Napi::Value Decompress(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  try {
    if (info.Length() < 1) invalid("decompress(frame, options) needs a frame");
    const Bytes f = bytes_of(info[0], "frame");
    const Napi::Object o = options_of(info, 1);
    const tzip::FrameHeader h = tzip::parse_frame_header(f.data, f.size);
    Napi::Uint8Array out;
    if (o.Has("out") && !o.Get("out").IsUndefined()) {
      bytes_of(o.Get("out"), "options.out");
      out = o.Get("out").As<Napi::Uint8Array>();
      if (out.ByteLength() != h.nbytes)
        invalid("options.out is " + std::to_string(out.ByteLength()) + " bytes, the frame holds " + std::to_string(h.nbytes));
    } else {
      out = tzip::addon::new_buffer(env, h.nbytes, "the decoded tensor (or pass options.out)");
    }
    const bool verify = !o.Has("verify") || o.Get("verify").IsUndefined() || o.Get("verify").ToBoolean().Value();
    return start(new DecompressWorker(env, info[0], f, out, verify, threads_opt(o)), o);
  } catch (const Napi::Error&) {
    throw;
  } catch (const std::exception&) {
    auto d = Napi::Promise::Deferred::New(env);
    d.Reject(make_error(env, tzip::addon::current_error()).Value());
    return d.Promise();
  }
}

// ---------------------------------------------------------------- synchronous helpers

Napi::Value ReadHeader(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  try {
    if (info.Length() < 1) invalid("readHeader(frame) needs a frame");
    const Bytes f = bytes_of(info[0], "frame");
    return tzip::addon::frame_header_object(env, tzip::parse_frame_header(f.data, f.size));
  } catch (const Napi::Error&) {
    throw;
  } catch (const std::exception&) {
    throw make_error(env, tzip::addon::current_error());
  }
}

Napi::Value MaxCompressedSize(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  try {
    if (info.Length() < 2) invalid("maxCompressedSize(nbytes, ndim, chunkSize?)");
    const uint64_t n = u64_of(info[0], "nbytes"), ndim = u64_of(info[1], "ndim");
    if (ndim > tzip::kMaxNdim) invalid("at most 32 dimensions are supported");
    uint64_t chunk = tzip::kDefaultChunkBytes;
    if (info.Length() > 2 && !info[2].IsUndefined()) chunk = u64_of(info[2], "chunkSize");
    if (chunk < tzip::kMinChunkBytes || chunk > tzip::kMaxChunkBytes || chunk % tzip::kChunkBytesMultiple)
      invalid("chunkSize must be a multiple of 256 between 4096 and 65536 bytes");
    return bigsafe(env, tzip::max_frame_bytes(n, uint32_t(ndim), uint32_t(chunk)));
  } catch (const Napi::Error&) {
    throw;
  } catch (const std::exception&) {
    throw make_error(env, tzip::addon::current_error());
  }
}

Napi::Value Entropy(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  try {
    if (info.Length() < 2 || !info[1].IsString()) invalid("entropy(input, dtype)");
    const Bytes in = bytes_of(info[0], "input");
    Dtype dtype;
    const std::string dname = info[1].As<Napi::String>().Utf8Value();
    if (!tzip::parse_dtype_name(dname, &dtype)) invalid("unknown dtype '" + dname + "'");
    if (in.size % tzip::dtype_size(dtype)) invalid("input is not a whole number of " + dname + " elements");
    const tzip::EntropyReport rep = tzip::entropy_report(in.data, in.size, dtype);
    Napi::Object r = Napi::Object::New(env);
    r.Set("boundBytes", rep.bound_bytes);
    Napi::Array planes = Napi::Array::New(env, rep.planes.size());
    for (uint32_t i = 0; i < rep.planes.size(); ++i) {
      Napi::Object p = Napi::Object::New(env);
      p.Set("name", rep.planes[i].name);
      p.Set("bits", rep.planes[i].bits);
      p.Set("entropyBits", rep.planes[i].entropy_bits);
      planes.Set(i, p);
    }
    r.Set("planes", planes);
    return r;
  } catch (const Napi::Error&) {
    throw;
  } catch (const std::exception&) {
    throw make_error(env, tzip::addon::current_error());
  }
}

Napi::Value Gpu(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  const tzip::gpu::Probe& p = tzip::addon::gpu_probe();
  Napi::Object r = Napi::Object::New(env);
  r.Set("available", p.available);
  r.Set("reason", p.reason);
  Napi::Array devs = Napi::Array::New(env, p.devices.size());
  for (uint32_t i = 0; i < p.devices.size(); ++i) {
    Napi::Object d = Napi::Object::New(env);
    d.Set("name", p.devices[i].name);
    d.Set("uuid", p.devices[i].uuid);
    d.Set("sms", p.devices[i].sms);
    d.Set("computeCapability", std::to_string(p.devices[i].major) + "." + std::to_string(p.devices[i].minor));
    d.Set("totalMemory", double(p.devices[i].totalMemory));
    devs.Set(i, d);
  }
  r.Set("devices", devs);
  return r;
}

// mapShared(path, writable): the whole file under /dev/shm mapped MAP_SHARED, as a Buffer that unmaps itself when
// garbage collected. Lets the daemon read and write a client's shared-memory tensors without copying them.
Napi::Value MapShared(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  try {
    if (info.Length() < 2 || !info[0].IsString()) invalid("mapShared(path, writable)");
    const std::string path = info[0].As<Napi::String>().Utf8Value();
    const bool writable = info[1].ToBoolean().Value();
    char real[PATH_MAX];
    if (!realpath(path.c_str(), real)) invalid("cannot resolve " + path + ": " + std::strerror(errno));
    if (std::strncmp(real, "/dev/shm/", 9) != 0) invalid(path + " is not a shared-memory file under /dev/shm");
    const int fd = open(real, (writable ? O_RDWR : O_RDONLY) | O_CLOEXEC);
    if (fd < 0) invalid("cannot open " + path + ": " + std::strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
      close(fd);
      invalid(path + " is not a regular file");
    }
    const size_t size = size_t(st.st_size);
    if (size == 0) {
      close(fd);
      return Napi::Buffer<uint8_t>::New(env, 0);
    }
    void* p = mmap(nullptr, size, writable ? PROT_READ | PROT_WRITE : PROT_READ, MAP_SHARED, fd, 0);
    const int err = errno;
    close(fd);
    if (p == MAP_FAILED) {
      const std::string why = "cannot map " + path + " (" + std::to_string(size) + " bytes): " + std::strerror(err);
      if (err == ENOMEM) throw Error(ErrorCode::OutOfMemory, "out of memory: " + why);  // address space or map count
      invalid(why);
    }
    tzip::addon::guard_register(p, size);  // a client that shrinks the file now costs it its request, not the daemon
    // The mapping's size travels as the finalizer's hint.
    napi_finalize unmap = [](napi_env, void* q, void* hint) {
      tzip::addon::guard_unregister(q);
      munmap(q, size_t(reinterpret_cast<uintptr_t>(hint)));
      tzip::addon::t_external_released = true;
    };
    return tzip::addon::external_buffer(env, static_cast<uint8_t*>(p), size, unmap,
                                        reinterpret_cast<void*>(uintptr_t(size)), "the mapping of " + path);
  } catch (const Napi::Error&) {
    throw;
  } catch (const std::exception&) {
    throw make_error(env, tzip::addon::current_error());
  }
}

// mapSharedFaulted(buffer): whether a mapping made by mapShared took a SIGBUS (its file shrank under it) since it was
// made; the faulting pages now read as zeros (addon/shared_guard.h).
Napi::Value MapSharedFaulted(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  if (info.Length() < 1 || !info[0].IsBuffer()) {
    throw make_error(env, Error(ErrorCode::InvalidArgument, "mapSharedFaulted(buffer) needs the Buffer mapShared returned"));
  }
  return Napi::Boolean::New(env, tzip::addon::guard_faulted(info[0].As<Napi::Buffer<uint8_t>>().Data()));
}

// errorCodes: { TZIP_INVALID_ARGUMENT: 1, ... }, the native codes this build was compiled with (errors.h), which
// test/error-codes.test.ts compares with the one error table, src/errors.json.
Napi::Object ErrorCodes(Napi::Env env) {
  Napi::Object codes = Napi::Object::New(env);
  for (const ErrorCode c : tzip::kErrorCodes) codes.Set(tzip::error_code_name(c), Napi::Number::New(env, int32_t(c)));
  codes.Freeze();
  return codes;
}

Napi::Object Init(Napi::Env env, Napi::Object exports) {
  exports.Set("errorCodes", ErrorCodes(env));
  exports.Set("mapShared", Napi::Function::New(env, MapShared));
  exports.Set("mapSharedFaulted", Napi::Function::New(env, MapSharedFaulted));
  exports.Set("compress", Napi::Function::New(env, Compress));
  exports.Set("decompress", Napi::Function::New(env, Decompress));
  exports.Set("readHeader", Napi::Function::New(env, ReadHeader));
  exports.Set("maxCompressedSize", Napi::Function::New(env, MaxCompressedSize));
  exports.Set("entropy", Napi::Function::New(env, Entropy));
  exports.Set("gpu", Napi::Function::New(env, Gpu));
  exports.Set("formatVersion", Napi::Number::New(env, tzip::kFormatVersion));
  exports.Set("defaultChunkSize", Napi::Number::New(env, tzip::kDefaultChunkBytes));
  exports.Set("defaultThreads", Napi::Number::New(env, default_threads()));
  tzip::addon::register_gpu_codec(env, exports);
  tzip::addon::register_gpu_memory(env, exports);
  tzip::addon::register_cuda_ipc(env, exports);
  tzip::addon::register_ring(env, exports);
  return exports;
}

}  // namespace

NODE_API_MODULE(tzip, Init)
