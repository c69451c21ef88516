"""GPU memory the client hands to the daemon: CUDA IPC handles of PyTorch storages, interprocess events.

How a CUDA tensor reaches the daemon (docs/protocol.md, handle kind ``cuda_ipc``):

* :func:`share_storage` -- ``UntypedStorage._share_cuda_()``: PyTorch's shareable handle of the
  allocation holding the storage (``[version][kind]`` + the 64-byte cudaIpcMemHandle_t of the
  allocation base for kind ``c``), the storage's offset in it and its size, and a slot in a
  ref-counter file. ``_share_cuda_`` also wraps the storage's memory in a ``CudaIPCSentData``
  (torch/csrc/StorageSharing.cpp, torch/csrc/CudaIPCTypes.cpp) whose counter starts at 1: when the
  storage dies with the counter above 0, the block is kept in PyTorch's "limbo" (not returned to
  the caching allocator) until the counter drops to 0. The consumer is meant to decrement it
  (``UntypedStorage._release_ipc_counter_cuda(ref_counter_handle, ref_counter_offset)``, what
  ``rebuild_cuda_tensor`` does for a storage it already holds). The daemon never holds a client's
  memory after a reply, so the client decrements the counter itself once the request that first
  used the share is answered (:meth:`Share.release`); after a request that failed without an
  answer (timeout, daemon gone) the counter is left as it is (:meth:`Share.poison`): the block
  then stays out of reuse, safely, rather than being handed out while a daemon might still use it.
* :class:`ShareCache` -- one share per storage per client, reused by later requests (a weak
  reference tells when the storage died). Every ``_share_cuda_`` call nests one more wrapper (with
  its own interprocess event) around the storage's memory until the storage dies, so sharing the
  same gradient buffer at every step would pile them up.
* :class:`GpuArena` -- per-device staging buffers allocated and shared once (their counter is
  kept at 1 while the arena holds them, released when they are dropped): small tensors are copied
  in (cheaper than a share), frames and small decompressed tensors are written there by the
  daemon and copied out into compact tensors (each direction one ``torch._foreach_copy_`` per
  request: :func:`gpu_copy_many`). Each buffer records an event on the stream that last used it;
  the next user's stream waits on it (no host synchronisation).
* :class:`EventPool` -- interprocess events (``torch.cuda.Event(interprocess=True)``) the client
  records on its stream after writing a request's inputs (``wait_event``); one per request in
  flight. :class:`DaemonEvents` -- the daemon's events (``event_handle`` of a reply) opened with
  ``torch.cuda.Event.from_ipc_handle``, which the client's stream waits on before using outputs.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable, Iterator

import torch

__all__ = [
    "EXPANDABLE_SEGMENTS_REFUSED",
    "ShareError",
    "Share",
    "share_storage",
    "ShareCache",
    "GpuArena",
    "GpuBuffer",
    "EventPool",
    "DaemonEvents",
    "device_uuid",
    "gpu_copy_from_bytes",
    "gpu_bytes_of",
    "gpu_copy_many",
    "regions_of",
    "StagingRegions",
]

#: Kind bytes of PyTorch's shareable handle (c10/cuda/CUDACachingAllocator.cpp, ShareableHandleType).
SHAREABLE_CUDA_MALLOC = ord("c")
SHAREABLE_CUDA_EXPANDABLE_SEGMENT = ord("e")

EXPANDABLE_SEGMENTS_REFUSED = (
    "the tensor lies in a PyTorch expandable segment (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True), whose CUDA "
    "IPC handle (kind \"e\") the tzip daemon does not open. Share memory from the regular caching allocator instead: "
    "start the training process without expandable_segments:True in PYTORCH_CUDA_ALLOC_CONF, or allocate the tensors "
    "to compress while torch.cuda.memory._set_allocator_settings('expandable_segments:False') is in effect, or "
    "compress a CPU copy (tensor.cpu())"
)


class ShareError(RuntimeError):
    """PyTorch could not share a storage through CUDA IPC (``expandable`` tells whether it is an expandable segment)."""

    def __init__(self, message: str, expandable: bool = False):
        super().__init__(message)
        self.expandable = expandable


def device_uuid(index: int) -> str:
    """The GPU's UUID as nvidia-smi -L prints it ('GPU-xxxxxxxx-...'), from torch.cuda.get_device_properties."""
    return f"GPU-{torch.cuda.get_device_properties(index).uuid}"


class Share:
    """One ``_share_cuda_()`` of a storage: what the daemon needs to open it, and its ref-counter slot."""

    __slots__ = ("handle", "offset", "size", "ref_counter", "ref_counter_offset", "_state", "_lock")

    def __init__(self, handle: bytes, offset: int, size: int, ref_counter: bytes | None, ref_counter_offset: int):
        self.handle = handle
        self.offset = offset
        self.size = size
        self.ref_counter = ref_counter
        self.ref_counter_offset = ref_counter_offset
        self._state = "held"  # held -> released | poisoned
        self._lock = threading.Lock()

    @property
    def expandable(self) -> bool:
        return len(self.handle) >= 2 and self.handle[1] == SHAREABLE_CUDA_EXPANDABLE_SEGMENT

    def wire(self, uuid: str, index: int, offset: int = 0, size: int | None = None) -> dict:
        """The protocol's ``cuda_ipc`` handle of bytes [offset, offset + size) of the storage (default: all of it)."""
        return {"kind": "cuda_ipc", "device_uuid": uuid, "device_index": index, "handle": self.handle,
                "offset": self.offset + offset, "size": self.size - offset if size is None else size,
                "ref_counter_handle": self.ref_counter, "ref_counter_offset": self.ref_counter_offset}

    def release(self) -> None:
        """Decrements PyTorch's counter of this share, once (nothing after :meth:`poison`)."""
        with self._lock:
            if self._state != "held":
                return
            self._state = "released"
        if self.ref_counter is not None:
            try:
                torch.UntypedStorage._release_ipc_counter_cuda(self.ref_counter, self.ref_counter_offset)
            except Exception:  # pragma: no cover - best effort, as PyTorch's own consumers do
                pass

    def poison(self) -> None:
        """A request using this share failed without an answer: never release the counter (the block stays out of reuse)."""
        with self._lock:
            if self._state == "held":
                self._state = "poisoned"


def share_storage(storage: torch.UntypedStorage) -> Share:
    """``storage._share_cuda_()`` as a :class:`Share`. Raises ShareError when PyTorch cannot share it."""
    try:
        (_device, handle, size, offset, ref_counter, ref_counter_offset, _event, _sync) = storage._share_cuda_()
    except RuntimeError as e:
        text = str(e)
        if "expandable" in text:
            raise ShareError(f"{EXPANDABLE_SEGMENTS_REFUSED} (PyTorch: {text})", expandable=True) from None
        raise ShareError(f"PyTorch cannot share this CUDA storage: {text}") from None
    if handle is None:
        raise ShareError("an empty CUDA storage has no IPC handle")
    share = Share(bytes(handle), int(offset), int(size), None if ref_counter is None else bytes(ref_counter), int(ref_counter_offset))
    if share.expandable:
        share.release()  # the daemon will not open it: nothing holds the memory
        raise ShareError(EXPANDABLE_SEGMENTS_REFUSED, expandable=True)
    if len(share.handle) < 2 or share.handle[1] != SHAREABLE_CUDA_MALLOC:
        share.release()
        raise ShareError(f"unknown CUDA IPC handle kind {share.handle[1:2]!r} from PyTorch {torch.__version__}")
    return share


class ShareCache:
    """One :class:`Share` per storage (keyed by its StorageImpl, checked alive through a weak reference)."""

    def __init__(self, share_fn: Callable[[torch.UntypedStorage], Share] = share_storage):
        from torch.multiprocessing.reductions import StorageWeakRef

        self._weak = StorageWeakRef
        self._share_fn = share_fn
        self._lock = threading.Lock()
        self._entries: dict[int, tuple[object, Share, tuple[int, int]]] = {}
        self._limit = 256

    def get(self, storage: torch.UntypedStorage) -> tuple[Share, bool]:
        """(share, new): the storage's share, made now when ``new`` (also when the storage was resized: new memory)."""
        ref = self._weak(storage)
        key = ref.cdata
        where = (storage.data_ptr(), storage.nbytes())
        with self._lock:
            seen = self._entries.get(key)
            if seen is not None and not seen[0].expired() and seen[2] == where:
                return seen[1], False
            share = self._share_fn(storage)
            self._entries[key] = (ref, share, where)
            if len(self._entries) > self._limit:
                self._purge()
            return share, True

    def _purge(self) -> None:
        live = {k: v for k, v in self._entries.items() if not v[0].expired()}
        self._entries = live
        self._limit = max(256, 2 * len(live))

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


class StagingRegions:
    """How one GPU request names regions of its staging buffer: by reference into the request's handle table
    (``table=True``, protocol version 2: the buffer's CUDA IPC handle and ref counter are sent once per request, not
    in each of a batch's handles; docs/protocol.md "Handle tables"), or as full ``cuda_ipc`` handles (version 1)."""

    __slots__ = ("share", "uuid", "index", "table")

    def __init__(self, share: Share, uuid: str, index: int, table: bool):
        self.share = share
        self.uuid = uuid
        self.index = index
        self.table = table

    def region(self, offset: int, size: int) -> dict:
        """The handle of bytes [offset, offset + size) of the buffer."""
        if self.table:
            return {"kind": "ref", "index": 0, "offset": offset, "size": size}
        return self.share.wire(self.uuid, self.index, offset, size)

    def body(self, body: dict) -> dict:
        """The request ``body`` with the handle table its references name (itself when there is none)."""
        if self.table:
            body["handles"] = [self.share.wire(self.uuid, self.index)]
        return body


class GpuBuffer:
    """A staging buffer of a :class:`GpuArena`: a uint8 CUDA tensor and its share.

    ``in_doubt`` is set by the client while a request naming the buffer waits for its answer: a
    buffer still in doubt when its lease ends (no answer) is never reused nor freed.
    """

    __slots__ = ("u8", "share", "size", "ready", "alloc_stream", "in_doubt")

    def __init__(self, u8: torch.Tensor, share: Share, alloc_stream: torch.cuda.Stream):
        self.u8 = u8
        self.share = share
        self.size = u8.numel()
        self.ready: torch.cuda.Event | None = None
        self.alloc_stream = alloc_stream
        self.in_doubt = False


class GpuArena:
    """Staging buffers on one GPU, reused between requests; at most ``keep_bytes`` of idle buffers are kept.

    Streams: a buffer records ``ready`` on the stream of each request that gives it back, and the next
    request's stream waits on it, so uses on different streams are ordered on the GPU. (The caching
    allocator's record_stream does nothing for a shared storage -- its DataPtr is PyTorch's
    CudaIPCSentData, not the allocator's -- so a dropped buffer's allocation stream waits on ``ready``
    instead before the block goes back to the allocator.)
    """

    MIN_BUFFER = 1 << 20

    def __init__(self, device: torch.device, keep_bytes: int, share_fn: Callable[[torch.UntypedStorage], Share] = share_storage):
        self.device = device
        self._keep = keep_bytes
        self._share_fn = share_fn
        self._free: list[GpuBuffer] = []
        self._lock = threading.Lock()

    def _new(self, nbytes: int, stream: torch.cuda.Stream) -> GpuBuffer:
        size = max(self.MIN_BUFFER, 1 << max(0, (nbytes - 1).bit_length()))
        if size > self._keep:  # will not be kept: no rounding beyond the allocator's 2 MiB
            size = max(self.MIN_BUFFER, -(-nbytes // (2 << 20)) * (2 << 20))
        with stream_scope(stream):
            u8 = torch.empty(size, dtype=torch.uint8, device=self.device)
        return GpuBuffer(u8, self._share_fn(u8.untyped_storage()), stream)

    def take(self, nbytes: int, stream: torch.cuda.Stream) -> GpuBuffer:
        """A buffer of at least ``nbytes`` bytes, usable on ``stream`` (its last user's work is waited for on the GPU)."""
        with self._lock:
            best = None
            for i, b in enumerate(self._free):
                if b.size >= nbytes and (best is None or b.size < self._free[best].size):
                    best = i
            buf = self._free.pop(best) if best is not None else None
        if buf is None:
            return self._new(nbytes, stream)
        if buf.ready is not None:
            stream.wait_event(buf.ready)
        return buf

    def give(self, buf: GpuBuffer, stream: torch.cuda.Stream) -> None:
        """Returns a buffer after its request; the work queued on ``stream`` with it is recorded, not waited for."""
        if buf.ready is None:
            buf.ready = torch.cuda.Event()
        buf.ready.record(stream)
        buf.in_doubt = False
        drop: list[GpuBuffer] = []
        with self._lock:
            self._free.append(buf)
            self._free.sort(key=lambda b: b.size)
            while self._free and sum(b.size for b in self._free) > self._keep:
                drop.append(self._free.pop())
        for b in drop:
            self._drop(b)

    @staticmethod
    def _drop(buf: GpuBuffer) -> None:
        if buf.ready is not None:
            buf.alloc_stream.wait_event(buf.ready)  # the allocator reuses the block on its allocation stream only
        buf.share.release()  # counter to 0 before the storage dies: the block goes back to the allocator
        buf.u8 = None  # type: ignore[assignment]

    @contextlib.contextmanager
    def lease(self, nbytes: int, stream: torch.cuda.Stream) -> Iterator[GpuBuffer]:
        """:meth:`take` for one request: given back when the block ends, unless the buffer is still
        ``in_doubt`` (a request naming it got no answer: the daemon may not be done with it). Such a buffer is
        forgotten with its counter held, so PyTorch keeps its block out of reuse."""
        buf = self.take(nbytes, stream)
        try:
            yield buf
        except BaseException:
            if buf.in_doubt:
                buf.share.poison()
            else:
                self.give(buf, stream)
            raise
        self.give(buf, stream)

    def close(self) -> None:
        with self._lock:
            bufs, self._free = self._free, []
        for b in bufs:
            self._drop(b)

    @property
    def idle_bytes(self) -> int:
        with self._lock:
            return sum(b.size for b in self._free)


class EventPool:
    """Interprocess events of one GPU, one per request in flight (the daemon's stream waits on it)."""

    def __init__(self, device: torch.device):
        self.device = device
        self._free: list[tuple[torch.cuda.Event, bytes | None]] = []
        self._lock = threading.Lock()

    def record(self, stream: torch.cuda.Stream) -> tuple[torch.cuda.Event, bytes]:
        """An event recorded on ``stream`` now, and its cudaIpcEventHandle_t bytes."""
        with self._lock:
            ev, handle = self._free.pop() if self._free else (torch.cuda.Event(interprocess=True), None)
        ev.record(stream)
        if handle is None:
            handle = bytes(ev.ipc_handle())
        return ev, handle

    def give(self, ev: torch.cuda.Event, handle: bytes) -> None:
        """The request was answered: the daemon's wait on ``ev`` is done, it may be recorded again."""
        with self._lock:
            self._free.append((ev, handle))

    def clear(self) -> None:
        with self._lock:
            self._free.clear()


class DaemonEvents:
    """The daemon's interprocess events of one GPU, opened once per handle."""

    MAX = 16

    def __init__(self, device: torch.device):
        self.device = device
        self._events: dict[bytes, torch.cuda.Event] = {}
        self._lock = threading.Lock()

    def get(self, handle: bytes) -> torch.cuda.Event:
        with self._lock:
            ev = self._events.get(handle)
            if ev is None:
                if len(self._events) >= self.MAX:  # a daemon restarted many times: start afresh
                    self._events.clear()
                ev = torch.cuda.Event.from_ipc_handle(self.device, handle)
                self._events[handle] = ev
            return ev

    def clear(self) -> None:
        with self._lock:
            self._events.clear()


def _int_alias(t: torch.Tensor) -> torch.Tensor:
    from ._dlpack import int_alias

    return int_alias(t)


class stream_scope:
    """``with torch.cuda.stream(stream)`` for a stream of the current device (the callers enter
    ``torch.cuda.device(stream's device)`` first), at a fraction of its cost: PyTorch's StreamContext asks for the
    current stream twice through Python helpers that look the device type up each time (14.4 µs a context on the
    H200 host, against about 1 µs for this; docs/benchmarks.md, "Daemon fast lane, second round"). It reads and sets the
    current stream with the two C calls ``torch.cuda.set_stream`` and ``current_stream`` are made of, and does
    nothing when ``stream`` already is the current one. Where this PyTorch lacks them, or the current device is not
    the stream's, it is PyTorch's context."""

    __slots__ = ("_stream", "_prev", "_ctx")

    def __init__(self, stream) -> None:
        self._stream = stream
        self._prev = None
        self._ctx = None

    def __enter__(self):
        s = self._stream
        if _get_stream is None or _get_device() != s.device_index:
            # (Setting another device's stream makes that device current: PyTorch's context restores both.)
            self._ctx = torch.cuda.stream(s)
            return self._ctx.__enter__()
        prev = _get_stream(s.device_index)
        if prev[0] != s.stream_id:
            self._prev = prev
            _set_stream(stream_id=s.stream_id, device_index=s.device_index, device_type=s.device_type)
        return s

    def __exit__(self, *exc) -> None:
        if self._ctx is not None:
            self._ctx.__exit__(*exc)
        elif self._prev is not None:
            sid, index, dtype = self._prev
            _set_stream(stream_id=sid, device_index=index, device_type=dtype)


_get_stream = getattr(torch._C, "_cuda_getCurrentStream", None)
_set_stream = getattr(torch._C, "_cuda_setStream", None)
_get_device = getattr(torch._C, "_cuda_getDevice", None)
if _set_stream is None or _get_device is None:
    _get_stream = None

_streams: dict[tuple[int, int, int], torch.cuda.Stream] = {}
_no_scope = contextlib.nullcontext()


def device_scope(index: int):
    """``torch.cuda.device(index)``, or a context that does nothing when ``index`` already is the current device (the
    usual case: the caller's tensors are on it). PyTorch's context costs about 0.8-1.7 µs on the H200 host even then
    (docs/benchmarks.md)."""
    if _get_device is not None and _get_device() == index:
        return _no_scope
    return torch.cuda.device(index)


def current_stream(index: int) -> torch.cuda.Stream:
    """``torch.cuda.current_stream(index)`` (int ``index``), the object made once per stream: PyTorch builds a new
    Stream object in Python on each call (6.7 µs a call on the H200 host, docs/benchmarks.md), while the C call
    underneath it answers in well under a microsecond. Keyed by the stream's (id, device, type) triple, which is what a
    Stream object is made of, so the object returned is equal to PyTorch's."""
    if _get_stream is None:
        return torch.cuda.current_stream(index)
    key = _get_stream(index)
    s = _streams.get(key)
    if s is None:
        s = torch.cuda.current_stream(index)
        if len(_streams) >= 256:  # e.g. a job making streams again and again: forget them all
            _streams.clear()
        _streams[key] = s
    return s


def gpu_copy_from_bytes(out: torch.Tensor, src_u8: torch.Tensor) -> None:
    """Writes C-order bytes ``src_u8`` (contiguous uint8 on out's device, exactly out's nbytes) into ``out`` (any layout)."""
    dst = _int_alias(out.detach())
    if dst.numel() == 0:
        return
    dst.copy_(src_u8.view(dst.dtype).view(dst.shape))


def gpu_bytes_of(t: torch.Tensor) -> torch.Tensor:
    """The values of CUDA tensor ``t`` in C order as a 1-D uint8 tensor of its nbytes: a view when ``t`` is
    contiguous, else a copy queued on the current stream (through the integer alias: bits move exactly)."""
    return _int_alias(t.detach()).contiguous().view(-1).view(torch.uint8)


def regions_of(u8: torch.Tensor, regions: list[tuple[int, int]]) -> list[torch.Tensor]:
    """Views of the contiguous uint8 tensor ``u8`` at ``regions``, (offset, size) pairs in bytes, in increasing and
    non-overlapping order: one ``split`` for the lot, where a slice per region costs a Python indexing call each."""
    if len(regions) == 1:  # a single tensor's request: a slice is cheaper than Tensor.split
        off, n = regions[0]
        return [u8[off : off + n]]
    sizes: list[int] = []
    end = 0
    for off, n in regions:
        sizes.append(off - end)
        sizes.append(n)
        end = off + n
    return list(u8[:end].split(sizes)[1::2])


def gpu_copy_many(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """``dsts[i].copy_(srcs[i])`` for every i (uint8 tensors of equal sizes on one device), queued on the current
    stream by one ``torch._foreach_copy_``: a few kernel launches for the whole list, where a ``copy_`` per pair costs
    a launch and ~7 µs of host time each (cProfile of the 200-parameter batch on the H200 host, docs/benchmarks.md).
    One contiguous pair (a single tensor's request) is one :func:`copy_raw` on the current stream, where the driver
    can be called."""
    if len(dsts) == 1:
        d, s = dsts[0], srcs[0]
        n = d.numel()
        if (_raw_stream is not None and n == s.numel() and d.dtype == s.dtype == torch.uint8 and d.is_cuda and s.is_cuda
                and d.is_contiguous() and s.is_contiguous()):
            index = d.get_device()
            if copy_raw(d.data_ptr(), s.data_ptr(), n, index, _raw_stream(index)):
                return
        d.copy_(s)
    elif dsts:
        torch._foreach_copy_(dsts, srcs)


_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def plain(t: torch.Tensor) -> bool:
    """Whether ``t``'s memory holds its values in C order as they are (contiguous, no lazy conjugate or negative):
    then its bytes can be copied raw."""
    return t.is_contiguous() and not t.is_conj() and not t.is_neg()


def copy_raw(dst: int, src: int, nbytes: int, index: int, raw_stream: int) -> bool:
    """Queues a copy of ``nbytes`` from device address ``src`` to ``dst`` on the CUstream ``raw_stream`` (of device
    ``index``; ``torch.cuda.Stream.cuda_stream``) by one ``cuMemcpyDtoDAsync``, without making tensors of the two
    ranges (a single tensor's staging copies, which :func:`gpu_copy_many` would take as uint8 views, each checked).
    False, with nothing queued, where the driver cannot be called: the caller copies with PyTorch."""
    if not _copy_device_ok():
        return False
    if nbytes:
        from ._memops import copy_device

        copy_device(dst, src, nbytes, index, raw_stream)
    return True


_copy_ok: bool | None = None


def _copy_device_ok() -> bool:
    """Whether :func:`gpu_copy_many` may call the driver (asked once)."""
    global _copy_ok
    if _copy_ok is None:
        from ._memops import available

        _copy_ok = available() is None
    return _copy_ok
