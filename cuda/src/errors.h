// Errors of the codec core and the addon: the "native" codes of the one error table, src/errors.json, with its stable
// numeric values (as zstd's: never renumbered). The addon gives JavaScript each code's name as `err.code`
// (docs/addon.md) and exports the table it was built with as `errorCodes`, which test/error-codes.test.ts compares
// with src/errors.json; gpu::ErrorCode (gpu/codec.h) has the same values, which the addon static_asserts.
#pragma once
#include <cstdint>
#include <stdexcept>
#include <string>

namespace tzip {

enum class ErrorCode : int32_t {
  InvalidArgument = 1,  // TZIP_INVALID_ARGUMENT
  Corrupt = 2,          // TZIP_CORRUPT
  Truncated = 3,        // TZIP_TRUNCATED
  Checksum = 4,         // TZIP_CHECKSUM
  Unsupported = 5,      // TZIP_UNSUPPORTED
  Cuda = 6,             // TZIP_CUDA: a CUDA runtime call failed (GPU codec and addon only)
  OutOfMemory = 7,      // TZIP_OUT_OF_MEMORY: a host or GPU allocation failed
  Internal = 8,         // TZIP_INTERNAL: a bug (an unexpected exception caught by the addon)
};

/// Every code, in value order.
inline constexpr ErrorCode kErrorCodes[] = {
    ErrorCode::InvalidArgument, ErrorCode::Corrupt,     ErrorCode::Truncated, ErrorCode::Checksum,
    ErrorCode::Unsupported,     ErrorCode::Cuda,        ErrorCode::OutOfMemory, ErrorCode::Internal,
};

/// The code's name as JavaScript, Python and the daemon's protocol spell it ("TZIP_CORRUPT"). A value that is no
/// code (a cast of garbage) is a bug: "TZIP_INTERNAL".
constexpr const char* error_code_name(ErrorCode c) {
  switch (c) {
    case ErrorCode::InvalidArgument: return "TZIP_INVALID_ARGUMENT";
    case ErrorCode::Corrupt: return "TZIP_CORRUPT";
    case ErrorCode::Truncated: return "TZIP_TRUNCATED";
    case ErrorCode::Checksum: return "TZIP_CHECKSUM";
    case ErrorCode::Unsupported: return "TZIP_UNSUPPORTED";
    case ErrorCode::Cuda: return "TZIP_CUDA";
    case ErrorCode::OutOfMemory: return "TZIP_OUT_OF_MEMORY";
    case ErrorCode::Internal: return "TZIP_INTERNAL";
  }
  return "TZIP_INTERNAL";
}

/// Thrown by every encoder/decoder entry point; decoders never read or write outside their buffers first. The core
/// throws InvalidArgument, Corrupt, Truncated, Checksum and Unsupported; a failed allocation in it is std::bad_alloc,
/// which the addon reports as OutOfMemory.
class Error : public std::runtime_error {
 public:
  Error(ErrorCode code, const std::string& what, uint64_t need_bytes = 0)
      : std::runtime_error(what), code_(code), need_bytes_(need_bytes) {}
  ErrorCode code() const { return code_; }
  /// For Truncated header errors: how many bytes the caller must supply to parse the header (0 if unknown).
  uint64_t need_bytes() const { return need_bytes_; }

 private:
  ErrorCode code_;
  uint64_t need_bytes_;
};

}  // namespace tzip
