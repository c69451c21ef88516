#include "cli/args.h"

#include <cstring>

#include "cli/deferral.h"
#include "container/json_subset.h"
#include "tzip/format.h"

namespace tzip::cli {

namespace {

/// A decimal number of 1 to 9 digits (what Number() reads the same way commander's parser does), or -1.
int64_t digits(const std::string& v) {
  if (v.empty() || v.size() > 9) return -1;
  int64_t n = 0;
  for (char c : v) {
    if (c < '0' || c > '9') return -1;
    n = n * 10 + (c - '0');
  }
  return n;
}

}  // namespace

Command parse_args(int argc, char** argv) {
  Command cmd;
  if (argc < 2) throw Defer("no command");
  const std::string name = argv[1];
  if (name == "compress") cmd.kind = Command::kCompress;
  else if (name == "decompress") cmd.kind = Command::kDecompress;
  else throw Defer("not compress or decompress");
  const bool compress = cmd.kind == Command::kCompress;
  bool has_input = false, has_output = false, has_codec = false, has_threads = false, has_chunk = false;
  for (int i = 2; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg.empty() || arg[0] != '-') {
      if (has_input) throw Defer("more than one input");
      has_input = true;
      cmd.input = arg;
      continue;
    }
    std::string opt = arg, value;
    bool inline_value = false;
    if (const size_t eq = arg.find('='); arg.rfind("--", 0) == 0 && eq != std::string::npos) {
      opt = arg.substr(0, eq);
      value = arg.substr(eq + 1);
      inline_value = true;
    }
    bool* seen;
    if (opt == "-o" && !inline_value) seen = &has_output;
    else if (opt == "--output") seen = &has_output;
    else if (opt == "--codec" && compress) seen = &has_codec;
    else if (opt == "--threads") seen = &has_threads;
    else if (opt == "--chunk-size" && compress) seen = &has_chunk;
    else throw Defer("option " + arg);
    if (*seen) throw Defer("repeated option " + opt);
    *seen = true;
    if (!inline_value) {
      if (i + 1 >= argc) throw Defer("option " + opt + " without a value");
      value = argv[++i];
    }
    if (value.empty() || value[0] == '-') throw Defer("option " + opt + " with an empty value or one starting with '-'");
    if (seen == &has_output) {
      cmd.output = value;
    } else if (seen == &has_codec) {
      if (value != "auto" && value != "fast" && value != "max" && value != "bytes" && value != "raw")
        throw Defer("codec " + value);
      cmd.codec = value;
    } else if (seen == &has_threads) {
      const int64_t n = digits(value);
      if (n < 1 || n > 1024) throw Defer("threads " + value);
      cmd.threads = uint32_t(n);
    } else {
      const int64_t n = digits(value);
      if (n < kMinChunkBytes || n > kMaxChunkBytes || n % kChunkBytesMultiple != 0) throw Defer("chunk size " + value);
      cmd.chunk_bytes = uint32_t(n);
    }
  }
  if (!has_input || !has_output) throw Defer("no input or no output");
  // Node reads argv as UTF-8 (a bad byte becomes U+FFFD): such a path is not the file this process would open.
  for (const std::string* p : {&cmd.input, &cmd.output})
    if (!container::is_utf8(reinterpret_cast<const uint8_t*>(p->data()), p->size())) throw Defer("a path that is not UTF-8");
  return cmd;
}

}  // namespace tzip::cli
