// The native CLI's one way out for anything it does not do itself: run the Node CLI (dist/src/cli/main.js) with the
// same arguments, so that messages, exit codes and every other command stay exactly the Node CLI's.
#pragma once
#include <stdexcept>
#include <string>

namespace tzip::cli {

/// Thrown wherever the native path stops: an option it does not take, a file it does not handle, any error. what()
/// says why (printed with TZIP_NATIVE_DEBUG=1).
struct Defer : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// Replaces this process with `node <package>/dist/src/cli/main.js argv[1..]` (node: $TZIP_NODE, else `node` on
/// PATH; main.js: $TZIP_NATIVE_MAIN_JS, else found from /proc/self/exe, <root>/build/Release/tzip-native). With TZIP_NATIVE_DEBUG=1 set it
/// first prints "tzip-native: running the Node CLI: <reason>" on stderr. Returns only if the exec fails, after
/// printing why on stderr.
void run_node_cli(char** argv, const std::string& reason);

}  // namespace tzip::cli
