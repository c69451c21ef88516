"""The client's requests through the submission ring (protocol version 4, docs/ring.md; :mod:`tzip._ring`): the
session's rings (opened on first use, one for CPU tensors and one per GPU; put aside with their session), the
regions registered on them (``ring_register`` / ``ring_release``), the SQEs of a call (one LINKed batch per call and
device) and the :class:`tzip._ring.Handle` of the call, whose finishing step copies the results out and falls back
to the ZeroMQ path when the ring could not take or finish the request. :class:`RingPath` is a part of
:class:`tzip.client.Client` (it uses the Client's session, arenas and GPU state)."""

from __future__ import annotations

import concurrent.futures
import ctypes
import dataclasses
import logging
import threading
import time
from typing import Any

import torch

from . import _ring, _shm
from ._codec_choice import codec_for
from ._cpu_path import DEDICATED_MIN_BYTES
from ._dlpack import copy_from_bytes, from_bytes, int_alias
from ._errors import DaemonUnavailableError, TzipDaemonError
from ._cuda import copy_raw, current_stream, device_scope, gpu_bytes_of, gpu_copy_from_bytes, gpu_copy_many, plain, regions_of, stream_scope
from ._cuda_segments import segment_key
from ._memops import allocation_of, ipc_handle, wait_value64, write_value64
from ._gpu_path import _Gpu, _NoDevice, _stream_for
from ._request import Request
from ._wire import _ALIGN, MAX_STAGE_BYTES, _align, _sqe_layout, cuda_device, cuda_region, shm_region
from .compressed import CompressedTensor

_log = logging.getLogger("tzip")


#: Entries of each submission ring (docs/ring.md; a power of two, at most hello's ``ring.entries_max``): batches of up
#: to this many tensors are one LINKed batch. Client(ring_entries=...) overrides it; 0 turns the ring off.
RING_ENTRIES = 1024
#: Seconds a thread waiting for a ring completion polls before it sleeps on the futex (_ring.DEFAULT_SPIN_S).
#: Client(ring_spin_s=...) overrides it.
RING_SPIN_S = _ring.DEFAULT_SPIN_S


#: SQE packing: the layout (tzip._ring.SQE) packed straight into a request's bytes, one call per SQE.
_PACK = _ring.SQE.pack_into
_U64 = _ring._U64.pack_into
_SQE_BYTES = _ring.SQE_BYTES
_OP_COMPRESS, _OP_DECOMPRESS, _LINK = _ring.OP_COMPRESS, _ring.OP_DECOMPRESS, _ring.F_LINK
_ZERO8 = (0,) * 8  # a decompress SQE's shape (6 dimensions), wait_value and signal_value
_A = _ALIGN - 1  # (n + _A) & ~_A: n rounded up to the alignment of the regions in a staging buffer (tzip._wire._align)
#: Dtypes whose tensors torch.empty makes as whole bytes (numel * itemsize): decompressed results of these are made in
#: their dtype and shape at once; the others are bytes seen as their dtype (tzip._dlpack.from_bytes).
_WHOLE_BYTE_DTYPES = frozenset(d for d in (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
                                           torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64,
                                           torch.complex128))
_new_compressed = CompressedTensor.__new__
#: The [version]["c"] head of PyTorch's shareable handle (c10/cuda/CUDACachingAllocator.cpp), before the 64-byte
#: cudaIpcMemHandle_t: the form in which the daemon takes CUDA IPC handles (src/daemon/schema.ts).
_IPC_HANDLE_HEAD = bytes([2, ord("c")])
#: Tensors of at most this many bytes get their frame written by the daemon straight into a payload of the frame bound
#: (maxCompressedSize) in the caller's memory, returned as a view of its first frame bytes: no staging buffer and no copy
#: out, for at most a few KiB of slack per payload (a larger frame is copied into a payload of its exact size).
IN_PAYLOAD_MAX_BYTES = 4096


def _ct(payload: torch.Tensor, dtype: torch.dtype, shape: torch.Size, codec: str, nbytes: int) -> CompressedTensor:
    """CompressedTensor(payload, dtype, shape, codec, nbytes) without its argument checks: for the frames made here
    (a new 1-D uint8 payload, the tensor's own torch.Size and int byte count)."""
    ct = _new_compressed(CompressedTensor)
    ct.payload, ct.dtype, ct.shape, ct.codec, ct.nbytes = payload, dtype, shape, codec, nbytes
    return ct


def _first(values: list):
    return values[0]


def _same(values: list):
    return values


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


def _give_staging(g: _Gpu, buf, stream) -> None:
    """The staging buffer of a GPU ring request goes back to ``g``'s arena (its next user's stream waits for
    ``stream``): the daemon is done with it, or never got it. (None: the request had none.)"""
    if buf is None:
        return
    buf.in_doubt = False
    g.arena.give(buf, stream)


def _drop_staging(g: _Gpu, buf, stream, submitted: bool) -> None:
    """The staging buffer of a GPU ring request that failed: given back when it was never ``submitted``, else
    poisoned (the daemon's stream may still use it: never reused nor freed). (None: the request had none.)"""
    if buf is None:
        return
    if submitted:
        buf.share.poison()
    else:
        _give_staging(g, buf, stream)


def _placed(sp, sbytes: int, dp, dbytes: int, off: int, rid: int, rgen: int):
    """Where one GPU SQE's ``src`` (``sbytes``) and ``dst`` (``dbytes``) are: at their place in the caller's memory
    (``sp``, ``dp``: (region id, generation, offset), from :meth:`RingPath._caller_places`) or, where that is None, at
    the next aligned bytes of the staging buffer (region ``rid``/``rgen``) from offset ``off``. Returns (src, dst, the
    staging offset of src or None, that of dst or None, the staging offset after them)."""
    if sp is None:
        src, s_at = (rid, rgen, off), off
        off += (sbytes + _A) & ~_A
    else:
        src, s_at = sp, None
    if dp is None:
        dst, d_at = (rid, rgen, off), off
        off += (dbytes + _A) & ~_A
    else:
        dst, d_at = dp, None
    return src, dst, s_at, d_at, off


def _region_gone(err: TzipDaemonError) -> bool:
    """Whether a GPU ring request failed because a region it names was released while it was queued (the oldest of a
    ring's registered caller allocations, or all of them by ``release_gpu()``, let go by another thread): the request
    is then done again through ZeroMQ, as for a ring that stopped, rather than failing the caller's call."""
    return err.code == "TZIP_HANDLE"


def _gather(parts: list[tuple[list[int], _ring.Handle]], n: int, single: bool) -> _ring.Handle:
    return _Gathered(parts, n, single)


class RingPath:
    """Compress and decompress through the session's submission rings."""

    # --- the session's rings and their regions ------------------------------------------------------------------
    def _ring(self, key: int | None) -> _ring.Ring | None:
        """This session's ring for CPU tensors (``key`` None) or for the tensors of cuda:``key``, opened on first use;
        None when the daemon offers no ring, this machine cannot use one, or opening it failed (the requests then go
        through ZeroMQ; why is in :attr:`ring_info`)."""
        ring = self._rings.get(key)
        if ring is not None and ring.usable and ring.sid == self._session.sid:
            return ring
        self._close_retired()
        if self._ring_caps is None or self._session.sid is None or key in self._ring_refused or self.ring_entries <= 0:
            return None
        with self._ring_lock:
            ring = self._rings.get(key)
            if ring is not None:
                if ring.usable and ring.sid == self._session.sid:
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
        sid = self._session.sid
        try:
            ring = _ring.Ring(name, entries, self._session.alive, spin_s=self.ring_spin_s,
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
                ring.home_stream = None  # type: ignore[attr-defined]  # the one stream that submitted so far (_gpu_submit)
                with torch.cuda.device(key):
                    # One event for every submission: recorded and waited for under gpu_lock, so each wait takes the
                    # record just before it (an event's wait uses its state when queued).
                    ring.order_event = torch.cuda.Event()  # type: ignore[attr-defined]
                body["device"] = cuda_device(ordinal)
            reply = self._session.call("ring_open", body, timeout=self.connect_timeout)
        except Exception as e:  # noqa: BLE001 - any refusal: ZeroMQ instead
            ring.close()
            if isinstance(e, DaemonUnavailableError):
                raise
            self._ring_refused[key] = f"ring_open: {e}"
            _log.info("tzip: no submission ring for %s (%s); requests go through ZeroMQ", "CPU tensors" if key is None else f"cuda:{key}", e)
            return None
        ring.id = int(reply["ring"])
        ring.sid = self._session.sid if self._session.sid is not None else sid
        ring.device = key
        self._rings[key] = ring
        return ring

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
            reply = self._session.call("ring_register", {"ring": ring.id, "regions": list(missing.values())})
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
        """The regions of the session's shared-memory files ``names`` (whole files) on ``ring`` (the cached ones looked
        up here; the others registered by :meth:`_ring_regions`)."""
        cached = ring.regions
        with self._release_lock:
            got = {n: cached.get(("shm", n)) for n in names}
        missing = [n for n, r in got.items() if r is None]
        if missing:
            got.update(zip(missing, self._ring_regions(ring, [(("shm", n), shm_region(n)) for n in missing])))
        return got

    def _flush_ring_releases(self, timeout: float = 10.0) -> None:
        """Sends the queued ``ring_release``s (regions of dropped segments and staging buffers), one per ring."""
        with self._release_lock:
            todo, self._ring_releases = self._ring_releases, []
        by_ring: dict[int, tuple[_ring.Ring, list[int]]] = {}
        for ring, rid in todo:
            by_ring.setdefault(id(ring), (ring, []))[1].append(rid)
        for ring, ids in by_ring.values():
            if ring.sid != self._session.sid or not ring.usable or self._session.sid is None:
                continue  # that session's rings are gone with it
            try:
                self._session.call("ring_release", {"ring": ring.id, "regions": ids}, timeout=timeout)
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
            if r.id is not None and r.sid is not None and r.sid == self._session.sid and not self._session.closing:
                try:
                    self._session.call("ring_close", {"ring": r.id}, timeout=2.0)
                except (DaemonUnavailableError, TzipDaemonError):
                    pass
            r.close()

    # --- compress -----------------------------------------------------------------------------------------------
    def _compress_ring_plan(self, req: Request):
        """Starters of the ring requests of ``req`` (one per CPU batch and per GPU), or None when the ring cannot
        carry all of them (no ring offered, an item it cannot describe): then the whole call goes through ZeroMQ."""
        items, codec, streams = req.items, req.codec, req.streams
        if self._ring_caps is None or self._session.sid is None or (codec is not None and codec not in _ring.CODEC_CODES) or not items:
            return None
        groups: dict[int | None, list[int]] = {}
        for i, t in enumerate(items):  # (is_cuda: the checks of the call let only CPU and CUDA tensors through)
            groups.setdefault(t.get_device() if t.is_cuda else None, []).append(i)
        starters = []
        for key, idx in groups.items():
            part = items if len(groups) == 1 else [items[i] for i in idx]
            if key is None:
                planned = self._ring_plan_compress_cpu(part)
                if planned is None or (len(part) > 1 and planned[1] > MAX_STAGE_BYTES):
                    return None  # (ZeroMQ splits such batches into requests of their own)
                starters.append((idx, key, planned, None))
            else:
                g = self._gpu(key)
                budget = req.ring_sm_budget
                if budget is None or not self._gpu_reachable(g):
                    return None
                planned = self._ring_plan_compress_gpu(part)
                if planned is None or planned[1] > MAX_STAGE_BYTES:
                    return None  # everything is staged through the ring: large tensors are handed over through ZeroMQ
                starters.append((idx, key, planned, (_stream_for(streams, key), budget)))
        try:
            for _, key, _, _ in starters:
                if self._ring(key) is None:
                    return None
        except DaemonUnavailableError:
            return None  # the ZeroMQ path notices it too, and retries (spawn) or falls back
        return starters

    @staticmethod
    def _ring_plan_compress_cpu(tensors: list[torch.Tensor]) -> tuple[list[tuple], int] | None:
        """(plan, staging bytes): per tensor (tensor, dtype, shape, its :func:`tzip._wire._sqe_layout`, zero-copy (file,
        offset) or None); the staging bytes are the inputs not in registered shared memory and every frame's bound.
        None when an SQE cannot describe a tensor (no bytes, a frame of more than 6 dimensions, PyTorch's shared
        memory)."""
        plans = []
        stage = 0
        # PyTorch's shared memory can only be file_system's (tzip._shm.torch_shm_handle): asked once per call.
        torch_files = torch.multiprocessing.get_sharing_strategy() == "file_system"
        find, sqe_layout = _shm.find, _sqe_layout
        for t in tensors:
            dtype, shape = t.dtype, t.shape
            lay = sqe_layout(dtype, shape)
            if lay is None:
                return None
            zc = None
            if t.is_contiguous():
                found = find(t.data_ptr(), lay[0])
                if found is not None:
                    zc = (found[0], found[2])
                elif torch_files and _shm.torch_shm_handle(t) is not None:
                    return None  # zero copy through ZeroMQ (its files are PyTorch's, not registered here)
            plans.append((t, dtype, shape, lay, zc))
            stage += (0 if zc else (lay[0] + _A) & ~_A) + ((lay[4] + _A) & ~_A)
        return plans, stage

    @staticmethod
    def _ring_plan_compress_gpu(tensors: list[torch.Tensor]) -> tuple[list[tuple], int] | None:
        """As the CPU plan, without zero copy: GPU tensors are copied into the registered staging arena (one copy on
        the GPU, no registration per tensor)."""
        plans = []
        stage = 0
        for t in tensors:
            dtype, shape = t.dtype, t.shape
            lay = _sqe_layout(dtype, shape)
            if lay is None:
                return None
            plans.append((t, dtype, shape, lay, None))
            stage += ((lay[0] + _A) & ~_A) + ((lay[4] + _A) & ~_A)
        return plans, stage

    def _compress_submit(self, req: Request, blocking: bool = False) -> _ring.Handle | None:
        """The call as ring requests, submitted now (a Handle of the call's return value), or None: not for the ring.
        ``blocking``: the caller waits for the result before it returns (then the daemon may read CUDA tensors in
        place; an asynchronous call's tensors are copied in stream order at submission, so the caller may go on
        writing them, as before). ``req.outs``: the call's checked ``out=`` buffers (a CUDA tensor's frame is
        written into its buffer; the caller copies any other frame in)."""
        starters = self._compress_ring_plan(req)
        if starters is None:
            return None
        if len(starters) == 1:  # one device: its request's handle is the call's
            _idx, key, planned, extra = starters[0]
            return self._compress_start(req, key, planned, extra, _first if req.single else _same, blocking)
        parts = [(idx, self._compress_start(req.part(idx), key, planned, extra, _same, blocking))
                 for idx, key, planned, extra in starters]
        return _gather(parts, len(req.items), req.single)

    def _compress_start(self, req: Request, key: int | None, planned: tuple[list[tuple], int], extra, post,
                        blocking: bool = False) -> _ring.Handle:
        """The ring request of every item of ``req``, all on device ``key`` (None: the CPU)."""
        plan, stage = planned
        # The call's codec (None: the device's default); the job's codec setting the ring thread applies itself.
        codec, tag = codec_for(req.codec, key is not None), req.ring_tag

        def fallback(err: BaseException | None):
            # The ring could not take or finish it (the daemon went away, the ring stopped, a region was refused):
            # the ZeroMQ route with its retry and raw fallback, for the same request (its SM budget and stream tag;
            # its frames are copied into any out= by the caller).
            if err is not None and not isinstance(err, (DaemonUnavailableError, TzipDaemonError)):
                raise err
            part = req.part(range(len(req.items)), None if key is None else {key: extra[0]})
            return post(self._compress_zmq(dataclasses.replace(part, outs=None)))

        ring = self._ring(key)
        if ring is None:
            return _done_handle(fallback, None)
        try:
            if key is None:
                return self._compress_start_cpu(ring, plan, stage, codec, tag, post, fallback)
            return self._compress_start_gpu(ring, self._gpu(key), plan, stage, codec, extra[0], extra[1], tag, post, fallback,
                                            blocking, req.outs)
        except (DaemonUnavailableError, TzipDaemonError) as e:
            return _done_handle(fallback, e)

    def _compress_start_cpu(self, ring: _ring.Ring, plan: list[tuple], stage: int, codec: str, tag: int, post,
                            fallback) -> _ring.Handle:
        n = len(plan)
        h = _ring.Handle(ring, n)
        seg = self._arena.take(max(1, stage))
        try:
            files = [p[4][0] for p in plan if p[4] is not None]
            regions = self._ring_shm(ring, list(dict.fromkeys([seg.name, *files])) if files else [seg.name])
            here = regions[seg.name]
            hid, hgen = here.id, here.generation
            ccode = _ring.CODEC_CODES[codec]
            sq = bytearray(n * _SQE_BYTES)
            ud = h.ud
            outs = []
            off = 0
            copy_in = self._copy_in
            for k, (t, _dtype, _shape, (nbytes, dcode, ndim, dims, cap), zc) in enumerate(plan):
                if zc is not None:
                    r = regions[zc[0]]
                    sid, sgen, soff = r.id, r.generation, zc[1]
                else:
                    copy_in(seg, off, t, nbytes)
                    sid, sgen, soff = hid, hgen, off
                    off += (nbytes + _A) & ~_A
                outs.append(off)
                _PACK(sq, k * _SQE_BYTES, ud + k, _OP_COMPRESS, _LINK, ccode, dcode, ndim, 0, tag, sid, sgen, soff, nbytes,
                      hid, hgen, off, cap, *dims, 0, 0)
                off += (cap + _A) & ~_A
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
                base, empty, memmove, names = seg.base, torch.empty, ctypes.memmove, _ring.CODEC_NAMES
                for (_t, dtype, shape, lay, _z), o, (_st, c, m, _msg) in zip(plan, outs, res):
                    if not 0 < m <= lay[4]:
                        raise TzipDaemonError("TZIP_CORRUPT", f"the ring reported a frame of {m} bytes (capacity {lay[4]})")
                    payload = empty(m, dtype=torch.uint8)
                    memmove(payload.data_ptr(), base + o, m)
                    cts.append(_ct(payload, dtype, shape, names.get(c, "raw"), lay[0]))
            finally:
                self._arena.give(seg)
            return post(cts)

        h._finish = finish
        return self._ring_submit(ring, h, sq, n)

    @staticmethod
    def _ring_submit(ring: _ring.Ring, h: _ring.Handle, sq: bytearray, n: int) -> _ring.Handle:
        """Publishes the ``n`` SQEs packed in ``sq`` for ``h`` (its finishing step set); ``h``."""
        try:
            ring.submit_packed(sq, n, h)
        except _ring.RingClosed as e:
            h._complete(e)  # nothing (or not all) of it was taken: its fallback runs now
        return h

    def _ring_gpu_buffer(self, ring: _ring.Ring, g: "_Gpu", buf) -> _ring.Region:
        """The region of the whole staging buffer ``buf`` on ``ring`` (registered once per buffer)."""
        with self._release_lock:
            known = ring.regions.get(("gpubuf", buf))
        if known is not None:
            return known
        ordinal = self._daemon_ordinal(g)
        spec = cuda_region(ordinal, buf.share.handle, buf.share.offset, buf.size)
        return self._ring_regions(ring, [(("gpubuf", buf), spec)])[0]

    def _caller_places(self, ring: _ring.Ring, g: "_Gpu", ranges: list) -> list:
        """Where the daemon finds caller memory in place (tzip._cuda_segments): per ``(address, bytes)`` of memory of
        ``g`` (None: to be staged anyway), the (region id, generation, offset) of the allocation holding it,
        registered on ``ring`` now where it is not yet; None where it must be staged instead (memory legacy CUDA IPC
        cannot share, an allocation the daemon refused). One driver query per allocation of the call."""
        table = ring.segments
        found: list = []  # per range: its Allocation or None
        seen: list = []  # the allocations of this call (their tensors keep them alive during it)
        for r in ranges:
            if r is None:
                found.append(None)
                continue
            addr, n = r
            a = None
            for x in seen:
                if x.base <= addr and addr + n <= x.base + x.size:
                    a = x
                    break
            if a is None:
                try:
                    a = allocation_of(addr, g.index)
                except TzipDaemonError:
                    a = None  # a driver that cannot say: staged
                if a is not None and (not a.ipc or table.was_refused(a.base, a.buffer_id)):
                    a = None
                elif a is not None:
                    seen.append(a)
            found.append(a if a is not None and addr + n <= a.base + a.size else None)
        missing = [a for a in seen if not table.known(a.base, a.buffer_id)]
        if missing:
            ordinal = self._daemon_ordinal(g)
            try:
                specs = [(segment_key(a.base, a.buffer_id),
                          cuda_region(ordinal, _IPC_HANDLE_HEAD + ipc_handle(a.base, g.index), 0, a.size)) for a in missing]
                self._ring_regions(ring, specs)
            except TzipDaemonError as e:
                # (DaemonUnavailableError goes up: the call falls back to ZeroMQ, which notices it too)
                for a in missing:
                    table.refuse(a.base, a.buffer_id)
                _log.info("tzip: the daemon did not register caller GPU memory on the ring (%s); it is staged", e)
            else:
                drop = []
                for a in missing:
                    drop.extend(table.add(a.base, a.buffer_id))
                if drop:
                    self._release_region_keys(ring, drop)
        regions = ring.regions
        out: list = []
        with self._release_lock:
            for r, a in zip(ranges, found):
                reg = None if a is None else regions.get(segment_key(a.base, a.buffer_id))
                out.append(None if reg is None else (reg.id, reg.generation, r[0] - a.base))
        return out

    def _sweep_segments(self, ring: _ring.Ring) -> None:
        """Queues the release of the caller's allocations registered on GPU ``ring`` that are gone (freed by the
        caching allocator, or made anew at their address): see tzip._cuda_segments, "Lifetime". The heartbeat thread
        calls it."""
        index = ring.device

        def allocation_at(base: int) -> tuple[int, int]:
            try:
                a = allocation_of(base, index)
            except TzipDaemonError:
                return (0, 0)
            return (a.base, a.buffer_id)

        keys = ring.segments.sweep(allocation_at)
        if keys:
            self._release_region_keys(ring, keys)

    def _release_region_keys(self, ring: _ring.Ring, keys: list) -> None:
        """Queues the ``ring_release`` of the regions cached under ``keys`` on ``ring`` (sent by the heartbeat, or by
        :meth:`_flush_ring_releases`)."""
        with self._release_lock:
            for k in keys:
                r = ring.regions.pop(k, None)
                if r is not None:
                    self._ring_releases.append((ring, r.id))

    def _gpu_submit(self, ring: _ring.Ring, g: "_Gpu", stream, h: _ring.Handle, sq: bytearray, n: int, vbox: list) -> _ring.Handle:
        """Submits a GPU batch (``n`` SQEs packed in ``sq`` for ``h``, whose finishing step and GPU wait are set)
        ordered after the work queued so far on ``stream`` (its inputs): ``produced = v`` is written once that work is
        done, the batch is marked WAIT (first SQE) / SIGNAL (last) with ``v`` (put in ``vbox``, read by the finishing
        step and the GPU wait), and published.

        One ``produced`` word serves every stream of the ring, so its writes must happen in ``v`` order and each only
        after its own producer work: they are queued on the ring's own stream (``ring.order_stream``), which first waits
        for an event of the caller's stream; values are taken and SQEs published under ``ring.gpu_lock``, so the SQ
        order is the ``v`` order too. (Written straight from two callers' streams, ``produced`` could reach a later
        value before an earlier batch's inputs were ready.)

        While one stream is the only one that ever submitted on the ring (``ring.home_stream``), its writes are in
        ``v`` order by stream order alone: it writes ``produced`` itself, one stream operation instead of three (an
        event record, the ring stream's wait, the write; each costs microseconds of driver time under MPS). The first
        submission from another stream makes the ring's stream wait for the home stream's last write, and from then on
        every submission goes through the ring's stream."""
        with ring.gpu_lock:  # type: ignore[attr-defined]
            v = ring.seq = ring.seq + 1  # type: ignore[attr-defined]  # (only ever taken under gpu_lock)
            vbox.append(v)
            home = ring.home_stream  # type: ignore[attr-defined]
            if home is None:
                home = ring.home_stream = stream  # type: ignore[attr-defined]
            try:
                if home is not False and home == stream:
                    write_value64(stream, ring.produced_dptr, v)  # type: ignore[attr-defined]
                else:
                    with device_scope(g.index):
                        ev = ring.order_event  # type: ignore[attr-defined]
                        if home is not False:  # the home stream's writes so far come first
                            ev.record(home)
                            ring.order_stream.wait_event(ev)  # type: ignore[attr-defined]
                            ring.home_stream = False  # type: ignore[attr-defined]
                        ev.record(stream)
                        ring.order_stream.wait_event(ev)  # type: ignore[attr-defined]
                        write_value64(ring.order_stream, ring.produced_dptr, v)  # type: ignore[attr-defined]
            except BaseException:
                # Nothing of the batch reached the ring: the caller gives its staging buffer back. (The value is spent;
                # later batches wait for later values, which produced reaches in order all the same.)
                vbox.clear()
                raise
            last = (n - 1) * _SQE_BYTES
            sq[_ring.SQE_OFF_FLAGS] |= _ring.F_WAIT
            _U64(sq, _ring.SQE_OFF_WAIT, v)
            sq[last + _ring.SQE_OFF_FLAGS] |= _ring.F_SIGNAL
            _U64(sq, last + _ring.SQE_OFF_SIGNAL, v)
            return self._ring_submit(ring, h, sq, n)

    @staticmethod
    def _gpu_wait_done(ring: _ring.Ring, stream, v: int) -> None:
        """``stream`` waits on the GPU until the ring's done word is >= ``v``."""
        wait_value64(stream, ring.done_dptr, v)  # type: ignore[attr-defined]

    def _compress_start_gpu(self, ring: _ring.Ring, g: "_Gpu", plan: list[tuple], stage: int, codec: str, stream, budget: int,
                            tag: int, post, fallback, blocking: bool = False, into: list | None = None) -> _ring.Handle:
        n = len(plan)
        h = _ring.Handle(ring, n)
        with device_scope(g.index), stream_scope(stream):
            # A blocking call's tensors are read where they are, and a small tensor's frame is written straight into
            # its payload, a frame with an out= buffer into it (tzip._cuda_segments); the other tensors and frames go
            # through the staging buffer.
            fulls = [o if o is not None else
                     torch.empty(p[3][4], dtype=torch.uint8, device=g.device) if p[3][0] <= IN_PAYLOAD_MAX_BYTES else None
                     for p, o in zip(plan, into or [None] * n)]
            places = self._caller_places(ring, g, [(p[0].data_ptr(), p[3][0]) if blocking and plain(p[0]) else None for p in plan] +
                                         [None if f is None else (f.data_ptr(), f.numel()) for f in fulls])
            src_places, dst_places = places[:n], places[n:]
            stage = sum((((p[3][0] + _A) & ~_A) if sp is None else 0) + (((p[3][4] + _A) & ~_A) if dp is None else 0)
                        for p, sp, dp in zip(plan, src_places, dst_places))
            buf = self._staging_take(g, stage, stream) if stage else None
            try:
                if buf is not None:
                    region = self._ring_gpu_buffer(ring, g, buf)
                    rid, rgen = region.id, region.generation
                else:
                    rid = rgen = 0
                ccode = _ring.CODEC_CODES[codec]
                sq = bytearray(n * _SQE_BYTES)
                ud = h.ud
                outs: list[int | None] = []
                staged: list[tuple[int, int]] = []
                srcs: list[torch.Tensor] = []
                off = 0
                for k, ((t, _dtype, _shape, (nbytes, dcode, ndim, dims, cap), _z), sp, dp) in enumerate(
                        zip(plan, src_places, dst_places)):
                    (sid, sgen, soff), (did, dgen, doff), s_at, d_at, off = _placed(sp, nbytes, dp, cap, off, rid, rgen)
                    if s_at is not None:
                        staged.append((s_at, nbytes))
                        srcs.append(t)
                    outs.append(d_at)
                    _PACK(sq, k * _SQE_BYTES, ud + k, _OP_COMPRESS, _LINK, ccode, dcode, ndim, budget, tag, sid, sgen, soff,
                          nbytes, did, dgen, doff, cap, *dims, 0, 0)
                if srcs and not (len(srcs) == 1 and plain(srcs[0]) and copy_raw(
                        buf.u8.data_ptr() + staged[0][0], srcs[0].data_ptr(), staged[0][1], g.index, stream.cuda_stream)):
                    gpu_copy_many(regions_of(buf.u8, staged), [gpu_bytes_of(t) for t in srcs])
            except BaseException:
                if buf is not None:
                    g.arena.give(buf, stream)
                raise
        if buf is not None:
            buf.in_doubt = True
        vbox: list[int] = []

        def finish(res):
            if isinstance(res, BaseException):
                _drop_staging(g, buf, stream, submitted=bool(vbox))
                return fallback(res)
            with device_scope(g.index), stream_scope(stream):
                try:
                    err = _ring.Handle.error_of(res)
                    if err is not None:
                        if _region_gone(err):
                            return fallback(err)
                        raise err
                    # No GPU wait on the done word here: a CQE is written after the batch's GPU work finished
                    # (docs/ring.md), so the frames are complete for any work queued from now on.
                    payloads = []
                    copies: list[tuple[torch.Tensor, int, int]] = []
                    for (_t, _dtype, _shape, lay, _z), (_st, _c, m, _msg), full, o in zip(plan, res, fulls, outs):
                        if not 0 < m <= lay[4]:
                            raise TzipDaemonError("TZIP_CORRUPT", f"the ring reported a frame of {m} bytes (capacity {lay[4]})")
                        if o is None:
                            payloads.append(full[:m])  # written in place (a small frame, or an out= buffer)
                        else:
                            # Each payload an allocation of its own (a view of a shared one would make torch.save
                            # write them all), or the out= buffer the daemon could not write into itself.
                            p = full[:m] if full is not None else torch.empty(m, dtype=torch.uint8, device=g.device)
                            payloads.append(p)
                            copies.append((p, o, m))
                    if copies and not (len(copies) == 1 and copy_raw(copies[0][0].data_ptr(), buf.u8.data_ptr() + copies[0][1],
                                                                     copies[0][2], g.index, stream.cuda_stream)):
                        gpu_copy_many([c[0] for c in copies], regions_of(buf.u8, [(c[1], c[2]) for c in copies]))
                finally:
                    _give_staging(g, buf, stream)
            names = _ring.CODEC_NAMES
            return post([_ct(p, dtype, shape, names.get(c, "raw"), lay[0])
                         for p, (_t, dtype, shape, lay, _z), (_st, c, _m, _msg) in zip(payloads, plan, res)])

        def on_wait(s):
            self._gpu_wait_done(ring, s if s is not None else current_stream(g.index), vbox[0])

        h._finish, h._on_wait = finish, on_wait
        try:
            return self._gpu_submit(ring, g, stream, h, sq, n, vbox)
        except BaseException:
            if not vbox:
                _give_staging(g, buf, stream)
            raise

    # --- decompress ---------------------------------------------------------------------------------------------
    def _decompress_submit(self, req: Request, blocking: bool = False) -> _ring.Handle | None:
        """The call as ring requests, submitted now, or None: not for the ring (then ZeroMQ, as before).
        ``blocking``: as for :meth:`_compress_submit` (an asynchronous call's ``out=`` tensors are written in stream
        order once the daemon is done, as before; new results, which the caller cannot touch before ``result()``,
        are written in place either way)."""
        items, outs, single = req.items, req.outs, req.single
        if self._ring_caps is None or self._session.sid is None or not items:
            return None
        groups: dict[int | None, list[int]] = {}
        stages: dict[int | None, int] = {}
        torch_files = torch.multiprocessing.get_sharing_strategy() == "file_system"  # (see _ring_plan_compress_cpu)
        for i, (ct, o) in enumerate(zip(items, outs)):
            payload, nbytes = ct.payload, ct.nbytes
            fbytes = payload.numel()
            if nbytes == 0 or fbytes == 0:
                return None
            target = o if o is not None else payload
            key = target.get_device() if target.is_cuda else None
            if key is None:
                if o is not None and torch_files and o.is_contiguous() and _shm.find(o.data_ptr(), nbytes) is None \
                        and _shm.torch_shm_handle(o) is not None:
                    return None  # PyTorch's shared memory: zero copy through ZeroMQ
            elif key not in groups and (req.ring_sm_budget is None or not self._gpu_reachable(self._gpu(key))):
                return None
            groups.setdefault(key, []).append(i)
            # Staging bytes of the ring request (GPU: frames and results; CPU: frames and the small results).
            stages[key] = stages.get(key, 0) + ((fbytes + _A) & ~_A) + (
                ((nbytes + _A) & ~_A) if key is not None or nbytes < DEDICATED_MIN_BYTES else 0)
        for key, idx in groups.items():
            if stages[key] > MAX_STAGE_BYTES and (key is not None or len(idx) > 1):
                return None
        try:
            for key in groups:
                if self._ring(key) is None:
                    return None
        except DaemonUnavailableError:
            return None
        if len(groups) == 1:
            key, idx = next(iter(groups.items()))
            return self._decompress_start(req, key, _first if single else _same, blocking)
        parts = [(idx, self._decompress_start(req.part(idx), key, _same, blocking)) for key, idx in groups.items()]
        return _gather(parts, len(items), single)

    def _decompress_start(self, req: Request, key: int | None, post, blocking: bool = False) -> _ring.Handle:
        """The ring request of every item of ``req``, all with their results on device ``key`` (None: the CPU)."""
        cts, outs, verify, tag = req.items, req.outs, req.verify, req.ring_tag
        stream = None if key is None else _stream_for(req.streams, key)

        def fallback(err: BaseException | None):
            # As for compress: the ZeroMQ route for the same request.
            if err is not None and not isinstance(err, (DaemonUnavailableError, TzipDaemonError)):
                raise err
            part = req.part(range(len(cts)), None if key is None else {key: stream})
            return post(self._decompress_zmq(part))

        ring = self._ring(key)
        if ring is None:
            return _done_handle(fallback, None)
        try:
            if key is None:
                return self._decompress_start_cpu(ring, cts, outs, verify, tag, post, fallback)
            return self._decompress_start_gpu(ring, self._gpu(key), cts, outs, verify, stream, req.ring_sm_budget or 0, tag,
                                              post, fallback, blocking)
        except (DaemonUnavailableError, TzipDaemonError) as e:
            return _done_handle(fallback, e)

    def _decompress_start_cpu(self, ring: _ring.Ring, cts: list[CompressedTensor], outs: list, verify: bool, tag: int,
                              post, fallback) -> _ring.Handle:
        plans = []
        lent: list[_shm.Segment] = []
        stage = 0
        find = _shm.find
        for ct, o in zip(cts, outs):
            frame = ct.payload  # (uint8: never part of an autograd graph)
            if frame.is_cuda:
                frame = frame.cpu()
            if not frame.is_contiguous():
                frame = frame.contiguous()
            fbytes, nbytes = frame.numel(), ct.nbytes
            found = find(frame.data_ptr(), fbytes)
            fzc = None if found is None else (found[0], found[2])
            dest = result = None
            if o is not None:
                if o.is_contiguous():
                    found = find(o.data_ptr(), nbytes)
                    dest = None if found is None else (found[0], found[2])
            elif nbytes >= DEDICATED_MIN_BYTES:
                seg, u8 = self._results.lend(nbytes)
                lent.append(seg)
                result = from_bytes(u8, ct.dtype, tuple(ct.shape))
                dest = (seg.name, 0)
            plans.append((ct, o, frame, fbytes, nbytes, fzc, dest, result))
            stage += (0 if fzc else (fbytes + _A) & ~_A) + (0 if dest else (nbytes + _A) & ~_A)
        n = len(plans)
        h = _ring.Handle(ring, n)
        seg = self._arena.take(max(1, stage))
        try:
            files = [p[5][0] for p in plans if p[5]] + [p[6][0] for p in plans if p[6]]
            regions = self._ring_shm(ring, list(dict.fromkeys([seg.name, *files])) if files else [seg.name])
            here = regions[seg.name]
            hid, hgen = here.id, here.generation
            flags = _LINK | (_ring.F_VERIFY if verify else 0)
            sq = bytearray(n * _SQE_BYTES)
            ud, base, memmove = h.ud, seg.base, ctypes.memmove
            out_offs = []
            off = 0
            for k, (_ct_, _o, frame, fbytes, nbytes, fzc, dest, _r) in enumerate(plans):
                if fzc is not None:
                    r = regions[fzc[0]]
                    sid, sgen, soff = r.id, r.generation, fzc[1]
                else:
                    memmove(base + off, frame.data_ptr(), fbytes)  # contiguous uint8
                    sid, sgen, soff = hid, hgen, off
                    off += (fbytes + _A) & ~_A
                if dest is not None:
                    r = regions[dest[0]]
                    did, dgen, doff = r.id, r.generation, dest[1]
                    out_offs.append(0)
                else:
                    did, dgen, doff = hid, hgen, off
                    out_offs.append(off)
                    off += (nbytes + _A) & ~_A
                _PACK(sq, k * _SQE_BYTES, ud + k, _OP_DECOMPRESS, flags, 0, 0, 0, 0, tag, sid, sgen, soff, fbytes, did, dgen,
                      doff, nbytes, *_ZERO8)
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
                base, empty, memmove = seg.base, torch.empty, ctypes.memmove
                for (ct, o, _f, _fb, nbytes, _fz, dest, result), out_off, (_st, _c, m, _msg) in zip(plans, out_offs, res):
                    if m != nbytes:
                        raise TzipDaemonError("TZIP_CORRUPT", f"the frame holds {m} bytes, the CompressedTensor says {nbytes}")
                    if o is not None:
                        if dest is None:
                            if o.is_contiguous():
                                memmove(o.data_ptr(), base + out_off, nbytes)
                            else:
                                copy_from_bytes(o, seg.u8[out_off : out_off + nbytes])
                        results.append(o)
                    elif result is not None:
                        results.append(result)
                    else:
                        dtype = ct.dtype
                        t = empty(ct.shape, dtype=dtype) if dtype in _WHOLE_BYTE_DTYPES else None
                        if t is None or t.nbytes != nbytes:
                            # Bytes seen as the dtype (every dtype, the sub-byte ones too; a shape that does not hold
                            # nbytes raises here, as it did).
                            t = empty(nbytes, dtype=torch.uint8)
                            memmove(t.data_ptr(), base + out_off, nbytes)
                            t = from_bytes(t, dtype, ct.shape)
                        else:
                            memmove(t.data_ptr(), base + out_off, nbytes)
                        results.append(t)
            finally:
                self._arena.give(seg)
            return post(results)

        h._finish = finish
        return self._ring_submit(ring, h, sq, n)

    def _decompress_start_gpu(self, ring: _ring.Ring, g: "_Gpu", cts: list[CompressedTensor], outs: list, verify: bool,
                              stream, budget: int, tag: int, post, fallback, blocking: bool = False) -> _ring.Handle:
        n = len(cts)
        h = _ring.Handle(ring, n)
        with device_scope(g.index), stream_scope(stream):
            frames = []
            temps = []  # whether frames[k] is a copy made here: it dies with this call, so it is staged, never named
            for ct in cts:
                f = ct.payload.detach()
                made = f.get_device() != g.index or not f.is_contiguous()
                if made:
                    f = f.to(g.device).contiguous()
                frames.append(f)
                temps.append(made)
            # The results exist now (written by the daemon, or copied out of the staging buffer in stream order once
            # it is done: see queue_copies); new ones as bytes seen as their dtype (every dtype, the sub-byte ones too).
            flats = [None if o is not None else torch.empty(ct.nbytes, dtype=torch.uint8, device=g.device)
                     for ct, o in zip(cts, outs)]
            results = [o if o is not None else from_bytes(f, ct.dtype, ct.shape) for ct, o, f in zip(cts, outs, flats)]
            # Frames read and results written where they are (tzip._cuda_segments) where the daemon can; the others
            # through the staging buffer.
            dsts = [f if f is not None else (o if blocking and plain(o) else None) for f, o in zip(flats, outs)]
            places = self._caller_places(ring, g, [None if t else (f.data_ptr(), f.numel()) for f, t in zip(frames, temps)] +
                                         [None if d is None else (d.data_ptr(), ct.nbytes) for d, ct in zip(dsts, cts)])
            src_places, dst_places = places[:n], places[n:]
            stage = sum((_align(f.numel()) if sp is None else 0) + (_align(ct.nbytes) if dp is None else 0)
                        for f, ct, sp, dp in zip(frames, cts, src_places, dst_places))
            buf = self._staging_take(g, stage, stream) if stage else None
            try:
                if buf is not None:
                    region = self._ring_gpu_buffer(ring, g, buf)
                    rid, rgen = region.id, region.generation
                else:
                    rid = rgen = 0
                flags = _LINK | (_ring.F_VERIFY if verify else 0)
                sq = bytearray(n * _SQE_BYTES)
                ud = h.ud
                staged: list[tuple[int, int]] = []
                staged_frames: list[torch.Tensor] = []
                out_offs: list[int | None] = []
                off = 0
                for k, (f, ct, sp, dp) in enumerate(zip(frames, cts, src_places, dst_places)):
                    fbytes, nbytes = f.numel(), ct.nbytes
                    (sid, sgen, soff), (did, dgen, doff), s_at, d_at, off = _placed(sp, fbytes, dp, nbytes, off, rid, rgen)
                    if s_at is not None:
                        staged.append((s_at, fbytes))
                        staged_frames.append(f)
                    out_offs.append(d_at)
                    _PACK(sq, k * _SQE_BYTES, ud + k, _OP_DECOMPRESS, flags, 0, 0, 0, budget, tag, sid, sgen, soff, fbytes,
                          did, dgen, doff, nbytes, *_ZERO8)
                if staged and not (len(staged) == 1 and copy_raw(buf.u8.data_ptr() + staged[0][0], staged_frames[0].data_ptr(),
                                                                 staged[0][1], g.index, stream.cuda_stream)):
                    gpu_copy_many(regions_of(buf.u8, staged), staged_frames)
            except BaseException:
                if buf is not None:
                    g.arena.give(buf, stream)
                raise
        if buf is not None:
            buf.in_doubt = True
        state = {"copied": None}  # the stream the copies out of the arena were queued on, and the event after them
        lock = threading.Lock()
        vbox: list[int] = []

        def queue_copies(s, completed: bool) -> None:
            """Once: ``s`` waits (on the GPU) for the done flag, unless the batch is known to be ``completed`` (its
            CQEs are in: they are written after its GPU work finished), then copies the results out of the arena,
            then the buffer goes back to the arena (its next user's stream waits for these copies). Later calls: ``s``
            waits for what the first one queued, if anything."""
            with lock:
                if state["copied"] is not None:
                    if s is not state["copied"][0] and state["copied"][1] is not None:
                        s.wait_event(state["copied"][1])
                    return
                with device_scope(g.index), stream_scope(s):
                    if not completed:
                        self._gpu_wait_done(ring, s, vbox[0])
                    # The results the daemon wrote into the staging buffer, copied out (those written in place need
                    # nothing more than the wait).
                    copies = [(ct, f, o, oo) for ct, f, o, oo in zip(cts, flats, outs, out_offs) if oo is not None]
                    one = copies[0][1] if len(copies) == 1 else None  # a single new result: one raw copy
                    if copies and not (one is not None and copy_raw(one.data_ptr(), buf.u8.data_ptr() + copies[0][3],
                                                                   copies[0][0].nbytes, g.index, s.cuda_stream)):
                        direct, srcs = [], []
                        for ct, f, o, oo in copies:
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
                    if copies or not completed:
                        ev = torch.cuda.Event()
                        ev.record(s)
                        state["copied"] = (s, ev)
                    else:
                        state["copied"] = (s, None)  # nothing queued: other streams need no wait either
                if buf is not None:
                    _give_staging(g, buf, s)

        def finish(res):
            if isinstance(res, BaseException):
                _drop_staging(g, buf, stream, submitted=bool(vbox))
                return fallback(res)
            err = _ring.Handle.error_of(res)
            if err is not None:
                with lock:
                    if state["copied"] is None:
                        _give_staging(g, buf, stream)
                        state["copied"] = (stream, None)
                if _region_gone(err):
                    return fallback(err)
                raise err
            for ct, (_st, _c, n, _m) in zip(cts, res):
                if n != ct.nbytes:
                    raise TzipDaemonError("TZIP_CORRUPT", f"the frame holds {n} bytes, the CompressedTensor says {ct.nbytes}")
            if state["copied"] is None:
                queue_copies(stream, True)
            return post(results)

        def on_wait(s):
            # (Not told whether the CQEs are in: a closure naming the handle would make a reference cycle that keeps
            # the results alive until the garbage collector runs.)
            queue_copies(s if s is not None else current_stream(g.index), False)

        h._finish, h._on_wait = finish, on_wait
        try:
            return self._gpu_submit(ring, g, stream, h, sq, n, vbox)
        except BaseException:
            if not vbox:
                _give_staging(g, buf, stream)
            raise

    def _ring_worth(self, items: list, outs: list) -> bool:
        """Whether every frame needs the daemon (raw frames for the CPU are decoded here, as without the ring)."""
        for ct, o in zip(items, outs):
            if ct.codec == "raw" and not (o if o is not None else ct.payload).is_cuda:
                return False
        return True

    def _wait_handle(self, h: _ring.Handle):
        """The value of a blocking call's handle (its request timeout: DaemonUnavailableError)."""
        try:
            return h.result(self.request_timeout)
        except concurrent.futures.TimeoutError:
            raise DaemonUnavailableError(f"no completion from the tzip daemon's ring in {self.request_timeout:g} s") from None
