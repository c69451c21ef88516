// How a safetensors data section is cut into the entries of a .tzip container (docs/container.md, "Entries"): the
// C++ twin of src/entries.ts. One entry per tensor in the header's sorted order, one 'U8' gap entry per run of bytes no
// tensor covers, covering the data section from 0 to its end without gaps.
#pragma once
#include <cstdint>
#include <vector>

#include "container/safetensors_header.h"

namespace tzip::container {

struct PlannedEntry {
  const Tensor* tensor = nullptr;  ///< the tensor, or nullptr for a gap
  uint64_t begin = 0, end = 0;     ///< data-section offsets
  Dtype dtype = Dtype::U8;         ///< codec dtype
  std::vector<uint64_t> shape;     ///< codec shape
};

/// The entries of `header` (which must outlive them), ascending and contiguous from 0 to header.data_length.
std::vector<PlannedEntry> plan_entries(const SafetensorsHeader& header);

}  // namespace tzip::container
