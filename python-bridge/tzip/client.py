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
PyTorch's ``file_system`` shared memory, GPU calls with ``sm_budget`` 0 or above 255, batches over 256 MiB of staging.
The job's settings apply to ring requests as the client last heard them (its heartbeat: ring requests have no reply).
:attr:`Client.ring_info` says what is open and why a ring was not.

Jobs (protocol version 3, daemons of tzip 0.1 with ``jobs``/``set``; older daemons are sent none of this): a
client tells the daemon which job it belongs to (:func:`job_info`: name, user, rank, world size, devices, MPS) in
its hello once it is attached or its job is named (``job=``, $TZIP_JOB), and with :meth:`Client.set_job` (what
``tzip.attach()`` / ``tzip.detach()`` call), again in every new session (after a daemon restart). Requests made
inside :func:`tagged` carry a stream tag (gradients, optimizer, checkpoint, sendrecv), so ``tzip jobs`` shows each
stream's bytes. Replies carry the job's settings (``tzip set JOB codec=...``): :attr:`Client.settings`; the
daemon applies them, and with ``codec="off"`` the integrations send plain data (:meth:`Client.job_codec`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import contextvars
import ctypes
import functools
import getpass
import math
import logging
import os
import re
import secrets
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch

from . import _ring, _shm
from ._dlpack import (
    DL_CPU,
    DL_CUDA,
    check_supported,
    copy_bytes,
    copy_from_bytes,
    copy_into_bytes,
    frame_layout,
    from_bytes,
    int_alias,
    wire_dtype,
)
from ._errors import DaemonSpawnError, DaemonUnavailableError, DeviceUnavailableError, OutOfMemoryError, TzipDaemonError
from ._frame import DTYPE_CODES, decode_raw, encode_raw, max_compressed_size, read_header
from ._spawn import (daemon_pid, daemon_running, default_ipc_path, default_socket_path, normalize_endpoint, pid_alive,
                     spawn_daemon)
from ._transport import Transport
from .compressed import CompressedTensor

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

#: Codecs a compress call accepts.
CODECS = ("auto", "fast", "max", "bytes", "raw")
#: Protocol versions this client speaks (3: job info, stream tags, the job's settings in replies; 4: the submission
#: ring, docs/ring.md).
PROTOCOL_VERSIONS = [1, 2, 3, 4]
#: What a request's bytes are, for the daemon's job registry (protocol version 3, docs/protocol.md): gradients (the
#: DDP comm hook, FSDP's reduce-scatter), optimizer (state offload), checkpoint (tzip.save/load, tzip.checkpoint),
#: sendrecv (the other tzip.distributed collectives), other (anything untagged).
STREAMS = ("gradients", "optimizer", "checkpoint", "sendrecv", "other")
#: The stream tag of the requests made in this context (see :func:`tagged`); None: untagged ("other").
_stream_tag: contextvars.ContextVar[str | None] = contextvars.ContextVar("tzip_stream_tag", default=None)
#: The SM budget of the call being made (``sm_budget=`` of compress/decompress), None: the daemon's.
_sm_budget: contextvars.ContextVar[int | None] = contextvars.ContextVar("tzip_sm_budget", default=None)
#: The largest SM budget a request may name (docs/protocol.md, "Jobs": sm_budget is 0..1024).
MAX_SM_BUDGET = 1024


def _checked_sm_budget(sm_budget: int | None) -> int | None:
    if sm_budget is None:
        return None
    if isinstance(sm_budget, bool) or not isinstance(sm_budget, int) or not 0 <= sm_budget <= MAX_SM_BUDGET:
        raise ValueError(f"sm_budget is an int from 0 (all SMs) to {MAX_SM_BUDGET}, or None (the daemon's); got {sm_budget!r}")
    return sm_budget


def _with_sm_budget(sm_budget: int | None, fn, *args):
    """Runs ``fn(*args)`` with the call's SM budget set (in this context only)."""
    token = _sm_budget.set(sm_budget)
    try:
        return fn(*args)
    finally:
        _sm_budget.reset(token)


#: Seconds between reconnection attempts while the daemon is away.
RETRY_INTERVAL_S = 1.0
#: Decompressed tensors of at least this many bytes get their own shared-memory segment (no copy).
DEDICATED_MIN_BYTES = 1 << 20
#: Idle shared-memory bytes kept for reuse as decompressed tensors once the caller's tensors over them died (a fresh
#: /dev/shm file costs its page faults: tzip._shm.ResultPool). Client(result_pool_keep_bytes=...) overrides it.
RESULT_POOL_KEEP_BYTES = 512 << 20
#: Staging bytes (inputs + output capacity) per request; larger batches are split (a single larger tensor goes alone).
MAX_STAGE_BYTES = 256 << 20
#: Estimated message bytes per tensor, to keep requests under the daemon's message cap.
_BYTES_PER_ITEM = 400
#: The same for GPU tensors (two CUDA IPC handles with ref-counter names and GPU UUIDs).
_BYTES_PER_GPU_ITEM = 800
#: GPU tensors of at least this many bytes are handed over where they are (a CUDA IPC share); smaller ones are
#: copied into the staging arena (cheaper than a share). Client(gpu_share_min_bytes=...) overrides it.
GPU_SHARE_MIN_BYTES = 1 << 20
#: Idle GPU staging bytes kept per GPU. Client(gpu_arena_keep_bytes=...) overrides it.
GPU_ARENA_KEEP_BYTES = 128 << 20
#: Entries of each submission ring (docs/ring.md; a power of two, at most hello's ``ring.entries_max``): batches of up
#: to this many tensors are one LINKed batch. Client(ring_entries=...) overrides it; 0 turns the ring off.
RING_ENTRIES = 1024
#: Seconds a thread waiting for a ring completion polls before it sleeps on the futex. Client(ring_spin_s=...). 2 ms,
#: as the daemon's threads poll GPU work: a futex wake-up costs tens of microseconds on a VM, more than most
#: small requests take (docs/benchmarks.md, "Daemon fast lane").
RING_SPIN_S = 2e-3
_ALIGN = 64


def _align(n: int) -> int:
    return (n + _ALIGN - 1) & ~(_ALIGN - 1)


@dataclass
class _Item:
    """One tensor of a compress batch, planned."""

    tensor: torch.Tensor
    dl: tuple[int, int, int]
    wshape: tuple[int, ...]
    nbytes: int
    capacity: int
    zero_copy: tuple[str, int] | None
    in_off: int = 0
    out_off: int = 0


@dataclass
class _Frame:
    """One frame of a decompress batch, planned."""

    ct: CompressedTensor
    out: torch.Tensor | None
    frame: torch.Tensor
    frame_zc: tuple[str, int] | None
    dl: tuple[int, int, int]
    wshape: tuple[int, ...]
    dest: tuple[str, int] | None = None  # zero-copy destination (file, offset)
    result: torch.Tensor | None = None
    frame_off: int = 0
    out_off: int = 0


def _zero_copy_handle(t: torch.Tensor, nbytes: int) -> tuple[str, int] | None:
    """(shm file name, offset) when ``t`` is contiguous and lies in shared memory the daemon may map."""
    if t.device.type != "cpu" or not t.is_contiguous() or nbytes == 0:
        return None
    found = _shm.find(t.data_ptr(), nbytes)
    if found is not None:
        return found[0], found[2]
    return _shm.torch_shm_handle(t)


def _device(t: torch.Tensor) -> dict[str, int]:
    if t.device.type == "cpu":
        return {"type": DL_CPU, "id": 0}
    if t.device.type == "cuda":
        return {"type": DL_CUDA, "id": t.device.index or 0}
    raise TzipDaemonError("TZIP_UNSUPPORTED", f"{t.device.type} tensors are not served: tzip serves CPU and CUDA tensors; "
                                              "move the tensor to one of those")


def _normalize_uuid(uuid: str) -> str:
    u = str(uuid).strip().lower()
    for prefix in ("gpu-", "mig-"):
        if u.startswith(prefix):
            return u[len(prefix):]
    return u


def _caller_streams(tensors: Iterable[torch.Tensor | None]) -> dict[int, Any]:
    """The caller's current CUDA stream of each GPU the tensors are on (the async variants run on other threads)."""
    streams: dict[int, Any] = {}
    for t in tensors:
        if t is not None and t.device.type == "cuda":
            i = t.device.index or 0
            if i not in streams:
                streams[i] = torch.cuda.current_stream(i)
    return streams


def _stream_for(streams: dict[int, Any] | None, index: int):
    if streams and index in streams:
        return streams[index]
    return torch.cuda.current_stream(index)


def _host_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU uint8 tensor of ``t``'s values in C order (any device, any dtype)."""
    n = t.numel() * t.element_size()
    flat = torch.empty(n, dtype=torch.uint8)
    if n:
        copy_into_bytes(flat, int_alias(t.detach()).cpu())
    return flat


def _to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CPU tensor's bytes as a tensor of the same dtype and shape on ``device`` (any dtype: copied as bytes)."""
    if host.numel() == 0:
        return torch.empty(host.shape, dtype=host.dtype, device=device)
    return from_bytes(_host_bytes(host).to(device), host.dtype, host.shape)


@functools.lru_cache(maxsize=4096)
def _sqe_layout(dtype: torch.dtype, shape: tuple[int, ...]) -> tuple[int, int, tuple[int, ...], int] | None:
    """(nbytes, frame dtype code, frame shape, frame bound) of a compress SQE for a tensor of ``dtype`` and ``shape``,
    or None when an SQE cannot describe it (no bytes; a frame of more than 6 dimensions)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return None
    dl, wshape = wire_dtype(dtype, shape)
    fdtype, fshape = frame_layout(*dl, wshape)
    if len(fshape) > _ring.MAX_NDIM:
        return None
    return nbytes, DTYPE_CODES[fdtype], tuple(fshape), max_compressed_size(nbytes, len(fshape))


def _stage_cpu(plan: list[tuple]) -> int:
    """Staging bytes of a CPU compress plan: the inputs not in registered shared memory, and every frame's bound."""
    return sum((0 if p[5] else _align(p[1])) + _align(p[4]) for p in plan)


def _copy_in(seg: _shm.Segment, off: int, t: torch.Tensor, nbytes: int) -> None:
    """Writes ``t``'s values in C order at ``off`` of ``seg``: one memmove when contiguous (a few numpy and torch views
    cost more than the copy for small tensors), else through the integer views."""
    if t.is_contiguous() and not t.is_conj() and not t.is_neg():
        ctypes.memmove(seg.base + off, t.data_ptr(), nbytes)
    else:
        copy_into_bytes(seg.u8[off : off + nbytes], t)


def _u8_of(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a 1-D uint8 view (any dtype: through its integer alias)."""
    return int_alias(t.detach()).reshape(-1).view(torch.uint8)


def _done_handle(fn, err: BaseException | None) -> _ring.Handle:
    """A Handle settled now with ``fn(err)`` (its value, or what it raised)."""
    h = _ring.Handle()
    try:
        h.set_result(fn(err))
    except BaseException as e:  # noqa: BLE001 - the caller gets it from the handle
        h.set_exception(e)
    return h


class _Gathered(_ring.Handle):
    """One call's handle over the handles of its parts (a CPU batch, each GPU's batch): ``parts`` are (indices in
    the call, handle of a list) pairs; the value is the list in call order (``single``: its one item)."""

    def __init__(self, parts: list[tuple[list[int], _ring.Handle]], n: int, single: bool):
        super().__init__(on_wait=self._wait_parts)
        self._parts = parts
        self._count = n
        self._single = single
        self._left_parts = len(parts)
        self._glock = threading.Lock()
        for _, h in parts:
            h.add_done_callback(self._part_done)

    def _drive(self, timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        for _, h in self._parts:
            h._drive(None if deadline is None else max(0.0, deadline - time.monotonic()))

    def _wait_parts(self, stream) -> None:
        for _, h in self._parts:
            h.wait(stream)

    def _part_done(self, _h) -> None:
        with self._glock:
            self._left_parts -= 1
            if self._left_parts:
                return
        out: list = [None] * self._count
        try:
            for idx, h in self._parts:
                for i, v in zip(idx, h.result(0)):
                    out[i] = v
        except BaseException as e:  # noqa: BLE001
            self.set_exception(e)
            return
        self.set_result(out[0] if self._single else out)


def _raiser(err: BaseException):
    def fn(_):
        raise err
    return fn


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


def _gather(parts: list[tuple[list[int], _ring.Handle]], n: int, single: bool) -> _ring.Handle:
    return _Gathered(parts, n, single)


class _NoDevice(Exception):
    """The daemon cannot serve a GPU (TZIP_NO_DEVICE, or its hello did not list it)."""


@dataclass
class _Gpu:
    """What the client keeps per GPU."""

    index: int
    device: torch.device
    uuid: str
    norm: str
    arena: Any
    events: Any
    daemon_events: Any


@dataclass
class _GpuItem:
    """One CUDA tensor of a compress batch, planned."""

    tensor: torch.Tensor
    dl: tuple[int, int, int]
    wshape: tuple[int, ...]
    nbytes: int
    capacity: int
    share: Any  # _cuda.Share when handed over where it is, else None (copied into the arena)
    out_off: int = 0


@dataclass
class _GpuFrame:
    """One frame of a GPU decompress batch, planned."""

    k: int
    ct: CompressedTensor
    out: torch.Tensor | None
    frame: torch.Tensor
    dl: tuple[int, int, int]
    wshape: tuple[int, ...]
    fshare: Any = None  # share of the frame's storage (else copied into the arena)
    dshare: Any = None  # share of the destination's storage (else written into the arena and copied out)
    dest_offset: int = 0
    result: torch.Tensor | None = None
    out_off: int = 0


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


@contextlib.contextmanager
def tagged(stream: str):
    """Tags every compress and decompress request made inside the ``with`` block, in this thread (and in the async
    calls submitted from it), with ``stream`` (one of :data:`STREAMS`), so the daemon counts their bytes under that
    stream of the job (``tzip jobs``). Protocol version 3; older daemons are sent no tag. Nesting: the innermost
    tag wins. Raises ValueError for an unknown stream."""
    if stream not in STREAMS:
        raise ValueError(f"unknown stream {stream!r}; one of {', '.join(STREAMS)}")
    token = _stream_tag.set(stream)
    try:
        yield
    finally:
        _stream_tag.reset(token)


def _printable(text: str) -> str:
    """``text`` with control characters (C0, DEL, C1) as U+FFFD: the daemon refuses them in job names and users
    (they would reach the terminals of ``tzip jobs``/``tzip top`` and split log lines; docs/protocol.md, "Jobs")."""
    return re.sub(r"[\x00-\x1f\x7f-\x9f]", "\ufffd", text)


def _script_name() -> str:
    arg0 = sys.argv[0] if sys.argv and sys.argv[0] else ""
    if arg0 in ("", "-c", "-m", "-"):
        return "python"
    return Path(arg0).name or "python"


def _env_int(name: str) -> int | None:
    try:
        return int(os.environ[name])
    except (KeyError, ValueError):
        return None


def _mps_client() -> bool | None:
    """Whether this process is (or will be) a CUDA MPS client: an MPS control pipe exists where CUDA looks for it
    ($CUDA_MPS_PIPE_DIRECTORY, else /tmp/nvidia-mps). None when it cannot tell (no CUDA device in use)."""
    pipe = os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or "/tmp/nvidia-mps"
    if os.path.exists(os.path.join(pipe, "control")):
        return True
    if os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or torch.cuda.is_initialized():
        return False
    return None


def job_info(name: str | None = None, devices: Iterable[torch.device] = ()) -> dict[str, Any]:
    """What this process tells the daemon about its job (protocol version 3's ``job``: ``hello`` and the ``job``
    op): ``name`` (``name``, else $TZIP_JOB, else torchrun's $TORCHELASTIC_RUN_ID, else ``<script>-<pid>``; at most
    200 characters: the ranks of a job share it), ``user``, ``rank`` and ``world_size`` (torch.distributed's when it
    is initialised, else $RANK / $WORLD_SIZE), ``devices`` (the UUIDs of the GPUs of ``devices`` and of the current
    CUDA device when CUDA is initialised, else ``["cpu"]``) and ``mps`` (see :func:`_mps_client`). Reads no GPU
    that is not in use (never initialises CUDA)."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if not name:
        name = os.environ.get("TZIP_JOB") or (run_id if run_id and run_id != "none" else None)
    if not name:
        name = f"{_script_name()}-{os.getpid()}"
    info: dict[str, Any] = {"name": _printable(str(name))[:200]}
    try:
        info["user"] = _printable(getpass.getuser())[:200]
    except (KeyError, OSError):
        info["user"] = str(os.getuid())
    rank, world = _env_int("RANK"), _env_int("WORLD_SIZE")
    dist_mod = sys.modules.get("torch.distributed")  # only when the job imported it: no import here
    if dist_mod is not None and dist_mod.is_available() and dist_mod.is_initialized():
        rank, world = dist_mod.get_rank(), dist_mod.get_world_size()
    if rank is not None and rank >= 0:
        info["rank"] = rank
    if world is not None and world >= 1:
        info["world_size"] = world
    gpus: dict[int, None] = {}
    for d in devices:
        if d.type == "cuda":
            gpus[d.index if d.index is not None else 0] = None
    if torch.cuda.is_initialized():
        gpus[torch.cuda.current_device()] = None
    uuids = []
    if gpus:
        from ._cuda import device_uuid

        uuids = [device_uuid(i) for i in gpus]
    info["devices"] = uuids[:64] or ["cpu"]
    info["mps"] = _mps_client()
    return info


class Client:
    """A connection to the tzip daemon (see the module docstring). Use :func:`connect` to make one."""

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
        self.spawn = spawn and not self._tcp
        self.strict = strict
        self.name = (name or f"python pid {os.getpid()}")[:200]
        self.connect_timeout = connect_timeout
        self.request_timeout = request_timeout
        self._pid = os.getpid()
        self.shm_prefix = f"tzip-{self._pid}-{secrets.token_hex(8)}-"
        self._transport = Transport(self.socket_path, curve)
        self._arena = _shm.Arena(self.shm_prefix, self._queue_release, on_full=self._make_room)
        self._results = _shm.ResultPool(self._arena, result_pool_keep_bytes)
        self._lock = threading.RLock()
        self._sid: str | None = None
        self._daemon: dict[str, Any] = {}
        self._daemon_pid: int | None = None
        self._socket_ino: int | None = None
        self._limits: dict[str, Any] = {}
        self._version = 1  # the protocol version of the session (hello)
        # Protocol version 3. The job's name (None: job_info's default) and whether its integrations are on: True
        # after tzip.attach(), False after tzip.detach(), None before either (then hello carries a job only when one
        # was named: job=, $TZIP_JOB). Sent again with every new session (a restarted daemon knows nothing).
        self._job_name = job
        self._attached: bool | None = None
        self._job_devices: dict[torch.device, None] = {}
        self._job_refused_by: int | None = None  # the daemon pid whose hello refused the job field (older daemon)
        self._settings: dict[str, Any] = {"codec": None, "sm_budget": None}
        self._heartbeat_s = 3.0
        self._next_attempt = 0.0
        self._last_error: Exception | None = None
        self._warned = False
        self._pending_release: list[str] = []
        self._release_lock = threading.RLock()  # finalizers (garbage collection) take it too
        self._closed = False
        self._closing = False  # close() runs: no heartbeat, no new session
        self._wake = threading.Event()
        self._workers = workers
        self.gpu_share_min_bytes = int(gpu_share_min_bytes)
        self.gpu_arena_keep_bytes = int(gpu_arena_keep_bytes)
        self._gpus: dict[int, _Gpu] = {}
        self._shares: Any = None  # _cuda.ShareCache, made on first GPU use
        self._gpu_handles: dict[bytes, None] = {}  # CUDA IPC handles sent to the daemon (for release_gpu)
        self._gpu_unreachable: set[str] = set()
        self._gpu_warned: set[str] = set()
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._heartbeat: threading.Thread | None = None
        # Protocol version 4 (docs/ring.md): hello's `ring` capability, this session's rings by what they serve (None:
        # CPU tensors, else the CUDA index), what could not be opened, and region releases for the heartbeat to send.
        self.ring_entries = int(ring_entries)
        self.ring_spin_s = float(ring_spin_s)
        self._ring_caps: dict[str, Any] | None = None
        self._rings: dict[int | None, _ring.Ring] = {}
        self._ring_refused: dict[int | None, str] = {}
        self._ring_lock = threading.RLock()
        self._ring_counter = 0
        self._ring_releases: list[tuple[_ring.Ring, int]] = []
        self._retired: list[_ring.Ring] = []
        if not self._ensure_session(force=True):
            if strict:
                err = self._unavailable()
                self.close()
                raise err
            self._warn_fallback()

    # --- connection ---------------------------------------------------------------------------
    @property
    def connected(self) -> bool:
        """Whether a session with a daemon is open (False while falling back)."""
        return self._sid is not None

    @property
    def daemon_info(self) -> dict[str, Any]:
        """What the daemon said about itself at hello (pid, version, format_version, gpu, ...)."""
        return dict(self._daemon)

    @property
    def protocol_version(self) -> int:
        """The protocol version of the current (or last) session: 1 to 4."""
        return self._version

    @property
    def ring_info(self) -> dict[str, Any]:
        """The submission rings of this session (protocol version 4, docs/ring.md): ``offered`` (hello's ``ring``
        capability, or None: requests go through ZeroMQ), ``rings`` (what each open ring serves: ``"cpu"`` or
        ``"cuda:N"`` -> its daemon id, state, entries and registered regions) and ``refused`` (why a ring could not be
        opened, by what it would serve)."""
        with self._ring_lock:
            rings = {("cpu" if k is None else f"cuda:{k}"): {"id": r.id, "state": r.state, "entries": r.entries,
                                                              "regions": len(r.regions), "file": r.name}
                     for k, r in self._rings.items()}
            refused = {("cpu" if k is None else f"cuda:{k}"): why for k, why in self._ring_refused.items()}
        return {"offered": None if self._ring_caps is None else dict(self._ring_caps), "rings": rings, "refused": refused}

    @property
    def settings(self) -> dict[str, Any]:
        """The job's settings as the daemon's last reply said them (protocol version 3; ``tzip set``): ``codec``
        ("fast", "max", "auto", "off" or None: the caller's) and ``sm_budget`` (SMs per request, 0: all, or None:
        the daemon's default). The daemon applies them to every request of this session; ``codec == "off"`` also
        tells the integrations to send their data plain (:meth:`job_codec`). A request or heartbeat (every few
        seconds) brings a change; both are None with an older daemon or while it is away."""
        return dict(self._settings)

    def job_codec(self, codec: str) -> str:
        """The codec an integration should use in place of ``codec`` under the job's settings: "raw" (plain data)
        when the job's codec is "off", else ``codec`` (a "fast", "max" or "auto" setting is applied by the daemon
        to every request it receives)."""
        return "raw" if self._settings.get("codec") == "off" else codec

    @property
    def job(self) -> dict[str, Any]:
        """The job info this client sends the daemon (:func:`job_info`) and ``attached``."""
        return {**job_info(self._job_name, self._job_devices), "attached": bool(self._attached)}

    def set_job(self, attached: bool, name: str | None = None, devices: Iterable[torch.device] = ()) -> dict[str, Any]:
        """Tells the daemon this process's job and whether its integrations are on (``tzip.attach()``: True,
        ``tzip.detach()``: False) with the ``job`` op, now if a session is open, else at the next hello; the daemon
        then counts this session's requests under the job (``tzip jobs``) and applies the job's settings. ``name``
        replaces the job's name (see :func:`job_info`); ``devices`` are added to the job's devices.

        Returns the job's settings (:attr:`settings`; both None with a daemon older than protocol version 3,
        which is sent nothing). Raises TzipDaemonError when the daemon refuses the job (an invalid name).
        A daemon away is not an error (the job is sent once it is back)."""
        self._check_pid()
        with self._lock:
            if name:
                self._job_name = str(name)[:200]
            for d in devices:
                self._job_devices[torch.device(d)] = None
            self._attached = bool(attached)
            if self._sid is None or self._version < 3:
                return self.settings
        try:
            self._send_job()
        except DaemonUnavailableError:
            pass  # sent with the next session
        return self.settings

    def _send_job(self) -> None:
        info = job_info(self._job_name, self._job_devices)
        self._call("job", {"job": info, "attached": bool(self._attached)}, timeout=self.connect_timeout)

    def _hello_job(self) -> dict[str, Any] | None:
        """The ``job`` of the hello: when attached or named (see ``_attached``), and not refused by this daemon."""
        if self._attached is False or (self._attached is None and not (self._job_name or os.environ.get("TZIP_JOB"))):
            return None
        if self._job_refused_by is not None and self._job_refused_by == self._daemon_pid:
            return None
        return job_info(self._job_name, self._job_devices)

    def _check_pid(self) -> None:
        if os.getpid() != self._pid:
            raise RuntimeError("a tzip Client cannot be used after fork(); call tzip.connect() in the child")
        if self._closed:
            raise RuntimeError("this tzip Client is closed")

    def _daemon_alive(self) -> bool:
        if self._tcp:
            return True  # no pid file or socket file to look at: requests time out instead
        pid = self._daemon_pid
        if pid is not None and not pid_alive(pid):
            return False
        try:
            return os.stat(self.socket_path).st_ino == self._socket_ino
        except OSError:
            return False

    def _unavailable(self) -> DaemonUnavailableError:
        if isinstance(self._last_error, DaemonUnavailableError):
            return self._last_error
        return DaemonUnavailableError(f"no tzip daemon serves {self.socket_path}" +
                                      (f" ({self._last_error})" if self._last_error else ""))

    def _ensure_session(self, force: bool = False) -> bool:
        """Opens a session when there is none (starting a daemon when ``spawn``); False when the daemon is away."""
        if self._sid is not None:
            return True
        if self._closing:
            return False  # no new session once close() began (the heartbeat thread may be in a call)
        with self._lock:
            if self._sid is not None:
                return True
            now = time.monotonic()
            if not force and now < self._next_attempt:
                return False
            try:
                if self.spawn:
                    spawn_daemon(self.socket_path)
                elif not self._tcp and not daemon_running(self.socket_path):
                    raise DaemonUnavailableError(f"no tzip daemon serves {self.socket_path} (start one with `tzip serve`, or connect with spawn=True)")
                self._hello()
            except DaemonUnavailableError as e:
                self._last_error = e
                self._next_attempt = time.monotonic() + RETRY_INTERVAL_S
                return False
            if self._warned:
                _log.info("tzip: reconnected to the daemon at %s", self.socket_path)
            self._warned = False
            self._last_error = None
            return True

    def _hello(self) -> None:
        pid = ino = None
        if not self._tcp:
            pid = daemon_pid(self.socket_path)
            try:
                ino = os.stat(self.socket_path).st_ino
            except OSError:
                raise DaemonUnavailableError(f"no tzip daemon serves {self.socket_path}") from None
        self._daemon_pid, self._socket_ino = pid, ino
        self._transport.reset()
        msg = {"op": "hello", "versions": PROTOCOL_VERSIONS, "pid": self._pid, "shm_prefix": self.shm_prefix, "name": self.name}
        job = self._hello_job()
        if job is not None:
            msg["job"] = job
        reply = self._transport.request(msg, self._daemon_alive, timeout=self.connect_timeout)
        if not reply.get("ok") and job is not None and (reply.get("error") or {}).get("code") == "TZIP_PROTOCOL":
            # A daemon older than protocol version 3 refuses the field (its schema knows no "job"): hello again
            # without it; the job is then never sent to this daemon.
            self._job_refused_by = pid
            del msg["job"]
            job = None
            reply = self._transport.request(msg, self._daemon_alive, timeout=self.connect_timeout)
        if not reply.get("ok"):
            err = reply.get("error") or {}
            if err.get("code") == "TZIP_BUSY":  # shutting down, or full: as good as away
                raise DaemonUnavailableError(f"the tzip daemon at {self.socket_path} does not take clients now: {err.get('message')}")
            raise TzipDaemonError(str(err.get("code")), str(err.get("message")))
        self._daemon = dict(reply.get("daemon") or {})
        self._version = int(reply.get("version", 1))
        self._limits = dict(reply.get("limits") or {})
        self._heartbeat_s = max(0.05, int(reply.get("heartbeat_ms", 3000)) / 1000)
        # Liveness is judged by the lock file's pid (as seen from this pid namespace), when it was alive at hello.
        self._daemon_pid = pid
        with self._release_lock:
            self._pending_release.clear()  # the new session has mapped nothing yet
        self._gpu_unreachable.clear()
        self._gpu_warned.clear()
        with self._release_lock:
            self._gpu_handles.clear()  # a new session has opened none of them
        self._settings = {"codec": None, "sm_budget": None}  # a new session: the daemon's say from its replies
        self._note_settings(reply)
        self._retire_rings()  # the last session's rings (the daemon closed them with it)
        caps = reply.get("ring") if self._version >= 4 else None
        self._ring_caps = dict(caps) if isinstance(caps, dict) else None
        self._sid = str(reply["sid"])
        if self._version >= 3 and self._attached is not None and job is None:
            # attached (or detached) before this session, e.g. the daemon restarted: it hears it again
            try:
                self._send_job()
            except (DaemonUnavailableError, TzipDaemonError) as e:
                _log.warning("tzip: the daemon at %s did not take this job's info: %s", self.socket_path, e)
        if self._heartbeat is None:
            self._heartbeat = threading.Thread(target=self._heartbeat_loop, name="tzip-heartbeat", daemon=True)
            self._heartbeat.start()

    def _note_settings(self, reply: dict[str, Any]) -> None:
        """Keeps the job's settings a protocol version 3 reply carries."""
        got = reply.get("settings")
        if isinstance(got, dict):
            self._settings = {"codec": got.get("codec"), "sm_budget": got.get("sm_budget")}

    def _mark_down(self, sid: str | None, err: Exception) -> None:
        with self._lock:
            if self._sid == sid:
                self._sid = None
                self._last_error = err
                self._next_attempt = 0.0  # try again on the next call
                self._transport.reset()

    def _call(self, op: str, body: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
        """One request of the current session (re-saying hello once if the daemon forgot the session)."""
        for attempt in range(2):
            if not self._ensure_session():
                raise self._unavailable()
            sid = self._sid
            msg = {"op": op, "sid": sid, **body}
            if self._version >= 3 and op in ("compress", "decompress"):
                tag = _stream_tag.get()
                if tag is not None:
                    msg["stream"] = tag
                budget = _sm_budget.get()
                if budget is not None:
                    msg["sm_budget"] = budget
            try:
                reply = self._transport.request(msg, self._daemon_alive, timeout if timeout is not None else self.request_timeout)
            except DaemonUnavailableError as e:
                self._mark_down(sid, e)
                raise
            if reply.get("ok"):
                self._note_settings(reply)
                return reply
            err = reply.get("error") or {}
            code = str(err.get("code"))
            if code == "TZIP_SESSION" and attempt == 0 and not self._closing:
                with self._lock:
                    if self._sid == sid:
                        self._sid = None
                continue
            raise TzipDaemonError(code, str(err.get("message")), err.get("index"), err.get("need"))
        raise AssertionError("unreachable")

    def _warn_fallback(self) -> None:
        if self._warned:
            return
        self._warned = True
        warnings.warn(f"tzip: the daemon is not available ({self._unavailable()}); compress() stores tensors "
                      "uncompressed (codec 'raw') until it is back", RuntimeWarning, stacklevel=3)

    def _queue_release(self, name: str) -> None:
        with self._release_lock:
            if self._closed:
                return
            self._pending_release.append(name)
            for ring in list(self._rings.values()):  # a file a ring maps stays mapped (pinned) until ring_release
                r = ring.regions.pop(("shm", name), None)
                if r is not None:
                    self._ring_releases.append((ring, r.id))
            many = len(self._pending_release) >= 64
        if many:
            self._wake.set()

    def _make_room(self) -> None:
        """/dev/shm is full: closes the idle segments (staging arena, result pool) and has the daemon unmap the removed
        files now (``release`` with ``reclaim``), so that their pages are freed."""
        self._arena.close()
        self._results.drop_idle()
        with self._release_lock:
            names, self._pending_release = self._pending_release, []
        if self._sid is None:
            return
        self._flush_ring_releases(timeout=5.0)  # the rings' mappings of removed files hold their pages too
        try:
            self._call("release", {"names": names, "reclaim": True}, timeout=5.0)
        except (DaemonUnavailableError, TzipDaemonError):
            pass

    def _heartbeat_loop(self) -> None:
        while not self._closed:
            self._wake.wait(self._heartbeat_s)
            self._wake.clear()
            if self._closed or self._closing or os.getpid() != self._pid:
                return
            self._results.trim()  # idle result segments go after 30 s, connected or not
            self._close_retired()
            if self._sid is None:
                continue
            for ring in list(self._rings.values()):
                if ring.device is not None:
                    self._gpu_buffer_regions(ring)
            self._flush_ring_releases()
            with self._release_lock:
                names, self._pending_release = self._pending_release, []
            try:
                if names:
                    self._call("release", {"names": names}, timeout=10.0)
                else:
                    self._call("heartbeat", {}, timeout=10.0)
            except (DaemonUnavailableError, TzipDaemonError):
                pass
            except Exception:  # pragma: no cover - never let the heartbeat thread die
                pass

    # --- the submission ring (protocol version 4, docs/ring.md) -------------------------------------------------
    def _ring(self, key: int | None) -> _ring.Ring | None:
        """This session's ring for CPU tensors (``key`` None) or for the tensors of cuda:``key``, opened on first use;
        None when the daemon offers no ring, this machine cannot use one, or opening it failed (the requests then go
        through ZeroMQ; why is in :attr:`ring_info`)."""
        ring = self._rings.get(key)
        if ring is not None and ring.usable and ring.sid == self._sid:
            return ring
        self._close_retired()
        if self._ring_caps is None or self._sid is None or key in self._ring_refused or self.ring_entries <= 0:
            return None
        with self._ring_lock:
            ring = self._rings.get(key)
            if ring is not None:
                if ring.usable and ring.sid == self._sid:
                    return ring
                # It stopped serving (closed, broken, or the daemon went away): ZeroMQ for the rest of this session.
                del self._rings[key]
                self._ring_refused[key] = f"ring {ring.name} stopped serving ({ring.state})"
                self._retired.append(ring)
                return None
            why = _ring.supported()
            if why is not None:
                self._ring_refused[key] = why
                return None
            return self._open_ring(key)

    def _open_ring(self, key: int | None) -> _ring.Ring | None:
        """(Ring lock held) ``ring_open`` of a new ring file; None (and the reason noted) when it cannot be opened."""
        caps = self._ring_caps or {}
        entries = min(self.ring_entries, int(caps.get("entries_max", 4096)))
        entries = 1 << max(3, entries.bit_length() - 1)  # a power of two, at least 8
        self._ring_counter += 1
        name = f"{self.shm_prefix}ring-{self._ring_counter}"
        sid = self._sid
        try:
            ring = _ring.Ring(name, entries, self._daemon_alive, spin_s=self.ring_spin_s,
                              max_batch=int(caps.get("max_batch", 1024)))
        except OSError as e:
            self._ring_refused[key] = f"cannot make the ring file: {e}"
            return None
        body: dict[str, Any] = {"name": name, "entries": entries}
        try:
            if key is not None:
                g = self._gpu(key)
                ordinal = self._daemon_ordinal(g)
                if ordinal is None:
                    raise _NoDevice(self._gpu_reason(g))
                from ._memops import available, host_register, host_unregister

                why = available()
                if why is not None:
                    raise _NoDevice(why)
                # The GPU ordering words (produced, done) live in the header page: our GPU writes and waits on it there.
                with torch.cuda.device(key):
                    dptr = host_register(ring.base, _ring.HEADER_BYTES)
                ring.before_unmap.append(lambda base=ring.base: host_unregister(base))
                ring.produced_dptr = dptr + _ring.OFF_PRODUCED  # type: ignore[attr-defined]
                ring.done_dptr = dptr + _ring.OFF_DONE  # type: ignore[attr-defined]
                ring.seq = 0  # type: ignore[attr-defined]  # the last produced / signal value used
                ring.gpu_lock = threading.Lock()  # type: ignore[attr-defined]
                ring.order_stream = torch.cuda.Stream(device=g.device)  # type: ignore[attr-defined]  # see _gpu_submit
                body["device"] = {"type": DL_CUDA, "id": ordinal}
            reply = self._call("ring_open", body, timeout=self.connect_timeout)
        except Exception as e:  # noqa: BLE001 - any refusal: ZeroMQ instead
            ring.close()
            if isinstance(e, DaemonUnavailableError):
                raise
            self._ring_refused[key] = f"ring_open: {e}"
            _log.info("tzip: no submission ring for %s (%s); requests go through ZeroMQ", "CPU tensors" if key is None else f"cuda:{key}", e)
            return None
        ring.id = int(reply["ring"])
        ring.sid = self._sid if self._sid is not None else sid
        ring.device = key
        self._rings[key] = ring
        return ring

    def _daemon_ordinal(self, g: "_Gpu") -> int | None:
        """The daemon's ordinal of ``g`` (hello's ``daemon.gpus[].index``, matched by UUID), or None."""
        for d in self._daemon.get("gpus") or []:
            if isinstance(d, dict) and _normalize_uuid(d.get("uuid", "")) == g.norm and isinstance(d.get("index"), int):
                return int(d["index"])
        return None

    def _ring_regions(self, ring: _ring.Ring, wanted: list[tuple[Any, dict[str, Any]]]) -> list[_ring.Region]:
        """The regions of ``wanted`` ((cache key, ``ring_register`` region) pairs) on ``ring``: cached ones as they
        are, the others registered in one ``ring_register``. Raises TzipDaemonError / DaemonUnavailableError."""
        with self._release_lock:
            got = [ring.regions.get(k) for k, _ in wanted]
        missing: dict[Any, dict[str, Any]] = {}
        for (k, spec), r in zip(wanted, got):
            if r is None and k not in missing:
                missing[k] = spec
        if missing:
            reply = self._call("ring_register", {"ring": ring.id, "regions": list(missing.values())})
            regs = reply.get("regions") or []
            if len(regs) != len(missing):
                raise TzipDaemonError("TZIP_PROTOCOL", f"ring_register answered {len(regs)} regions for {len(missing)}")
            with self._release_lock:
                for k, r in zip(missing, regs):
                    region = _ring.Region(r["id"], r["generation"], r["bytes"])
                    if k in ring.regions:  # another thread registered it meanwhile: ours goes again
                        self._ring_releases.append((ring, region.id))
                    else:
                        ring.regions[k] = region
                got = [ring.regions[k] for k, _ in wanted]
        return got  # type: ignore[return-value]

    def _ring_shm(self, ring: _ring.Ring, names: list[str]) -> dict[str, _ring.Region]:
        """The regions of the session's shared-memory files ``names`` (whole files) on ``ring``."""
        regs = self._ring_regions(ring, [(("shm", n), {"kind": "shm", "name": n}) for n in names])
        return dict(zip(names, regs))

    def _flush_ring_releases(self, timeout: float = 10.0) -> None:
        """Sends the queued ``ring_release``s (regions of dropped segments and staging buffers), one per ring."""
        with self._release_lock:
            todo, self._ring_releases = self._ring_releases, []
        by_ring: dict[int, tuple[_ring.Ring, list[int]]] = {}
        for ring, rid in todo:
            by_ring.setdefault(id(ring), (ring, []))[1].append(rid)
        for ring, ids in by_ring.values():
            if ring.sid != self._sid or not ring.usable or self._sid is None:
                continue  # that session's rings are gone with it
            try:
                self._call("ring_release", {"ring": ring.id, "regions": ids}, timeout=timeout)
            except (DaemonUnavailableError, TzipDaemonError):
                pass

    def _gpu_buffer_regions(self, ring: _ring.Ring) -> None:
        """Queues the release of regions of staging buffers the GPU arena dropped (their memory went back to PyTorch)."""
        with self._release_lock:
            for k in [k for k in ring.regions if k[0] == "gpubuf" and k[1].u8 is None]:
                self._ring_releases.append((ring, ring.regions.pop(k).id))

    def _retire_rings(self) -> None:
        """A new session: the rings of the last one are put aside (closed later, outside any lock: closing one fails
        its pending requests, whose fallback may itself call the daemon)."""
        with self._ring_lock:
            self._retired.extend(self._rings.values())
            self._rings.clear()
            self._ring_refused.clear()
        with self._release_lock:
            self._ring_releases.clear()

    def _close_retired(self) -> None:
        """Closes the rings put aside: a ring of the current session that stopped serving (broken) is closed in the
        daemon too (``ring_close``: it holds the ring's regions until then), then here (the file goes)."""
        if not self._retired:
            return
        with self._ring_lock:
            rings, self._retired = self._retired, []
        for r in rings:
            if r.id is not None and r.sid is not None and r.sid == self._sid and not self._closing:
                try:
                    self._call("ring_close", {"ring": r.id}, timeout=2.0)
                except (DaemonUnavailableError, TzipDaemonError):
                    pass
            r.close()

    # --- daemon requests ----------------------------------------------------------------------
    def ping(self) -> float:
        """Round-trip time of an empty request (heartbeat), seconds."""
        self._check_pid()
        t = time.perf_counter()
        self._call("heartbeat", {})
        return time.perf_counter() - t

    def stats(self) -> dict[str, Any]:
        """The daemon's counters (and this session's, under ``session``)."""
        self._check_pid()
        return self._call("stats", {})

    def shutdown_daemon(self) -> None:
        """Asks the daemon to stop (it finishes the requests in flight first)."""
        self._check_pid()
        self._call("shutdown", {})
        self._mark_down(self._sid, DaemonUnavailableError("the daemon was shut down"))

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

    # --- compress -----------------------------------------------------------------------------
    def compress(self, tensors: torch.Tensor | Iterable[torch.Tensor], codec: str = "auto", *, sm_budget: int | None = None):
        """Compresses one tensor (-> CompressedTensor) or a batch (-> list, one request per batch and device where it
        fits). A CUDA tensor's payload stays on its GPU.

        Args:
            tensors: a tensor or an iterable of tensors, any shape and dtype, on the CPU or a GPU; views keep their
                storage offset, non-contiguous tensors are compressed as their contiguous values.
            codec: 'auto' | 'fast' | 'max' | 'bytes' | 'raw' (docs/format.md).
            sm_budget: SMs the daemon's GPU kernels may occupy for this call (0: all SMs of the device); None: the
                daemon's budget (``tzip serve --sm-budget``, default 10). A job's own budget (``tzip set JOB
                sm_budget=N``) wins over it (docs/protocol.md, "Jobs"). Protocol version 3; older daemons ignore it.

        Returns:
            CompressedTensor (payload: a uint8 tensor on the input's device) or a list of them.

        Raises:
            ValueError: unknown codec, or an sm_budget that is not an int in 0..1024. TypeError: an item that is not a
                tensor.
            TzipDaemonError: the daemon refused a tensor (its ``code``: e.g. TZIP_INVALID_ARGUMENT).
            DaemonUnavailableError / DeviceUnavailableError: with ``strict=True`` only, when the daemon is gone or
                cannot serve the tensor's GPU (otherwise raw frames, and one warning).
        """
        self._check_pid()
        budget = _checked_sm_budget(sm_budget)
        single = isinstance(tensors, torch.Tensor)
        items = [tensors] if single else list(tensors)
        return _with_sm_budget(budget, self._compress, items, single, codec, None)

    def compress_async(self, tensors, codec: str = "auto", *, sm_budget: int | None = None) -> _ring.Handle:
        """:meth:`compress` without waiting: returns a :class:`tzip._ring.Handle`, a concurrent.futures.Future of
        what :meth:`compress` returns, with ``wait(stream=None)``.

        Through the submission ring (protocol version 4): submitted on the calling thread (a few microseconds);
        ``result()`` reaps the completion. CUDA tensors: their bytes are read after the work queued so far on the
        caller's current stream (a ``cuStreamWriteValue64`` the daemon's stream waits for, no CPU wait);
        ``wait(stream)`` makes ``stream`` wait on the GPU for the frames; ``result()`` gives CompressedTensors whose
        payloads are ready in the caller's stream order. Otherwise (ZeroMQ): the call runs on the client's worker
        threads, ordered the same way; ``wait(stream)`` then waits on the host.

        Raises: as :meth:`compress`, from ``result()`` (an invalid ``sm_budget`` at once)."""
        self._check_pid()
        budget = _checked_sm_budget(sm_budget)
        single = isinstance(tensors, torch.Tensor)
        items = [tensors] if single else list(tensors)
        streams = _caller_streams(t for t in items if isinstance(t, torch.Tensor))
        try:
            handle = _with_sm_budget(budget, self._compress_start_call, items, single, codec, streams)
        except (ValueError, TypeError, TzipDaemonError) as e:
            return _done_handle(_raiser(e), None)
        if handle is not None:
            return handle
        # the caller's stream tag (tagged()) goes with the call to the worker thread
        return self._pool_handle(streams, _with_sm_budget, budget, self._compress, items, single, codec, streams, False)

    def _compress_start_call(self, items: list, single: bool, codec: str, streams: dict[int, Any] | None) -> _ring.Handle | None:
        """Checks the call's arguments and submits it through the ring when it can (else None)."""
        self._check_compress_args(items, codec)
        if not self._ring_caps or self._sid is None:
            return None
        h = self._compress_submit(items, single, codec, streams)
        if h is not None and len(self._rings):
            for r in list(self._rings.values()):
                r.watch()  # completions nobody waits for (concurrent.futures.wait) are reaped in the background
        return h

    def _pool_handle(self, streams: dict[int, Any] | None, fn, *args) -> _ring.Handle:
        """``fn(*args)`` on the worker threads (in the caller's context: its stream tag) as a Handle."""
        fut = self._pool().submit(contextvars.copy_context().run, fn, *args)
        h = _ring.Handle(on_wait=lambda s: _host_wait(h, streams, s))
        fut.add_done_callback(lambda f: _settle_from(h, f))
        return h

    @staticmethod
    def _check_compress_args(items: list, codec: str) -> None:
        if codec not in CODECS:
            raise ValueError(f"unknown codec {codec!r}; one of {', '.join(CODECS)}")
        for t in items:
            check_supported(t)
            _device(t)

    def _compress(self, items: list, single: bool, codec: str, streams: dict[int, Any] | None, use_ring: bool = True):
        self._check_pid()
        self._check_compress_args(items, codec)
        if use_ring and self._ring_caps and self._sid is not None:
            h = self._compress_submit(items, single, codec, streams)
            if h is not None:
                return self._wait_handle(h)
        out = None
        for attempt in range(2):
            try:
                # The retry skips the reconnect back-off: it is the one extra attempt a spawning client makes.
                if not self._ensure_session(force=attempt > 0):
                    raise self._unavailable()
                out = self._compress_remote(items, codec, streams)
                break
            except DaemonUnavailableError:
                # The daemon went away during the call: with spawn, start one and try once more.
                if attempt == 0 and self.spawn:
                    continue
                if self.strict:
                    raise
                self._warn_fallback()
                out = [self._compress_raw(t) for t in items]
        return out[0] if single else out

    def _compress_remote(self, tensors: list[torch.Tensor], codec: str, streams: dict[int, Any] | None) -> list[CompressedTensor]:
        """One request per batch of CPU tensors and per batch of each GPU's tensors."""
        groups: dict[int | None, list[int]] = {}
        for i, t in enumerate(tensors):
            groups.setdefault(None if t.device.type == "cpu" else (t.device.index or 0), []).append(i)
        out: list[CompressedTensor] = [None] * len(tensors)  # type: ignore[list-item]
        for key, idx in groups.items():
            part = [tensors[i] for i in idx]
            if key is None:
                done = self._compress_cpu(part, codec)
            else:
                done = self._compress_gpu(self._gpu(key), part, codec, _stream_for(streams, key))
            for i, ct in zip(idx, done):
                out[i] = ct
        return out

    def _plan(self, t: torch.Tensor) -> _Item:
        shape = tuple(t.shape)
        dl, wshape = wire_dtype(t.dtype, shape)
        nbytes = t.numel() * t.element_size()
        _, fshape = frame_layout(*dl, wshape)
        capacity = max_compressed_size(nbytes, len(fshape))
        return _Item(t, dl, wshape, nbytes, capacity, _zero_copy_handle(t, nbytes))

    def _batches(self, items: list, stage_of, per_item: int = _BYTES_PER_ITEM) -> list[list]:
        max_batch = int(self._limits.get("max_batch", 4096))
        max_items = max(1, min(max_batch, int(self._limits.get("max_message_bytes", 1 << 20)) // per_item))
        batches: list[list] = []
        cur: list = []
        stage = 0
        for it in items:
            need = stage_of(it)
            if cur and (len(cur) >= max_items or stage + need > MAX_STAGE_BYTES):
                batches.append(cur)
                cur, stage = [], 0
            cur.append(it)
            stage += need
        if cur:
            batches.append(cur)
        return batches

    def _compress_cpu(self, tensors: list[torch.Tensor], codec: str) -> list[CompressedTensor]:
        items = [self._plan(t) for t in tensors]

        def stage_of(it: _Item) -> int:
            return (0 if it.zero_copy else _align(it.nbytes)) + _align(it.capacity)

        results: list[CompressedTensor] = []
        for batch in self._batches(items, stage_of):
            with self._arena.lease(max(1, sum(stage_of(it) for it in batch))) as seg:
                off = 0
                entries = []
                for it in batch:
                    if it.zero_copy is not None:
                        data = {"kind": "shm", "name": it.zero_copy[0], "offset": it.zero_copy[1], "size": it.nbytes}
                    else:
                        copy_into_bytes(seg.u8[off : off + it.nbytes], it.tensor)
                        data = {"kind": "shm", "name": seg.name, "offset": off, "size": it.nbytes}
                        off += _align(it.nbytes)
                    it.out_off = off
                    off += _align(it.capacity)
                    entries.append({
                        "tensor": {"device": _device(it.tensor), "dtype": {"code": it.dl[0], "bits": it.dl[1], "lanes": it.dl[2]},
                                   "shape": list(it.wshape), "byte_offset": 0, "data": data},
                        "out": {"kind": "shm", "name": seg.name, "offset": it.out_off, "size": it.capacity},
                    })
                reply = self._call("compress", {"codec": codec, "tensors": entries})
                for it, fr in zip(batch, reply["frames"]):
                    n = int(fr["bytes"])
                    payload = torch.empty(n, dtype=torch.uint8)
                    copy_bytes(payload, seg.u8[it.out_off : it.out_off + n])
                    results.append(CompressedTensor(payload, it.tensor.dtype, it.tensor.shape, str(fr["codec"]), it.nbytes))
        return results

    # --- requests through the ring (protocol version 4, docs/ring.md) -------------------------------------------
    def _ring_sm_budget(self) -> int | None:
        """The SQE's sm_budget of the call (0: the ring's default), or None when an SQE cannot say it (0 = all SMs,
        or more than 255: such GPU requests go through ZeroMQ). The job's budget (``tzip set JOB sm_budget=N``, as
        the last reply or heartbeat said it) wins over the call's, as the daemon does for ZeroMQ requests."""
        job = self._settings.get("sm_budget")
        budget = job if isinstance(job, int) else _sm_budget.get()
        if budget is None:
            return 0
        return budget if 1 <= budget <= 255 else None

    def _ring_codec(self, codec: str) -> str:
        """The codec of the call's SQEs: the job's (``tzip set JOB codec=...``; "off": raw frames) over the call's,
        as the daemon applies it to ZeroMQ requests. The ring thread does not know the job's settings: the client
        applies them, as the last reply or heartbeat said them (docs/protocol.md, "Jobs")."""
        job = self._settings.get("codec")
        if job == "off":
            return "raw"
        return job if job in _ring.CODEC_CODES else codec

    def _compress_ring_plan(self, items: list[torch.Tensor], codec: str, streams: dict[int, Any] | None):
        """Starters of the ring requests of ``items`` (one per CPU batch and per GPU), or None when the ring cannot
        carry all of them (no ring offered, an item it cannot describe): then the whole call goes through ZeroMQ."""
        if self._ring_caps is None or self._sid is None or codec not in _ring.CODEC_CODES or not items:
            return None
        codec = self._ring_codec(codec)
        groups: dict[int | None, list[int]] = {}
        for i, t in enumerate(items):
            groups.setdefault(None if t.device.type == "cpu" else (t.device.index or 0), []).append(i)
        tag = _ring.STREAM_TAGS.get(_stream_tag.get(), 0)
        starters = []
        for key, idx in groups.items():
            part = [items[i] for i in idx]
            if key is None:
                plan = self._ring_plan_compress_cpu(part)
                if plan is None or (len(plan) > 1 and _stage_cpu(plan) > MAX_STAGE_BYTES):
                    return None  # (ZeroMQ splits such batches into requests of their own)
                starters.append((idx, key, plan, None))
            else:
                g = self._gpu(key)
                budget = self._ring_sm_budget()
                if budget is None or not self._gpu_reachable(g):
                    return None
                plan = self._ring_plan_compress_gpu(part)
                if plan is None or sum(_align(p[1]) + _align(p[4]) for p in plan) > MAX_STAGE_BYTES:
                    return None  # everything is staged through the ring: large tensors are handed over through ZeroMQ
                starters.append((idx, key, plan, (_stream_for(streams, key), budget)))
        try:
            for _, key, _, _ in starters:
                if self._ring(key) is None:
                    return None
        except DaemonUnavailableError:
            return None  # the ZeroMQ path notices it too, and retries (spawn) or falls back
        return [(idx, key, plan, extra, tag, codec) for idx, key, plan, extra in starters]

    @staticmethod
    def _ring_plan_compress_cpu(tensors: list[torch.Tensor]) -> list[tuple] | None:
        """Per tensor: (tensor, nbytes, frame dtype code, frame shape, capacity, zero-copy (file, offset) or None);
        None when an SQE cannot describe one (no bytes, a frame of more than 6 dimensions, PyTorch's shared memory)."""
        plans = []
        for t in tensors:
            layout = _sqe_layout(t.dtype, tuple(t.shape))
            if layout is None:
                return None
            nbytes, dcode, fshape, cap = layout
            zc = None
            if t.is_contiguous():
                found = _shm.find(t.data_ptr(), nbytes)
                if found is not None:
                    zc = (found[0], found[2])
                elif _shm.torch_shm_handle(t) is not None:
                    return None  # zero copy through ZeroMQ (its files are PyTorch's, not registered here)
            plans.append((t, nbytes, dcode, fshape, cap, zc))
        return plans

    @staticmethod
    def _ring_plan_compress_gpu(tensors: list[torch.Tensor]) -> list[tuple] | None:
        """As the CPU plan, without zero copy: GPU tensors are copied into the registered staging arena (one copy on
        the GPU, no registration per tensor)."""
        plans = []
        for t in tensors:
            layout = _sqe_layout(t.dtype, tuple(t.shape))
            if layout is None:
                return None
            plans.append((t, *layout, None))
        return plans

    def _compress_submit(self, items: list, single: bool, codec: str, streams: dict[int, Any] | None) -> _ring.Handle | None:
        """The call as ring requests, submitted now (a Handle of the call's return value), or None: not for the ring."""
        starters = self._compress_ring_plan(items, codec, streams)
        if starters is None:
            return None
        n = len(items)

        def combine_one(idx):
            def post(cts):
                if single:
                    return cts[0]
                return cts
            return post

        if len(starters) == 1 and starters[0][0] == list(range(n)):
            idx, key, plan, extra, tag, codec = starters[0]
            return self._compress_start(key, plan, codec, extra, tag, combine_one(idx))
        parts = [(idx, self._compress_start(key, plan, codec, extra, tag, lambda cts: cts))
                 for idx, key, plan, extra, tag, codec in starters]
        return _gather(parts, n, single)

    def _compress_start(self, key: int | None, plan: list[tuple], codec: str, extra, tag: int, post) -> _ring.Handle:
        tensors = [p[0] for p in plan]
        streams = None if key is None else {key: extra[0]}
        ctx = contextvars.copy_context()  # the fallback runs with the caller's stream tag and SM budget

        def fallback(err: BaseException | None):
            # The ring could not take or finish it (the daemon went away, the ring stopped, a region was refused):
            # the ZeroMQ path with its retry and raw fallback.
            if err is not None and not isinstance(err, (DaemonUnavailableError, TzipDaemonError)):
                raise err
            return post(ctx.run(self._compress, tensors, False, codec, streams, False))

        ring = self._ring(key)
        if ring is None:
            return _done_handle(fallback, None)
        try:
            if key is None:
                return self._compress_start_cpu(ring, plan, codec, tag, post, fallback)
            return self._compress_start_gpu(ring, self._gpu(key), plan, codec, extra[0], extra[1], tag, post, fallback)
        except (DaemonUnavailableError, TzipDaemonError) as e:
            return _done_handle(fallback, e)

    def _compress_start_cpu(self, ring: _ring.Ring, plan: list[tuple], codec: str, tag: int, post, fallback) -> _ring.Handle:
        stage = _stage_cpu(plan)
        seg = self._arena.take(max(1, stage))
        try:
            regions = self._ring_shm(ring, list(dict.fromkeys([seg.name] + [p[5][0] for p in plan if p[5]])))
            here = regions[seg.name]
            ccode = _ring.CODEC_CODES[codec]
            sqes = []
            outs = []
            off = 0
            for t, nbytes, dcode, fshape, cap, zc in plan:
                if zc is not None:
                    src = (regions[zc[0]], zc[1], nbytes)
                else:
                    _copy_in(seg, off, t, nbytes)
                    src = (here, off, nbytes)
                    off += _align(nbytes)
                outs.append(off)
                sqes.append(_ring.sqe(_ring.OP_COMPRESS, 0, codec=ccode, dtype=dcode, shape=fshape, stream=tag, src=src,
                                      dst=(here, off, cap)))
                off += _align(cap)
        except BaseException:
            self._arena.give(seg)
            raise

        def finish(res):
            if isinstance(res, BaseException):
                seg.close()  # the daemon may not be done with it: never reused
                return fallback(res)
            try:
                err = _ring.Handle.error_of(res)
                if err is not None:
                    raise err
                cts = []
                for (t, nbytes, _d, _s, cap, _z), o, (_st, c, n, _m) in zip(plan, outs, res):
                    if not 0 < n <= cap:
                        raise TzipDaemonError("TZIP_CORRUPT", f"the ring reported a frame of {n} bytes (capacity {cap})")
                    payload = torch.empty(n, dtype=torch.uint8)
                    ctypes.memmove(payload.data_ptr(), seg.base + o, n)
                    cts.append(CompressedTensor(payload, t.dtype, t.shape, _ring.CODEC_NAMES.get(c, "raw"), nbytes))
            finally:
                self._arena.give(seg)
            return post(cts)

        return self._ring_submit(ring, sqes, finish)

    def _ring_submit(self, ring: _ring.Ring, sqes: list[tuple], finish, on_wait=None) -> _ring.Handle:
        h = _ring.Handle(ring, len(sqes), finish, on_wait)
        try:
            ring.submit([sqes], h)
        except _ring.RingClosed as e:
            h._complete(e)  # nothing (or not all) of it was taken: its fallback runs now
        return h

    def _ring_next_value(self, ring: _ring.Ring) -> int:
        with self._ring_lock:
            ring.seq += 1  # type: ignore[attr-defined]
            return ring.seq  # type: ignore[attr-defined]

    def _ring_gpu_buffer(self, ring: _ring.Ring, g: "_Gpu", buf) -> _ring.Region:
        """The region of the whole staging buffer ``buf`` on ``ring`` (registered once per buffer)."""
        ordinal = self._daemon_ordinal(g)
        spec = {"kind": "cuda", "device": {"type": DL_CUDA, "id": ordinal}, "handle": buf.share.handle,
                "offset": buf.share.offset, "bytes": buf.size}
        return self._ring_regions(ring, [(("gpubuf", buf), spec)])[0]

    def _gpu_submit(self, ring: _ring.Ring, g: "_Gpu", stream, sqes: list[tuple], finish, on_wait, vbox: list) -> _ring.Handle:
        """Submits a GPU batch ordered after the work queued so far on ``stream`` (its inputs): ``produced = v`` is
        written once that work is done, the batch is marked WAIT (first SQE) / SIGNAL (last) with ``v`` (put in
        ``vbox``, read by ``finish``/``on_wait``), and published.

        One ``produced`` word serves every stream of the ring, so its writes must happen in ``v`` order and each only
        after its own producer work: they are queued on the ring's own stream (``ring.order_stream``), which first waits
        for an event of the caller's stream; values are taken and SQEs published under ``ring.gpu_lock``, so the SQ
        order is the ``v`` order too. (Written straight from two callers' streams, ``produced`` could reach a later
        value before an earlier batch's inputs were ready.)"""
        from ._memops import write_value64

        with ring.gpu_lock:  # type: ignore[attr-defined]
            v = self._ring_next_value(ring)
            vbox.append(v)
            with torch.cuda.device(g.index):
                ev = torch.cuda.Event()
                ev.record(stream)
                ring.order_stream.wait_event(ev)  # type: ignore[attr-defined]
                write_value64(ring.order_stream, ring.produced_dptr, v)  # type: ignore[attr-defined]
            first = sqes[0]
            sqes[0] = (first[0], first[1] | _ring.F_WAIT, *first[2:-2], v, first[-1])
            last = sqes[-1]
            sqes[-1] = (last[0], last[1] | _ring.F_SIGNAL, *last[2:-1], v)
            return self._ring_submit(ring, sqes, finish, on_wait)

    @staticmethod
    def _gpu_wait_done(ring: _ring.Ring, stream, v: int) -> None:
        """``stream`` waits on the GPU until the ring's done word is >= ``v``."""
        from ._memops import wait_value64

        wait_value64(stream, ring.done_dptr, v)  # type: ignore[attr-defined]

    def _compress_start_gpu(self, ring: _ring.Ring, g: "_Gpu", plan: list[tuple], codec: str, stream, budget: int, tag: int,
                            post, fallback) -> _ring.Handle:
        from ._cuda import gpu_bytes_of, gpu_copy_many, regions_of

        stage = sum(_align(p[1]) + _align(p[4]) for p in plan)
        with torch.cuda.device(g.index), torch.cuda.stream(stream):
            buf = self._staging_take(g, stage, stream)
            try:
                region = self._ring_gpu_buffer(ring, g, buf)
                ccode = _ring.CODEC_CODES[codec]
                sqes = []
                outs = []
                staged: list[tuple[int, int]] = []
                srcs: list[torch.Tensor] = []
                off = 0
                for t, nbytes, dcode, fshape, cap, _z in plan:
                    staged.append((off, nbytes))
                    srcs.append(gpu_bytes_of(t))
                    src = (region, off, nbytes)
                    off += _align(nbytes)
                    outs.append(off)
                    sqes.append(_ring.sqe(_ring.OP_COMPRESS, 0, codec=ccode, dtype=dcode, shape=fshape, sm_budget=budget,
                                          stream=tag, src=src, dst=(region, off, cap)))
                    off += _align(cap)
                gpu_copy_many(regions_of(buf.u8, staged), srcs)
            except BaseException:
                g.arena.give(buf, stream)
                raise
        buf.in_doubt = True
        vbox: list[int] = []

        def finish(res):
            if isinstance(res, BaseException):
                if vbox:
                    buf.share.poison()  # the daemon's stream may still use it: never reused nor freed
                else:
                    buf.in_doubt = False
                    g.arena.give(buf, stream)
                return fallback(res)
            v = vbox[0]
            with torch.cuda.device(g.index), torch.cuda.stream(stream):
                try:
                    err = _ring.Handle.error_of(res)
                    if err is not None:
                        raise err
                    sizes = []
                    for (t, nbytes, _d, _s, cap, _z), (_st, c, n, _m) in zip(plan, res):
                        if not 0 < n <= cap:
                            raise TzipDaemonError("TZIP_CORRUPT", f"the ring reported a frame of {n} bytes (capacity {cap})")
                        sizes.append(n)
                    self._gpu_wait_done(ring, stream, v)
                    # Each payload an allocation of its own (a view of a shared one would make torch.save write them all).
                    payloads = [torch.empty(n, dtype=torch.uint8, device=g.device) for n in sizes]
                    gpu_copy_many(payloads, regions_of(buf.u8, [(o, n) for o, n in zip(outs, sizes)]))
                finally:
                    buf.in_doubt = False
                    g.arena.give(buf, stream)
            return post([CompressedTensor(p, t.dtype, t.shape, _ring.CODEC_NAMES.get(c, "raw"), nbytes)
                         for p, (t, nbytes, *_r), (_st, c, _n, _m) in zip(payloads, plan, res)])

        def on_wait(s):
            self._gpu_wait_done(ring, s if s is not None else torch.cuda.current_stream(g.index), vbox[0])

        try:
            return self._gpu_submit(ring, g, stream, sqes, finish, on_wait, vbox)
        except BaseException:
            if not vbox:
                buf.in_doubt = False
                g.arena.give(buf, stream)
            raise

    def _staging_take(self, g: "_Gpu", nbytes: int, stream):
        """A staging buffer of ``g``'s arena (given back by the request's finishing step); PyTorch refusing to share
        one is TZIP_UNSUPPORTED."""
        from ._cuda import ShareError

        try:
            return g.arena.take(max(1, nbytes), stream)
        except ShareError as e:
            raise TzipDaemonError("TZIP_UNSUPPORTED", f"cannot stage CUDA tensors for the daemon: {e}") from None

    # decompress
    def _decompress_submit(self, items: list, outs: list, single: bool, verify: bool,
                           streams: dict[int, Any] | None) -> _ring.Handle | None:
        """The call as ring requests, submitted now, or None: not for the ring (then ZeroMQ, as before)."""
        if self._ring_caps is None or self._sid is None or not items:
            return None
        groups: dict[int | None, list[int]] = {}
        for i, (ct, o) in enumerate(zip(items, outs)):
            if ct.nbytes == 0 or ct.payload.numel() == 0:
                return None
            target = o.device if o is not None else ct.payload.device
            key = None if target.type == "cpu" else (target.index or 0)
            if key is None:
                if o is not None and o.is_contiguous() and _shm.find(o.data_ptr(), ct.nbytes) is None \
                        and _shm.torch_shm_handle(o) is not None:
                    return None  # PyTorch's shared memory: zero copy through ZeroMQ
            else:
                if self._ring_sm_budget() is None or not self._gpu_reachable(self._gpu(key)):
                    return None
            groups.setdefault(key, []).append(i)
        for key, idx in groups.items():
            # Staging bytes of the ring request (GPU: frames and results; CPU: frames and the small results).
            stage = sum(_align(items[i].payload.numel()) + (_align(items[i].nbytes) if key is not None or
                        items[i].nbytes < DEDICATED_MIN_BYTES else 0) for i in idx)
            if stage > MAX_STAGE_BYTES and (key is not None or len(idx) > 1):
                return None
        try:
            for key in groups:
                if self._ring(key) is None:
                    return None
        except DaemonUnavailableError:
            return None
        tag = _ring.STREAM_TAGS.get(_stream_tag.get(), 0)
        n = len(items)
        if len(groups) == 1:
            key, idx = next(iter(groups.items()))
            return self._decompress_start(key, [items[i] for i in idx], [outs[i] for i in idx], verify, streams, tag,
                                          (lambda r: r[0]) if single else (lambda r: r))
        parts = [(idx, self._decompress_start(key, [items[i] for i in idx], [outs[i] for i in idx], verify, streams, tag,
                                              lambda r: r)) for key, idx in groups.items()]
        return _gather(parts, n, single)

    def _decompress_start(self, key: int | None, cts: list[CompressedTensor], outs: list, verify: bool,
                          streams: dict[int, Any] | None, tag: int, post) -> _ring.Handle:
        stream = None if key is None else _stream_for(streams, key)
        ctx = contextvars.copy_context()

        def fallback(err: BaseException | None):
            if err is not None and not isinstance(err, (DaemonUnavailableError, TzipDaemonError)):
                raise err
            return post(ctx.run(self._decompress, cts, outs, False, verify, None if key is None else {key: stream}, False))

        ring = self._ring(key)
        if ring is None:
            return _done_handle(fallback, None)
        try:
            if key is None:
                return self._decompress_start_cpu(ring, cts, outs, verify, tag, post, fallback)
            return self._decompress_start_gpu(ring, self._gpu(key), cts, outs, verify, stream, tag, post, fallback)
        except (DaemonUnavailableError, TzipDaemonError) as e:
            return _done_handle(fallback, e)

    def _decompress_start_cpu(self, ring: _ring.Ring, cts: list[CompressedTensor], outs: list, verify: bool, tag: int,
                              post, fallback) -> _ring.Handle:
        plans = []
        lent: list[_shm.Segment] = []
        stage = 0
        for ct, o in zip(cts, outs):
            frame = ct.payload.detach()
            if frame.device.type != "cpu":
                frame = frame.cpu()
            if not frame.is_contiguous():
                frame = frame.contiguous()
            found = _shm.find(frame.data_ptr(), frame.numel())
            fzc = None if found is None else (found[0], found[2])
            dest = result = None
            if o is not None:
                if o.is_contiguous():
                    found = _shm.find(o.data_ptr(), ct.nbytes)
                    dest = None if found is None else (found[0], found[2])
            elif ct.nbytes >= DEDICATED_MIN_BYTES:
                seg, u8 = self._results.lend(ct.nbytes)
                lent.append(seg)
                result = from_bytes(u8, ct.dtype, tuple(ct.shape))
                dest = (seg.name, 0)
            plans.append([ct, o, frame, fzc, dest, result, 0, 0])
            stage += (0 if fzc else _align(frame.numel())) + (0 if dest else _align(ct.nbytes))
        seg = self._arena.take(max(1, stage))
        try:
            names = [seg.name] + [p[3][0] for p in plans if p[3]] + [p[4][0] for p in plans if p[4]]
            regions = self._ring_shm(ring, list(dict.fromkeys(names)))
            here = regions[seg.name]
            flags = _ring.F_VERIFY if verify else 0
            sqes = []
            off = 0
            for p in plans:
                ct, o, frame, fzc, dest = p[0], p[1], p[2], p[3], p[4]
                n = frame.numel()
                if fzc is not None:
                    src = (regions[fzc[0]], fzc[1], n)
                else:
                    ctypes.memmove(seg.base + off, frame.data_ptr(), n)  # contiguous uint8
                    src = (here, off, n)
                    off += _align(n)
                if dest is not None:
                    dst = (regions[dest[0]], dest[1], ct.nbytes)
                else:
                    p[7] = off
                    dst = (here, off, ct.nbytes)
                    off += _align(ct.nbytes)
                sqes.append(_ring.sqe(_ring.OP_DECOMPRESS, flags, stream=tag, src=src, dst=dst))
        except BaseException:
            self._arena.give(seg)
            raise

        def finish(res):
            if isinstance(res, BaseException):
                seg.close()
                for s in lent:
                    self._results.discard(s)
                return fallback(res)
            try:
                err = _ring.Handle.error_of(res)
                if err is not None:
                    raise err
                results = []
                for (ct, o, _f, _fz, dest, result, _x, out_off), (_st, _c, n, _m) in zip(plans, res):
                    if n != ct.nbytes:
                        raise TzipDaemonError("TZIP_CORRUPT", f"the frame holds {n} bytes, the CompressedTensor says {ct.nbytes}")
                    if o is not None:
                        if dest is None:
                            if o.is_contiguous():
                                ctypes.memmove(o.data_ptr(), seg.base + out_off, ct.nbytes)
                            else:
                                copy_from_bytes(o, seg.u8[out_off : out_off + ct.nbytes])
                        results.append(o)
                    elif result is not None:
                        results.append(result)
                    else:
                        flat = torch.empty(ct.nbytes, dtype=torch.uint8)
                        ctypes.memmove(flat.data_ptr(), seg.base + out_off, ct.nbytes)
                        results.append(from_bytes(flat, ct.dtype, ct.shape))
            finally:
                self._arena.give(seg)
            return post(results)

        return self._ring_submit(ring, sqes, finish)

    def _decompress_start_gpu(self, ring: _ring.Ring, g: "_Gpu", cts: list[CompressedTensor], outs: list, verify: bool,
                              stream, tag: int, post, fallback) -> _ring.Handle:
        from ._cuda import gpu_copy_from_bytes, gpu_copy_many, regions_of

        budget = self._ring_sm_budget() or 0
        with torch.cuda.device(g.index), torch.cuda.stream(stream):
            frames = []
            for ct in cts:
                f = ct.payload.detach()
                if f.device != g.device:
                    f = f.to(g.device)
                frames.append(f if f.is_contiguous() else f.contiguous())
            stage = sum(_align(f.numel()) + _align(ct.nbytes) for f, ct in zip(frames, cts))
            buf = self._staging_take(g, stage, stream)
            try:
                region = self._ring_gpu_buffer(ring, g, buf)
                flags = _ring.F_VERIFY if verify else 0
                sqes = []
                staged: list[tuple[int, int]] = []
                out_offs: list[int] = []
                off = 0
                for f, ct in zip(frames, cts):
                    n = f.numel()
                    staged.append((off, n))
                    src = (region, off, n)
                    off += _align(n)
                    out_offs.append(off)
                    sqes.append(_ring.sqe(_ring.OP_DECOMPRESS, flags, sm_budget=budget, stream=tag, src=src,
                                          dst=(region, off, ct.nbytes)))
                    off += _align(ct.nbytes)
                gpu_copy_many(regions_of(buf.u8, staged), frames)
                # The results exist now (written in stream order once the daemon is done: see queue_copies); new ones
                # as bytes seen as their dtype (every dtype, the sub-byte ones too).
                flats = [None if o is not None else torch.empty(ct.nbytes, dtype=torch.uint8, device=g.device)
                         for ct, o in zip(cts, outs)]
                results = [o if o is not None else from_bytes(f, ct.dtype, ct.shape) for ct, o, f in zip(cts, outs, flats)]
            except BaseException:
                g.arena.give(buf, stream)
                raise
        buf.in_doubt = True
        state = {"copied": None}  # the stream the copies out of the arena were queued on, and the event after them
        lock = threading.Lock()
        vbox: list[int] = []

        def queue_copies(s) -> None:
            """Once: ``s`` waits (on the GPU) for the done flag, then copies the results out of the arena, then the
            buffer goes back to the arena (its next user's stream waits for these copies). Later calls: ``s`` waits
            for those copies."""
            with lock:
                if state["copied"] is not None:
                    if s is not state["copied"][0] and state["copied"][1] is not None:
                        s.wait_event(state["copied"][1])
                    return
                with torch.cuda.device(g.index), torch.cuda.stream(s):
                    self._gpu_wait_done(ring, s, vbox[0])
                    direct, srcs = [], []
                    for f, ct, o, oo in zip(flats, cts, outs, out_offs):
                        src = buf.u8[oo : oo + ct.nbytes]
                        if f is not None:
                            direct.append(f)
                            srcs.append(src)
                        elif o.is_contiguous():
                            direct.append(_u8_of(o))
                            srcs.append(src)
                        else:
                            gpu_copy_from_bytes(o, src)  # any layout: a copy of its own
                    gpu_copy_many(direct, srcs)
                    ev = torch.cuda.Event()
                    ev.record(s)
                    state["copied"] = (s, ev)
                buf.in_doubt = False
                g.arena.give(buf, s)

        def finish(res):
            if isinstance(res, BaseException):
                if vbox:
                    buf.share.poison()  # the daemon's stream may still use it: never reused nor freed
                else:
                    buf.in_doubt = False
                    g.arena.give(buf, stream)
                return fallback(res)
            err = _ring.Handle.error_of(res)
            if err is not None:
                with lock:
                    if state["copied"] is None:
                        buf.in_doubt = False
                        g.arena.give(buf, stream)
                        state["copied"] = (stream, None)
                raise err
            for ct, (_st, _c, n, _m) in zip(cts, res):
                if n != ct.nbytes:
                    raise TzipDaemonError("TZIP_CORRUPT", f"the frame holds {n} bytes, the CompressedTensor says {ct.nbytes}")
            if state["copied"] is None:
                queue_copies(stream)
            return post(results)

        def on_wait(s):
            queue_copies(s if s is not None else torch.cuda.current_stream(g.index))

        try:
            return self._gpu_submit(ring, g, stream, sqes, finish, on_wait, vbox)
        except BaseException:
            if not vbox:
                buf.in_doubt = False
                g.arena.give(buf, stream)
            raise

    def _compress_raw(self, t: torch.Tensor) -> CompressedTensor:
        """The fallback: a frame of codec raw, written here (for a CUDA tensor: on the CPU, then copied to its GPU)."""
        shape = tuple(t.shape)
        dl, wshape = wire_dtype(t.dtype, shape)
        fdtype, fshape = frame_layout(*dl, wshape)
        nbytes = t.numel() * t.element_size()
        if t.device.type == "cpu":
            flat = torch.empty(nbytes, dtype=torch.uint8)
            copy_into_bytes(flat, t)
        else:
            flat = _host_bytes(t)
        payload = encode_raw(flat, fdtype, fshape)
        if t.device.type != "cpu":
            payload = payload.to(t.device)
        return CompressedTensor(payload, t.dtype, t.shape, "raw", nbytes)

    # --- the GPU path -----------------------------------------------------------------------------
    def _gpu(self, index: int) -> _Gpu:
        g = self._gpus.get(index)
        if g is not None:
            return g
        from . import _cuda

        with self._lock:
            g = self._gpus.get(index)
            if g is None:
                device = torch.device("cuda", index)
                uuid = _cuda.device_uuid(index)
                g = _Gpu(index, device, uuid, _normalize_uuid(uuid), _cuda.GpuArena(device, self.gpu_arena_keep_bytes),
                         _cuda.EventPool(device), _cuda.DaemonEvents(device))
                self._gpus[index] = g
            if self._shares is None:
                self._shares = _cuda.ShareCache()
        return g

    def _gpu_reachable(self, g: _Gpu) -> bool:
        if g.norm in self._gpu_unreachable:
            return False
        return any(_normalize_uuid(d.get("uuid", "")) == g.norm for d in (self._daemon.get("gpus") or []) if isinstance(d, dict))

    def _gpu_reason(self, g: _Gpu) -> str:
        if not self._daemon.get("gpu"):
            return f"the daemon has no GPU ({self._daemon.get('gpu_reason', 'no reason given')})"
        seen = ", ".join(str(d.get("uuid")) for d in (self._daemon.get("gpus") or []) if isinstance(d, dict))
        return f"the daemon does not see {g.uuid} (it sees {seen or 'none'})"

    def _warn_gpu_fallback(self, g: _Gpu, reason: str) -> None:
        if g.norm in self._gpu_warned:
            return
        self._gpu_warned.add(g.norm)
        warnings.warn(f"tzip: {reason}; compress() stores tensors of cuda:{g.index} uncompressed (codec 'raw') and "
                      "decompress() goes through the CPU until a daemon serves that GPU", RuntimeWarning, stacklevel=4)

    def _share(self, t: torch.Tensor):
        """The cached share of ``t``'s storage, or None when PyTorch cannot share it (it is copied instead).
        Expandable segments raise TZIP_UNSUPPORTED with the ways to share such tensors."""
        from . import _cuda

        try:
            share, _new = self._shares.get(t.untyped_storage())
        except _cuda.ShareError as e:
            if e.expandable:
                raise TzipDaemonError("TZIP_UNSUPPORTED", str(e)) from None
            return None
        return share

    @contextlib.contextmanager
    def _staging(self, g: _Gpu, nbytes: int, stream):
        """A staging buffer of ``g``'s arena for one request (see _cuda.GpuArena.lease); PyTorch refusing to share
        one is TZIP_UNSUPPORTED (expandable segments, the cudaMallocAsync backend)."""
        from ._cuda import ShareError

        try:
            lease = g.arena.lease(max(1, nbytes), stream)
            buf = lease.__enter__()
        except ShareError as e:
            raise TzipDaemonError("TZIP_UNSUPPORTED", f"cannot stage CUDA tensors for the daemon: {e}") from None
        try:
            yield buf
        except BaseException:
            if not lease.__exit__(*sys.exc_info()):
                raise
        else:
            lease.__exit__(None, None, None)

    def _gpu_request(self, g: _Gpu, op: str, body: dict[str, Any], stream, buf, shares: list) -> dict[str, Any]:
        """One GPU request: records the wait event, calls, settles PyTorch's counters, waits on the daemon's event."""
        ev, ev_handle = g.events.record(stream)
        body["wait_event"] = ev_handle
        buf.in_doubt = True

        def settle() -> None:  # the daemon holds nothing of ours any more (it may keep the allocations mapped)
            buf.in_doubt = False
            g.events.give(ev, ev_handle)
            with self._release_lock:
                for sh in [*shares, buf.share]:
                    self._gpu_handles[sh.handle] = None
            for sh in shares:
                sh.release()

        try:
            reply = self._call(op, body)
        except TzipDaemonError as e:
            settle()  # an answer
            if e.code == "TZIP_NO_DEVICE":
                self._gpu_unreachable.add(g.norm)
                raise _NoDevice(e.detail) from None
            raise
        except BaseException as e:
            if isinstance(e, DaemonUnavailableError) and not self._daemon_alive():
                settle()  # the daemon process is gone, and its CUDA context with it
            else:
                # No answer (a timeout): the daemon may still use the memory. PyTorch's counters stay held, so the
                # blocks are never handed out again (leaked, safely); the buffer and the event are not reused.
                for sh in shares:
                    sh.poison()
            raise
        settle()
        handle = reply.get("event_handle")
        if handle:
            stream.wait_event(g.daemon_events.get(bytes(handle)))
        return reply

    def _plan_gpu(self, t: torch.Tensor) -> _GpuItem:
        shape = tuple(t.shape)
        dl, wshape = wire_dtype(t.dtype, shape)
        nbytes = t.numel() * t.element_size()
        _, fshape = frame_layout(*dl, wshape)
        share = self._share(t) if nbytes >= self.gpu_share_min_bytes and t.is_contiguous() else None
        return _GpuItem(t, dl, wshape, nbytes, max_compressed_size(nbytes, len(fshape)), share)

    def _compress_gpu(self, g: _Gpu, tensors: list[torch.Tensor], codec: str, stream) -> list[CompressedTensor]:
        if not self._gpu_reachable(g):
            return self._compress_gpu_fallback(g, tensors, self._gpu_reason(g))
        out: list[CompressedTensor] = [None] * len(tensors)  # type: ignore[list-item]
        remote = []
        for i, t in enumerate(tensors):
            if t.numel() == 0:
                # no bytes to share: the frame is the CPU path's (the codec writes the same bytes everywhere)
                ct = self._compress_cpu([torch.empty(t.shape, dtype=t.dtype)], codec)[0]
                out[i] = CompressedTensor(ct.payload.to(g.device), t.dtype, t.shape, ct.codec, 0)
            else:
                remote.append(i)
        try:
            with torch.cuda.device(g.index), torch.cuda.stream(stream):
                items = [self._plan_gpu(tensors[i]) for i in remote]

                def stage_of(it: _GpuItem) -> int:
                    return (0 if it.share is not None else _align(it.nbytes)) + _align(it.capacity)

                done: list[CompressedTensor] = []
                for batch in self._batches(items, stage_of, _BYTES_PER_GPU_ITEM):
                    done.extend(self._compress_gpu_batch(g, batch, codec, stream, sum(stage_of(it) for it in batch)))
        except _NoDevice as e:
            return self._compress_gpu_fallback(g, tensors, str(e))
        for i, ct in zip(remote, done):
            out[i] = ct
        return out

    def _compress_gpu_batch(self, g: _Gpu, batch: list[_GpuItem], codec: str, stream, stage: int) -> list[CompressedTensor]:
        from ._cuda import StagingRegions, gpu_bytes_of, gpu_copy_many, regions_of

        with self._staging(g, stage, stream) as buf:
            arena = StagingRegions(buf.share, g.uuid, g.index, self._version >= 2)
            off = 0
            entries = []
            staged: list[tuple[int, int]] = []  # arena regions the staged tensors are copied into
            staged_src: list[torch.Tensor] = []
            for it in batch:
                if it.share is not None:
                    data = it.share.wire(g.uuid, g.index)
                    byte_offset = it.tensor.storage_offset() * it.tensor.element_size()
                else:
                    staged.append((off, it.nbytes))
                    staged_src.append(gpu_bytes_of(it.tensor))
                    data = arena.region(off, it.nbytes)
                    byte_offset = 0
                    off += _align(it.nbytes)
                it.out_off = off
                off += _align(it.capacity)
                entries.append({
                    "tensor": {"device": {"type": DL_CUDA, "id": g.index}, "dtype": {"code": it.dl[0], "bits": it.dl[1], "lanes": it.dl[2]},
                               "shape": list(it.wshape), "byte_offset": byte_offset, "data": data},
                    "out": arena.region(it.out_off, it.capacity),
                })
            gpu_copy_many(regions_of(buf.u8, staged), staged_src)
            reply = self._gpu_request(g, "compress", arena.body({"codec": codec, "tensors": entries}), stream, buf,
                                      [it.share for it in batch if it.share is not None])
            frames = reply["frames"]
            sizes = []
            for it, fr in zip(batch, frames):
                n = int(fr["bytes"])
                if not 0 < n <= it.capacity:
                    raise TzipDaemonError("TZIP_CORRUPT", f"the daemon reported a frame of {n} bytes (capacity {it.capacity})")
                sizes.append(n)
            # Each payload is an allocation of its own (a view of a shared one would make torch.save write them all).
            payloads = [torch.empty(n, dtype=torch.uint8, device=g.device) for n in sizes]
            gpu_copy_many(payloads, regions_of(buf.u8, [(it.out_off, n) for it, n in zip(batch, sizes)]))
            return [CompressedTensor(payload, it.tensor.dtype, it.tensor.shape, str(fr["codec"]), it.nbytes)
                    for it, fr, payload in zip(batch, frames, payloads)]

    def _compress_gpu_fallback(self, g: _Gpu, tensors: list[torch.Tensor], reason: str) -> list[CompressedTensor]:
        if self.strict:
            raise DeviceUnavailableError("TZIP_NO_DEVICE", f"cannot compress tensors of cuda:{g.index}: {reason}")
        self._warn_gpu_fallback(g, reason)
        return [self._compress_raw(t) for t in tensors]

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
        budget = _checked_sm_budget(sm_budget)
        items, outs, single = self._decompress_args(cts, out)
        return _with_sm_budget(budget, self._decompress, items, outs, single, verify, None)

    def decompress_async(self, cts, out=None, verify: bool = True, *, sm_budget: int | None = None) -> _ring.Handle:
        """:meth:`decompress` without waiting: returns a :class:`tzip._ring.Handle`, a concurrent.futures.Future of
        what :meth:`decompress` returns, with ``wait(stream=None)``.

        Through the submission ring (protocol version 4), for CUDA results: the frames are read after the work
        queued so far on the caller's current stream, ``wait(stream)`` makes ``stream`` wait on the GPU (no CPU wait)
        and then copy the results into place: tensors used on ``stream`` afterwards hold the decompressed values
        (the tensors are ``result()``'s; a failed request raises from ``result()``). Otherwise (ZeroMQ, CPU): as
        :meth:`compress_async`.

        Raises: as :meth:`decompress`, from ``result()`` (argument errors at once)."""
        self._check_pid()
        budget = _checked_sm_budget(sm_budget)
        items, outs, single = self._decompress_args(cts, out)
        streams = _caller_streams([*(o for o in outs if isinstance(o, torch.Tensor)),
                                   *(ct.payload for ct in items if isinstance(ct, CompressedTensor))])
        try:
            handle = _with_sm_budget(budget, self._decompress_start_call, items, outs, single, verify, streams)
        except (ValueError, TypeError, TzipDaemonError) as e:
            return _done_handle(_raiser(e), None)
        if handle is not None:
            return handle
        return self._pool_handle(streams, _with_sm_budget, budget, self._decompress, items, outs, single, verify, streams,
                                 False)

    def _decompress_start_call(self, items: list, outs: list, single: bool, verify: bool,
                               streams: dict[int, Any] | None) -> _ring.Handle | None:
        self._check_decompress_args(items, outs)
        if not self._ring_caps or self._sid is None or not self._ring_worth(items, outs):
            return None
        h = self._decompress_submit(items, outs, single, verify, streams)
        if h is not None:
            for r in list(self._rings.values()):
                r.watch()
        return h

    def _ring_worth(self, items: list, outs: list) -> bool:
        """Whether every frame needs the daemon (raw frames for the CPU are decoded here, as without the ring)."""
        for ct, o in zip(items, outs):
            target = o.device if o is not None else ct.payload.device
            if ct.codec == "raw" and target.type == "cpu":
                return False
        return True

    def _wait_handle(self, h: _ring.Handle):
        """The value of a blocking call's handle (its request timeout: DaemonUnavailableError)."""
        try:
            return h.result(self.request_timeout)
        except concurrent.futures.TimeoutError:
            raise DaemonUnavailableError(f"no completion from the tzip daemon's ring in {self.request_timeout:g} s") from None

    @staticmethod
    def _decompress_args(cts, out) -> tuple[list, list, bool]:
        if isinstance(cts, (bytes, bytearray, memoryview)):
            raise TypeError(f"expected a CompressedTensor or a list of them, got {type(cts).__name__} "
                            "(bytes from CompressedTensor.to_bytes(): CompressedTensor.from_bytes(...) first)")
        single = isinstance(cts, CompressedTensor)
        items = [cts] if single else list(cts)
        if single:
            outs = [out]
        elif out is None:
            outs = [None] * len(items)
        elif isinstance(out, torch.Tensor):
            raise TypeError("out= of a batch is a list (a tensor or None per compressed tensor), not one tensor")
        else:
            outs = list(out)
            if len(outs) != len(items):
                raise ValueError(f"out has {len(outs)} entries for {len(items)} compressed tensors")
        return items, outs, single

    def _decompress(self, items: list, outs: list, single: bool, verify: bool, streams: dict[int, Any] | None,
                    use_ring: bool = True):
        self._check_pid()
        self._check_decompress_args(items, outs)
        if use_ring and self._ring_caps and self._sid is not None and self._ring_worth(items, outs):
            h = self._decompress_submit(items, outs, single, verify, streams)
            if h is not None:
                return self._wait_handle(h)
        results: list[torch.Tensor | None] = [None] * len(items)
        remote = []
        for i, (ct, o) in enumerate(zip(items, outs)):
            target = o.device if o is not None else ct.payload.device
            if ct.codec == "raw" and (target.type == "cpu" or not self.connected or not self._gpu_reachable(self._gpu(target.index or 0))):
                results[i] = self._decompress_raw(ct, o, verify)
            else:
                remote.append(i)
        if remote:
            for attempt in range(2):
                try:
                    if not self._ensure_session(force=attempt > 0):
                        raise self._unavailable()
                    self._decompress_remote(items, outs, remote, verify, streams, results)
                    break
                except DaemonUnavailableError as e:
                    if attempt == 0 and self.spawn:
                        continue  # the daemon went away during the call: start one and try once more
                    for i in remote:
                        if results[i] is None and items[i].codec == "raw":
                            results[i] = self._decompress_raw(items[i], outs[i], verify)
                    rest = [i for i in remote if results[i] is None]
                    if rest:
                        raise DaemonUnavailableError(f"cannot decompress codec {items[rest[0]].codec!r} frames: {e}") from None
                    break
        return results[0] if single else results

    @staticmethod
    def _check_decompress_args(items: list, outs: list) -> None:
        for ct, o in zip(items, outs):
            if not isinstance(ct, CompressedTensor):
                raise TypeError(f"expected CompressedTensor, got {type(ct).__name__}")
            if o is not None:
                check_supported(o)
                _device(o)
                if o.dtype != ct.dtype or tuple(o.shape) != tuple(ct.shape):
                    raise ValueError(f"out is {o.dtype} {tuple(o.shape)}, the compressed tensor {ct.dtype} {tuple(ct.shape)}")
            if ct.payload.device.type != "cpu":
                _device(ct.payload)

    def _decompress_remote(self, items: list[CompressedTensor], outs: list, idx: list[int], verify: bool,
                           streams: dict[int, Any] | None, results: list) -> None:
        """Fills ``results[i]`` for ``i`` in ``idx``: one request per batch of CPU destinations and per batch of each GPU's."""
        groups: dict[int | None, list[int]] = {}
        for i in idx:
            if results[i] is not None:
                continue
            o = outs[i]
            target = o.device if o is not None else items[i].payload.device
            groups.setdefault(None if target.type == "cpu" else (target.index or 0), []).append(i)
        for key, part in groups.items():
            cts = [items[i] for i in part]
            os_ = [outs[i] for i in part]
            if key is None:
                done = self._decompress_cpu([self._on_cpu(ct) for ct in cts], os_, verify)
            else:
                done = self._decompress_gpu(self._gpu(key), cts, os_, verify, _stream_for(streams, key))
            for i, t in zip(part, done):
                results[i] = t

    @staticmethod
    def _on_cpu(ct: CompressedTensor) -> CompressedTensor:
        if ct.payload.device.type == "cpu":
            return ct
        return CompressedTensor(ct.payload.detach().cpu(), ct.dtype, ct.shape, ct.codec, ct.nbytes)

    def _decompress_raw(self, ct: CompressedTensor, out: torch.Tensor | None, verify: bool) -> torch.Tensor:
        """A raw frame decoded here, on the CPU; the result goes to ``out`` or to the payload's device."""
        frame = ct.payload.detach().cpu().contiguous()
        header = read_header(frame)
        if header.nbytes != ct.nbytes:
            raise ValueError(f"the frame holds {header.nbytes} bytes, the CompressedTensor says {ct.nbytes}")
        body = decode_raw(frame, header, verify)
        if out is not None and out.device.type == "cpu":
            copy_from_bytes(out, body)
            return out
        flat = torch.empty(body.numel(), dtype=torch.uint8)
        copy_bytes(flat, body)
        host = from_bytes(flat, ct.dtype, ct.shape)
        if out is not None:
            return self._place(host, out)
        return host if ct.payload.device.type == "cpu" else _to_device(host, ct.payload.device)

    @staticmethod
    def _place(host: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Copies a CPU result into ``out`` on a GPU (as integers, any dtype); returns ``out``."""
        from ._cuda import gpu_copy_from_bytes

        gpu_copy_from_bytes(out, _host_bytes(host).to(out.device))
        return out

    def _decompress_cpu(self, cts: list[CompressedTensor], outs: list[torch.Tensor | None], verify: bool) -> list[torch.Tensor]:
        lent: list[_shm.Segment] = []
        try:
            return self._decompress_cpu_planned(cts, outs, verify, lent)
        except TzipDaemonError:
            raise  # answered: the daemon is done with the segments, they may be reused
        except BaseException:
            for seg in lent:  # the daemon may not be done with them (no answer): never reuse
                self._results.discard(seg)
            raise

    def _decompress_cpu_planned(self, cts: list[CompressedTensor], outs: list[torch.Tensor | None], verify: bool,
                                lent: list[_shm.Segment]) -> list[torch.Tensor]:
        plans = []
        for ct, o in zip(cts, outs):
            frame = ct.payload if ct.payload.is_contiguous() else ct.payload.contiguous()
            dl, wshape = wire_dtype(ct.dtype, tuple(ct.shape))
            d = _Frame(ct, o, frame, _zero_copy_handle(frame, frame.numel()), dl, wshape)
            if o is not None:
                d.dest = _zero_copy_handle(o, ct.nbytes)
            elif ct.nbytes >= DEDICATED_MIN_BYTES:
                seg, u8 = self._results.lend(ct.nbytes)
                d.result = from_bytes(u8, ct.dtype, tuple(ct.shape))
                d.dest = (seg.name, 0)
                lent.append(seg)
            plans.append(d)

        def stage_of(d: _Frame) -> int:
            return (0 if d.frame_zc else _align(d.frame.numel())) + (0 if d.dest else _align(d.ct.nbytes))

        results: list[torch.Tensor] = []
        for batch in self._batches(plans, stage_of):  # type: ignore[arg-type]
            with self._arena.lease(max(1, sum(stage_of(d) for d in batch))) as seg:
                off = 0
                entries = []
                for d in batch:
                    n = d.frame.numel()
                    if d.frame_zc is not None:
                        fh = {"kind": "shm", "name": d.frame_zc[0], "offset": d.frame_zc[1], "size": n}
                    else:
                        copy_bytes(seg.u8[off : off + n], d.frame)
                        fh = {"kind": "shm", "name": seg.name, "offset": off, "size": n}
                        d.frame_off = off
                        off += _align(n)
                    if d.dest is not None:
                        oh = {"kind": "shm", "name": d.dest[0], "offset": d.dest[1], "size": d.ct.nbytes}
                    else:
                        oh = {"kind": "shm", "name": seg.name, "offset": off, "size": d.ct.nbytes}
                        d.out_off = off
                        off += _align(d.ct.nbytes)
                    entries.append({
                        "frame": fh,
                        "out": {"device": {"type": DL_CPU, "id": 0}, "dtype": {"code": d.dl[0], "bits": d.dl[1], "lanes": d.dl[2]},
                                "shape": list(d.wshape), "byte_offset": 0, "data": oh},
                    })
                reply = self._call("decompress", {"frames": entries, "verify": verify})
                for d, info in zip(batch, reply["tensors"]):
                    if int(info["nbytes"]) != d.ct.nbytes:
                        raise TzipDaemonError("TZIP_CORRUPT", f"the frame holds {info['nbytes']} bytes, the CompressedTensor says {d.ct.nbytes}")
                    if d.out is not None:
                        if d.dest is None:
                            copy_from_bytes(d.out, seg.u8[d.out_off : d.out_off + d.ct.nbytes])
                        results.append(d.out)
                    elif d.result is not None:
                        results.append(d.result)
                    else:
                        flat = torch.empty(d.ct.nbytes, dtype=torch.uint8)
                        copy_bytes(flat, seg.u8[d.out_off : d.out_off + d.ct.nbytes])
                        results.append(from_bytes(flat, d.ct.dtype, d.ct.shape))
        return results

    def _decompress_gpu(self, g: _Gpu, cts: list[CompressedTensor], outs: list, verify: bool, stream) -> list[torch.Tensor]:
        if not self._gpu_reachable(g):
            return self._decompress_gpu_via_cpu(g, cts, outs, verify, self._gpu_reason(g))
        results: list[torch.Tensor | None] = [None] * len(cts)
        try:
            with torch.cuda.device(g.index), torch.cuda.stream(stream):
                plans = []
                for k, (ct, o) in enumerate(zip(cts, outs)):
                    if ct.nbytes == 0:
                        # no bytes: the frame is checked by the CPU path, the result made here
                        self._decompress_cpu([self._on_cpu(ct)], [None], verify)
                        results[k] = o if o is not None else torch.empty(ct.shape, dtype=ct.dtype, device=g.device)
                    else:
                        plans.append(self._plan_gpu_frame(g, k, ct, o))

                def stage_of(d: _GpuFrame) -> int:
                    return (0 if d.fshare is not None else _align(d.frame.numel())) + (0 if d.dshare is not None else _align(d.ct.nbytes))

                for batch in self._batches(plans, stage_of, _BYTES_PER_GPU_ITEM):
                    self._decompress_gpu_batch(g, batch, verify, stream, sum(stage_of(d) for d in batch), results)
        except _NoDevice as e:
            return self._decompress_gpu_via_cpu(g, cts, outs, verify, str(e))
        return results  # type: ignore[return-value]

    def _plan_gpu_frame(self, g: _Gpu, k: int, ct: CompressedTensor, o: torch.Tensor | None) -> _GpuFrame:
        frame = ct.payload.detach()
        if frame.device != g.device:
            frame = frame.to(g.device)
        if not frame.is_contiguous():
            frame = frame.contiguous()
        dl, wshape = wire_dtype(ct.dtype, tuple(ct.shape))
        d = _GpuFrame(k, ct, o, frame, dl, wshape)
        if frame.numel() >= self.gpu_share_min_bytes:
            d.fshare = self._share(frame)
        if ct.nbytes >= self.gpu_share_min_bytes:
            if o is not None:
                if o.is_contiguous():
                    d.dshare = self._share(o)
                    d.dest_offset = o.storage_offset() * o.element_size()
            else:
                flat = torch.empty(ct.nbytes, dtype=torch.uint8, device=g.device)
                d.dshare = self._share(flat)
                if d.dshare is not None:
                    d.result = from_bytes(flat, ct.dtype, ct.shape)
        return d

    def _decompress_gpu_batch(self, g: _Gpu, batch: list[_GpuFrame], verify: bool, stream, stage: int, results: list) -> None:
        from ._cuda import StagingRegions, gpu_copy_from_bytes, gpu_copy_many, regions_of

        with self._staging(g, stage, stream) as buf:
            arena = StagingRegions(buf.share, g.uuid, g.index, self._version >= 2)
            off = 0
            entries = []
            shares = []
            staged: list[tuple[int, int]] = []  # arena regions the frames not handed over are copied into
            staged_src: list[torch.Tensor] = []
            for d in batch:
                n = d.frame.numel()
                if d.fshare is not None:
                    fh = d.fshare.wire(g.uuid, g.index, d.frame.storage_offset(), n)
                    shares.append(d.fshare)
                else:
                    staged.append((off, n))
                    staged_src.append(d.frame)
                    fh = arena.region(off, n)
                    off += _align(n)
                if d.dshare is not None:
                    data = d.dshare.wire(g.uuid, g.index)
                    byte_offset = d.dest_offset
                    shares.append(d.dshare)
                else:
                    d.out_off = off
                    data = arena.region(off, d.ct.nbytes)
                    byte_offset = 0
                    off += _align(d.ct.nbytes)
                entries.append({
                    "frame": fh,
                    "out": {"device": {"type": DL_CUDA, "id": g.index}, "dtype": {"code": d.dl[0], "bits": d.dl[1], "lanes": d.dl[2]},
                            "shape": list(d.wshape), "byte_offset": byte_offset, "data": data},
                })
            gpu_copy_many(regions_of(buf.u8, staged), staged_src)
            reply = self._gpu_request(g, "decompress", arena.body({"frames": entries, "verify": verify}), stream, buf, shares)
            fresh: list[torch.Tensor] = []  # new tensors the results in the arena are copied into, with their regions
            fresh_regions: list[tuple[int, int]] = []
            for d, info in zip(batch, reply["tensors"]):
                n = d.ct.nbytes
                if int(info["nbytes"]) != n:
                    raise TzipDaemonError("TZIP_CORRUPT", f"the frame holds {info['nbytes']} bytes, the CompressedTensor says {n}")
                if d.dshare is not None:
                    results[d.k] = d.out if d.out is not None else d.result
                elif d.out is not None:
                    gpu_copy_from_bytes(d.out, buf.u8[d.out_off : d.out_off + n])  # any layout: a copy of its own
                    results[d.k] = d.out
                else:
                    flat = torch.empty(n, dtype=torch.uint8, device=g.device)
                    fresh.append(flat)
                    fresh_regions.append((d.out_off, n))
                    results[d.k] = from_bytes(flat, d.ct.dtype, d.ct.shape)
            gpu_copy_many(fresh, regions_of(buf.u8, fresh_regions))

    def _decompress_gpu_via_cpu(self, g: _Gpu, cts: list[CompressedTensor], outs: list, verify: bool, reason: str) -> list[torch.Tensor]:
        """The daemon cannot reach this GPU: frames are decoded through the CPU path and copied back."""
        self._warn_gpu_fallback(g, reason)
        hosts: list[torch.Tensor | None] = [None] * len(cts)
        rest = []
        for k, ct in enumerate(cts):
            if ct.codec == "raw":
                hosts[k] = self._decompress_raw(self._on_cpu(ct), None, verify)
            else:
                rest.append(k)
        if rest:
            done = self._decompress_cpu([self._on_cpu(cts[k]) for k in rest], [None] * len(rest), verify)
            for k, h in zip(rest, done):
                hosts[k] = h
        out: list[torch.Tensor] = []
        for h, o in zip(hosts, outs):
            out.append(self._place(h, o) if o is not None else _to_device(h, g.device))  # type: ignore[arg-type]
        return out

    def release_gpu(self) -> int:
        """Asks the daemon to close its mappings of this client's GPU memory (they are opened again when needed).
        Call it after ``torch.cuda.empty_cache()``: a segment the caching allocator freed stays allocated on the GPU
        while the daemon maps it. Returns how many of this session's allocations the daemon let go of (one that
        another session also maps, or that a running request uses, is counted but closed later).

        Raises:
            TzipDaemonError: the daemon refused the request (e.g. an unknown session).
            DaemonUnavailableError: the daemon did not answer within 10 s."""
        self._check_pid()
        with self._release_lock:
            handles = list(self._gpu_handles)
            self._gpu_handles.clear()
        if not handles or self._sid is None:
            return 0
        reply = self._call("release", {"handles": handles}, timeout=10.0)
        return int(reply.get("released", 0))

    # --- lifetime -------------------------------------------------------------------------------
    def _pool(self) -> concurrent.futures.ThreadPoolExecutor:
        self._check_pid()
        with self._lock:
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(self._workers, thread_name_prefix="tzip-client")
            return self._executor

    def close(self) -> None:
        """Ends the session (the daemon drops this client's mappings), frees the arena, closes the sockets."""
        if self._closed or os.getpid() != self._pid:
            return
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        self._closing = True  # the heartbeat thread sends nothing more and opens no session after the goodbye
        self._wake.set()
        with self._ring_lock:
            rings = list(self._rings.values())
            self._rings.clear()
        if self._sid is not None:
            for ring in rings:
                if ring.sid == self._sid and ring.state != "dead":
                    try:
                        self._call("ring_close", {"ring": ring.id}, timeout=2.0)
                    except (DaemonUnavailableError, TzipDaemonError):
                        pass
            try:
                self._call("release", {"end": True}, timeout=2.0)
            except (DaemonUnavailableError, TzipDaemonError):
                pass
        for ring in rings:
            ring.close()  # the daemon unmapped it (ring_close, or the session's end): the file goes
        self._close_retired()
        # A request of the heartbeat thread still waiting gives up within one poll; only then are the sockets closed
        # (closing a socket another thread waits on aborts the process inside libzmq).
        self._transport.interrupt()
        if self._heartbeat is not None:
            self._heartbeat.join()
        self._closed = True
        self._sid = None
        self._wake.set()
        self._arena.close()
        self._results.close()
        for g in self._gpus.values():
            g.arena.close()
            g.events.clear()
            g.daemon_events.clear()
        if self._shares is not None:
            self._shares.clear()
        self._transport.close()

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
