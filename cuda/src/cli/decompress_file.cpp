#include "cli/decompress_file.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "cli/atomic_output.h"
#include "cli/background_writer.h"
#include "cli/deferral.h"
#include "cli/entry_schedule.h"
#include "core/parallel.h"
#include "cli/mapped_file.h"
#include "cli/phase_clock.h"
#include "cli/progress.h"
#include "container/reader.h"
#include "core/frame.h"

namespace tzip::cli {

namespace {

/// As in compress_file.cpp: frames and entries above this are left to the Node CLI (its Buffer limit).
constexpr uint64_t kMaxEntryBytes = uint64_t(1) << 31;
/// Output bytes per piece (see decompress_file). Small enough that two buffers stay in the caches' reach and the last
/// piece's writeback, which the final fsync waits for, is short; large enough that a piece's threads and write
/// calls cost little.
constexpr uint64_t kPieceBytes = uint64_t(4) << 20;

/// The checks src/reader.ts (checkFrame) makes of a frame's header against its entry.
void check_frame(const FrameHeader& h, const container::ContainerEntry& e) {
  if (h.frame_bytes() != e.index.frame_bytes || h.nbytes != e.plan.end - e.plan.begin || h.dtype != e.plan.dtype ||
      h.shape != e.plan.shape)
    throw Defer("a frame does not match its entry");
}

}  // namespace

RunResult decompress_file(const Command& cmd) {
  const auto started = std::chrono::steady_clock::now();
  PhaseClock clock;
  const MappedFile input(cmd.input);
  clock.mark("map");
  if (input.same_file_as(cmd.output)) throw Defer("output is the input");
  const uint8_t* file = input.data();
  const container::OpenedContainer c = container::open_container(file, input.size());
  for (const container::ContainerEntry& e : c.entries)
    if (e.index.frame_bytes > kMaxEntryBytes || e.plan.end - e.plan.begin > kMaxEntryBytes)
      throw Defer("a frame or entry above 2 GiB");
  uint32_t threads = cmd.threads;
  if (threads == 0) threads = std::max(1u, std::thread::hardware_concurrency());  // the addon's default

  clock.mark("parse");
  AtomicOutput out(cmd.output);
  out.write_at(c.header_bytes, c.header.data_offset, 0);
  const auto& entries = c.entries;
  // Every frame's header is checked against its entry first (src/reader.ts checkFrame, and decode_frame's length
  // checks: frame_bytes equal to the index's, nbytes to the entry's), then the chunks are decoded piece by piece.
  std::vector<FrameHeader> headers;
  headers.reserve(entries.size());
  for (const container::ContainerEntry& e : entries) {
    headers.push_back(parse_frame_header(file + e.index.frame_offset, e.index.frame_bytes));
    check_frame(headers.back(), e);
  }
  // The output goes out in pieces of about kPieceBytes: a run of small entries decoded side by side (one thread
  // each), or a range of a large entry's chunks decoded with every thread. Buffers of a piece's size take turns
  // (BackgroundWriter), so they stay in memory already mapped (fresh memory costs a page fault per 4 KiB) and the
  // output streams to disk while the next piece is decoded.
  struct Group {
    bool split;                        // a range of one large entry's chunks, decoded with every thread
    uint64_t first_entry, last_entry;  // entries [first, last); a split entry's group has one
    uint64_t first_chunk, last_chunk;  // for a split entry: its chunks decoded here
    uint64_t begin, end;               // data-section bytes
  };
  const auto large = [&](uint64_t i) {
    return is_wide(headers[i].n_chunks, threads) || entries[i].plan.end - entries[i].plan.begin > kPieceBytes;
  };
  std::vector<Group> groups;
  for (uint64_t i = 0; i < entries.size();) {
    const FrameHeader& h = headers[i];
    const uint64_t begin = entries[i].plan.begin;
    if (large(i)) {
      const uint64_t step = std::max<uint64_t>(4ull * threads, kPieceBytes / h.chunk_bytes);
      for (uint64_t k = 0; k < h.n_chunks; k += step) {
        const uint64_t last = std::min(h.n_chunks, k + step);
        groups.push_back({true, i, i + 1, k, last, begin + k * h.chunk_bytes,
                          std::min(entries[i].plan.end, begin + last * h.chunk_bytes)});
      }
      ++i;
      continue;
    }
    uint64_t j = i + 1;
    while (j < entries.size() && entries[j - 1].plan.end - begin < kPieceBytes && !large(j)) ++j;
    groups.push_back({false, i, j, 0, 0, begin, entries[j - 1].plan.end});
    i = j;
  }
  Progress progress(cmd.input, c.header.data_length);
  BackgroundWriter writer(out);
  for (uint64_t turn = 0; turn < groups.size(); ++turn) {
    const Group& g = groups[turn];
    uint8_t* buffer = writer.buffer(turn, g.end - g.begin);
    const auto frame = [&](uint64_t i) { return file + entries[i].index.frame_offset; };
    if (g.split) {
      decode_frame_chunks(frame(g.first_entry), headers[g.first_entry], g.first_chunk, g.last_chunk, buffer, true, threads);
    } else {
      parallel_for(g.last_entry - g.first_entry, threads, [&](uint64_t k, uint32_t) {
        const uint64_t i = g.first_entry + k;
        decode_frame_chunks(frame(i), headers[i], 0, headers[i].n_chunks, buffer + (entries[i].plan.begin - g.begin), true, 1);
      });
    }
    const off_t at = off_t(c.header.data_offset + g.begin), n = off_t(g.end - g.begin);
    writer.write(turn, {{buffer, size_t(n), at}}, at, at + n);
    progress.update(g.end);
  }
  writer.finish();
  clock.mark("code");
  if (ftruncate(out.fd(), off_t(c.original_size)) != 0) throw Defer("ftruncate the output");
  out.commit();
  clock.mark("commit");
  RunResult r;
  r.input_bytes = input.size();
  r.output_bytes = c.original_size;
  r.entries = entries.size();
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  return r;
}

}  // namespace tzip::cli
