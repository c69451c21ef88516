// An error of the addon's entry points: a native code of the one error table (errors.h, src/errors.json) and a
// message, plus, for batched GPU calls, one code per item. It is a tzip::Error, so every handler of the codec core's
// errors takes it too (make_error in args.h gives JavaScript the per-item codes).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "core/errors.h"
#include "gpu/codec.h"

namespace tzip::addon {

class CodedError : public tzip::Error {
 public:
  /// `need_bytes`: for TZIP_TRUNCATED header errors, the bytes of the frame the caller must supply (0: unknown).
  CodedError(tzip::ErrorCode code, const std::string& message, uint64_t need_bytes = 0)
      : tzip::Error(code, message, need_bytes) {}
  /// gpuCompress/gpuDecompress: per item, its code, 0 for an item that succeeded (becomes err.itemErrors, with '' for
  /// 0); empty otherwise.
  std::vector<int32_t> item_errors;
};

// The GPU codec's codes are the native codes with the same values (one table, src/errors.json).
static_assert(int32_t(tzip::ErrorCode::InvalidArgument) == tzip::gpu::kInvalidArgument, "one error table");
static_assert(int32_t(tzip::ErrorCode::Corrupt) == tzip::gpu::kCorrupt, "one error table");
static_assert(int32_t(tzip::ErrorCode::Truncated) == tzip::gpu::kTruncated, "one error table");
static_assert(int32_t(tzip::ErrorCode::Checksum) == tzip::gpu::kChecksum, "one error table");
static_assert(int32_t(tzip::ErrorCode::Unsupported) == tzip::gpu::kUnsupported, "one error table");
static_assert(int32_t(tzip::ErrorCode::Cuda) == tzip::gpu::kCudaError, "one error table");
static_assert(int32_t(tzip::ErrorCode::OutOfMemory) == tzip::gpu::kOutOfMemory, "one error table");

/// A non-zero code of the GPU codec (per call or per decoded frame) as a native code. A value that is none of the GPU
/// codec's (a result array the decoder never wrote, after a failed launch) is TZIP_CUDA.
inline tzip::ErrorCode from_gpu(int32_t code) {
  return code >= tzip::gpu::kInvalidArgument && code <= tzip::gpu::kOutOfMemory ? tzip::ErrorCode(code)
                                                                                 : tzip::ErrorCode::Cuda;
}

[[noreturn]] inline void throw_invalid(const std::string& message) {
  throw CodedError(tzip::ErrorCode::InvalidArgument, message);
}

}  // namespace tzip::addon
