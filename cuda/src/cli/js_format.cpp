#include "cli/js_format.h"

#include <cmath>
#include <cstdio>

namespace tzip::cli {

std::string js_to_fixed(double x, int digits) {
  // A double's decimal expansion is finite (at most 1074 fractional digits): print it exactly, then round half up.
  static char buf[1100 + 32];
  std::snprintf(buf, sizeof buf, "%.1100f", x);
  std::string s(buf);
  const size_t dot = s.find('.');
  const size_t keep = dot + (digits > 0 ? 1 + size_t(digits) : 0);
  const bool up = s[dot + 1 + size_t(digits)] >= '5';
  s.resize(keep);
  if (up) {
    size_t i = s.size();
    for (;;) {
      if (i == 0) {
        s.insert(s.begin(), '1');
        break;
      }
      --i;
      if (s[i] == '.') continue;
      if (s[i] == '9') {
        s[i] = '0';
        continue;
      }
      ++s[i];
      break;
    }
  }
  return s;
}

std::string format_size(uint64_t bytes) {
  const double b = double(bytes);
  if (b < 1e3) return std::to_string(bytes) + " B";
  if (b < 1e6) return js_to_fixed(b / 1e3, 2) + " kB";
  if (b < 1e9) return js_to_fixed(b / 1e6, 2) + " MB";
  return js_to_fixed(b / 1e9, 2) + " GB";
}

std::string format_ratio(uint64_t compressed, uint64_t original) {
  return original == 0 ? "-" : js_to_fixed(double(compressed) / double(original), 4);
}

std::string format_gbps(uint64_t bytes, double seconds) {
  if (!(seconds > 0)) return "-";
  const double gbps = double(bytes) / seconds / 1e9;
  if (!std::isfinite(gbps)) return "-";
  return gbps >= 10 ? js_to_fixed(gbps, 1) : gbps >= 1 ? js_to_fixed(gbps, 2) : js_to_fixed(gbps, 3);
}

}  // namespace tzip::cli
