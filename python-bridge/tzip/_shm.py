"""POSIX shared memory the client hands to the daemon: files under /dev/shm, mapped here and there.

* :class:`Segment` -- one file ``/dev/shm/<name>``, created here (mode 0600, exclusive), mapped,
  and seen as a uint8 tensor. Its name starts with the client's prefix
  (``tzip-<pid>-<hex>-``), which is how the daemon knows it is this client's.
* :func:`find` -- which live segment of this process holds an address range (zero-copy: a tensor
  already in one of our segments is handed over as it is).
* :func:`torch_shm_handle` -- the file behind a tensor PyTorch put in shared memory with the
  ``file_system`` sharing strategy (``/dev/shm/torch_<pid>_...``), also handed over as it is.
* :class:`Arena` -- a pool of segments for staging: tensors that are not in shared memory are
  copied into one (once), the daemon writes frames/tensors into one, and the segment goes back
  to the pool after the reply.
* :class:`ResultPool` -- segments for tensors handed to the caller (large decompressed tensors):
  a segment comes back to the pool when the last tensor over it dies, and the next result of
  about its size is written there. A fresh /dev/shm file costs its page faults on both sides
  (measured: a 25 MB decode into a fresh file 0.75-0.79 GB/s, into a reused one 1.12-1.31, into
  process memory 1.32; docs/benchmarks.md).

A segment's file is removed when the segment is closed or garbage collected (the last tensor
over it gone); the daemon is told to drop its mapping then (``on_drop``). Files of a client
killed before it could clean up are removed by the daemon once it sees the process is gone.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import errno
import mmap
import os
import threading
import time
import weakref
from typing import Callable, Iterator

import torch

__all__ = ["Segment", "Arena", "ResultPool", "find", "torch_shm_handle", "SHM_DIR"]

SHM_DIR = "/dev/shm"
_PAGE = mmap.PAGESIZE

# Live segments of this process by base address, for find().
# Reentrant: a segment's finalizer may run (garbage collection) while this thread holds the lock.
_lock = threading.RLock()
_bases: list[int] = []
_by_base: dict[int, tuple[str, int]] = {}


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class Segment:
    """A shared-memory file of ``size`` bytes (rounded up to pages), mapped read-write.

    The file lives as long as its mapping: as long as this object or any tensor made from
    :attr:`u8` or :meth:`tensor` lives (they hold the mapping). Then the file is removed and
    ``on_drop(name)`` tells the daemon to drop its mapping too.
    """

    __slots__ = ("name", "size", "u8", "base", "mm", "_finalizer", "__weakref__")

    def __init__(self, name: str, size: int, on_drop: Callable[[str], None] | None = None):
        if "/" in name or not name:
            raise ValueError(f"bad shared-memory name {name!r}")
        self.name = name
        self.size = max(_PAGE, -(-size // _PAGE) * _PAGE)
        path = os.path.join(SHM_DIR, name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, self.size)
            # Reserve the pages now: on a full /dev/shm (a container's default is 64 MB) a write into a sparse
            # file's hole raises SIGBUS, which would kill this process (or spoil the daemon's request).
            try:
                os.posix_fallocate(fd, 0, self.size)
            except OSError as e:
                if e.errno not in (errno.ENOSPC, errno.ENOMEM):
                    raise
                raise OSError(e.errno, f"no room in {SHM_DIR} for a shared-memory segment of {self.size} bytes "
                              f"({os.strerror(e.errno)}); free some, or give the container more "
                              "(docker run --shm-size)", path) from None
            mm = mmap.mmap(fd, self.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            _unlink(path)
            raise
        os.close(fd)
        self.mm = mm
        self.u8 = torch.frombuffer(mm, dtype=torch.uint8)  # holds the mapping
        self.base = self.u8.data_ptr()
        with _lock:
            bisect.insort(_bases, self.base)
            _by_base[self.base] = (name, self.size)
        # When the mapping goes (no segment, no tensor over it) or close(): forget it, remove the file, tell the daemon.
        self._finalizer = weakref.finalize(mm, Segment._cleanup, self.base, path, name, on_drop, os.getpid())

    @staticmethod
    def _cleanup(base: int, path: str, name: str, on_drop: Callable[[str], None] | None, pid: int) -> None:
        with _lock:
            i = bisect.bisect_left(_bases, base)
            if i < len(_bases) and _bases[i] == base:
                del _bases[i]
            _by_base.pop(base, None)
        if os.getpid() != pid:
            return  # a forked child exiting: the file is the parent's
        _unlink(path)
        if on_drop is not None:
            try:
                on_drop(name)
            except Exception:  # pragma: no cover - never raise from a finalizer
                pass

    def tensor(self, dtype: torch.dtype, shape: tuple[int, ...], offset: int = 0) -> torch.Tensor:
        """A tensor of ``dtype`` and ``shape`` over this segment's bytes from ``offset`` (it keeps the file alive)."""
        n = 1
        for d in shape:
            n *= d
        nbytes = n * dtype.itemsize
        if offset + nbytes > self.size:
            raise ValueError("tensor beyond the segment")
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        return self.u8[offset : offset + nbytes].view(dtype).reshape(shape)

    def close(self) -> None:
        """Removes the file now and tells the daemon (tensors over it keep their memory, but are no longer shared)."""
        self._finalizer()


def find(ptr: int, nbytes: int) -> tuple[str, int, int] | None:
    """(file name, file size, offset) of the live segment of this process holding bytes [ptr, ptr + nbytes); None if none does."""
    with _lock:
        i = bisect.bisect_right(_bases, ptr) - 1
        if i < 0:
            return None
        base = _bases[i]
        name, size = _by_base[base]
    if ptr + nbytes > base + size:
        return None
    return name, size, ptr - base


def torch_shm_handle(t: torch.Tensor) -> tuple[str, int] | None:
    """(file name, offset of the tensor's first byte) for a tensor in PyTorch ``file_system`` shared memory, else None.

    Only storages that are already shared are looked at, and only under the ``file_system`` strategy
    (asking a storage for its file name under another strategy would move it into new shared memory).
    """
    try:
        import torch.multiprocessing as tmp

        if tmp.get_sharing_strategy() != "file_system":
            return None
        storage = t.untyped_storage()
        if not storage.is_shared() or storage.device.type != "cpu":
            return None
        _, handle, size = storage._share_filename_cpu_()
        name = handle.decode() if isinstance(handle, bytes) else str(handle)
        name = name.lstrip("/")
        path = os.path.join(SHM_DIR, name)
        header = os.path.getsize(path) - size
        if header < 0:
            return None
        return name, header + (t.data_ptr() - storage.data_ptr())
    except Exception:
        return None


class Arena:
    """A pool of staging segments named ``<prefix>a<n>``; at most ``keep_bytes`` of idle segments are kept."""

    MIN_SEGMENT = 1 << 20
    #: Seconds a segment is retried on a full /dev/shm after ``on_full`` freed what it could.
    FULL_RETRY_S = 1.0

    def __init__(self, prefix: str, on_drop: Callable[[str], None], keep_bytes: int = 512 << 20,
                 on_full: Callable[[], None] | None = None):
        self._prefix = prefix
        self._on_drop = on_drop
        self._on_full = on_full
        self._keep = keep_bytes
        self._free: list[Segment] = []
        self._lock = threading.Lock()
        self._counter = 0

    def new_name(self, kind: str = "a") -> str:
        with self._lock:
            self._counter += 1
            return f"{self._prefix}{kind}{self._counter}"

    def take(self, nbytes: int) -> Segment:
        """A segment of at least ``nbytes`` bytes for one request (give it back with :meth:`give`)."""
        with self._lock:
            found = self._take_free(nbytes)
        if found is not None:
            return found
        return self.segment(max(self.MIN_SEGMENT, 1 << max(0, (nbytes - 1).bit_length())))

    def _take_free(self, nbytes: int) -> Segment | None:
        """(Lock held) the smallest free segment of at least nbytes, taken out of the pool. A method of its own so
        that no local of take() keeps a free segment alive (and mapped) while take() makes a new one, possibly after
        on_full closed the free ones."""
        best = None
        for i, free in enumerate(self._free):
            if free.size >= nbytes and (best is None or free.size < self._free[best].size):
                best = i
        return None if best is None else self._free.pop(best)

    def segment(self, nbytes: int, kind: str = "a") -> Segment:
        """A new segment of ``nbytes`` (rounded up to pages) named ``<prefix><kind><n>``, outside the pool.

        When /dev/shm is full, ``on_full()`` is called once (it frees what can be freed: idle segments, the daemon's
        mappings of removed files) and the segment is tried again for up to ``FULL_RETRY_S`` seconds (the daemon
        unmaps dropped files at its next garbage collection). Raises OSError (ENOSPC) if there is still no room."""
        try:
            return Segment(self.new_name(kind), nbytes, self._on_drop)
        except OSError as e:
            if e.errno not in (errno.ENOSPC, errno.ENOMEM) or self._on_full is None:
                raise
            self._on_full()
            deadline = time.monotonic() + self.FULL_RETRY_S
            while True:
                time.sleep(0.05)
                try:
                    return Segment(self.new_name(kind), nbytes, self._on_drop)
                except OSError as again:
                    if again.errno not in (errno.ENOSPC, errno.ENOMEM) or time.monotonic() >= deadline:
                        raise

    def give(self, seg: Segment) -> None:
        """Returns a segment after its request; the largest idle ones beyond the keep budget are closed."""
        drop: list[Segment] = []
        with self._lock:
            self._free.append(seg)
            self._free.sort(key=lambda s: s.size)
            while sum(s.size for s in self._free) > self._keep and self._free:
                drop.append(self._free.pop())
        for s in drop:
            s.close()

    @contextlib.contextmanager
    def lease(self, nbytes: int) -> Iterator[Segment]:
        """:meth:`take` for one request: given back when the block ends normally, closed (never reused) when it
        raises, since the daemon may not be done with it (a timeout)."""
        seg = self.take(nbytes)
        try:
            yield seg
        except BaseException:
            seg.close()
            raise
        self.give(seg)

    def close(self) -> None:
        with self._lock:
            segs, self._free = self._free, []
        for s in segs:
            s.close()

    @property
    def idle_bytes(self) -> int:
        with self._lock:
            return sum(s.size for s in self._free)


class ResultPool:
    """Shared-memory segments lent out as the caller's tensors, taken back when every tensor over them is gone.

    :meth:`lend` gives a uint8 tensor of exactly ``nbytes`` over a segment of this pool. The tensor (and every view
    of it) holds a buffer object of its own over the segment's mapping; when the last of them dies, the segment is
    idle again and a later :meth:`lend` of about its size (``nbytes`` up to the segment's size, at most 1/8 + a page
    more) reuses it: the file stays mapped here and in the daemon, so its pages are not faulted in again.

    Idle segments are kept up to ``keep_bytes`` and for ``keep_s`` seconds (:meth:`trim`); a segment whose request
    failed without an answer is :meth:`discard`-ed (closed when its tensors die, never reused: the daemon may still
    be writing it). Thread-safe; the return path runs in garbage collection and only appends to a deque.
    """

    def __init__(self, arena: Arena, keep_bytes: int = 512 << 20, keep_s: float = 30.0):
        self._arena = arena
        self._keep = int(keep_bytes)
        self._keep_s = float(keep_s)
        self._lock = threading.Lock()
        self._idle: list[tuple[float, Segment]] = []  # (when it came back, segment)
        self._back: collections.deque[Segment] = collections.deque()
        self._discarded: set[str] = set()
        self._lent: set[str] = set()
        self._closed = False
        _pools.add(self)

    def lend(self, nbytes: int) -> tuple[Segment, torch.Tensor]:
        """(segment, uint8 tensor of ``nbytes`` bytes at its start). ``nbytes`` >= 1."""
        with self._lock:
            drop = self._collect()
            seg = self._take_idle(nbytes)
        for s in drop:
            s.close()
        if seg is None:
            seg = self._arena.segment(nbytes, "t")
        self._lent.add(seg.name)
        view = memoryview(seg.mm)[:nbytes]
        u8 = torch.frombuffer(view, dtype=torch.uint8)  # holds `view`: it dies with the last tensor over it
        weakref.finalize(view, self._returned, seg)
        return seg, u8

    def _take_idle(self, nbytes: int) -> Segment | None:
        """(Lock held) the smallest idle segment of nbytes .. nbytes + 1/8 + a page, taken out of the idle list. A
        method of its own so that no local of lend() keeps another idle segment alive (and mapped) while lend() makes
        a new one, possibly after freeing the idle ones on a full /dev/shm."""
        limit = nbytes + nbytes // 8 + _PAGE
        best = None
        for i, (_, s) in enumerate(self._idle):
            if nbytes <= s.size <= limit and (best is None or s.size < self._idle[best][1].size):
                best = i
        return None if best is None else self._idle.pop(best)[1]

    def _returned(self, seg: Segment) -> None:
        """The last tensor over ``seg`` died (runs in garbage collection: takes no lock)."""
        self._lent.discard(seg.name)
        self._back.append(seg)
        if self._closed:  # close() may have drained the deque just before this append: drain it again
            self._close_returned()

    def _close_returned(self) -> None:
        while True:
            try:
                s = self._back.popleft()
            except IndexError:
                return
            s.close()

    def _forked(self) -> None:
        """After a fork, in the parent: the child shares the pages of every segment lent now (MAP_SHARED) and may still
        use its copies of the tensors over them, so none of these is ever reused."""
        self._discarded.update(list(self._lent))

    def discard(self, seg: Segment) -> None:
        """Never reuse ``seg`` (its request failed without an answer): closed once its tensors are gone."""
        with self._lock:
            self._discarded.add(seg.name)

    def trim(self) -> None:
        """Closes idle segments older than ``keep_s`` seconds, and the largest beyond ``keep_bytes``."""
        with self._lock:
            drop = self._collect()
        for s in drop:
            s.close()

    def _collect(self) -> list[Segment]:
        """(Lock held) moves returned segments to the idle list; returns those the caller closes (discarded, too old,
        beyond the keep budget, or all once the pool is closed)."""
        now = time.monotonic()
        drop: list[Segment] = []
        while self._back:
            s = self._back.popleft()
            if self._closed or s.name in self._discarded:
                self._discarded.discard(s.name)
                drop.append(s)
            else:
                self._idle.append((now, s))
        keep = [(t, s) for t, s in self._idle if now - t <= self._keep_s]
        drop.extend(s for t, s in self._idle if now - t > self._keep_s)
        keep.sort(key=lambda e: e[1].size)
        while keep and sum(s.size for _, s in keep) > self._keep:
            drop.append(keep.pop()[1])
        self._idle = keep
        return drop

    def drop_idle(self) -> None:
        """Closes every idle segment now (/dev/shm is full)."""
        with self._lock:
            drop = self._collect() + [s for _, s in self._idle]
            self._idle = []
        for s in drop:
            s.close()

    def close(self) -> None:
        """Closes the idle segments now; lent ones are closed when their tensors die."""
        self._closed = True
        self.drop_idle()
        self._close_returned()

    @property
    def idle_bytes(self) -> int:
        with self._lock:
            return sum(s.size for _, s in self._idle)


#: Live result pools, told about forks (ResultPool._forked).
_pools: "weakref.WeakSet[ResultPool]" = weakref.WeakSet()


def _after_fork_in_parent() -> None:
    for pool in list(_pools):
        pool._forked()


def _after_fork_in_child() -> None:
    """In a forked child: a fresh registry lock (another thread of the parent may have held the old one at the fork, and
    no thread here would ever release it: the child's first find() hung) and an empty registry (the parent's segments
    belong to the parent's session: a client of the child must copy their bytes, not name the parent's files)."""
    global _lock, _bases, _by_base
    _lock = threading.RLock()
    _bases = []
    _by_base = {}


os.register_at_fork(after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child)
