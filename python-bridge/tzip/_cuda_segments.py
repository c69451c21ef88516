"""The caller's CUDA memory registered on a ring, so that GPU ring requests need no staging copies (docs/ring.md,
"The caller's GPU memory").

A GPU ring request names its tensors by region, offset and length. A region can be a staging buffer of the client's
arena (the tensor copied in and the results copied out on the caller's stream) or, here, a whole allocation of the
caller's memory: a segment of PyTorch's caching allocator, registered once on the ring from its CUDA IPC handle
(``cuIpcGetMemHandle`` of its base). The daemon's codec then reads a tensor to compress, and reads frames and writes
results of a decompress, where they are: under MPS on the H200 host each staging copy cost 10-11 µs of driver time
for a 1-element tensor (docs/benchmarks.md, "Daemon fast lane, second round").

Telling allocations apart: each request asks the driver which allocation holds a tensor (``cuPointerGetAttributes``:
base, size, buffer id, whether legacy CUDA IPC can share it; tzip._memops.allocation_of), once per allocation and
call. A registered allocation is known by (base, buffer id): the driver never gives two allocations of a process the
same buffer id, so a segment the caching allocator freed (``torch.cuda.empty_cache()``) and a new one that got the
same address are two entries, and the old one's region is released when the new one is seen. Memory that legacy
CUDA IPC cannot share (PyTorch's expandable segments, other ``cuMemCreate`` memory) is staged as before.

Lifetime: the daemon keeps the allocation mapped while the region is registered, as it does for allocations named in
ZeroMQ requests, and a segment PyTorch frees stays allocated on the GPU while the daemon maps it. So the client's
heartbeat thread asks the driver about each registered allocation (:meth:`SegmentTable.sweep`, one query each) and
releases those that are gone; ``Client.release_gpu()`` (after ``torch.cuda.empty_cache()``) lets go of all of them at
once. At most :data:`MAX_SEGMENTS` allocations per ring stay registered; the least recently used go first. A request
queued behind such a release fails TZIP_HANDLE in the daemon and is done again through ZeroMQ.
"""

from __future__ import annotations

import threading

__all__ = ["MAX_SEGMENTS", "SegmentTable", "segment_key"]

#: Allocations registered per ring at most (the daemon's per-session caps, ``--max-regions`` 8192 and
#: ``--max-ipc-handles`` 4096, are far above: this bounds the GPU memory that freed segments can keep allocated).
MAX_SEGMENTS = 256


def segment_key(base: int, buffer_id: int) -> tuple[str, int, int]:
    """The key of an allocation's region in the ring's region cache (``tzip._ring.Ring.regions``)."""
    return ("seg", base, buffer_id)


class SegmentTable:
    """One ring's registered allocations of the caller: base -> buffer id, least recently used first. The regions
    themselves are in the ring's region cache under :func:`segment_key`."""

    __slots__ = ("_ids", "_refused", "_lock", "limit")

    def __init__(self, limit: int = MAX_SEGMENTS):
        self._ids: dict[int, int] = {}
        self._refused: set[tuple[int, int]] = set()
        self._lock = threading.Lock()
        self.limit = limit

    def refuse(self, base: int, buffer_id: int) -> None:
        """Remembers an allocation the daemon would not register (its requests are staged, not asked again)."""
        with self._lock:
            if len(self._refused) >= 4 * self.limit:
                self._refused.clear()
            self._refused.add((base, buffer_id))

    def was_refused(self, base: int, buffer_id: int) -> bool:
        return (base, buffer_id) in self._refused

    def known(self, base: int, buffer_id: int) -> bool:
        """Whether the allocation at ``base`` with ``buffer_id`` is registered (it becomes the most recently used)."""
        with self._lock:
            if self._ids.get(base) != buffer_id:
                return False
            self._ids[base] = self._ids.pop(base)  # to the end: the limit lets go of the least recently used first
            return True

    def add(self, base: int, buffer_id: int) -> list[tuple[str, int, int]]:
        """Records a registration; returns the keys of the regions to release: an older allocation at the same base
        (freed since), and the least recently used ones past :attr:`limit`."""
        drop = []
        with self._lock:
            old = self._ids.pop(base, None)
            if old is not None and old != buffer_id:
                drop.append(segment_key(base, old))
            self._ids[base] = buffer_id
            while len(self._ids) > self.limit:
                b = next(iter(self._ids))
                drop.append(segment_key(b, self._ids.pop(b)))
        return drop

    def sweep(self, allocation_at) -> list[tuple[str, int, int]]:
        """Forgets the allocations that are gone: ``allocation_at(base)`` says which (base, buffer id) holds ``base``
        now ((0, 0) for none, as ``cuPointerGetAttributes`` answers for freed memory); an entry it no longer matches
        was freed (``torch.cuda.empty_cache()``) or made anew. Returns the keys of their regions, to release: the
        daemon's mapping would keep freed memory allocated on the GPU until then."""
        with self._lock:
            items = list(self._ids.items())
        gone = [(b, i) for b, i in items if allocation_at(b) != (b, i)]
        with self._lock:
            for b, i in gone:
                if self._ids.get(b) == i:
                    del self._ids[b]
        return [segment_key(b, i) for b, i in gone]

    def clear(self) -> list[tuple[str, int, int]]:
        """Forgets every entry; the keys of their regions, to release."""
        with self._lock:
            keys = [segment_key(b, i) for b, i in self._ids.items()]
            self._ids.clear()
            self._refused.clear()
        return keys

    def __len__(self) -> int:
        return len(self._ids)
