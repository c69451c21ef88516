// The native CLI's output file, created as src/atomic-output.ts creates one: written to a temporary file in the
// target's folder (".<name>.<pid>.<8 hex>.tmp", O_EXCL), fsynced, given an existing target's permission bits, and
// renamed over the target only when complete. Only the plain cases are handled here: a target that does not exist or
// is a regular file. A symbolic link, a device, a folder, a FIFO or a socket throws Defer, and the Node CLI follows
// the link, writes the device in place or reports the error. An interrupt (SIGINT, SIGTERM, SIGHUP) while the
// temporary file exists removes it before the process dies of the signal (the Node CLI leaves it behind).
#pragma once
#include <sys/types.h>

#include <string>

namespace tzip::cli {

class AtomicOutput {
 public:
  /// Creates the temporary file beside `target`. Throws Defer (target not plain, temporary file not creatable).
  explicit AtomicOutput(const std::string& target);
  /// Removes the temporary file unless commit() succeeded.
  ~AtomicOutput();
  AtomicOutput(const AtomicOutput&) = delete;
  AtomicOutput& operator=(const AtomicOutput&) = delete;

  int fd() const { return fd_; }
  /// Writes all `n` bytes at `offset`. Throws Defer on any error.
  void write_at(const void* data, size_t n, off_t offset);
  /// Starts writing `n` bytes at `offset` back to disk (sync_file_range, no wait), so that commit()'s fsync finds
  /// little left to do. Errors are left for that fsync to report.
  void start_writeback(off_t offset, off_t n);
  /// fsync, close, chmod to the old target's mode (if one existed), rename over the target. Throws Defer on any
  /// error (the temporary file is then removed by the destructor).
  void commit();

 private:
  std::string target_, temp_;
  int fd_ = -1;
  bool existed_ = false, committed_ = false;
  mode_t mode_ = 0;
};

}  // namespace tzip::cli
