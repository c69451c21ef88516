// The addon's GPU, CUDA IPC and submission ring entry points (documented in docs/addon.md and src/native.ts), registered by addon.cpp.
#pragma once
#include <napi.h>

#include <string>

namespace tzip::addon {

/// gpuCompress, gpuDecompress: batched GPU codec calls on the addon's per-device stream (addon/gpu_codec.cpp). Also
/// holds the streams' scratch cache for `env` (released by an environment cleanup hook).
void register_gpu_codec(Napi::Env env, Napi::Object exports);

/// gpuDevices, cudaMemGetInfo, gpuAlloc, gpuFree, gpuCopyToDevice, gpuCopyFromDevice (addon/gpu_memory.cpp).
void register_gpu_memory(Napi::Env env, Napi::Object exports);

/// cudaIpcGetMemHandle, cudaIpcOpenMemHandle, cudaIpcCloseMemHandle, cudaEventCreateInterprocess,
/// cudaIpcOpenEventHandle, cudaEventDestroy (addon/cuda_ipc.cpp).
void register_cuda_ipc(Napi::Env env, Napi::Object exports);

/// ringOpen: the submission ring of docs/ring.md, a native thread per ring serving SQEs from a shared-memory file
/// (addon/ring_napi.cpp, addon/ring.h).
void register_ring(Napi::Env env, Napi::Object exports);

/// Checks that a GPU can be used (else TZIP_UNSUPPORTED) and that `v` is the ordinal of a visible one (else
/// TZIP_INVALID_ARGUMENT); returns it. Defined in addon/gpu_memory.cpp.
int device_of(const Napi::Value& v, const std::string& what);

/// device_of(argument i, "device").
int device_arg(const Napi::CallbackInfo& info, size_t i);

}  // namespace tzip::addon
