// CUDA IPC: the daemon opens the memory and event handles that PyTorch clients share (cudaIpcOpenMemHandle,
// cudaIpcOpenEventHandle) and shares its own interprocess events (cudaEventCreateInterprocess). cudaIpcGetMemHandle is
// for tests and tools. Handles are the 64 raw bytes of cudaIpcMemHandle_t / cudaIpcEventHandle_t.
#include <cstring>
#include <string>

#include "addon/args.h"
#include "addon/device.h"
#include "addon/register.h"

namespace tzip::addon {

namespace {

static_assert(sizeof(cudaIpcMemHandle_t) == 64 && sizeof(cudaIpcEventHandle_t) == 64, "CUDA IPC handles are 64 bytes");

template <class Handle>
Handle handle_arg(const Napi::CallbackInfo& info, const char* what) {
  if (info.Length() < 1) invalid(std::string(what) + " is required");
  const Bytes b = bytes_of(info[0], what);
  if (b.size != sizeof(Handle))
    invalid(std::string(what) + " must be " + std::to_string(sizeof(Handle)) + " bytes, not " + std::to_string(b.size));
  Handle h;
  std::memcpy(&h, b.data, sizeof h);
  return h;
}

Napi::BigInt big(Napi::Env env, const void* p) {
  return Napi::BigInt::New(env, static_cast<uint64_t>(reinterpret_cast<uintptr_t>(p)));
}

uint64_t nonnull(uint64_t v, const char* what) {
  if (!v) invalid(std::string(what) + " is null");
  return v;
}

template <class T>
T as(uint64_t v) {
  return reinterpret_cast<T>(static_cast<uintptr_t>(v));
}

// cudaIpcGetMemHandle(ptr, device) => Buffer (64 bytes): the handle of the allocation holding ptr.
Napi::Value IpcGetMemHandle(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  return guarded(env, [&]() -> Napi::Value {
    const int dev = device_arg(info, 1);
    const uint64_t p = nonnull(arg_u64(info, 0, "ptr"), "ptr");
    DeviceScope scope(dev);
    check_device_range(p, 0, dev, "cudaIpcGetMemHandle: ptr");
    cudaIpcMemHandle_t h;
    cuda_check(cudaIpcGetMemHandle(&h, as<void*>(p)), "cudaIpcGetMemHandle");
    return Napi::Buffer<uint8_t>::Copy(env, reinterpret_cast<const uint8_t*>(&h), sizeof h);
  });
}

// cudaIpcOpenMemHandle(handle, device) => bigint: base of the other process's allocation, mapped here.
Napi::Value IpcOpenMemHandle(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  return guarded(env, [&]() -> Napi::Value {
    const int dev = device_arg(info, 1);
    const cudaIpcMemHandle_t h = handle_arg<cudaIpcMemHandle_t>(info, "handle");
    DeviceScope scope(dev);
    void* p = nullptr;
    cuda_check(cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess), "cudaIpcOpenMemHandle");
    return big(env, p);
  });
}

// cudaIpcCloseMemHandle(base, device).
Napi::Value IpcCloseMemHandle(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  return guarded(env, [&]() -> Napi::Value {
    const int dev = device_arg(info, 1);
    const uint64_t p = nonnull(arg_u64(info, 0, "base"), "base");
    DeviceScope scope(dev);
    cuda_check(cudaIpcCloseMemHandle(as<void*>(p)), "cudaIpcCloseMemHandle(" + hex_ptr(p) + ")");
    return env.Undefined();
  });
}

// cudaIpcOpenEventHandle(handle, device) => bigint (cudaEvent_t).
Napi::Value IpcOpenEventHandle(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  return guarded(env, [&]() -> Napi::Value {
    const int dev = device_arg(info, 1);
    const cudaIpcEventHandle_t h = handle_arg<cudaIpcEventHandle_t>(info, "handle");
    DeviceScope scope(dev);
    cudaEvent_t ev = nullptr;
    cuda_check(cudaIpcOpenEventHandle(&ev, h), "cudaIpcOpenEventHandle");
    return big(env, ev);
  });
}

// cudaEventCreateInterprocess(device) => {event: bigint, handle: Buffer (64 bytes)}.
Napi::Value EventCreateInterprocess(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  return guarded(env, [&]() -> Napi::Value {
    const int dev = device_arg(info, 0);
    DeviceScope scope(dev);
    cudaEvent_t ev = nullptr;
    cuda_check(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming | cudaEventInterprocess),
               "cudaEventCreateWithFlags(cudaEventInterprocess)");
    cudaIpcEventHandle_t h;
    const cudaError_t e = cudaIpcGetEventHandle(&h, ev);
    if (e != cudaSuccess) cudaEventDestroy(ev);
    cuda_check(e, "cudaIpcGetEventHandle");
    Napi::Object r = Napi::Object::New(env);
    r.Set("event", big(env, ev));
    r.Set("handle", Napi::Buffer<uint8_t>::Copy(env, reinterpret_cast<const uint8_t*>(&h), sizeof h));
    return r;
  });
}

// cudaEventDestroy(event, device).
Napi::Value EventDestroy(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  return guarded(env, [&]() -> Napi::Value {
    const int dev = device_arg(info, 1);
    const uint64_t ev = nonnull(arg_u64(info, 0, "event"), "event");
    DeviceScope scope(dev);
    cuda_check(cudaEventDestroy(as<cudaEvent_t>(ev)), "cudaEventDestroy");
    return env.Undefined();
  });
}

}  // namespace

void register_cuda_ipc(Napi::Env env, Napi::Object exports) {
  exports.Set("cudaIpcGetMemHandle", Napi::Function::New(env, IpcGetMemHandle));
  exports.Set("cudaIpcOpenMemHandle", Napi::Function::New(env, IpcOpenMemHandle));
  exports.Set("cudaIpcCloseMemHandle", Napi::Function::New(env, IpcCloseMemHandle));
  exports.Set("cudaIpcOpenEventHandle", Napi::Function::New(env, IpcOpenEventHandle));
  exports.Set("cudaEventCreateInterprocess", Napi::Function::New(env, EventCreateInterprocess));
  exports.Set("cudaEventDestroy", Napi::Function::New(env, EventDestroy));
}

}  // namespace tzip::addon
