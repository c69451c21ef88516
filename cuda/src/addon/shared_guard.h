// SIGBUS guard for the daemon's mappings of clients' shared-memory files (mapShared in addon.cpp).
//
// A client may shrink (ftruncate) its /dev/shm file while the daemon reads or writes it; touching a page of a
// MAP_SHARED mapping past the new end of the file raises SIGBUS, which would kill the daemon and every other
// client's work with it. The guard registers each mapping; its SIGBUS handler replaces the faulting page of a
// registered mapping with a private zero page (mmap MAP_FIXED | MAP_ANONYMOUS), marks the mapping faulted and
// returns, so the access completes on the zero page. The daemon asks mapSharedFaulted(buffer) after each request
// and answers TZIP_HANDLE for a faulted mapping, whose bytes it then drops. Faults outside registered mappings go
// to the handler that was installed before (or the default action).
#pragma once
#include <cstddef>

namespace tzip::addon {

/// Registers [base, base + size) (installs the SIGBUS handler the first time). False when the registry is full
/// (65536 live mappings): the mapping then works unguarded.
bool guard_register(void* base, size_t size);
/// Forgets the mapping at `base` (call before munmap).
void guard_unregister(void* base);
/// Whether the mapping at `base` took a SIGBUS since it was registered.
bool guard_faulted(const void* base);

}  // namespace tzip::addon
