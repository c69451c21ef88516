// How the native CLI's compress spreads a file's entries over its threads (decompress cuts its output finer, into
// pieces of a frame's chunks: decompress_file.cpp). Each entry is coded by the codec's own frame
// functions, whose bytes do not depend on the thread count; only the time does. Entries go in file order, in groups:
// a run of small entries (a model's norms and biases) side by side, one thread each, or one large entry (a weight
// matrix) with every thread on its chunks, so that neither a long tail of small entries nor one big tensor leaves a
// core idle. After each group the caller writes what the group made, so the output streams out (and its writeback to
// disk starts) while later groups are coded.
#pragma once
#include <cstdint>
#include <vector>

#include "core/parallel.h"

namespace tzip::cli {

/// Whether an entry of `chunks` chunks is coded alone with all `threads` (it has enough chunks to keep them busy).
inline bool is_wide(uint64_t chunks, uint32_t threads) { return threads > 1 && chunks >= 4ull * threads; }

/// Most bytes of input in a group of small entries: bounds the memory a group's output takes, and lets the output
/// stream out even from a file of only small entries.
inline constexpr uint64_t kGroupBytes = uint64_t(32) << 20;

/// For each group of entries in file order (a run of entries with wide[i] false of at most kGroupBytes of `bytes`
/// (or one entry), or one entry with wide[i] true),
/// calls prepare(first, last) on this thread, then code(i, t) for its entries (side by side on up to `threads` threads with t = 1, or alone with t = threads),
/// then done(first, last) on this thread for the group [first, last). Rethrows the first failure (parallel_for's rule).
template <typename Prepare, typename Code, typename Done>
void run_entries(const std::vector<bool>& wide, const std::vector<uint64_t>& bytes, uint32_t threads, Prepare prepare,
                 Code code, Done done) {
  const uint64_t n = wide.size();
  for (uint64_t first = 0; first < n;) {
    uint64_t last = first + 1;
    if (!wide[first])
      for (uint64_t sum = bytes[first]; last < n && !wide[last] && sum + bytes[last] <= kGroupBytes; ++last) sum += bytes[last];
    prepare(first, last);
    if (wide[first]) {
      code(first, threads);
    } else {
      parallel_for(last - first, threads, [&](uint64_t k, uint32_t) { code(first + k, 1u); });
    }
    done(first, last);
    first = last;
  }
}

}  // namespace tzip::cli
