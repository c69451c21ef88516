// Errors of the codec core. Each maps to a JavaScript error code in the addon (docs/addon.md).
#pragma once
#include <stdexcept>
#include <string>

namespace tzip {

enum class ErrorCode { InvalidArgument, Corrupt, Truncated, Checksum, Unsupported };

const char* error_code_name(ErrorCode c);

/// Thrown by every encoder/decoder entry point; decoders never read or write outside their buffers first.
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
