#include "gpu/probe.h"

#include <cuda_runtime.h>
#include <dlfcn.h>

#include <cstdio>
#include <utility>

namespace tzip::gpu {
namespace {

std::string formatUuid(const cudaUUID_t& id) {
  const auto* b = reinterpret_cast<const unsigned char*>(id.bytes);
  char s[64];
  std::snprintf(s, sizeof s,
                "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x",
                b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11],
                b[12], b[13], b[14], b[15]);
  return s;
}

}  // namespace

Probe probe() {
  Probe p;
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    p.reason = cudaGetErrorString(err);
    // The runtime says "driver version is insufficient" also when there is no driver at all: say which it is.
    if (err == cudaErrorInsufficientDriver) {
      if (void* lib = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_LOCAL)) {
        dlclose(lib);
      } else {
        p.reason = "no CUDA driver: libcuda.so.1 is not installed or not on the library path";
      }
    }
    cudaGetLastError();  // clear the sticky-free error so later calls start clean
    return p;
  }
  if (count == 0) {
    p.reason = cudaGetErrorString(cudaErrorNoDevice);
    return p;
  }
  for (int i = 0; i < count; ++i) {
    cudaDeviceProp prop{};
    err = cudaGetDeviceProperties(&prop, i);
    if (err != cudaSuccess) {
      p.devices.clear();
      p.reason = cudaGetErrorString(err);
      cudaGetLastError();
      return p;
    }
    DeviceInfo d;
    d.name = prop.name;
    d.uuid = formatUuid(prop.uuid);
    d.sms = prop.multiProcessorCount;
    d.major = prop.major;
    d.minor = prop.minor;
    d.totalMemory = prop.totalGlobalMem;
    p.devices.push_back(std::move(d));
  }
  p.available = true;
  return p;
}

}  // namespace tzip::gpu
