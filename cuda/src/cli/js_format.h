// The numbers of the Node CLI's one-line summaries (src/cli/format.ts), formatted as JavaScript formats them, so that
// the native CLI prints the same line: Number.prototype.toFixed rounds the exact value of the double half up (printf
// rounds ties to even), and sizes use decimal units.
#pragma once
#include <cstdint>
#include <string>

namespace tzip::cli {

/// JavaScript's x.toFixed(digits) for finite 0 <= x < 1e21.
std::string js_to_fixed(double x, int digits);
/// formatSize: "512 B", "4.51 kB", "90.87 MB", "1.20 GB" (k = 10^3, M = 10^6, G = 10^9).
std::string format_size(uint64_t bytes);
/// formatRatio: compressed / original with 4 decimals; "-" when original is 0.
std::string format_ratio(uint64_t compressed, uint64_t original);
/// formatGBps(gbPerSecond(bytes, seconds)): GB/s with 1, 2 or 3 decimals; "-" when seconds is 0.
std::string format_gbps(uint64_t bytes, double seconds);

}  // namespace tzip::cli
