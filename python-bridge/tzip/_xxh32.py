"""XXH32 (seed 0) and the chunk digest of tzip frames (docs/format.md, "Checksums"), through the ``xxhash`` package.

The chunk digest (format version 2): the chunk's bytes are cut into 16-byte stripes (the last may be shorter),
lane ``l`` (0..31) is the concatenation of stripes ``l, l+32, l+64, ...``, and the digest is XXH32 of the 32 lane
XXH32s as little-endian ``u32``. Here the whole 512-byte blocks (one stripe per lane) are regrouped by lane with one
numpy transpose, so a 64 KiB chunk costs one copy and 33 hash calls.
"""

from __future__ import annotations

import struct

import numpy as np
import xxhash

__all__ = ["xxh32", "chunk_digest", "chunk_digests"]

_LANES = 32
_STRIPE = 16
_BLOCK = _LANES * _STRIPE  # 512 bytes: one stripe for each lane
_LANE_DIGESTS = struct.Struct(f"<{_LANES}I")


def xxh32(data) -> int:
    """XXH32 with seed 0 of a bytes-like object, as an unsigned 32-bit int."""
    return xxhash.xxh32_intdigest(data, seed=0)


def chunk_digest(data) -> int:
    """The chunk digest of the bytes ``data`` (bytes-like or 1-D uint8 array), as an unsigned 32-bit int."""
    view = np.ascontiguousarray(data).reshape(-1) if isinstance(data, np.ndarray) else np.frombuffer(data, np.uint8)
    blocks = len(view) // _BLOCK
    # Whole blocks regrouped by lane (a stripe moved as two uint64): row l = the whole-block stripes of lane l, in order.
    by_lane = view[: blocks * _BLOCK].view(np.uint64).reshape(blocks, _LANES, 2).transpose(1, 0, 2).copy()
    lanes = memoryview(by_lane.view(np.uint8).reshape(-1))
    row = blocks * _STRIPE
    # After the last whole block, stripe j (fewer than 32, the last possibly short) belongs to lane j.
    rest = view[blocks * _BLOCK :].tobytes()
    digests = []
    for lane in range(_LANES):
        tail = rest[_STRIPE * lane : _STRIPE * (lane + 1)]
        if tail:
            h = xxhash.xxh32(lanes[row * lane : row * (lane + 1)], seed=0)
            h.update(tail)
            digests.append(h.intdigest())
        else:
            digests.append(xxhash.xxh32_intdigest(lanes[row * lane : row * (lane + 1)], seed=0))
    return xxh32(_LANE_DIGESTS.pack(*digests))


def chunk_digests(data: np.ndarray, chunk: int) -> list[int]:
    """The chunk digest of each ``chunk``-byte piece of the 1-D uint8 array ``data`` (the last piece may be shorter)."""
    flat = np.ascontiguousarray(data).reshape(-1)
    whole = len(flat) // chunk if chunk % _BLOCK == 0 else 0
    out: list[int] = []
    if whole:
        # Every whole chunk at once: one transpose, then the 32 lanes of chunk c are rows 32c .. 32c+31.
        blocks = chunk // _BLOCK
        lanes = flat[: whole * chunk].view(np.uint64).reshape(whole, blocks, _LANES, 2).transpose(0, 2, 1, 3).copy()
        mv = memoryview(lanes.view(np.uint8).reshape(-1))
        row = blocks * _STRIPE
        d = [xxhash.xxh32_intdigest(mv[row * r : row * (r + 1)], seed=0) for r in range(whole * _LANES)]
        out = [xxh32(_LANE_DIGESTS.pack(*d[_LANES * c : _LANES * (c + 1)])) for c in range(whole)]
    return out + [chunk_digest(flat[i : i + chunk]) for i in range(whole * chunk, len(flat), chunk)]
