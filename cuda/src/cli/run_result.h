// What a native compress or decompress run reports back for the summary line the Node CLI prints.
#pragma once
#include <cstdint>

namespace tzip::cli {

struct RunResult {
  uint64_t input_bytes = 0, output_bytes = 0, entries = 0;
  double seconds = 0;  ///< wall clock, from opening the input to the renamed output
};

}  // namespace tzip::cli
