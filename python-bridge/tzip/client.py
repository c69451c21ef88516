"""Client of the tzip daemon: compress and decompress PyTorch tensors through it.

    import tzip.client as tz          # (tzip.connect once tzip/__init__.py exports it)
    with tz.connect() as client:
        ct = client.compress(weight)                     # CompressedTensor
        cts = client.compress([p.grad for p in params])  # one request for the whole batch
        again = client.decompress(ct)                    # bit-identical tensor
        fut = client.compress_async(bucket)              # concurrent.futures.Future

How tensor bytes travel (docs/protocol.md): never through the socket. The daemon maps POSIX
shared-memory files (/dev/shm) the client names in its requests.

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

Every dtype of a CPU tensor is accepted (bool, integers, floats, bfloat16, complex, float8 and the
sub-byte/bits dtypes); quantized, sparse and meta tensors are refused. Bytes are copied through
integer views, so -0.0 and NaN payloads survive bit for bit.

When the daemon is away: with ``strict=True`` every call raises :class:`DaemonUnavailableError`.
Otherwise :meth:`Client.compress` returns uncompressed CompressedTensors (codec ``"raw"``, a
valid frame written here in Python) and warns once per outage; raw frames decompress here
without the daemon, other codecs need it (DaemonUnavailableError). The client reconnects on the
first call after the daemon is back; with ``spawn=True`` a daemon that died is started again within
the call (no fallback then). Nothing is ever silently altered: ``ct.codec`` says what was done.

A Client belongs to the process that made it (not usable after fork) and may be used from many
threads at once. Do not modify a tensor while a call that reads or writes it runs.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import secrets
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import torch

from . import _shm
from ._dlpack import (
    DL_CPU,
    check_supported,
    copy_bytes,
    copy_from_bytes,
    copy_into_bytes,
    frame_layout,
    from_bytes,
    wire_dtype,
)
from ._errors import DaemonSpawnError, DaemonUnavailableError, TzipDaemonError
from ._frame import decode_raw, encode_raw, max_compressed_size, read_header
from ._spawn import daemon_pid, daemon_running, default_socket_path, pid_alive, spawn_daemon
from ._transport import Transport
from .compressed import CompressedTensor

__all__ = [
    "Client",
    "connect",
    "CompressedTensor",
    "TzipDaemonError",
    "DaemonUnavailableError",
    "DaemonSpawnError",
    "CODECS",
    "PROTOCOL_VERSIONS",
]

_log = logging.getLogger("tzip")

#: Codecs a compress call accepts.
CODECS = ("auto", "fast", "max", "bytes", "raw")
#: Protocol versions this client speaks.
PROTOCOL_VERSIONS = [1]
#: Seconds between reconnection attempts while the daemon is away.
RETRY_INTERVAL_S = 1.0
#: Decompressed tensors of at least this many bytes get their own shared-memory segment (no copy).
DEDICATED_MIN_BYTES = 1 << 20
#: Staging bytes (inputs + output capacity) per request; larger batches are split (a single larger tensor goes alone).
MAX_STAGE_BYTES = 256 << 20
#: Estimated message bytes per tensor, to keep requests under the daemon's message cap.
_BYTES_PER_ITEM = 400
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
    if t.device.type != "cpu":
        raise TzipDaemonError(
            "TZIP_UNSUPPORTED",
            f"{t.device.type} tensors are not served yet: GPU tensors need the GPU build of tzip (CUDA IPC handles); "
            "move the tensor to the CPU",
        )
    return {"type": DL_CPU, "id": 0}


class Client:
    """A connection to the tzip daemon (see the module docstring). Use :func:`connect` to make one."""

    def __init__(self, socket: str | None = None, spawn: bool = True, strict: bool = False, *, name: str | None = None,
                 connect_timeout: float = 10.0, request_timeout: float | None = None, workers: int = 4):
        self.socket_path = os.path.abspath(socket) if socket else default_socket_path()
        self.spawn = spawn
        self.strict = strict
        self.name = (name or f"python pid {os.getpid()}")[:200]
        self.connect_timeout = connect_timeout
        self.request_timeout = request_timeout
        self._pid = os.getpid()
        self.shm_prefix = f"tzip-{self._pid}-{secrets.token_hex(8)}-"
        self._transport = Transport(self.socket_path)
        self._arena = _shm.Arena(self.shm_prefix, self._queue_release)
        self._lock = threading.RLock()
        self._sid: str | None = None
        self._daemon: dict[str, Any] = {}
        self._daemon_pid: int | None = None
        self._socket_ino: int | None = None
        self._limits: dict[str, Any] = {}
        self._heartbeat_s = 3.0
        self._next_attempt = 0.0
        self._last_error: Exception | None = None
        self._warned = False
        self._pending_release: list[str] = []
        self._release_lock = threading.RLock()  # finalizers (garbage collection) take it too
        self._closed = False
        self._wake = threading.Event()
        self._workers = workers
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._heartbeat: threading.Thread | None = None
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

    def _check_pid(self) -> None:
        if os.getpid() != self._pid:
            raise RuntimeError("a tzip Client cannot be used after fork(); call tzip.connect() in the child")
        if self._closed:
            raise RuntimeError("this tzip Client is closed")

    def _daemon_alive(self) -> bool:
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
        with self._lock:
            if self._sid is not None:
                return True
            now = time.monotonic()
            if not force and now < self._next_attempt:
                return False
            try:
                if self.spawn:
                    spawn_daemon(self.socket_path)
                elif not daemon_running(self.socket_path):
                    raise DaemonUnavailableError(f"no tzip daemon serves {self.socket_path} (start one with `tzip serve`)")
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
        pid = daemon_pid(self.socket_path)
        try:
            ino = os.stat(self.socket_path).st_ino
        except OSError:
            raise DaemonUnavailableError(f"no tzip daemon serves {self.socket_path}") from None
        self._daemon_pid, self._socket_ino = pid, ino
        self._transport.reset()
        msg = {"op": "hello", "versions": PROTOCOL_VERSIONS, "pid": self._pid, "shm_prefix": self.shm_prefix, "name": self.name}
        reply = self._transport.request(msg, self._daemon_alive, timeout=self.connect_timeout)
        if not reply.get("ok"):
            err = reply.get("error") or {}
            if err.get("code") == "TZIP_BUSY":  # shutting down, or full: as good as away
                raise DaemonUnavailableError(f"the tzip daemon at {self.socket_path} does not take clients now: {err.get('message')}")
            raise TzipDaemonError(str(err.get("code")), str(err.get("message")))
        self._daemon = dict(reply.get("daemon") or {})
        self._limits = dict(reply.get("limits") or {})
        self._heartbeat_s = max(0.05, int(reply.get("heartbeat_ms", 3000)) / 1000)
        # Liveness is judged by the lock file's pid (as seen from this pid namespace), when it was alive at hello.
        self._daemon_pid = pid
        with self._release_lock:
            self._pending_release.clear()  # the new session has mapped nothing yet
        self._sid = str(reply["sid"])
        if self._heartbeat is None:
            self._heartbeat = threading.Thread(target=self._heartbeat_loop, name="tzip-heartbeat", daemon=True)
            self._heartbeat.start()

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
            try:
                reply = self._transport.request(msg, self._daemon_alive, timeout if timeout is not None else self.request_timeout)
            except DaemonUnavailableError as e:
                self._mark_down(sid, e)
                raise
            if reply.get("ok"):
                return reply
            err = reply.get("error") or {}
            code = str(err.get("code"))
            if code == "TZIP_SESSION" and attempt == 0:
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
            many = len(self._pending_release) >= 64
        if many:
            self._wake.set()

    def _heartbeat_loop(self) -> None:
        while not self._closed:
            self._wake.wait(self._heartbeat_s)
            self._wake.clear()
            if self._closed or os.getpid() != self._pid:
                return
            if self._sid is None:
                continue
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
        seg = _shm.Segment(self._arena.new_name("t"), max(nbytes, 1), self._queue_release)
        return seg.tensor(dtype, shape)

    # --- compress -----------------------------------------------------------------------------
    def compress(self, tensors: torch.Tensor | Iterable[torch.Tensor], codec: str = "auto"):
        """Compresses one tensor (-> CompressedTensor) or a batch (-> list, one request per batch where it fits)."""
        self._check_pid()
        if codec not in CODECS:
            raise ValueError(f"unknown codec {codec!r}; one of {', '.join(CODECS)}")
        single = isinstance(tensors, torch.Tensor)
        items = [tensors] if single else list(tensors)
        for t in items:
            check_supported(t)
            _device(t)
        out = None
        for attempt in range(2):
            try:
                # The retry skips the reconnect back-off: it is the one extra attempt a spawning client makes.
                if not self._ensure_session(force=attempt > 0):
                    raise self._unavailable()
                out = self._compress_remote(items, codec)
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

    def compress_async(self, tensors, codec: str = "auto") -> concurrent.futures.Future:
        """:meth:`compress` on the client's worker threads; returns a Future."""
        return self._pool().submit(self.compress, tensors, codec)

    def _plan(self, t: torch.Tensor) -> _Item:
        shape = tuple(t.shape)
        dl, wshape = wire_dtype(t.dtype, shape)
        nbytes = t.numel() * t.element_size()
        _, fshape = frame_layout(*dl, wshape)
        capacity = max_compressed_size(nbytes, len(fshape))
        return _Item(t, dl, wshape, nbytes, capacity, _zero_copy_handle(t, nbytes))

    def _batches(self, items: list[_Item], stage_of) -> list[list[_Item]]:
        max_batch = int(self._limits.get("max_batch", 4096))
        max_items = max(1, min(max_batch, int(self._limits.get("max_message_bytes", 1 << 20)) // _BYTES_PER_ITEM))
        batches: list[list[_Item]] = []
        cur: list[_Item] = []
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

    def _compress_remote(self, tensors: list[torch.Tensor], codec: str) -> list[CompressedTensor]:
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

    def _compress_raw(self, t: torch.Tensor) -> CompressedTensor:
        """The fallback: a frame of codec raw, written here."""
        shape = tuple(t.shape)
        dl, wshape = wire_dtype(t.dtype, shape)
        fdtype, fshape = frame_layout(*dl, wshape)
        nbytes = t.numel() * t.element_size()
        flat = torch.empty(nbytes, dtype=torch.uint8)
        copy_into_bytes(flat, t)
        return CompressedTensor(encode_raw(flat, fdtype, fshape), t.dtype, t.shape, "raw", nbytes)

    # --- decompress ---------------------------------------------------------------------------
    def decompress(self, cts: CompressedTensor | Iterable[CompressedTensor], out=None, verify: bool = True):
        """Decompresses one CompressedTensor (-> tensor) or a batch (-> list).

        ``out``: a tensor (or, for a batch, a list with tensors or None) of the same dtype and shape to
        write into; returned filled. Raw frames are decoded here; other codecs need the daemon.
        """
        self._check_pid()
        single = isinstance(cts, CompressedTensor)
        items = [cts] if single else list(cts)
        if single:
            outs = [out]
        elif out is None:
            outs = [None] * len(items)
        else:
            outs = list(out)
            if len(outs) != len(items):
                raise ValueError(f"out has {len(outs)} entries for {len(items)} compressed tensors")
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
        results: list[torch.Tensor | None] = [None] * len(items)
        remote = []
        for i, (ct, o) in enumerate(zip(items, outs)):
            if ct.codec == "raw":
                results[i] = self._decompress_raw(ct, o, verify)
            else:
                remote.append(i)
        if remote:
            for attempt in range(2):
                try:
                    if not self._ensure_session(force=attempt > 0):
                        raise self._unavailable()
                    done = self._decompress_remote([items[i] for i in remote], [outs[i] for i in remote], verify)
                    break
                except DaemonUnavailableError as e:
                    if attempt == 0 and self.spawn:
                        continue  # the daemon went away during the call: start one and try once more
                    raise DaemonUnavailableError(f"cannot decompress codec {items[remote[0]].codec!r} frames: {e}") from None
            for i, t in zip(remote, done):
                results[i] = t
        return results[0] if single else results

    def decompress_async(self, cts, out=None, verify: bool = True) -> concurrent.futures.Future:
        """:meth:`decompress` on the client's worker threads; returns a Future."""
        return self._pool().submit(self.decompress, cts, out, verify)

    def _decompress_raw(self, ct: CompressedTensor, out: torch.Tensor | None, verify: bool) -> torch.Tensor:
        frame = ct.payload.detach().contiguous()
        header = read_header(frame)
        if header.nbytes != ct.nbytes:
            raise ValueError(f"the frame holds {header.nbytes} bytes, the CompressedTensor says {ct.nbytes}")
        body = decode_raw(frame, header, verify)
        if out is not None:
            copy_from_bytes(out, body)
            return out
        flat = torch.empty(body.numel(), dtype=torch.uint8)
        copy_bytes(flat, body)
        return from_bytes(flat, ct.dtype, ct.shape)

    def _decompress_remote(self, cts: list[CompressedTensor], outs: list[torch.Tensor | None], verify: bool) -> list[torch.Tensor]:
        plans = []
        for ct, o in zip(cts, outs):
            frame = ct.payload if ct.payload.is_contiguous() else ct.payload.contiguous()
            dl, wshape = wire_dtype(ct.dtype, tuple(ct.shape))
            d = _Frame(ct, o, frame, _zero_copy_handle(frame, frame.numel()), dl, wshape)
            if o is not None:
                d.dest = _zero_copy_handle(o, ct.nbytes)
            elif ct.nbytes >= DEDICATED_MIN_BYTES:
                seg = _shm.Segment(self._arena.new_name("t"), ct.nbytes, self._queue_release)
                d.result = seg.tensor(ct.dtype, tuple(ct.shape))
                d.dest = (seg.name, 0)
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
        if self._sid is not None:
            try:
                self._call("release", {"end": True}, timeout=2.0)
            except (DaemonUnavailableError, TzipDaemonError):
                pass
        self._closed = True
        self._sid = None
        self._wake.set()
        self._arena.close()
        if self._heartbeat is not None:
            self._heartbeat.join(timeout=2.0)
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
    /tmp/tzip-$UID/tzip.sock), starting one when none runs and ``spawn`` is true.

    ``strict=True``: raise DaemonUnavailableError when no daemon can be reached (now or later) instead of
    falling back to uncompressed frames. Other keyword arguments go to :class:`Client`.
    """
    return Client(socket, spawn, strict, **kwargs)
