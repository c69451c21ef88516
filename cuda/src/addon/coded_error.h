// An error of the addon's GPU and CUDA IPC entry points: a JavaScript error code (docs/addon.md) and a message, plus,
// for batched decodes, one code per item. The codec core's tzip::Error has no TZIP_CUDA; this one carries any code.
#pragma once
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace tzip::addon {

class CodedError : public std::runtime_error {
 public:
  CodedError(std::string code, const std::string& message) : std::runtime_error(message), code_(std::move(code)) {}
  const std::string& code() const { return code_; }
  /// gpuDecompress: per item, the error code or "" (becomes err.itemErrors); empty otherwise.
  std::vector<std::string> item_errors;

 private:
  std::string code_;
};

[[noreturn]] inline void throw_invalid(const std::string& message) {
  throw CodedError("TZIP_INVALID_ARGUMENT", message);
}

}  // namespace tzip::addon
