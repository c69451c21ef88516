"""XXH32 (seed 0), the digest of tzip frames (docs/format.md), through the well-kept ``xxhash`` package."""

from __future__ import annotations

import numpy as np
import xxhash

__all__ = ["xxh32", "xxh32_chunks"]


def xxh32(data) -> int:
    """XXH32 with seed 0 of a bytes-like object, as an unsigned 32-bit int."""
    return xxhash.xxh32_intdigest(data, seed=0)


def xxh32_chunks(data: np.ndarray, chunk: int) -> list[int]:
    """XXH32 of each ``chunk``-byte piece of the 1-D uint8 array ``data`` (the last piece may be shorter)."""
    view = memoryview(np.ascontiguousarray(data)).cast("B")
    return [xxhash.xxh32_intdigest(view[i : i + chunk], seed=0) for i in range(0, len(view), chunk)]
