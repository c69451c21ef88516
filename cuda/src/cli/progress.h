// The native CLI's progress line on stderr, in place of the Node CLI's cli-progress bar (src/cli/progress.ts): shown
// only when stderr is a terminal, first drawn once a run has taken 200 ms (a run that ends sooner draws nothing), at
// most every 100 ms, and erased when the run ends, as the Node bar is (clearOnComplete), so a terminal is left as the
// Node CLI leaves it: `label [=====     ] 42% | 12.3/45.4 MB`.
#pragma once
#include <chrono>
#include <cstdint>
#include <string>

namespace tzip::cli {

class Progress {
 public:
  /// `label`: the input path, as the Node CLI labels its bar; `total`: bytes the run works through.
  Progress(std::string label, uint64_t total);
  /// Erases the line if it was drawn.
  ~Progress();
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;
  /// `done` of the total bytes are through.
  void update(uint64_t done);

 private:
  std::string label_;
  uint64_t total_;
  bool enabled_, drawn_ = false;
  std::chrono::steady_clock::time_point started_, last_;
};

}  // namespace tzip::cli
