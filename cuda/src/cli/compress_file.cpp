#include "cli/compress_file.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

#include "cli/atomic_output.h"
#include "cli/background_writer.h"
#include "cli/deferral.h"
#include "cli/entry_schedule.h"
#include "cli/mapped_file.h"
#include "cli/phase_clock.h"
#include "cli/progress.h"
#include "container/entries.h"
#include "container/layout.h"
#include "core/frame.h"
#include "tzip/xxhash32.h"

namespace tzip::cli {

namespace {

/// Entries larger than this are left to the Node CLI: a Node Buffer holds at most 2^32 bytes (buffer.constants
/// .MAX_LENGTH on Node 20), beyond which the Node CLI refuses the file; 2^31 stays clear of it on every version.
constexpr uint64_t kMaxEntryBytes = uint64_t(1) << 31;

}  // namespace

RunResult compress_file(const Command& cmd) {
  const auto started = std::chrono::steady_clock::now();
  PhaseClock clock;
  const MappedFile input(cmd.input);
  clock.mark("map");
  if (input.same_file_as(cmd.output)) throw Defer("output is the input");
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

  clock.mark("parse");
  AtomicOutput out(cmd.output);
  const uint64_t header_bytes = header.data_offset;
  uint8_t prefix[container::kPrefixBytes];
  container::encode_prefix({size, true, xxh32(file, header_bytes, 0)}, prefix);
  out.write_at(prefix, sizeof prefix, 0);
  out.write_at(file, header_bytes, container::kPrefixBytes);

  const uint8_t* data = file + header.data_offset;
  std::vector<uint64_t> bytes(plan.size());
  std::vector<bool> wide(plan.size());
  for (size_t i = 0; i < plan.size(); ++i) {
    bytes[i] = plan[i].end - plan[i].begin;
    wide[i] = is_wide(num_chunks(bytes[i], chunk), threads);
  }
  // Each frame of a group is coded into its own slot of max_frame_bytes, then written at its place in the file.
  BackgroundWriter writer(out);
  std::vector<uint64_t> slot(plan.size() + 1, 0), frame_bytes(plan.size(), 0);
  uint8_t* arena = nullptr;
  uint64_t turn = 0;
  auto prepare = [&](uint64_t first, uint64_t last) {
    slot[first] = 0;
    for (uint64_t i = first; i < last; ++i)
      slot[i + 1] = slot[i] + max_frame_bytes(bytes[i], uint32_t(plan[i].shape.size()), chunk);
    arena = writer.buffer(turn, slot[last]);
  };
  std::vector<container::IndexEntry> index(plan.size());
  uint64_t position = container::align_up(container::kPrefixBytes + header_bytes);
  Progress progress(cmd.input, header.data_length);
  uint64_t done_bytes = 0;
  run_entries(wide, bytes, threads, prepare, [&](uint64_t i, uint32_t t) {
      const container::PlannedEntry& e = plan[i];
      const uint8_t* raw = data + e.begin;
      EncodeOptions opt;
      opt.codec = is_auto ? resolve_auto(raw, bytes[i], e.dtype, chunk, t) : codec;
      opt.threads = t;
      opt.chunk_bytes = chunk;
      frame_bytes[i] = encode_frame(raw, bytes[i], e.dtype, e.shape, opt, arena + slot[i]);
    }, [&](uint64_t first, uint64_t last) {
      std::vector<BackgroundWriter::Piece> pieces;
      const uint64_t from = position;
      for (uint64_t i = first; i < last; ++i) {
        pieces.push_back({arena + slot[i], frame_bytes[i], off_t(position)});
        index[i] = {plan[i].begin, plan[i].end, position, frame_bytes[i]};
        position = container::align_up(position + frame_bytes[i]);
        done_bytes += bytes[i];
      }
      writer.write(turn++, std::move(pieces), off_t(from), off_t(position));
      progress.update(done_bytes);
    });
  writer.finish();
  clock.mark("code");

  std::vector<uint8_t> tail(index.size() * container::kIndexEntryBytes + container::kTrailerBytes);
  container::encode_index(index, tail.data());
  const uint64_t index_bytes = index.size() * container::kIndexEntryBytes;
  container::encode_trailer({position, uint32_t(index.size()), xxh32(tail.data(), index_bytes, 0), size},
                            tail.data() + index_bytes);
  out.write_at(tail.data(), tail.size(), off_t(position));
  out.commit();
  clock.mark("commit");
  RunResult r;
  r.input_bytes = size;
  r.output_bytes = position + tail.size();
  r.entries = plan.size();
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  return r;
}

}  // namespace tzip::cli
