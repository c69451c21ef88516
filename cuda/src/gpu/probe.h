// GPU discovery. Plain C++ header (no CUDA headers) so addon.cpp and the codec
// core can include it without nvcc.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

namespace tzip::gpu {

struct DeviceInfo {
  std::string name;
  std::string uuid;  // nvidia-smi style: GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx
  int sms = 0;
  int major = 0;
  int minor = 0;
  size_t totalMemory = 0;
};

struct Probe {
  bool available = false;
  std::string reason;  // CUDA's error text when !available, empty otherwise
  std::vector<DeviceInfo> devices;
};

// Never throws. Works without a driver: the CUDA runtime is linked statically
// and loads libcuda lazily, so a missing driver is just an error code here.
Probe probe();

}  // namespace tzip::gpu
