// Writes the native CLI's output on a thread of its own, so that the coding of the next group of entries goes on
// while the last one is copied into the page cache and sent to disk (sync_file_range, which blocks while the disk's
// queue is full, then the output's fsync finds little left to do). Two buffers take turns: the coder fills one while
// this thread writes the other.
#pragma once
#include <sys/types.h>

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "cli/atomic_output.h"

namespace tzip::cli {

class BackgroundWriter {
 public:
  /// One write: `n` bytes at `data` to file offset `offset`.
  struct Piece {
    const uint8_t* data;
    size_t n;
    off_t offset;
  };

  explicit BackgroundWriter(AtomicOutput& out);
  /// Stops the thread (after the writes queued so far).
  ~BackgroundWriter();
  BackgroundWriter(const BackgroundWriter&) = delete;
  BackgroundWriter& operator=(const BackgroundWriter&) = delete;

  /// A buffer of at least `n` bytes that no queued write still reads: buffer `turn % 2`, grown as needed. Waits for
  /// the writes from that buffer's previous turn. Throws Defer when a write failed.
  uint8_t* buffer(uint64_t turn, uint64_t n);
  /// Queues `pieces` (from buffer(turn, ...)), then the writeback of [sync_from, sync_to).
  void write(uint64_t turn, std::vector<Piece> pieces, off_t sync_from, off_t sync_to);
  /// Waits for every queued write. Throws Defer when one failed.
  void finish();

 private:
  struct Job {
    uint64_t turn;
    std::vector<Piece> pieces;
    off_t sync_from, sync_to;
  };
  void run();
  void wait_for_turn_locked(std::unique_lock<std::mutex>& lock, uint64_t turn);

  AtomicOutput& out_;
  std::unique_ptr<uint8_t[]> buffers_[2];
  uint64_t buffer_bytes_[2] = {0, 0};
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Job> jobs_;
  uint64_t done_turns_ = 0;  ///< jobs finished, in order
  uint64_t queued_turns_ = 0;
  bool stop_ = false;
  std::string error_;
  std::thread thread_;
};

}  // namespace tzip::cli
