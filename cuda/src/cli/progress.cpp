#include "cli/progress.h"

#include <unistd.h>

#include <cstdio>

namespace tzip::cli {

namespace {

void write_all(const std::string& s) {
  const char* p = s.data();
  size_t n = s.size();
  while (n > 0) {
    const ssize_t w = write(STDERR_FILENO, p, n);
    if (w <= 0) return;  // a progress line is not worth an error
    p += w;
    n -= size_t(w);
  }
}

}  // namespace

Progress::Progress(std::string label, uint64_t total)
    : label_(std::move(label)), total_(total), enabled_(isatty(STDERR_FILENO) == 1),
      started_(std::chrono::steady_clock::now()), last_(started_) {}

Progress::~Progress() {
  if (drawn_) write_all("\r\x1b[2K");
}

void Progress::update(uint64_t done) {
  if (!enabled_) return;
  const auto now = std::chrono::steady_clock::now();
  if (now - started_ < std::chrono::milliseconds(200) || (drawn_ && now - last_ < std::chrono::milliseconds(100))) return;
  last_ = now;
  drawn_ = true;
  const uint64_t total = total_ > 0 ? total_ : 1;
  const int width = 30, filled = int(width * (done > total ? total : done) / total);
  char tail[96];
  std::snprintf(tail, sizeof tail, "] %d%% | %.1f/%.1f MB", int(100 * (done > total ? total : done) / total),
                double(done) / 1e6, double(total_) / 1e6);
  write_all("\r\x1b[2K" + label_ + " [" + std::string(size_t(filled), '=') + std::string(size_t(width - filled), ' ') + tail);
}

}  // namespace tzip::cli
