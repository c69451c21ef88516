// Opening a .tzip container held in memory (an mmap of the file): every check src/reader.ts makes before it decodes a
// frame (docs/container.md, "Reading"), the C++ twin of its validate(). What it accepts, the TypeScript reader
// accepts with the same entries; what it refuses throws (tzip::Error or NotHandled) without a message meant for
// users: the native CLI hands such files to the Node CLI, which reports them.
#pragma once
#include <cstdint>
#include <vector>

#include "container/entries.h"
#include "container/layout.h"
#include "container/safetensors_header.h"

namespace tzip::container {

struct ContainerEntry {
  PlannedEntry plan;
  IndexEntry index;
};

struct OpenedContainer {
  uint64_t original_size = 0;
  const uint8_t* header_bytes = nullptr;  ///< the original file's first 8 + N bytes, inside the file
  SafetensorsHeader header;               ///< views into header_bytes
  std::vector<ContainerEntry> entries;
};

/// Checks the container of `size` bytes at `file` and returns its entries. `file` must outlive the result.
OpenedContainer open_container(const uint8_t* file, uint64_t size);

}  // namespace tzip::container
