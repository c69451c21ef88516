// build/Release/tzip-native: the `tzip` command (bin/tzip runs it when it is built) for the two commands whose run
// time is mostly Node's own start-up and per-entry round trips (issue 36): `tzip compress FILE` and `tzip decompress
// FILE`, done here in one process with the codec core (tzip_core; no Node, no CUDA). Everything else, and any
// situation the native path does not fully handle (args.h, every error), is handed to the Node CLI with the same
// arguments (deferral.h), before anything is printed and with the temporary output removed, so that messages, exit
// codes and files stay exactly the Node CLI's. The one line printed on success is the Node CLI's (src/cli/compress.ts,
// decompress.ts); the Node CLI's progress bar (a terminal only) is a simpler line here (progress.h).
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <exception>
#include <string>

#include "cli/args.h"
#include "cli/compress_file.h"
#include "cli/decompress_file.h"
#include "cli/deferral.h"
#include "cli/js_format.h"

namespace {

using namespace tzip::cli;

/// The summary line, as the Node CLI prints it.
std::string run(const Command& cmd) {
  if (cmd.kind == Command::kCompress) {
    const RunResult r = compress_file(cmd);
    return cmd.input + " (" + format_size(r.input_bytes) + ") -> " + cmd.output + " (" + format_size(r.output_bytes) +
           "): ratio " + format_ratio(r.output_bytes, r.input_bytes) + ", " + std::to_string(r.entries) + " entries, " +
           js_to_fixed(r.seconds, 2) + " s, " + format_gbps(r.input_bytes, r.seconds) + " GB/s\n";
  }
  const RunResult r = decompress_file(cmd);
  return cmd.input + " (" + format_size(r.input_bytes) + ") -> " + cmd.output + " (" + format_size(r.output_bytes) +
         "): " + std::to_string(r.entries) + " entries, " + js_to_fixed(r.seconds, 2) + " s, " +
         format_gbps(r.output_bytes, r.seconds) + " GB/s\n";
}

/// Writes all of `s` to stdout; false on an error (a closed pipe, a full disk).
bool print(const std::string& s) {
  const char* p = s.data();
  size_t n = s.size();
  while (n > 0) {
    const ssize_t w = write(STDOUT_FILENO, p, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    p += w;
    n -= size_t(w);
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  std::string reason;
  try {
    const Command cmd = parse_args(argc, argv);
    const std::string line = run(cmd);
    // As Node, a closed pipe is an error to report, not a signal to die of. The Node CLI reports a failed write of
    // its result with its own message and exit code: running it again rewrites the same output and fails the same way.
    std::signal(SIGPIPE, SIG_IGN);
    if (print(line)) return 0;
    reason = "writing the result to stdout failed";
  } catch (const std::exception& e) {
    reason = e.what();
  } catch (...) {
    reason = "an unknown exception";
  }
  run_node_cli(argv, reason);
  return 4;
}
