#include "cli/atomic_output.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <random>

#include "cli/deferral.h"

namespace tzip::cli {

namespace {

[[noreturn]] void fail(const std::string& what) { throw Defer(what + ": " + std::strerror(errno)); }

// The temporary file an interrupt (Ctrl-C, SIGTERM, a closed terminal) removes before the process dies of it, as
// a failed run removes it. One output per process.
char g_temp[4096];
const int kSignals[] = {SIGINT, SIGTERM, SIGHUP};

void remove_temp_and_die(int sig) {
  if (g_temp[0] != 0) unlink(g_temp);  // async-signal-safe
  std::signal(sig, SIG_DFL);
  std::raise(sig);
}

void watch_signals(const std::string& temp) {
  if (temp.size() >= sizeof g_temp) return;
  std::memcpy(g_temp, temp.c_str(), temp.size() + 1);
  for (int sig : kSignals) std::signal(sig, remove_temp_and_die);
}

void unwatch_signals() {
  for (int sig : kSignals) std::signal(sig, SIG_DFL);
  g_temp[0] = 0;
}

}  // namespace

AtomicOutput::AtomicOutput(const std::string& target) : target_(target) {
  if (target.empty() || target.back() == '/') throw Defer("output path is empty or ends with '/'");
  struct stat st;
  if (lstat(target.c_str(), &st) == 0) {
    if (!S_ISREG(st.st_mode)) throw Defer("output is not a regular file (a link, folder, device, FIFO or socket)");
    existed_ = true;
    mode_ = st.st_mode & 07777;
  } else if (errno != ENOENT) {
    fail("lstat " + target);
  }
  const size_t slash = target.rfind('/');
  const std::string dir = slash == std::string::npos ? "" : target.substr(0, slash + 1);
  const std::string base = slash == std::string::npos ? target : target.substr(slash + 1);
  std::random_device rd;
  char suffix[32];
  std::snprintf(suffix, sizeof suffix, ".%ld.%08x.tmp", long(getpid()), unsigned(rd()));
  temp_ = dir + "." + base + suffix;
  // O_EXCL and mode 0666 (less the umask), as Node's open(path, 'wx').
  fd_ = open(temp_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_TRUNC | O_CLOEXEC, 0666);
  if (fd_ < 0) {
    temp_.clear();
    fail("create a temporary file beside " + target);
  }
  watch_signals(temp_);
}

AtomicOutput::~AtomicOutput() {
  if (fd_ >= 0) close(fd_);
  if (!committed_ && !temp_.empty()) unlink(temp_.c_str());
  unwatch_signals();
}

void AtomicOutput::write_at(const void* data, size_t n, off_t offset) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t w = pwrite(fd_, p, n, offset);
    if (w < 0) {
      if (errno == EINTR) continue;
      fail("write " + temp_);
    }
    if (w == 0) throw Defer("write " + temp_ + ": no progress");
    p += w;
    n -= size_t(w);
    offset += w;
  }
}

void AtomicOutput::start_writeback(off_t offset, off_t n) {
  sync_file_range(fd_, offset, n, SYNC_FILE_RANGE_WRITE);
}

void AtomicOutput::commit() {
  if (fsync(fd_) != 0) fail("fsync " + temp_);
  const int fd = fd_;
  fd_ = -1;
  if (close(fd) != 0) fail("close " + temp_);
  if (existed_ && chmod(temp_.c_str(), mode_) != 0) fail("chmod " + temp_);
  if (rename(temp_.c_str(), target_.c_str()) != 0) fail("rename " + temp_);
  committed_ = true;
  unwatch_signals();
}

}  // namespace tzip::cli
