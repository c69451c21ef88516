// `tzip decompress FILE.tzip -o OUT.safetensors` in one native process: the bytes src/restore.ts writes, after every
// check src/reader.ts makes (container/reader.h) and, per entry, the frame header checked against its entry and every
// chunk digest checked while decoding (the codec's decode_frame, as the addon's decompress with verify).
#pragma once
#include "cli/args.h"
#include "cli/run_result.h"

namespace tzip::cli {

/// Decompresses cmd.input into cmd.output. Throws Defer, tzip::Error, NotHandled or std::bad_alloc for anything it
/// does not do (no temporary file is left behind).
RunResult decompress_file(const Command& cmd);

}  // namespace tzip::cli
