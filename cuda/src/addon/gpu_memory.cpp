// gpuDevices and cudaMemGetInfo (what the daemon matches clients' GPUs by), and the synchronous device-memory helpers
// for tests and tools: gpuAlloc, gpuFree, gpuCopyToDevice, gpuCopyFromDevice.
#include <string>

#include "addon/args.h"
#include "addon/device.h"
#include "addon/register.h"

namespace tzip::addon {

int device_of(const Napi::Value& v, const std::string& what) {
  require_gpu();
  if (v.IsUndefined() || v.IsNull()) invalid(what + " is required: a GPU ordinal");
  const int32_t d = i32_of(v, what);
  check_device(d);
  return d;
}

int device_arg(const Napi::CallbackInfo& info, size_t i) {
  return device_of(info.Length() > i ? info[i] : info.Env().Undefined(), "device");
}

namespace {

void* as_ptr(uint64_t p) { return reinterpret_cast<void*>(static_cast<uintptr_t>(p)); }

// gpuDevices() => [{ordinal, uuid, name, smCount, totalMemory, pciBusId, computeCapability}]; [] without a GPU.
Napi::Value GpuDevices(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  const gpu::Probe& p = gpu_probe();
  if (!p.available) return Napi::Array::New(env, 0);
  Napi::Array out = Napi::Array::New(env, p.devices.size());
  for (uint32_t i = 0; i < p.devices.size(); ++i) {
    const gpu::DeviceInfo& d = p.devices[i];
    char bus[64] = {0};
    if (cudaDeviceGetPCIBusId(bus, sizeof bus, int(i)) != cudaSuccess) {
      cudaGetLastError();
      bus[0] = 0;
    }
    Napi::Object o = Napi::Object::New(env);
    o.Set("ordinal", i);
    o.Set("uuid", d.uuid);
    o.Set("name", d.name);
    o.Set("smCount", d.sms);
    o.Set("totalMemory", double(d.totalMemory));
    o.Set("pciBusId", std::string(bus));
    o.Set("computeCapability", std::to_string(d.major) + "." + std::to_string(d.minor));
    out.Set(i, o);
  }
  return out;
}

// cudaMemGetInfo(device) => {free, total} in bytes.
Napi::Value MemGetInfo(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  return guarded(env, [&]() -> Napi::Value {
    const int dev = device_arg(info, 0);
    DeviceScope scope(dev);
    size_t free_b = 0, total_b = 0;
    cuda_check(cudaMemGetInfo(&free_b, &total_b), "cudaMemGetInfo");
    Napi::Object r = Napi::Object::New(env);
    r.Set("free", double(free_b));
    r.Set("total", double(total_b));
    return r;
  });
}

// gpuAlloc(device, nbytes) => bigint: cudaMalloc of max(nbytes, 1) bytes.
Napi::Value GpuAlloc(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  return guarded(env, [&]() -> Napi::Value {
    const int dev = device_arg(info, 0);
    const uint64_t n = arg_u64(info, 1, "nbytes");
    DeviceScope scope(dev);
    void* p = nullptr;
    cuda_check(cudaMalloc(&p, n ? n : 1), "cudaMalloc(" + std::to_string(n) + " bytes)");
    return Napi::BigInt::New(env, static_cast<uint64_t>(reinterpret_cast<uintptr_t>(p)));
  });
}

// gpuFree(ptr, device): cudaFree.
Napi::Value GpuFree(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  return guarded(env, [&]() -> Napi::Value {
    const int dev = device_arg(info, 1);
    const uint64_t p = arg_u64(info, 0, "ptr");
    DeviceScope scope(dev);
    cuda_check(cudaFree(as_ptr(p)), "cudaFree(" + hex_ptr(p) + ")");
    return env.Undefined();
  });
}

// gpuCopyToDevice(ptr, src, device): synchronous copy of src's bytes to [ptr, ptr + src.byteLength).
Napi::Value GpuCopyToDevice(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  return guarded(env, [&]() -> Napi::Value {
    const int dev = device_arg(info, 2);
    const uint64_t p = arg_u64(info, 0, "ptr");
    if (info.Length() < 2) invalid("gpuCopyToDevice(ptr, src, device) needs src");
    const Bytes src = bytes_of(info[1], "src");
    if (src.size == 0) return env.Undefined();
    DeviceScope scope(dev);
    check_device_range(p, src.size, dev, "gpuCopyToDevice: destination");
    cuda_check(cudaMemcpy(as_ptr(p), src.data, src.size, cudaMemcpyHostToDevice), "cudaMemcpy (host to device)");
    // A copy from pageable memory may return before its DMA is done: wait, so that work on other streams sees it.
    cuda_check(cudaStreamSynchronize(cudaStreamLegacy), "cudaStreamSynchronize");
    return env.Undefined();
  });
}

// gpuCopyFromDevice(ptr, nbytes, device) => Buffer: synchronous copy of [ptr, ptr + nbytes) to a new Buffer.
Napi::Value GpuCopyFromDevice(const Napi::CallbackInfo& info) {
  Napi::Env env = info.Env();
  return guarded(env, [&]() -> Napi::Value {
    const int dev = device_arg(info, 2);
    const uint64_t p = arg_u64(info, 0, "ptr");
    const uint64_t n = arg_u64(info, 1, "nbytes");
    if (n == 0) return Napi::Buffer<uint8_t>::New(env, 0);
    DeviceScope scope(dev);
    check_device_range(p, n, dev, "gpuCopyFromDevice: source");
    Napi::Buffer<uint8_t> out = new_buffer(env, n, "gpuCopyFromDevice");
    cuda_check(cudaMemcpy(out.Data(), as_ptr(p), n, cudaMemcpyDeviceToHost), "cudaMemcpy (device to host)");
    return out;
  });
}

}  // namespace

void register_gpu_memory(Napi::Env env, Napi::Object exports) {
  exports.Set("gpuDevices", Napi::Function::New(env, GpuDevices));
  exports.Set("cudaMemGetInfo", Napi::Function::New(env, MemGetInfo));
  exports.Set("gpuAlloc", Napi::Function::New(env, GpuAlloc));
  exports.Set("gpuFree", Napi::Function::New(env, GpuFree));
  exports.Set("gpuCopyToDevice", Napi::Function::New(env, GpuCopyToDevice));
  exports.Set("gpuCopyFromDevice", Napi::Function::New(env, GpuCopyFromDevice));
}

}  // namespace tzip::addon
