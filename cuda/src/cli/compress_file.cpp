#include "cli/compress_file.h"

#include <sys/stat.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

#include "cli/atomic_output.h"
#include "cli/deferral.h"
#include "cli/entry_schedule.h"
#include "cli/mapped_file.h"
#include "container/entries.h"
#include "container/layout.h"
#include "frame.h"
#include "tzip/xxhash32.h"

namespace tzip::cli {

namespace {

/// Entries larger than this are left to the Node CLI: a Node Buffer holds at most 2^32 bytes (buffer.constants
/// .MAX_LENGTH on Node 20), beyond which the Node CLI refuses the file; 2^31 stays clear of it on every version.
constexpr uint64_t kMaxEntryBytes = uint64_t(1) << 31;
/// Input bytes coded per batch: bounds the frame memory (about one batch) for files of any size.
constexpr uint64_t kBatchBytes = uint64_t(1) << 30;

}  // namespace

CompressResult compress_file(const Command& cmd) {
  const auto started = std::chrono::steady_clock::now();
  const MappedFile input(cmd.input);
  struct stat out_st;
  if (stat(cmd.output.c_str(), &out_st) == 0 && out_st.st_dev == input.info().st_dev && out_st.st_ino == input.info().st_ino)
    throw Defer("output is the input");
  const uint8_t* file = input.data();
  const uint64_t size = input.size();
  const container::SafetensorsHeader header = container::parse_safetensors_header(file, size, size);
  const std::vector<container::PlannedEntry> plan = container::plan_entries(header);
  for (const container::PlannedEntry& e : plan)
    if (e.end - e.begin > kMaxEntryBytes) throw Defer("an entry above 2 GiB");
  if (plan.size() > UINT32_MAX) throw Defer("more entries than the trailer counts");

  Codec codec;
  bool is_auto;
  if (!parse_codec_name(cmd.codec, &codec, &is_auto)) throw Defer("codec " + cmd.codec);
  const uint32_t chunk = cmd.chunk_bytes != 0 ? cmd.chunk_bytes : kDefaultChunkBytes;
  uint32_t threads = cmd.threads;
  if (threads == 0) threads = std::max(1u, std::thread::hardware_concurrency());  // the addon's default

  AtomicOutput out(cmd.output);
  const uint64_t header_bytes = header.data_offset;
  uint8_t prefix[container::kPrefixBytes];
  container::encode_prefix({size, true, xxh32(file, header_bytes, 0)}, prefix);
  out.write_at(prefix, sizeof prefix, 0);
  out.write_at(file, header_bytes, container::kPrefixBytes);

  const uint8_t* data = file + header.data_offset;
  std::vector<container::IndexEntry> index(plan.size());
  uint64_t position = container::align_up(container::kPrefixBytes + header_bytes);
  std::unique_ptr<uint8_t[]> arena;
  uint64_t arena_bytes = 0;
  for (size_t first = 0; first < plan.size();) {
    size_t last = first;
    uint64_t batch = 0;
    while (last < plan.size() && (last == first || batch + (plan[last].end - plan[last].begin) <= kBatchBytes)) {
      batch += plan[last].end - plan[last].begin;
      ++last;
    }
    // Each frame is coded into its own slot of max_frame_bytes, then written at its place in the file.
    std::vector<uint64_t> slot(last - first + 1, 0), frame_bytes(last - first, 0);
    std::vector<bool> wide(last - first);
    for (size_t i = first; i < last; ++i) {
      const uint64_t n = plan[i].end - plan[i].begin;
      slot[i - first + 1] = slot[i - first] + max_frame_bytes(n, uint32_t(plan[i].shape.size()), chunk);
      wide[i - first] = is_wide(num_chunks(n, chunk), threads);
    }
    if (slot.back() > arena_bytes) {
      arena.reset();
      arena.reset(new uint8_t[slot.back()]);
      arena_bytes = slot.back();
    }
    run_entries(wide, threads, [&](uint64_t k, uint32_t t) {
      const container::PlannedEntry& e = plan[first + k];
      const uint8_t* raw = data + e.begin;
      const uint64_t n = e.end - e.begin;
      EncodeOptions opt;
      opt.codec = is_auto ? resolve_auto(raw, n, e.dtype, chunk, t) : codec;
      opt.threads = t;
      opt.chunk_bytes = chunk;
      frame_bytes[k] = encode_frame(raw, n, e.dtype, e.shape, opt, arena.get() + slot[k]);
    });
    for (size_t i = first; i < last; ++i) {
      const uint64_t k = i - first;
      out.write_at(arena.get() + slot[k], frame_bytes[k], off_t(position));
      index[i] = {plan[i].begin, plan[i].end, position, frame_bytes[k]};
      position = container::align_up(position + frame_bytes[k]);
    }
    first = last;
  }

  std::vector<uint8_t> tail(index.size() * container::kIndexEntryBytes + container::kTrailerBytes);
  container::encode_index(index, tail.data());
  const uint64_t index_bytes = index.size() * container::kIndexEntryBytes;
  container::encode_trailer({position, uint32_t(index.size()), xxh32(tail.data(), index_bytes, 0), size},
                            tail.data() + index_bytes);
  out.write_at(tail.data(), tail.size(), off_t(position));
  out.commit();
  CompressResult r;
  r.input_bytes = size;
  r.output_bytes = position + tail.size();
  r.entries = plan.size();
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  return r;
}

}  // namespace tzip::cli
