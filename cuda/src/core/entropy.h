// Order-0 entropy bound of a tensor split into the fields the codecs code (docs/format.md, "Streams").
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "tzip/format.h"

namespace tzip {

struct PlaneEntropy {
  std::string name;     // e.g. "exponent", "sign+mantissa"
  uint32_t bits;        // symbol width
  double entropy_bits;  // order-0 entropy per symbol (bits), over the whole tensor
};

struct EntropyReport {
  double bound_bytes = 0;  // sum over planes of n * H / 8: no order-0 coder of these planes does better
  std::vector<PlaneEntropy> planes;
};

/// Splits `nbytes` of `dtype` as the float codecs do (bf16/fp16/fp32: exponent and residual streams) or into byte
/// planes (other dtypes) and returns each plane's order-0 entropy and the bound in bytes.
EntropyReport entropy_report(const uint8_t* data, uint64_t nbytes, Dtype dtype);

}  // namespace tzip
