"""The client's side of the submission ring (docs/ring.md, protocol version 4): the data plane of a session.

A ring is a file ``/dev/shm/<shm_prefix>ring-<n>`` made and mapped here, opened by the daemon with ``ring_open`` (the
control plane stays on ZeroMQ: :mod:`tzip.client`), and served by a native thread of the daemon's addon. Per request
nothing crosses the socket: the client packs 128-byte submission entries (SQEs) naming registered regions by
``(id, generation, offset, bytes)`` into the file, publishes them by storing ``sq_head``, rings the doorbell when the
thread sleeps, and reaps 64-byte completion entries (CQEs) after ``cq_head``.

* :class:`Ring` -- the file, its header words (ctypes views into the mapping), publishing SQEs packed by the caller
  (:meth:`Ring.submit_packed`: one copy into the mapping per batch; :meth:`Ring.submit` packs :func:`sqe` tuples
  first), the doorbell futexes, and reaping: any thread that waits reaps for every pending request of the ring and
  dispatches completions by ``user_data`` (a request's id in the high 32 bits, the SQE's index in it in the low 32:
  one dictionary entry per request, not per SQE). One lock per ring.
* :class:`Handle` -- what ``compress_async`` / ``decompress_async`` return: a :class:`concurrent.futures.Future`
  (existing callers keep working) with ``wait(stream=None)`` (a GPU-side wait where there is one) and ``result()``.
* :func:`sqe` -- the field tuple of one SQE; :data:`SQE` / :data:`CQE` -- their layouts.

Memory ordering (x86-64 only; other machines use the ZeroMQ path, :func:`supported`): x86 keeps stores in order
with other stores and loads in order with other loads, so writing an SQE's bytes and then ``sq_head`` publishes
the SQE, and reading ``cq_head`` and then the CQE's bytes sees the whole CQE. What x86 does reorder is a store
followed by a load of another address: ``sq_head = n`` then ``read sq_sleeping`` (and ``cq_waiting = 1`` then ``read
cq_head``) may execute load first, which is the lost-wake-up race of every doorbell. :func:`full_barrier` orders them:
CPython has no fence primitive, but acquiring and releasing an uncontended :class:`threading.Lock` executes a locked
read-modify-write (glibc's ``sem_trywait``/``sem_post`` in 3.10-3.12, ``PyMutex``'s compare-and-swap from 3.13),
which is a full barrier on x86. The sleeping side waits with a timeout anyway (docs/ring.md), so a lost wake-up
would cost a delay, never a hang.
"""

from __future__ import annotations

import concurrent.futures
import concurrent.futures._base as _futures_base
import ctypes
import errno
import itertools
import mmap
import os
import platform
import struct
import threading
import time
import weakref
from typing import Any, Callable, Sequence

from . import _generated_constants as _generated
from ._cuda_segments import SegmentTable
from ._errors import ERROR_CODES, DaemonUnavailableError, TzipDaemonError

__all__ = ["MAGIC", "HEADER_BYTES", "SQE_BYTES", "CQE_BYTES", "SQE", "CQE", "OP_NOP", "OP_COMPRESS", "OP_DECOMPRESS",
           "F_LINK", "F_VERIFY", "F_WAIT", "F_SIGNAL", "CODEC_CODES", "CODEC_NAMES", "STREAM_TAGS", "MAX_NDIM",
           "ring_bytes", "sqe", "supported", "full_barrier", "futex_wake", "futex_wait", "Ring", "Handle", "Region",
           "RingClosed", "DEFAULT_SPIN_S"]

# The ring file's layout and an SQE's codes (docs/ring.md, "The ring file" and "Submission queue entry"): src/errors.json
# ("ring"), generated, as the daemon's ring thread reads them (cuda/include/tzip/generated/constants.h).
MAGIC = _generated.RING_MAGIC
HEADER_BYTES = _generated.RING_HEADER_BYTES
SQE_BYTES = _generated.RING_SQE_BYTES
CQE_BYTES = _generated.RING_CQE_BYTES
#: Most dimensions an SQE describes (frames of more go through ZeroMQ).
MAX_NDIM = _generated.RING_MAX_NDIM

# Header offsets: each group of words on its own cache line; produced and done are the u64 GPU ordering words
# (docs/ring.md, "GPU ordering flags").
OFF_MAGIC, OFF_ENTRIES = _generated.RING_OFF_MAGIC, _generated.RING_OFF_ENTRIES
OFF_SQ_HEAD = _generated.RING_OFF_SQ_HEAD
OFF_SQ_TAIL, OFF_SQ_SLEEPING = _generated.RING_OFF_SQ_TAIL, _generated.RING_OFF_SQ_SLEEPING
OFF_SQ_DOORBELL = _generated.RING_OFF_SQ_DOORBELL
OFF_CQ_HEAD, OFF_STATE = _generated.RING_OFF_CQ_HEAD, _generated.RING_OFF_STATE
OFF_CQ_TAIL, OFF_CQ_WAITING = _generated.RING_OFF_CQ_TAIL, _generated.RING_OFF_CQ_WAITING
OFF_CQ_DOORBELL = _generated.RING_OFF_CQ_DOORBELL
OFF_PRODUCED, OFF_DONE = _generated.RING_OFF_PRODUCED, _generated.RING_OFF_DONE

STATE_SERVING, STATE_CLOSED, STATE_BROKEN = (_generated.RING_STATE_SERVING, _generated.RING_STATE_CLOSED,
                                             _generated.RING_STATE_BROKEN)

OP_NOP, OP_COMPRESS, OP_DECOMPRESS = _generated.RING_OP_NOP, _generated.RING_OP_COMPRESS, _generated.RING_OP_DECOMPRESS
F_LINK, F_VERIFY, F_WAIT, F_SIGNAL = (_generated.RING_F_LINK, _generated.RING_F_VERIFY, _generated.RING_F_WAIT,
                                      _generated.RING_F_SIGNAL)
CODEC_CODES = {**_generated.CODEC_IDS, "auto": _generated.CODEC_AUTO_ID}  # src/errors.json (generated)
CODEC_NAMES = {v: k for k, v in CODEC_CODES.items() if k != "auto"}
#: SQE stream tags (docs/ring.md): the client's stream names (tzip.client.STREAMS) -> their codes.
STREAM_TAGS = {None: 0, **_generated.STREAM_TAGS}

#: user_data u64, op flags codec dtype ndim sm_budget stream (u8 each), reserved u8, src (id u32, generation u32,
#: offset u64, bytes u64), dst (the same), shape u64[6], wait_value u64, signal_value u64: 128 bytes.
SQE = struct.Struct("<QBBBBBBBxIIQQIIQQ6QQQ")
#: Byte offsets in an SQE of the fields patched after packing (flags; wait_value, signal_value).
SQE_OFF_FLAGS, SQE_OFF_WAIT, SQE_OFF_SIGNAL = 9, 112, 120
_U64 = struct.Struct("<Q")
#: user_data u64, status i32, codec u8, reserved u8[3], result u64, message char[40]: 64 bytes.
CQE = struct.Struct("<QiB3xQ40s")
assert SQE.size == SQE_BYTES and CQE.size == CQE_BYTES

_NAME_OF_CODE = {v: k for k, v in ERROR_CODES.items()}
_M32 = 0xFFFFFFFF

# --- futexes and the barrier -------------------------------------------------------------------------------------
#: SYS_futex by machine (asm/unistd_64.h). The ring is used on x86-64 only: see the module docstring.
_SYS_FUTEX = {"x86_64": 202, "AMD64": 202}
FUTEX_WAIT, FUTEX_WAKE = 0, 1  # shared futexes: no FUTEX_PRIVATE_FLAG (the word is in a file mapped by two processes)


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_libc = None
_syscall = None
_sys_futex = _SYS_FUTEX.get(platform.machine())
if _sys_futex is not None and os.name == "posix":
    try:
        _libc = ctypes.CDLL(None, use_errno=True)
        _syscall = _libc.syscall
        _syscall.restype = ctypes.c_long
        _syscall.argtypes = [ctypes.c_long, ctypes.c_void_p, ctypes.c_int, ctypes.c_uint, ctypes.c_void_p,
                             ctypes.c_void_p, ctypes.c_uint]
    except (OSError, AttributeError):  # pragma: no cover - a libc without syscall()
        _syscall = None


def supported() -> str | None:
    """None when this machine can use the ring, else why not (the client then stays on ZeroMQ)."""
    if _syscall is None:
        return f"the ring's memory ordering and futex calls are written for x86-64 Linux, not {platform.system()} {platform.machine()}"
    return None


_barrier_lock = threading.Lock()


def full_barrier() -> None:
    """A full memory barrier (store-load ordering) on x86-64: an uncontended lock's locked read-modify-writes (see
    the module docstring for why this is the barrier)."""
    _barrier_lock.acquire()
    _barrier_lock.release()


def futex_wake(addr: int, n: int = 1) -> None:
    """FUTEX_WAKE of up to ``n`` waiters on the u32 at ``addr`` (a shared mapping)."""
    _syscall(_sys_futex, addr, FUTEX_WAKE, n, None, None, 0)


def futex_wait(addr: int, expected: int, timeout_s: float) -> None:
    """FUTEX_WAIT on the u32 at ``addr`` while it holds ``expected``, at most ``timeout_s`` seconds (the GIL is
    released meanwhile). Returns on a wake, a timeout, a changed value (EAGAIN) or a signal alike: callers re-check."""
    sec = int(timeout_s)
    ts = _Timespec(sec, int((timeout_s - sec) * 1e9))
    _syscall(_sys_futex, addr, FUTEX_WAIT, expected & _M32, ctypes.addressof(ts), None, 0)


# --- layout ------------------------------------------------------------------------------------------------------
def ring_bytes(entries: int) -> int:
    """Size of the ring file of ``entries`` entries: header, SQ (128 bytes each), CQ (64 bytes each)."""
    return HEADER_BYTES + entries * SQE_BYTES + entries * CQE_BYTES


class Region:
    """A registered region as an SQE names it: daemon-assigned ``id`` and ``generation``, its ``bytes``."""

    __slots__ = ("id", "generation", "bytes")

    def __init__(self, id: int, generation: int, nbytes: int):
        self.id = int(id)
        self.generation = int(generation)
        self.bytes = int(nbytes)

    def __repr__(self) -> str:
        return f"Region(id={self.id}, generation={self.generation}, bytes={self.bytes})"


_NO_SHAPE = (0, 0, 0, 0, 0, 0)


def sqe(op: int, flags: int = 0, *, codec: int = 0, dtype: int = 0, shape: Sequence[int] = (), sm_budget: int = 0,
        stream: int = 0, src: tuple[Region, int, int] | None = None, dst: tuple[Region, int, int] | None = None,
        wait_value: int = 0, signal_value: int = 0) -> tuple:
    """The fields of one SQE after ``user_data`` (which :meth:`Ring.submit` assigns), for :data:`SQE`.

    ``src``/``dst``: (region, offset, bytes). ``shape``: the frame's shape (compress; at most :data:`MAX_NDIM`).
    ``LINK`` is set by :meth:`Ring.submit` for every SQE of a batch but its last; pass the other flags."""
    ndim = len(shape)
    if ndim > MAX_NDIM:
        raise ValueError(f"an SQE describes at most {MAX_NDIM} dimensions, not {ndim}")
    s_id = s_gen = s_off = s_n = d_id = d_gen = d_off = d_n = 0
    if src is not None:
        s_id, s_gen, s_off, s_n = src[0].id, src[0].generation, src[1], src[2]
    if dst is not None:
        d_id, d_gen, d_off, d_n = dst[0].id, dst[0].generation, dst[1], dst[2]
    dims = (*shape, *_NO_SHAPE[ndim:]) if ndim else _NO_SHAPE
    return (op, flags, codec, dtype, ndim, sm_budget, stream, s_id, s_gen, s_off, s_n, d_id, d_gen, d_off, d_n,
            *dims, wait_value, signal_value)


class RingClosed(DaemonUnavailableError):
    """The ring stopped serving (closed or broken by the daemon, or the daemon went away)."""


# --- handles -----------------------------------------------------------------------------------------------------
class Handle(concurrent.futures.Future):
    """A request in flight: what ``Client.compress_async`` / ``decompress_async`` return.

    A :class:`concurrent.futures.Future` (``result(timeout)``, ``exception()``, ``done()``, ``add_done_callback``,
    :func:`concurrent.futures.wait` all work), plus :meth:`wait`. It cannot be cancelled once made (the request is
    already submitted): ``cancel()`` returns False.

    Who completes it: a thread that calls :meth:`result` (or :meth:`wait` on a CPU request) reaps the ring's
    completions itself (a short spin, then a futex wait); requests nobody waits for are completed by the ring's
    background reaper within about a millisecond.
    """

    def __init__(self, ring: "Ring | None" = None, n: int = 0, finish: Callable[[list], Any] | None = None,
                 on_wait: Callable[[Any], None] | None = None):
        super().__init__()
        # What set_running_or_notify_cancel() does to a new Future (nobody waits on it yet, it cannot be cancelled),
        # without taking its condition's lock.
        self._state = _futures_base.RUNNING
        self._ring = ring
        self._n = n
        self._left = n
        self._cqes: list = [None] * n
        self._finish = finish
        self._on_wait = on_wait
        self._ran = False
        #: The request's id on its ring (``user_data`` of its k-th SQE: ``ud + k``; 0 without a ring).
        self.ud = ring.new_ud() if ring is not None else 0

    # The completion records of this request, in submission order: (status, codec, result, message) each.
    @property
    def cqes(self) -> list:
        return list(self._cqes)

    def cancel(self) -> bool:
        return False

    def _drive(self, timeout: float | None) -> None:
        if self._ring is not None and not self.done():
            self._ring.wait_for(self, timeout)

    def result(self, timeout: float | None = None):
        """The request's host values (the same as the blocking call's return value), reaping completions while it
        waits. Raises what the blocking call raises, or concurrent.futures.TimeoutError after ``timeout`` s."""
        self._drive(timeout)
        return super().result(timeout)

    def exception(self, timeout: float | None = None):
        self._drive(timeout)
        return super().exception(timeout)

    def wait(self, stream=None) -> None:
        """Orders ``stream`` (a torch.cuda.Stream; default: the current stream of the request's GPU) after the request.

        GPU requests through the ring: a GPU-side wait (``cuStreamWaitValue64`` on the ring's done flag), no CPU
        wait: work queued on ``stream`` afterwards sees the daemon's results (decompressed tensors: the handle's
        outputs). CPU requests, and requests through ZeroMQ: waits on the host for the request (as :meth:`result`,
        without raising; the outputs of a ZeroMQ GPU request are then ordered on the stream).
        """
        if self._on_wait is not None:
            self._on_wait(stream)
            return
        concurrent.futures.wait([self])

    def _complete(self, error: BaseException | None = None) -> None:
        """Runs the request's finishing step (outside the ring's lock) and settles the Future, once."""
        if self._ran:
            return
        self._ran = True
        try:
            if error is not None and self._finish is None:
                raise error
            value = self._finish(self._cqes if error is None else error) if self._finish is not None else list(self._cqes)
        except BaseException as e:  # noqa: BLE001 - handed to the caller through the Future
            if not self.done():
                self.set_exception(e)
            return
        if not self.done():
            self.set_result(value)

    @staticmethod
    def error_of(cqes: list, what: str = "") -> TzipDaemonError | None:
        """The TzipDaemonError of the first failed completion (``index``: its position), else None."""
        for k, c in enumerate(cqes):
            if c is not None and c[0] != 0:
                return status_error(c[0], c[3], k, what)
        return None


def status_error(status: int, message: str, index: int | None = None, what: str = "") -> TzipDaemonError:
    """The exception of a CQE's status (a value of src/errors.json) and message."""
    name = _NAME_OF_CODE.get(status)
    if name is None:
        return TzipDaemonError("TZIP_PROTOCOL", f"{what}the ring answered an unknown status {status}: {message}", index)
    return TzipDaemonError(name, f"{what}{message}" if message else f"{what}{name.lower().removeprefix('tzip_').replace('_', ' ')}",
                           index)


# --- the ring ----------------------------------------------------------------------------------------------------
def _unlink(path: str, pid: int | None = None) -> None:
    if pid is not None and os.getpid() != pid:
        return  # a forked child exiting: the file is the parent's
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


#: Seconds a thread waiting for a ring completion polls ``cq_head`` before it sleeps on the futex: 2 ms, as the
#: daemon's threads poll GPU work; a futex wake-up costs tens of microseconds on a VM, more than most small requests
#: take (docs/benchmarks.md, "Daemon fast lane").
DEFAULT_SPIN_S = 2e-3


class Ring:
    """One ring file, mapped, and the client's state of it (see the module docstring).

    ``name``: the file's name under /dev/shm (the session's prefix + ``ring-<n>``); ``entries``: a power of two in
    [8, 4096]; ``alive()``: whether the daemon still runs (asked every ``check_s`` while waiting); ``spin_s``: how
    long a waiting thread polls ``cq_head`` before it sleeps on the futex (seconds; :data:`DEFAULT_SPIN_S`);
    ``max_batch``: most SQEs of one
    LINKed batch (hello's ``ring.max_batch``). Thread-safe. The file is removed by :meth:`close` (or when the Ring
    is garbage collected).

    Raises OSError when the file cannot be made (e.g. a full /dev/shm).
    """

    SLEEP_SLICE_S = 0.05
    REAPER_POLL_S = 0.0005
    #: How often a waiting thread asks whether the daemon still lives and the ring still serves, s.
    CHECK_S = 0.1

    def __init__(self, name: str, entries: int, alive: Callable[[], bool] = lambda: True, *, spin_s: float = DEFAULT_SPIN_S,
                 max_batch: int = _generated.RING_MAX_BATCH, shm_dir: str = "/dev/shm"):
        lo, hi = _generated.RING_MIN_ENTRIES, _generated.RING_MAX_ENTRIES
        if entries < lo or entries > hi or entries & (entries - 1):
            raise ValueError(f"ring entries are a power of two in [{lo}, {hi}], not {entries}")
        if "/" in name or not name:
            raise ValueError(f"bad ring file name {name!r}")
        self.name = name
        self.entries = entries
        self.path = os.path.join(shm_dir, name)
        self.size = ring_bytes(entries)
        self.spin_s = float(spin_s)
        self.max_batch = max(1, min(int(max_batch), entries))
        self.id: int | None = None  # the daemon's ring id (ring_open)
        self.sid: str | None = None  # the session it belongs to
        self.device: int | None = None  # the CUDA index it serves (None: CPU only)
        self.regions: dict[Any, Region] = {}  # the client's cache of registered regions (client.py's keys)
        self.segments = SegmentTable()  # the caller's CUDA allocations registered on it (GPU rings)
        self._alive = alive
        self._mask = entries - 1
        self._sq_base = HEADER_BYTES
        self._cq_base = HEADER_BYTES + entries * SQE_BYTES
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, self.size)
            try:
                os.posix_fallocate(fd, 0, self.size)  # a write into a hole of a full /dev/shm would SIGBUS us
            except OSError as e:
                if e.errno in (errno.ENOSPC, errno.ENOMEM):
                    raise OSError(e.errno, f"no room in {shm_dir} for a ring of {self.size} bytes", self.path) from None
                raise
            mm = mmap.mmap(fd, self.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            _unlink(self.path)
            raise
        os.close(fd)
        self._mm = mm
        mm[OFF_MAGIC:OFF_MAGIC + 8] = MAGIC
        struct.pack_into("<I", mm, OFF_ENTRIES, entries)
        u32 = ctypes.c_uint32
        self._sq_head = u32.from_buffer(mm, OFF_SQ_HEAD)
        self._sq_tail = u32.from_buffer(mm, OFF_SQ_TAIL)
        self._sq_sleeping = u32.from_buffer(mm, OFF_SQ_SLEEPING)
        self._sq_doorbell = u32.from_buffer(mm, OFF_SQ_DOORBELL)
        self._cq_head = u32.from_buffer(mm, OFF_CQ_HEAD)
        self._state = u32.from_buffer(mm, OFF_STATE)
        self._cq_tail = u32.from_buffer(mm, OFF_CQ_TAIL)
        self._cq_waiting = u32.from_buffer(mm, OFF_CQ_WAITING)
        self._cq_doorbell = u32.from_buffer(mm, OFF_CQ_DOORBELL)
        self._produced = ctypes.c_uint64.from_buffer(mm, OFF_PRODUCED)
        self._done = ctypes.c_uint64.from_buffer(mm, OFF_DONE)
        #: Address of the mapping's first byte (the header page: cudaHostRegister'ed for the GPU ordering words).
        self.base = ctypes.addressof(self._sq_head) - OFF_SQ_HEAD
        #: Called (no arguments) before the file is unmapped (client.py: cudaHostUnregister of the header page).
        self.before_unmap: list[Callable[[], None]] = []
        self._sq_doorbell_addr = ctypes.addressof(self._sq_doorbell)
        self._cq_doorbell_addr = ctypes.addressof(self._cq_doorbell)
        self._head = 0  # sq_head as published (free-running)
        self._tail = 0  # cq_tail as published
        self._ids = itertools.count(1)  # request ids (the high 32 bits of user_data)
        self._pending: dict[int, Handle] = {}  # request id -> its handle, while any of its SQEs is unreaped
        self._unreaped = 0  # SQEs published whose CQE was not reaped
        self._reaper_idle = False  # the background reaper waits on the condition with nothing to do
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._reaping = False  # a thread holds the reaper role (sleeps on cq_doorbell, advances cq_tail)
        self._dead: BaseException | None = None
        self._reaper: threading.Thread | None = None
        self._next_check = 0.0
        self._pid = os.getpid()
        self._finalizer = weakref.finalize(self, _unlink, self.path, self._pid)

    # --- state -------------------------------------------------------------------------------------------------
    @property
    def state(self) -> str:
        """'serving', 'closed' or 'broken' (the daemon's word), or 'dead' (failed here: daemon gone, closed)."""
        if self._dead is not None:
            return "dead"
        s = self._state.value
        return {STATE_SERVING: "serving", STATE_CLOSED: "closed", STATE_BROKEN: "broken"}.get(s, f"state {s}")

    @property
    def usable(self) -> bool:
        return self._dead is None and self._state.value == STATE_SERVING

    @property
    def in_flight(self) -> int:
        """SQEs submitted whose completions were not reaped yet."""
        with self._lock:
            return self._unreaped

    def pending_handles(self) -> list[Handle]:
        """The handles of the requests whose completions are not all reaped yet."""
        with self._lock:
            return list(self._pending.values())

    def words(self) -> dict[str, int]:
        """The header's words as they are now (diagnostics, tests)."""
        return {"sq_head": self._sq_head.value, "sq_tail": self._sq_tail.value, "sq_sleeping": self._sq_sleeping.value,
                "sq_doorbell": self._sq_doorbell.value, "cq_head": self._cq_head.value, "state": self._state.value,
                "cq_tail": self._cq_tail.value, "cq_waiting": self._cq_waiting.value,
                "cq_doorbell": self._cq_doorbell.value, "produced": self._produced.value, "done": self._done.value}

    # --- submission --------------------------------------------------------------------------------------------
    def new_ud(self) -> int:
        """The ``user_data`` of a new request's first SQE (its k-th SQE: + k): a request id in the high 32 bits."""
        return (next(self._ids) & _M32) << 32

    def submit(self, batches: Sequence[Sequence[tuple]], handle: Handle) -> None:
        """Publishes ``batches`` (each a list of :func:`sqe` tuples, LINKed into one batch of the ring thread;
        longer ones are split at ``max_batch``) for ``handle`` (made with this ring and ``n`` = the number of SQEs),
        then rings the doorbell if the thread sleeps. Waits (reaping) while the ring has no room for a batch.

        Raises RingClosed when the ring no longer serves."""
        n = sum(len(b) for b in batches)
        buf = bytearray(n * SQE_BYTES)
        pack, ud, k = SQE.pack_into, handle.ud, 0
        for b in batches:
            last = len(b) - 1
            for j, fields in enumerate(b):
                if j < last:
                    fields = (fields[0], fields[1] | F_LINK, *fields[2:])
                pack(buf, k * SQE_BYTES, ud + k, *fields)
                k += 1
        self.submit_packed(buf, n, handle)

    def submit_packed(self, buf: bytearray, n: int, handle: Handle) -> None:
        """Publishes the ``n`` SQEs packed in ``buf`` (:data:`SQE` each; the k-th with ``user_data`` ``handle.ud +
        k``, and ``LINK`` on every one that continues its batch) for ``handle`` (made with this ring and ``n``
        SQEs), then rings the doorbell if the thread sleeps. A batch longer than ``max_batch`` is split there (the
        last SQE of each part loses its ``LINK``, as does the last of all). Waits (reaping) while the ring has no room
        for a part. Raises RingClosed when the ring no longer serves."""
        if n == 0:
            return
        step = self.max_batch
        for e in (*range(step - 1, n - 1, step), n - 1):
            buf[e * SQE_BYTES + SQE_OFF_FLAGS] &= ~F_LINK & 0xFF
        mv = memoryview(buf)
        for k in range(0, n, step):
            self._publish(mv, k, min(step, n - k), handle)
        self.ring_doorbell()

    def _publish(self, mv: memoryview, k0: int, n: int, handle: Handle) -> None:
        """Copies SQEs ``k0 .. k0 + n`` of ``mv`` (one chain) into the SQ and publishes them."""
        mm, mask, base, entries = self._mm, self._mask, self._sq_base, self.entries
        while True:
            with self._lock:
                if self._dead is not None:
                    raise RingClosed(str(self._dead))
                # Every SQE gets one CQE: with at most `entries` unreaped SQEs, neither queue can overflow.
                if self._unreaped + n <= entries:
                    self._pending[handle.ud >> 32] = handle
                    head = self._head
                    pos = head & mask
                    first = min(n, entries - pos)  # up to the SQ's end, the rest from its start
                    a = base + pos * SQE_BYTES
                    mm[a:a + first * SQE_BYTES] = mv[k0 * SQE_BYTES:(k0 + first) * SQE_BYTES]
                    if first < n:
                        mm[base:base + (n - first) * SQE_BYTES] = mv[(k0 + first) * SQE_BYTES:(k0 + n) * SQE_BYTES]
                    self._unreaped += n
                    self._head = (head + n) & _M32
                    # The SQEs' bytes are stored before the index: x86 keeps ordinary stores in order, and the barrier
                    # drains the non-temporal stores a large memcpy may use.
                    full_barrier()
                    self._sq_head.value = self._head
                    return
            # No room: the doorbell for what is queued, then reap something (or wait for whoever reaps).
            self.ring_doorbell()
            self._reap_some(time.monotonic() + self.SLEEP_SLICE_S)

    def ring_doorbell(self) -> None:
        """Wakes the ring thread if it sleeps: after the published ``sq_head``, a full barrier, then ``sq_sleeping``."""
        full_barrier()
        if self._sq_sleeping.value:
            self._sq_doorbell.value = (self._sq_doorbell.value + 1) & _M32
            futex_wake(self._sq_doorbell_addr, 1)

    # --- completion --------------------------------------------------------------------------------------------
    def wait_for(self, handle: Handle, timeout: float | None = None) -> None:
        """Returns once ``handle`` is done (its finishing step ran), reaping for every request of the ring meanwhile.
        Raises concurrent.futures.TimeoutError after ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not handle.done():
            if handle._left == 0:
                # Every completion is in; another thread runs its finishing step.
                concurrent.futures.Future.result(handle, None if deadline is None else max(0.0, deadline - time.monotonic()))
                return
            if deadline is not None and time.monotonic() >= deadline:
                raise concurrent.futures.TimeoutError()
            slice_end = time.monotonic() + self.SLEEP_SLICE_S
            if deadline is not None:
                slice_end = min(slice_end, deadline)
            self._reap_some(slice_end, handle)

    def _reap_some(self, until: float, handle: Handle | None = None) -> None:
        """Takes the reaper role and reaps until ``handle`` (or, without one, anything) completed or ``until``; when
        another thread holds the role, waits for it to dispatch something instead."""
        with self._cv:
            if self._reaping:
                self._cv.wait(max(0.0, until - time.monotonic()))
                return
            self._reaping = True
        try:
            self._reap_until(until, handle)
        finally:
            with self._cv:
                self._reaping = False
                self._cv.notify_all()

    def _reap_until(self, until: float, handle: Handle | None) -> None:
        spin_end = time.monotonic() + self.spin_s
        while True:
            if self._drain() and (handle is None or handle._left == 0):
                return
            if handle is not None and handle._left == 0:
                return
            if self._dead is not None:
                return
            now = time.monotonic()
            if now >= until:
                return
            if now >= self._next_check:
                self._next_check = now + self.CHECK_S
                if self._check_dead():
                    return
            if now < spin_end:
                continue
            # Sleep on cq_doorbell: its value first, then cq_waiting = 1, a barrier, and a last look at cq_head (the
            # daemon bumps the doorbell after storing cq_head and then reading cq_waiting: one of the two sees the other).
            bell = self._cq_doorbell.value
            self._cq_waiting.value = 1
            full_barrier()
            if self._cq_head.value == self._tail and self._state.value == STATE_SERVING:
                futex_wait(self._cq_doorbell_addr, bell, max(1e-4, min(until - now, self.SLEEP_SLICE_S)))
            self._cq_waiting.value = 0

    def _drain(self) -> bool:
        """Reaps every CQE there is and finishes the requests they complete; True when there was any."""
        done: list[Handle] = []
        with self._lock:
            head = self._cq_head.value
            tail = self._tail
            n = (head - tail) & _M32
            if n == 0:
                return False
            if n > self.entries:
                self._kill_locked(RingClosed(f"ring {self.name}: cq_head {head} is {n} entries past cq_tail {tail} "
                                             f"(of {self.entries}); the ring is not usable"))
                done = []
            else:
                mm, unpack, mask, base, pending = self._mm, CQE.unpack_from, self._mask, self._cq_base, self._pending
                for i in range(n):
                    ud, status, codec, result, msg = unpack(mm, base + ((tail + i) & mask) * CQE_BYTES)
                    rid = ud >> 32
                    h = pending.get(rid)
                    k = ud & _M32
                    if h is None or k >= h._n or h._cqes[k] is not None:
                        continue  # not ours to know (a duplicate or a torn entry): nothing waits for it
                    h._cqes[k] = (status, codec, result, msg.split(b"\0", 1)[0].decode("ascii", "replace") if status else "")
                    self._unreaped -= 1
                    h._left -= 1
                    if h._left == 0:
                        del pending[rid]
                        done.append(h)
                self._tail = (tail + n) & _M32
                self._cq_tail.value = self._tail
        for h in done:
            h._complete()
        if self._dead is not None:
            self._fail_pending()
        return True

    def _check_dead(self) -> bool:
        """Whether the ring stopped serving (daemon gone, ring closed or broken): then its pending requests fail."""
        if self._dead is not None:
            return True
        state = self._state.value
        if state != STATE_SERVING:
            self._drain()  # completions written before it stopped still count
            why = "broken (an index out of range)" if state == STATE_BROKEN else "closed by the daemon"
            self.kill(RingClosed(f"the tzip daemon's ring {self.name} is {why}"))
            return True
        if not self._alive():
            self.kill(RingClosed("the tzip daemon went away"))
            return True
        return False

    def _kill_locked(self, err: BaseException) -> None:
        if self._dead is None:
            self._dead = err

    def kill(self, err: BaseException) -> None:
        """Stops using the ring: every pending request fails with ``err`` (a DaemonUnavailableError for the client's
        fallback), later submissions raise RingClosed."""
        with self._lock:
            self._kill_locked(err)
        self._fail_pending()
        with self._cv:
            self._cv.notify_all()

    def _fail_pending(self) -> None:
        with self._lock:
            handles = list(self._pending.values())
            self._pending.clear()
            self._unreaped = 0
            err = self._dead
        for h in handles:
            h._complete(err)

    # --- the background reaper ---------------------------------------------------------------------------------
    def watch(self) -> None:
        """Makes sure requests nobody waits for get completed (concurrent.futures.wait, done callbacks): starts the
        ring's background reaper once. It polls ``cq_head`` every REAPER_POLL_S while requests are pending and no
        other thread reaps, and sleeps on a condition otherwise."""
        if self._reaper is None:
            with self._lock:
                if self._reaper is None and self._dead is None:
                    self._reaper = threading.Thread(target=self._reaper_loop, name=f"tzip-ring-{self.name[-12:]}", daemon=True)
                    self._reaper.start()
        # Only a reaper that waits with nothing pending needs the nudge: it set _reaper_idle under the lock the
        # submission took to add its request, so a request added before that was seen by its check.
        if self._reaper_idle:
            with self._cv:
                self._cv.notify_all()

    def _reaper_loop(self) -> None:
        while True:
            with self._cv:
                while self._dead is None and (not self._pending or self._reaping):
                    self._reaper_idle = not self._pending
                    self._cv.wait(0.5)
                    self._reaper_idle = False
                if self._dead is not None:
                    return
                self._reaping = True
            try:
                self._drain()
                now = time.monotonic()
                if now >= self._next_check:
                    self._next_check = now + self.CHECK_S
                    self._check_dead()
            finally:
                with self._cv:
                    self._reaping = False
                    self._cv.notify_all()
            time.sleep(self.REAPER_POLL_S)
            if os.getpid() != self._pid:
                return

    # --- lifetime ----------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Fails what is pending (RingClosed), unmaps and removes the file. Call after ``ring_close`` (or once the
        session is gone)."""
        self.kill(RingClosed(f"ring {self.name} closed"))
        views = ("_sq_head", "_sq_tail", "_sq_sleeping", "_sq_doorbell", "_cq_head", "_state", "_cq_tail",
                 "_cq_waiting", "_cq_doorbell", "_produced", "_done")
        if os.getpid() == self._pid:
            for fn in self.before_unmap:
                try:
                    fn()
                except Exception:  # pragma: no cover - never keep a file because of it
                    pass
            self.before_unmap = []
        with self._lock:
            # Release the ctypes views first: an mmap with exported buffers cannot be closed.
            dummy = ctypes.c_uint32(STATE_CLOSED)
            for v in views:
                setattr(self, v, dummy if v not in ("_produced", "_done") else ctypes.c_uint64(0))
            try:
                self._mm.close()
            except BufferError:  # pragma: no cover - another view still alive: the GC unmaps it
                pass
        if os.getpid() == self._pid:
            self._finalizer()

    def __repr__(self) -> str:
        return f"<tzip Ring {self.name} id={self.id} entries={self.entries} {self.state}>"
