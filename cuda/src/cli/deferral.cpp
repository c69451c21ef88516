#include "cli/deferral.h"

#include <limits.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace tzip::cli {

namespace {

/// $TZIP_NATIVE_MAIN_JS (set by bin/tzip, which knows the package root even when build/Release is a link), else
/// <package root>/dist/src/cli/main.js from this executable's own path (<root>/build/Release/tzip-native).
std::string main_js() {
  if (const char* given = std::getenv("TZIP_NATIVE_MAIN_JS"); given != nullptr && *given) return given;
  char self[PATH_MAX];
  const ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
  if (n <= 0) return "dist/src/cli/main.js";
  std::string path(self, size_t(n));
  for (int up = 0; up < 3; ++up) path.erase(path.rfind('/'));  // tzip-native, Release, build
  return path + "/dist/src/cli/main.js";
}

}  // namespace

void run_node_cli(char** argv, const std::string& reason) {
  const char* debug = std::getenv("TZIP_NATIVE_DEBUG");
  if (debug != nullptr && std::strcmp(debug, "1") == 0) std::fprintf(stderr, "tzip-native: running the Node CLI: %s\n", reason.c_str());
  const std::string script = main_js();
  unsetenv("TZIP_NATIVE_MAIN_JS");  // the launcher's note to this process; not for the Node CLI's children
  const char* node = std::getenv("TZIP_NODE");
  std::vector<char*> args;
  args.push_back(const_cast<char*>(node != nullptr && *node ? node : "node"));
  args.push_back(const_cast<char*>(script.c_str()));
  for (char** a = argv + 1; *a != nullptr; ++a) args.push_back(*a);
  args.push_back(nullptr);
  std::fflush(stdout);
  std::fflush(stderr);
  if (node != nullptr && *node) execv(node, args.data());
  else execvp("node", args.data());
  std::fprintf(stderr, "tzip: cannot run the Node CLI (%s %s): %s\n", args[0], script.c_str(), std::strerror(errno));
}

}  // namespace tzip::cli
