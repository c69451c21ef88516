#include "cli/decompress_file.h"

#include <sys/stat.h>
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
#include "cli/mapped_file.h"
#include "cli/phase_clock.h"
#include "container/reader.h"
#include "frame.h"

namespace tzip::cli {

namespace {

/// As in compress_file.cpp: frames and entries above this are left to the Node CLI (its Buffer limit).
constexpr uint64_t kMaxEntryBytes = uint64_t(1) << 31;

/// The checks src/reader.ts (checkFrame) makes of a frame's header against its entry.
void check_frame(const FrameHeader& h, const container::ContainerEntry& e) {
  if (h.frame_bytes() != e.index.frame_bytes || h.nbytes != e.plan.end - e.plan.begin || h.dtype != e.plan.dtype ||
      h.shape != e.plan.shape)
    throw Defer("a frame does not match its entry");
}

}  // namespace

DecompressResult decompress_file(const Command& cmd) {
  const auto started = std::chrono::steady_clock::now();
  PhaseClock clock;
  const MappedFile input(cmd.input);
  clock.mark("map");
  struct stat out_st;
  if (stat(cmd.output.c_str(), &out_st) == 0 && out_st.st_dev == input.info().st_dev && out_st.st_ino == input.info().st_ino)
    throw Defer("output is the input");
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
  std::vector<uint64_t> bytes(entries.size());
  std::vector<bool> wide(entries.size());
  for (size_t i = 0; i < entries.size(); ++i) {
    bytes[i] = entries[i].plan.end - entries[i].plan.begin;
    wide[i] = is_wide(parse_frame_prefix(file + entries[i].index.frame_offset, entries[i].index.frame_bytes).n_chunks, threads);
  }
  // A group's entries are contiguous in the data section: decoded into one buffer, written with one call.
  BackgroundWriter writer(out);
  uint8_t* buffer = nullptr;
  uint64_t begin = 0, turn = 0;
  auto prepare = [&](uint64_t first, uint64_t last) {
    begin = entries[first].plan.begin;
    buffer = writer.buffer(turn, entries[last - 1].plan.end - begin);
  };
  run_entries(wide, bytes, threads, prepare, [&](uint64_t i, uint32_t t) {
      const container::ContainerEntry& e = entries[i];
      const uint8_t* frame = file + e.index.frame_offset;
      check_frame(parse_frame_header(frame, e.index.frame_bytes), e);
      decode_frame(frame, e.index.frame_bytes, buffer + (e.plan.begin - begin), bytes[i], true, t);
    }, [&](uint64_t, uint64_t last) {
      const off_t at = off_t(c.header.data_offset + begin), n = off_t(entries[last - 1].plan.end - begin);
      writer.write(turn++, {{buffer, size_t(n), at}}, at, at + n);
    });
  writer.finish();
  clock.mark("code");
  if (ftruncate(out.fd(), off_t(c.original_size)) != 0) throw Defer("ftruncate the output");
  out.commit();
  clock.mark("commit");
  DecompressResult r;
  r.input_bytes = input.size();
  r.output_bytes = c.original_size;
  r.entries = entries.size();
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  return r;
}

}  // namespace tzip::cli
