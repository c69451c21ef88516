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
#include "cli/deferral.h"
#include "cli/entry_schedule.h"
#include "cli/mapped_file.h"
#include "container/reader.h"
#include "frame.h"

namespace tzip::cli {

namespace {

/// As in compress_file.cpp: frames and entries above this are left to the Node CLI (its Buffer limit).
constexpr uint64_t kMaxEntryBytes = uint64_t(1) << 31;
/// Output bytes decoded per batch: bounds the memory for files of any size.
constexpr uint64_t kBatchBytes = uint64_t(1) << 30;

/// The checks src/reader.ts (checkFrame) makes of a frame's header against its entry.
void check_frame(const FrameHeader& h, const container::ContainerEntry& e) {
  if (h.frame_bytes() != e.index.frame_bytes || h.nbytes != e.plan.end - e.plan.begin || h.dtype != e.plan.dtype ||
      h.shape != e.plan.shape)
    throw Defer("a frame does not match its entry");
}

}  // namespace

DecompressResult decompress_file(const Command& cmd) {
  const auto started = std::chrono::steady_clock::now();
  const MappedFile input(cmd.input);
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

  AtomicOutput out(cmd.output);
  out.write_at(c.header_bytes, c.header.data_offset, 0);
  std::unique_ptr<uint8_t[]> buffer;
  uint64_t buffer_bytes = 0;
  const auto& entries = c.entries;
  for (size_t first = 0; first < entries.size();) {
    size_t last = first;
    const uint64_t begin = entries[first].plan.begin;
    while (last < entries.size() && (last == first || entries[last].plan.end - begin <= kBatchBytes)) ++last;
    const uint64_t bytes = entries[last - 1].plan.end - begin;
    if (bytes > buffer_bytes) {
      buffer.reset();
      buffer.reset(new uint8_t[bytes]);
      buffer_bytes = bytes;
    }
    std::vector<bool> wide(last - first);
    for (size_t i = first; i < last; ++i) {
      const FrameHeader h = parse_frame_prefix(file + entries[i].index.frame_offset, entries[i].index.frame_bytes);
      wide[i - first] = is_wide(h.n_chunks, threads);
    }
    run_entries(wide, threads, [&](uint64_t k, uint32_t t) {
      const container::ContainerEntry& e = entries[first + k];
      const uint8_t* frame = file + e.index.frame_offset;
      check_frame(parse_frame_header(frame, e.index.frame_bytes), e);
      decode_frame(frame, e.index.frame_bytes, buffer.get() + (e.plan.begin - begin), e.plan.end - e.plan.begin, true, t);
    });
    out.write_at(buffer.get(), bytes, off_t(c.header.data_offset + begin));
    first = last;
  }
  if (ftruncate(out.fd(), off_t(c.original_size)) != 0) throw Defer("ftruncate the output");
  out.commit();
  DecompressResult r;
  r.input_bytes = input.size();
  r.output_bytes = c.original_size;
  r.entries = entries.size();
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  return r;
}

}  // namespace tzip::cli
