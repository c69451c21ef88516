// The command lines the native CLI runs itself, read conservatively: `compress IN -o OUT [--codec C] [--threads N]
// [--chunk-size B]` and `decompress IN -o OUT [--threads N]` (src/cli/compress.ts, decompress.ts, options.ts), each
// option at most once, as `--opt VALUE` or `--opt=VALUE` (`-o VALUE` for the output), values that commander and the
// option parsers would take to mean the same thing. Anything else throws Defer: global options (--json), help,
// other commands, repeated or unknown options, values starting with '-', values the Node CLI would refuse.
#pragma once
#include <cstdint>
#include <string>

namespace tzip::cli {

struct Command {
  enum Kind { kCompress, kDecompress } kind = kCompress;
  std::string input, output;
  std::string codec = "auto";  ///< compress: auto, fast, max, bytes or raw
  uint32_t threads = 0;        ///< 0: not given (all cores)
  uint32_t chunk_bytes = 0;    ///< compress; 0: not given (the codec's default)
};

/// Parses argv[1..argc) (argv[0] is the program). Throws Defer for anything outside the forms above.
Command parse_args(int argc, char** argv);

}  // namespace tzip::cli
