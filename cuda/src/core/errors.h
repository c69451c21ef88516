// Errors of the codec core and the addon: the "native" codes of the one error table, src/errors.json, with its stable
// numeric values (as zstd's: never renumbered). tzip::ErrorCode itself is generated from the table
// (cuda/include/tzip/generated/constants.h, by scripts/gen-constants.mjs). The addon gives JavaScript each code's name as `err.code`
// (docs/addon.md) and exports the table it was built with as `errorCodes`, which test/error-codes.test.ts compares
// with src/errors.json; gpu::ErrorCode (generated beside it) has the same values, which the addon static_asserts.
#pragma once
#include <cstdint>
#include <stdexcept>
#include <string>

#include "tzip/generated/constants.h"  // tzip::ErrorCode, kErrorCodes, error_code_name

namespace tzip {

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
