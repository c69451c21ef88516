#include "container/entries.h"

namespace tzip::container {

std::vector<PlannedEntry> plan_entries(const SafetensorsHeader& header) {
  std::vector<PlannedEntry> entries;
  entries.reserve(header.tensors.size() * 2 + 1);
  uint64_t cursor = 0;
  auto gap_until = [&](uint64_t end) {
    if (end > cursor) {
      entries.push_back({nullptr, cursor, end, Dtype::U8, {end - cursor}});
      cursor = end;
    }
  };
  for (const Tensor& t : header.tensors) {
    gap_until(t.begin);
    entries.push_back({&t, t.begin, t.end, t.codec_dtype, t.codec_shape});
    cursor = t.end;
  }
  gap_until(header.data_length);
  return entries;
}

}  // namespace tzip::container
