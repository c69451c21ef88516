// How the native CLI spreads a file's entries over its threads. Each entry is coded by the codec's own frame
// functions, whose bytes do not depend on the thread count; only the time does. Many small entries (a model's norms
// and biases) run side by side, one thread each, and each large one (a weight matrix) gets every thread for its
// chunks, so neither a long tail of small entries nor one big tensor leaves a core idle.
#pragma once
#include <cstdint>
#include <vector>

#include "parallel.h"

namespace tzip::cli {

/// Whether an entry of `chunks` chunks is coded alone with all `threads` (it has enough chunks to keep them busy).
inline bool is_wide(uint64_t chunks, uint32_t threads) { return threads > 1 && chunks >= 4ull * threads; }

/// Calls fn(i, t) for every i in [0, wide.size()): entries with wide[i] false side by side on up to `threads` threads
/// (t = 1), then the wide ones one after another (t = threads). Rethrows the first failure (parallel_for's rule).
template <typename Fn>
void run_entries(const std::vector<bool>& wide, uint32_t threads, Fn fn) {
  std::vector<uint64_t> narrow;
  for (uint64_t i = 0; i < wide.size(); ++i)
    if (!wide[i]) narrow.push_back(i);
  parallel_for(narrow.size(), threads, [&](uint64_t k, uint32_t) { fn(narrow[k], 1u); });
  for (uint64_t i = 0; i < wide.size(); ++i)
    if (wide[i]) fn(i, threads);
}

}  // namespace tzip::cli
