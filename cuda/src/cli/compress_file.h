// `tzip compress FILE.safetensors -o OUT.tzip` in one native process: the bytes src/writer.ts writes (docs/container.md,
// "Writing"), every entry's frame made by the codec's own encode_frame with the options the addon's compress uses,
// all entries at once across the threads.
#pragma once
#include "cli/args.h"
#include "cli/run_result.h"

namespace tzip::cli {

/// Compresses cmd.input into cmd.output. Throws Defer, tzip::Error, NotHandled or std::bad_alloc for anything it does
/// not do (no temporary file is left behind).
RunResult compress_file(const Command& cmd);

}  // namespace tzip::cli
