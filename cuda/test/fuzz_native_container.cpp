// libFuzzer target: the native CLI's readers of untrusted files (cuda/src/container/): a .tzip container
// (open_container: prefix, header digest, trailer, index, safetensors header, entry plan, frame placement) and a
// safetensors header alone (parse_safetensors_header, what `tzip compress` reads), on hostile bytes.
// Properties: nothing is read outside the input (ASan); every refusal is tzip::Error or NotHandled, never another
// exception; what is accepted is consistent: tensors sorted and not overlapping, inside the data section, entries
// contiguous from 0 to the data section's end, frames aligned, in order and before the index.
#include <algorithm>
#include <cstring>

#include "container/reader.h"
#include "fuzz_support.h"

using namespace tzip_fuzz;
using namespace tzip::container;

namespace {

void check_plan(const SafetensorsHeader& h, const std::vector<PlannedEntry>& plan) {
  uint64_t cursor = 0;
  for (const PlannedEntry& e : plan) {
    FUZZ_CHECK(e.begin == cursor && e.end >= e.begin, "entries are contiguous");
    FUZZ_CHECK(e.tensor != nullptr || e.end > e.begin, "gap entries are not empty");
    cursor = e.end;
  }
  FUZZ_CHECK(cursor == h.data_length, "entries cover the data section");
  for (size_t i = 0; i < h.tensors.size(); ++i) {
    const Tensor& t = h.tensors[i];
    FUZZ_CHECK(t.begin <= t.end && t.end <= h.data_length, "a tensor lies in the data section");
    FUZZ_CHECK(i == 0 || h.tensors[i - 1].begin <= t.begin, "tensors are sorted");
  }
}

void check_safetensors(const uint8_t* data, size_t size) {
  // An exact-size copy, so that ASan sees any read past the end.
  const std::vector<uint8_t> file(data, data + size);
  try {
    const SafetensorsHeader h = parse_safetensors_header(file.data(), file.size(), file.size());
    FUZZ_CHECK(h.data_offset == kLengthPrefixBytes + h.header_length && h.data_offset <= size, "header within the file");
    check_plan(h, plan_entries(h));
  } catch (const NotHandled&) {
  } catch (const tzip::Error&) {
  }
}

void check_container(const uint8_t* data, size_t size) {
  const std::vector<uint8_t> file(data, data + size);
  try {
    const OpenedContainer c = open_container(file.data(), file.size());
    std::vector<PlannedEntry> plan;
    for (const ContainerEntry& e : c.entries) plan.push_back(e.plan);
    check_plan(c.header, plan);
    uint64_t end = 0;
    for (const ContainerEntry& e : c.entries) {
      FUZZ_CHECK(e.index.frame_offset % kAlignment == 0 && e.index.frame_offset >= end, "frames aligned and in order");
      end = e.index.frame_offset + e.index.frame_bytes;
      FUZZ_CHECK(end + kTrailerBytes <= size, "a frame lies inside the file");
    }
  } catch (const NotHandled&) {
  } catch (const tzip::Error&) {
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  check_safetensors(data, size);
  check_container(data, size);
  return 0;
}
