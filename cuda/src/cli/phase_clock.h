// Phase timestamps of a native CLI run, printed on stderr when TZIP_NATIVE_PROFILE=1 ("tzip-native: <phase> <ms>"),
// to tell where a run's time goes (scripts/bench-cli.sh, docs/benchmarks.md). Costs nothing when off.
#pragma once
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace tzip::cli {

class PhaseClock {
 public:
  PhaseClock() : on_(enabled()), last_(std::chrono::steady_clock::now()) {}
  /// Prints the milliseconds since the previous mark (or construction) under `phase`.
  void mark(const char* phase) {
    if (!on_) return;
    const auto now = std::chrono::steady_clock::now();
    std::fprintf(stderr, "tzip-native: %-10s %7.2f ms\n", phase, std::chrono::duration<double, std::milli>(now - last_).count());
    last_ = now;
  }

 private:
  static bool enabled() {
    const char* v = std::getenv("TZIP_NATIVE_PROFILE");
    return v != nullptr && std::strcmp(v, "1") == 0;
  }
  bool on_;
  std::chrono::steady_clock::time_point last_;
};

}  // namespace tzip::cli
