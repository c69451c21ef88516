"""Client of the tzip daemon: compress and decompress PyTorch tensors through it.

    import tzip.client as tz          # (tzip.connect once tzip/__init__.py exports it)
    with tz.connect() as client:
        ct = client.compress(weight)                     # CompressedTensor
        cts = client.compress([p.grad for p in params])  # one request for the whole batch
        again = client.decompress(ct)                    # bit-identical tensor
        fut = client.compress_async(bucket)              # concurrent.futures.Future

How tensor bytes travel (docs/protocol.md): never through the socket. The daemon maps POSIX
shared-memory files (/dev/shm) the client names in its requests, and opens the CUDA IPC handles
of GPU tensors (PyTorch's ``_share_cuda_``; see :mod:`tzip._cuda`).

* Zero copy for tensors already in shared memory: tensors made by :meth:`Client.empty` (or
  returned by :meth:`Client.decompress` for tensors of 1 MiB and more), and tensors PyTorch put
  in shared memory under the ``file_system`` sharing strategy. They must be contiguous.
* One copy otherwise: the tensor's values are copied into a per-client shared-memory arena
  (a pool of /dev/shm segments reused between requests; idle segments beyond 512 MiB are freed).
  Non-contiguous tensors are copied the same way: their values in C order are compressed, and
  the CompressedTensor records the shape (decompression gives a contiguous tensor).
* Frames come back into the arena and are copied once into the CompressedTensor's payload
  (compact: exactly the frame's size). Decompressed tensors of 1 MiB and more are written by the
  daemon straight into a new shared-memory tensor returned as it is; smaller ones are copied
  out of the arena. ``out=`` decompresses into your tensor (straight when it is in shared memory).
  The shared memory of a decompressed tensor is reused for a later result of about its size once
  every tensor over it is gone (idle segments beyond ``result_pool_keep_bytes``, 512 MiB, or idle
  for 30 s are freed): a fresh /dev/shm file costs its page faults in the daemon and here. Results
  that exist when the process forks are never reused (the child shares their pages).
* Shared-memory files reserve their pages when made (posix_fallocate). On a full /dev/shm the client
  frees its idle segments, has the daemon unmap removed files and tries again for a second; then the
  call raises OSError (ENOSPC) naming the size and ``docker run --shm-size``.

CUDA tensors stay on their GPU (the daemon finds the GPU by UUID):

* Contiguous tensors of ``gpu_share_min_bytes`` (1 MiB) and more are handed over where they are
  (a CUDA IPC handle of their storage, shared once per storage; views keep their storage offset).
  Smaller or non-contiguous ones are copied on the GPU into a per-client staging arena (one
  buffer per request, shared once; idle buffers beyond ``gpu_arena_keep_bytes``, 128 MiB per GPU,
  are freed). Frames are written by the daemon into the arena and copied into compact payloads on
  the same GPU; decompressed tensors of 1 MiB and more (new ones, or a contiguous ``out=``) are
  written in place, smaller ones (``out=`` included) copied out of the arena.
* Ordering is stream-ordered, never a device synchronisation: the client records an interprocess
  event on the current stream (the caller's stream for the async variants) after the inputs, the
  daemon's stream waits on it, and the current stream waits on the daemon's event before the
  outputs are used. A call returns once the daemon finished; the outputs are ready in stream order.
* PyTorch's IPC ref counter of each share is released by the client once the daemon answered, so
  memory PyTorch frees is really freed (see :mod:`tzip._cuda`). Tensors in expandable segments
  (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``) are refused with TZIP_UNSUPPORTED and the
  ways to share them.
* A daemon without GPUs (or without this GPU): compress falls back to raw frames (warning once;
  ``strict=True`` raises :class:`DeviceUnavailableError`), decompress goes through the CPU.
* :meth:`Client.release_gpu` tells the daemon to close its mappings of this client's GPU memory
  (after ``torch.cuda.empty_cache()``, so freed segments really go back to the driver).

Every dtype of a CPU or CUDA tensor is accepted (bool, integers, floats, bfloat16, complex, float8 and
the sub-byte/bits dtypes); quantized, sparse and meta tensors are refused. Bytes are copied through
integer views, so -0.0 and NaN payloads survive bit for bit.

When the daemon is away: with ``strict=True`` every call raises :class:`DaemonUnavailableError`.
Otherwise :meth:`Client.compress` returns uncompressed CompressedTensors (codec ``"raw"``, a
valid frame written here in Python) and warns once per outage; raw frames decompress here
without the daemon, other codecs need it (DaemonUnavailableError). The client reconnects on the
first call after the daemon is back; with ``spawn=True`` a daemon that died is started again within
the call (no fallback then). Nothing is ever silently altered: ``ct.codec`` says what was done.

A Client belongs to the process that made it (not usable after fork) and may be used from many
threads at once. Do not modify a tensor while a call that reads or writes it runs.

The submission ring (protocol version 4, docs/ring.md; :mod:`tzip._ring`): when hello offers ``ring``, requests go
through a shared-memory ring per session instead of ZeroMQ messages: one ring for CPU tensors and one per GPU, each a
file ``/dev/shm/<prefix>ring-<n>`` the daemon's native ring thread serves. A call becomes 128-byte SQEs naming
registered regions (the staging arena's segments, the result pool's and ``Client.empty``'s shared-memory files,
the GPU staging buffers: each registered once with ``ring_register``), one LINKed batch per call and device; the
calling thread publishes them and reaps their completions (a short spin, then a futex). CUDA tensors are copied into
the registered staging arena on the caller's stream; the ring's stream starts the batch once ``produced`` (written
with ``cuStreamWriteValue64`` after that copy) says so, and the caller's stream waits for ``done`` on the GPU
(``cuStreamWaitValue64``; :mod:`tzip._memops`) before the results are copied out. ``compress_async`` /
``decompress_async`` return a :class:`tzip._ring.Handle` (a Future with ``wait(stream)``). ZeroMQ stays for daemons
without the ring and for what an SQE cannot describe: tensors without bytes, frames of more than 6 dimensions,
PyTorch's ``file_system`` shared memory, GPU calls with ``sm_budget`` 0 or above 255 on a GPU of more than 255 SMs,
batches over 256 MiB of staging.
The daemon applies the job's settings to ring requests itself, from the reply of the ``set`` that changed them on.
:attr:`Client.ring_info` says what is open and why a ring was not.

Jobs (protocol version 3, daemons of tzip 0.1 with ``jobs``/``set``; older daemons are sent none of this): a
client tells the daemon which job it belongs to (:func:`job_info`: name, user, rank, world size, devices, MPS) in
its hello once it is attached or its job is named (``job=``, $TZIP_JOB), and with :meth:`Client.set_job` (what
``tzip.attach()`` / ``tzip.detach()`` call), again in every new session (after a daemon restart). Requests made
inside :func:`tagged` carry a stream tag (gradients, optimizer, checkpoint, sendrecv), so ``tzip jobs`` shows each
stream's bytes. Replies carry the job's settings (``tzip set JOB codec=...``): :attr:`Client.settings`; the
daemon applies them, and with ``codec="off"`` the integrations send plain data (:meth:`Client.job_codec`).

Where the code is: this module holds the Client's session (hello, reconnection, heartbeat, the job, the shared-memory
files and GPU handles released to the daemon), its public calls and how each call picks a path: the submission ring
(:mod:`tzip._ring_path`), else ZeroMQ requests for CPU tensors (:mod:`tzip._cpu_path`) and CUDA tensors
(:mod:`tzip._gpu_path`), else raw frames written here (:mod:`tzip._fallback`). :mod:`tzip._wire` builds every
descriptor those requests carry; :mod:`tzip._job` the job info, stream tags and SM budget.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import logging
import os
import secrets
import threading
import time
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch

from . import _ring, _shm
from ._call_args import (_into_outs, check_compress_args, check_decompress_args, compress_request, decompress_request,
                         frame_bound)
from ._codec_choice import CODECS
from ._cpu_path import DEDICATED_MIN_BYTES, RESULT_POOL_KEEP_BYTES
from ._dlpack import copy_into_bytes
from ._errors import DaemonSpawnError, DaemonUnavailableError, DeviceUnavailableError, OutOfMemoryError, TzipDaemonError
from ._gpu_path import GPU_ARENA_KEEP_BYTES, GPU_SHARE_MIN_BYTES, _Gpu
from ._heartbeat import Heartbeat
from ._job import MAX_SM_BUDGET, STREAMS, _stream_tag, job_info, tagged
from ._ring_one import RingOne
from ._request import Request
from ._ring_path import RING_ENTRIES, RING_SPIN_S, _done_handle, _raiser
from ._rings import Rings
from ._session import PROTOCOL_VERSIONS, RETRY_INTERVAL_S, Session
from ._spawn import default_ipc_path, default_socket_path, normalize_endpoint
from ._transport import Transport
from ._wire import MAX_STAGE_BYTES, _device
from ._zmq_path import ZmqPath
from .compressed import CompressedTensor

# Names other modules and tests import from here (tzip.client is where they were defined, and where tests patch
# copy_into_bytes: the code reading it stays in this module; PROTOCOL_VERSIONS and job_info are read, and patched, in
# tzip._session).
_REEXPORTED = (DEDICATED_MIN_BYTES, MAX_SM_BUDGET, MAX_STAGE_BYTES, RING_ENTRIES, RING_SPIN_S, RETRY_INTERVAL_S, _device,
               _stream_tag, DaemonSpawnError, OutOfMemoryError)

__all__ = [
    "Client",
    "connect",
    "CompressedTensor",
    "TzipDaemonError",
    "DaemonUnavailableError",
    "DaemonSpawnError",
    "DeviceUnavailableError",
    "OutOfMemoryError",
    "CODECS",
    "PROTOCOL_VERSIONS",
    "STREAMS",
    "job_info",
    "tagged",
]

_log = logging.getLogger("tzip")



def _settle_from(h: _ring.Handle, f: concurrent.futures.Future) -> None:
    """Settles ``h`` as the worker thread's future ``f`` ended."""
    e = f.exception()
    if e is not None:
        h.set_exception(e)
    else:
        h.set_result(f.result())


def _host_wait(h: _ring.Handle, streams: dict[int, Any] | None, stream) -> None:
    """wait(stream) of a request through ZeroMQ: on the host; then ``stream`` waits for the caller's stream of its GPU
    (where the worker ordered the outputs)."""
    concurrent.futures.wait([h])
    if stream is None or not streams:
        return
    src = streams.get(stream.device.index if stream.device.index is not None else 0)
    if src is not None and src != stream:
        ev = torch.cuda.Event()
        ev.record(src)
        stream.wait_event(ev)


def _curve_keys(curve_dir: str | None) -> tuple[bytes, bytes, bytes]:
    """The CURVE keys for the daemon's TCP socket: ``server.public``, ``client.public`` and ``client.secret`` (Z85)
    from ``curve_dir``, else $TZIP_CURVE_DIR, else the ``curve/`` folder next to the default socket (the daemon
    creates them there, mode 0600 in a 0700 folder). Raises DaemonUnavailableError when they cannot be read."""
    # TZIP_SOCKET may itself be the tcp:// endpoint: the keys are then next to the default ipc socket.
    near = default_socket_path()
    if near.startswith("tcp://"):
        near = default_ipc_path()
    d = curve_dir or os.environ.get("TZIP_CURVE_DIR") or os.path.join(os.path.dirname(near), "curve")
    try:
        return tuple(Path(d, name).read_bytes().strip() for name in ("server.public", "client.public", "client.secret"))
    except OSError as e:
        raise DaemonUnavailableError(f"cannot read the daemon's CURVE keys in {d} (start `tzip serve --tcp PORT` "
                                     f"first, or pass curve_dir=): {e}") from None


class Client(RingOne, ZmqPath):
    """A connection to the tzip daemon (see the module docstring). Use :func:`connect` to make one.

    The session with the daemon is a :class:`tzip._session.Session` of its own; the request routes are its parts
    (:class:`tzip._ring_path.RingPath` with the lean single-tensor GPU calls of :class:`tzip._ring_one.RingOne`, and
    :class:`tzip._zmq_path.ZmqPath` over :class:`tzip._cpu_path.CpuPath` and :class:`tzip._gpu_path.GpuPath`): they
    use the session and the state this class makes in ``__init__``."""

    def __init__(self, socket: str | None = None, spawn: bool = True, strict: bool = False, *, name: str | None = None,
                 connect_timeout: float = 10.0, request_timeout: float | None = None, workers: int = 4,
                 gpu_share_min_bytes: int = GPU_SHARE_MIN_BYTES, gpu_arena_keep_bytes: int = GPU_ARENA_KEEP_BYTES,
                 result_pool_keep_bytes: int = RESULT_POOL_KEEP_BYTES, curve_dir: str | None = None,
                 job: str | None = None, ring_entries: int = RING_ENTRIES, ring_spin_s: float = RING_SPIN_S):
        # The endpoint as users write it (a path, ipc:///abs/path, tcp://127.0.0.1:PORT), in one form. A tcp://
        # endpoint: the daemon's CURVE-only TCP socket on this host (shared memory and CUDA IPC handles still need
        # the same machine). No spawning, and liveness comes from request timeouts only.
        self.socket_path = normalize_endpoint(os.fspath(socket)) if socket else default_socket_path()
        self._tcp = self.socket_path.startswith("tcp://")
        curve = _curve_keys(curve_dir) if self._tcp else None
        self.strict = strict
        self.name = (name or f"python pid {os.getpid()}")[:200]
        self._pid = os.getpid()
        self.shm_prefix = f"tzip-{self._pid}-{secrets.token_hex(8)}-"
        self._session = Session(self.socket_path, Transport(self.socket_path, curve), tcp=self._tcp,
                                spawn=spawn and not self._tcp,
                                name=self.name, pid=self._pid, shm_prefix=self.shm_prefix,
                                connect_timeout=connect_timeout, request_timeout=request_timeout, job=job,
                                on_session=self._on_session)
        self._lock = self._session.lock  # the client's lazily made parts (executor, GPU state) share it
        self._release_lock = threading.RLock()  # finalizers (garbage collection) take it too
        # Protocol version 4 (docs/ring.md): this session's submission rings, opened on first use.
        self._rings = Rings(self._session, self.shm_prefix, ring_entries, ring_spin_s, self._release_lock,
                            self._open_gpu_ring)
        # (the heartbeat is made below: the arena's callbacks look it up when they run)
        self._arena = _shm.Arena(self.shm_prefix, lambda name: self._heartbeat.queue_release(name),
                                 on_full=lambda: self._heartbeat.make_room())
        self._results = _shm.ResultPool(self._arena, result_pool_keep_bytes)
        self._heartbeat = Heartbeat(self._session, self._rings, self._arena, self._results, self._release_lock,
                                    self._sweep_segments)
        self._wake = self._heartbeat.wake
        self._closed = False
        self._workers = workers
        self.gpu_share_min_bytes = int(gpu_share_min_bytes)
        self.gpu_arena_keep_bytes = int(gpu_arena_keep_bytes)
        self._gpus: dict[int, _Gpu] = {}
        self._shares: Any = None  # _cuda.ShareCache, made on first GPU use
        self._gpu_handles: dict[bytes, None] = {}  # CUDA IPC handles sent to the daemon (for release_gpu)
        self._gpu_unreachable: set[str] = set()
        self._gpu_warned: set[str] = set()
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        if not self._session.ensure(force=True):
            if strict:
                err = self._session.unavailable()
                self.close()
                raise err
            self._session.warn_fallback()

    # --- connection ---------------------------------------------------------------------------
    @property
    def spawn(self) -> bool:
        """Whether a call starts a daemon when none serves (never for a tcp:// endpoint)."""
        return self._session.spawn

    @spawn.setter
    def spawn(self, value: bool) -> None:
        self._session.spawn = bool(value) and not self._tcp

    @property
    def connect_timeout(self) -> float:
        """Seconds a hello (and the ring and job requests) may take."""
        return self._session.connect_timeout

    @connect_timeout.setter
    def connect_timeout(self, value: float) -> None:
        self._session.connect_timeout = value

    @property
    def request_timeout(self) -> float | None:
        """Seconds a request may take (None: until it ends or the daemon goes away)."""
        return self._session.request_timeout

    @request_timeout.setter
    def request_timeout(self, value: float | None) -> None:
        self._session.request_timeout = value

    @property
    def connected(self) -> bool:
        """Whether a session with a daemon is open (False while falling back)."""
        return self._session.sid is not None

    @property
    def daemon_info(self) -> dict[str, Any]:
        """What the daemon said about itself at hello (pid, version, format_version, gpu, ...)."""
        return dict(self._session.daemon)

    @property
    def protocol_version(self) -> int:
        """The protocol version of the current (or last) session: 1 to 4."""
        return self._session.version

    @property
    def ring_info(self) -> dict[str, Any]:
        """The submission rings of this session (protocol version 4, docs/ring.md): ``offered`` (hello's ``ring``
        capability, or None: requests go through ZeroMQ), ``rings`` (what each open ring serves: ``"cpu"`` or
        ``"cuda:N"`` -> its daemon id, state, entries and registered regions) and ``refused`` (why a ring could not be
        opened, by what it would serve)."""
        return self._rings.info()

    @property
    def settings(self) -> dict[str, Any]:
        """The job's settings as the daemon's last reply said them (protocol version 3; ``tzip set``): ``codec``
        ("fast", "max", "auto", "off" or None: the caller's) and ``sm_budget`` (SMs per request, 0: all, or None:
        the daemon's default). The daemon applies them to every request of this session; ``codec == "off"`` also
        tells the integrations to send their data plain (:meth:`job_codec`). A request or heartbeat (every few
        seconds) brings a change; both are None with an older daemon or while it is away."""
        return dict(self._session.settings)

    def job_codec(self, codec: str) -> str:
        """The codec an integration should use in place of ``codec`` under the job's settings: "raw" (plain data)
        when the job's codec is "off", else ``codec`` (a "fast", "max" or "auto" setting is applied by the daemon
        to every request it receives)."""
        return "raw" if self._session.settings.get("codec") == "off" else codec

    @property
    def job(self) -> dict[str, Any]:
        """The job info this client sends the daemon (:func:`job_info`) and ``attached``."""
        return self._session.job()

    def set_job(self, attached: bool, name: str | None = None, devices: Iterable[torch.device] = ()) -> dict[str, Any]:
        """Tells the daemon this process's job and whether its integrations are on (``tzip.attach()``: True,
        ``tzip.detach()``: False) with the ``job`` op, now if a session is open, else at the next hello; the daemon
        then counts this session's requests under the job (``tzip jobs``) and applies the job's settings. ``name``
        replaces the job's name (see :func:`job_info`); ``devices`` are added to the job's devices.

        Returns the job's settings (:attr:`settings`; both None with a daemon older than protocol version 3,
        which is sent nothing). Raises TzipDaemonError when the daemon refuses the job (an invalid name).
        A daemon away is not an error (the job is sent once it is back)."""
        self._check_pid()
        self._session.set_job(attached, name, devices)
        return self.settings

    def _on_session(self, reply: dict[str, Any], version: int) -> None:
        """A new session (Session's hello, under its lock, before its id is published): what the last session had
        mapped is gone, its rings with it; the new one's ring capability (protocol version 4) comes from ``reply``."""
        with self._release_lock:
            self._heartbeat.new_session()  # the new session has mapped nothing yet
            self._gpu_handles.clear()  # a new session has opened none of them
        self._gpu_unreachable.clear()
        self._gpu_warned.clear()
        caps = reply.get("ring") if version >= 4 else None
        # the last session's rings are put aside (the daemon closed them with it)
        self._rings.new_session(dict(caps) if isinstance(caps, dict) else None)
        self._heartbeat.start()

    def _check_pid(self) -> None:
        if os.getpid() != self._pid:
            raise RuntimeError("a tzip Client cannot be used after fork(); call tzip.connect() in the child")
        if self._closed:
            raise RuntimeError("this tzip Client is closed")

    # --- daemon requests ----------------------------------------------------------------------
    def ping(self) -> float:
        """Round-trip time of an empty request (heartbeat), seconds."""
        self._check_pid()
        t = time.perf_counter()
        self._session.call("heartbeat", {})
        return time.perf_counter() - t

    def stats(self) -> dict[str, Any]:
        """The daemon's counters (and this session's, under ``session``)."""
        self._check_pid()
        return self._session.call("stats", {})

    def shutdown_daemon(self) -> None:
        """Asks the daemon to stop (it finishes the requests in flight first)."""
        self._check_pid()
        self._session.call("shutdown", {})
        self._session.mark_down(self._session.sid, DaemonUnavailableError("the daemon was shut down"))

    # --- shared-memory tensors ----------------------------------------------------------------
    def empty(self, shape: Sequence[int] | torch.Size, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """An uninitialised CPU tensor in shared memory: compressing it (or decompressing into it) copies nothing."""
        self._check_pid()
        shape = tuple(int(d) for d in shape)
        nbytes = 1
        for d in shape:
            nbytes *= d
        nbytes *= dtype.itemsize
        return self._arena.segment(max(nbytes, 1), "t").tensor(dtype, shape)

    @staticmethod
    def _copy_in(seg: _shm.Segment, off: int, t: torch.Tensor, nbytes: int) -> None:
        """Writes ``t``'s values in C order at ``off`` of ``seg``: every staging copy of a CPU tensor's values (the
        ZeroMQ and ring paths). One memmove when contiguous (a few numpy and torch views cost more than the copy for
        small tensors), else through the integer views. It stays in this module: tests count the staging copies
        through ``tzip.client.copy_into_bytes``."""
        if t.is_contiguous() and not t.is_conj() and not t.is_neg():
            ctypes.memmove(seg.base + off, t.data_ptr(), nbytes)
        else:
            copy_into_bytes(seg.u8[off : off + nbytes], t)

    # --- compress -----------------------------------------------------------------------------
    def compress(self, tensors: torch.Tensor | Iterable[torch.Tensor], codec: str | None = None, *, sm_budget: int | None = None,
                 out=None):
        """Compresses one tensor (-> CompressedTensor) or a batch (-> list, one request per batch and device where it
        fits). A CUDA tensor's payload stays on its GPU.

        Args:
            tensors: a tensor or an iterable of tensors, any shape and dtype, on the CPU or a GPU; views keep their
                storage offset, non-contiguous tensors are compressed as their contiguous values, lazy conjugate and
                negative views (``conj()`` of a complex tensor) as their values.
            codec: 'auto' | 'fast' | 'max' | 'bytes' | 'raw' (docs/format.md), or None (default): 'fast' for CUDA
                tensors (the codec that keeps pace with a network link on the GPU), 'auto' for CPU tensors
                (tzip._codec_choice says why, with the figures). A job's codec setting wins over both.
            sm_budget: SMs the daemon's GPU kernels may occupy for this call (0: all SMs of the device); None: the
                daemon's budget (``tzip serve --sm-budget``, default 10). A job's own budget (``tzip set JOB
                sm_budget=N``) wins over it (docs/protocol.md, "Jobs"). Protocol version 3; older daemons ignore it.
            out: where the frame goes: a contiguous 1-D uint8 tensor on the input's device of at least
                :meth:`frame_bound` bytes (for a batch: a list with such a tensor or None per input), apart from the
                inputs and from each other. The payload returned is ``out[:frame bytes]``, a view, so a buffer kept
                across calls (a DDP bucket's) spares an allocation per call; being a view, it changes when out is
                written again, and ``torch.save`` of it writes out's whole storage. CUDA tensors through the
                submission ring have their frames written there by the daemon; other calls (CPU tensors, requests of
                more than 256 MiB, which go through ZeroMQ) copy the frame in (docs/ring.md, "The caller's GPU
                memory"). The caller's work queued on the current stream before the call (e.g. a send of the previous
                frame) finishes before the frame is written. :meth:`compress_async` takes no ``out``.

        Returns:
            CompressedTensor (payload: a uint8 tensor on the input's device, a view of ``out`` when given) or a list.

        Raises:
            ValueError: unknown codec, an sm_budget that is not an int in 0..1024, an ``out`` that is too small, not a
                contiguous 1-D uint8 tensor on the input's device, made in inference mode (outside it), or shares
                memory with an input or another out.
            TypeError: an item that is not a tensor, or one tensor as ``out`` of a batch.
            TzipDaemonError: the daemon refused a tensor (its ``code``: e.g. TZIP_INVALID_ARGUMENT).
            DaemonUnavailableError / DeviceUnavailableError: with ``strict=True`` only, when the daemon is gone or
                cannot serve the tensor's GPU (otherwise raw frames, and one warning).
        """
        self._check_pid()
        return self._compress(compress_request(tensors, codec, sm_budget, out))

    frame_bound = staticmethod(frame_bound)

    def compress_async(self, tensors, codec: str | None = None, *, sm_budget: int | None = None) -> _ring.Handle:
        """:meth:`compress` without waiting: returns a :class:`tzip._ring.Handle`, a concurrent.futures.Future of
        what :meth:`compress` returns, with ``wait(stream=None)``.

        Through the submission ring (protocol version 4): submitted on the calling thread (a few microseconds);
        ``result()`` reaps the completion. CUDA tensors: their bytes are read after the work queued so far on the
        caller's current stream (a ``cuStreamWriteValue64`` the daemon's stream waits for, no CPU wait);
        ``wait(stream)`` makes ``stream`` wait on the GPU for the frames; ``result()`` gives CompressedTensors whose
        payloads are ready in the caller's stream order. The tensors are copied in the caller's stream order at
        submission, so the caller may write them right away (the blocking :meth:`compress` lets the daemon read them
        in place instead: docs/ring.md "The caller's GPU memory"). Otherwise (ZeroMQ): the call runs on the client's
        worker threads, ordered the same way; ``wait(stream)`` then waits on the host.

        Raises: as :meth:`compress`, from ``result()`` (an invalid ``sm_budget`` at once)."""
        self._check_pid()
        req = compress_request(tensors, codec, sm_budget, asynchronous=True)
        try:
            handle = self._compress_start_call(req)
        except (ValueError, TypeError, TzipDaemonError) as e:
            return _done_handle(_raiser(e), None)
        if handle is not None:
            return handle
        return self._pool_handle(req.streams, self._compress_zmq, req)

    def _compress_start_call(self, req: Request) -> _ring.Handle | None:
        """Checks the call's arguments and submits it through the ring when it can (else None)."""
        check_compress_args(req.items, req.codec)
        if not self._rings.usable:
            return None
        h = self._compress_submit(req)
        if h is not None and len(self._rings):
            for r in list(self._rings.values()):
                r.watch()  # completions nobody waits for (concurrent.futures.wait) are reaped in the background
        return h

    def _pool_handle(self, streams: dict[int, Any] | None, fn, *args) -> _ring.Handle:
        """``fn(*args)`` on the worker threads as a Handle (the request in ``args`` carries the call's context)."""
        fut = self._pool().submit(fn, *args)
        h = _ring.Handle(on_wait=lambda s: _host_wait(h, streams, s))
        fut.add_done_callback(lambda f: _settle_from(h, f))
        return h

    def _compress(self, req: Request):
        """Serves the blocking call ``req`` by the first route that takes it, each asked once: the one-tensor ring
        path (one CUDA tensor), the general ring path, else ZeroMQ (:meth:`_compress_zmq`). A ring route that took the
        call and cannot finish it hands the same request to :meth:`_compress_zmq` itself."""
        self._check_pid()
        check_compress_args(req.items, req.codec)
        if self._rings.usable:
            if req.single and req.streams is None and req.items[0].is_cuda:
                one = self._compress_one(req)
                if one is not None:
                    return one
            h = self._compress_submit(req, blocking=True)
            if h is not None:
                return _into_outs(self._wait_handle(h), req.outs, req.single)
        return self._compress_zmq(req)

    # --- decompress ---------------------------------------------------------------------------
    def decompress(self, cts: CompressedTensor | Iterable[CompressedTensor], out=None, verify: bool = True, *,
                   sm_budget: int | None = None):
        """Decompresses one CompressedTensor (-> tensor) or a batch (-> list).

        ``out``: a tensor (or, for a batch, a list with tensors or None) of the same dtype and shape to
        write into; returned filled. The result lies on ``out``'s device, else on the payload's device.
        ``verify``: check every chunk's digest (docs/format.md, section 9; default True).
        ``sm_budget``: as for :meth:`compress`.
        Frames of codec ``raw`` are decoded in this process without the daemon (always when the result goes to the
        CPU; for a GPU result when the daemon cannot serve that GPU); other codecs need the daemon.

        Raises:
            ValueError: ``out`` of another dtype, shape or length than the frames. TypeError: an item that is not a
                CompressedTensor (e.g. bytes: use CompressedTensor.from_bytes), or one tensor as ``out`` of a batch.
            TzipDaemonError: a corrupt frame (``code`` TZIP_CORRUPT, TZIP_TRUNCATED, TZIP_CHECKSUM, TZIP_UNSUPPORTED)
                or another refusal of the daemon.
            DaemonUnavailableError / DeviceUnavailableError: a non-raw frame and no daemon (or no daemon GPU) to
                decode it.
        """
        self._check_pid()
        return self._decompress(decompress_request(cts, out, verify, sm_budget))

    def decompress_async(self, cts, out=None, verify: bool = True, *, sm_budget: int | None = None) -> _ring.Handle:
        """:meth:`decompress` without waiting: returns a :class:`tzip._ring.Handle`, a concurrent.futures.Future of
        what :meth:`decompress` returns, with ``wait(stream=None)``.

        Through the submission ring (protocol version 4), for CUDA results: the frames are read after the work
        queued so far on the caller's current stream, ``wait(stream)`` makes ``stream`` wait on the GPU (no CPU wait)
        and then copy the results into place: tensors used on ``stream`` afterwards hold the decompressed values
        (the tensors are ``result()``'s; a failed request raises from ``result()``). The daemon reads the frames where
        they are (do not change a CompressedTensor's payload until the handle is done) and writes new results in
        place; ``out=`` tensors are written in stream order once it is done. Otherwise (ZeroMQ, CPU): as
        :meth:`compress_async`.

        Raises: as :meth:`decompress`, from ``result()`` (argument errors at once)."""
        self._check_pid()
        req = decompress_request(cts, out, verify, sm_budget, asynchronous=True)
        try:
            handle = self._decompress_start_call(req)
        except (ValueError, TypeError, TzipDaemonError) as e:
            return _done_handle(_raiser(e), None)
        if handle is not None:
            return handle
        return self._pool_handle(req.streams, self._decompress_zmq, req)

    def _decompress_start_call(self, req: Request) -> _ring.Handle | None:
        check_decompress_args(req.items, req.outs)
        if not self._rings.usable or not self._ring_worth(req.items, req.outs):
            return None
        h = self._decompress_submit(req)
        if h is not None:
            for r in list(self._rings.values()):
                r.watch()
        return h

    def _decompress(self, req: Request):
        """Serves the blocking call ``req`` as :meth:`_compress` does: the one-frame ring path, the general ring path,
        else :meth:`_decompress_zmq`."""
        self._check_pid()
        check_decompress_args(req.items, req.outs)
        if self._rings.usable and self._ring_worth(req.items, req.outs):
            if req.single and req.streams is None:
                one = self._decompress_one(req)
                if one is not None:
                    return one
            h = self._decompress_submit(req, blocking=True)
            if h is not None:
                return self._wait_handle(h)
        return self._decompress_zmq(req)

    # --- lifetime -------------------------------------------------------------------------------
    def _pool(self) -> concurrent.futures.ThreadPoolExecutor:
        self._check_pid()
        with self._lock:
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(self._workers, thread_name_prefix="tzip-client")
            return self._executor

    def close(self) -> None:
        """Ends the session (the daemon drops this client's mappings), frees the arena, closes the sockets. Requests
        still in flight (``compress_async``/``decompress_async``) are finished first, through ZeroMQ as through the
        ring, waiting at most ``request_timeout`` for the ring's (None: until they end, or the daemon does)."""
        if self._closed or os.getpid() != self._pid:
            return
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        self._rings.wait_in_flight(self.request_timeout)
        self._session.closing = True  # the heartbeat thread sends nothing more and opens no session after the goodbye
        self._wake.set()
        rings = self._rings.close_in_daemon()
        if self._session.sid is not None:
            try:
                self._session.call("release", {"end": True}, timeout=2.0)
            except (DaemonUnavailableError, TzipDaemonError):
                pass
        for ring in rings:
            ring.close()  # the daemon unmapped it (ring_close, or the session's end): the file goes
        self._rings.close_retired()
        # A request of the heartbeat thread still waiting gives up within one poll; only then are the sockets closed
        # (closing a socket another thread waits on aborts the process inside libzmq).
        self._session.transport.interrupt()
        self._heartbeat.stop()
        self._closed = True
        self._session.sid = None
        self._arena.close()
        self._results.close()
        for g in self._gpus.values():
            g.arena.close()
            g.events.clear()
            g.daemon_events.clear()
        if self._shares is not None:
            self._shares.clear()
        self._session.transport.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "connected" if self.connected else "not connected (fallback)" if not self.strict else "not connected"
        return f"<tzip Client {self.socket_path} {state}>"


def connect(socket: str | None = None, spawn: bool = True, strict: bool = False, **kwargs) -> Client:
    """Connects to the tzip daemon on ``socket`` (default: $TZIP_SOCKET, $XDG_RUNTIME_DIR/tzip/tzip.sock,
    /tmp/tzip-$UID/tzip.sock), starting one when none runs and ``spawn`` is true. ``socket`` is a path (made
    absolute), ``ipc:///abs/path`` or ``tcp://127.0.0.1:PORT`` (:func:`tzip._spawn.normalize_endpoint`; ValueError
    for anything else).

    ``socket`` may also be the daemon's TCP endpoint ``tcp://127.0.0.1:PORT`` (``tzip serve --tcp PORT``): it
    speaks only CURVE, with the keys the daemon keeps in ``curve/`` next to its socket (``curve_dir=`` or
    $TZIP_CURVE_DIR to look elsewhere); such a daemon is never spawned.

    ``strict=True``: raise DaemonUnavailableError when no daemon can be reached (now or later) instead of
    falling back to uncompressed frames. Other keyword arguments go to :class:`Client`.
    """
    return Client(socket, spawn, strict, **kwargs)
