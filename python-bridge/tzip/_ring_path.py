"""The client's requests through the submission ring (protocol version 4, docs/ring.md; :mod:`tzip._ring`): the SQEs
of a call (one LINKed batch per call and device) on the session's rings (:class:`tzip._rings.Rings`, which also
registers the regions they name), and the :class:`tzip._ring.Handle` of the call, whose finishing step copies the
results out and falls back to the ZeroMQ path when the ring could not take or finish the request. :class:`RingPath`
is a part of :class:`tzip.client.Client` (it uses the Client's session, arenas and GPU state); its GPU requests are
:class:`tzip._ring_gpu.RingGpu`'s."""

from __future__ import annotations

import concurrent.futures
import ctypes
import dataclasses
import logging
import threading
import time

import torch

from . import _ring, _shm
from ._codec_choice import codec_for
from ._cpu_path import DEDICATED_MIN_BYTES
from ._dlpack import copy_from_bytes, from_bytes
from ._errors import DaemonUnavailableError, TzipDaemonError
from ._gpu_path import _stream_for
from ._request import Request
from ._ring_gpu import RingGpu
from ._sqe import _A, _LINK, _OP_COMPRESS, _OP_DECOMPRESS, _PACK, _SQE_BYTES, _ZERO8, _ct
from ._wire import MAX_STAGE_BYTES, _sqe_layout
from .compressed import CompressedTensor

_log = logging.getLogger("tzip")


#: Entries of each submission ring (docs/ring.md; a power of two, at most hello's ``ring.entries_max``): batches of up
#: to this many tensors are one LINKed batch. Client(ring_entries=...) overrides it; 0 turns the ring off.
RING_ENTRIES = 1024
#: Seconds a thread waiting for a ring completion polls before it sleeps on the futex (_ring.DEFAULT_SPIN_S).
#: Client(ring_spin_s=...) overrides it.
RING_SPIN_S = _ring.DEFAULT_SPIN_S


#: Dtypes whose tensors torch.empty makes as whole bytes (numel * itemsize): decompressed results of these are made in
#: their dtype and shape at once; the others are bytes seen as their dtype (tzip._dlpack.from_bytes).
_WHOLE_BYTE_DTYPES = frozenset(d for d in (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
                                           torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64,
                                           torch.complex128))


def _first(values: list):
    return values[0]


def _same(values: list):
    return values


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


def _gather(parts: list[tuple[list[int], _ring.Handle]], n: int, single: bool) -> _ring.Handle:
    return _Gathered(parts, n, single)


class RingPath(RingGpu):
    """Compress and decompress through the session's submission rings."""

    # --- compress -----------------------------------------------------------------------------------------------
    def _compress_ring_plan(self, req: Request):
        """Starters of the ring requests of ``req`` (one per CPU batch and per GPU), or None when the ring cannot
        carry all of them (no ring offered, an item it cannot describe): then the whole call goes through ZeroMQ."""
        items, codec, streams = req.items, req.codec, req.streams
        if not self._rings.usable or (codec is not None and codec not in _ring.CODEC_CODES) or not items:
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
                budget = req.ring_sm_budget(g.sms)
                if budget is None or not self._gpu_reachable(g):
                    return None
                planned = self._ring_plan_compress_gpu(part)
                if planned is None or planned[1] > MAX_STAGE_BYTES:
                    return None  # everything is staged through the ring: large tensors are handed over through ZeroMQ
                starters.append((idx, key, planned, (_stream_for(streams, key), budget)))
        try:
            for _, key, _, _ in starters:
                if self._rings.ring(key) is None:
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

        ring = self._rings.ring(key)
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
            regions = self._rings.shm(ring, list(dict.fromkeys([seg.name, *files])) if files else [seg.name])
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

    # --- decompress ---------------------------------------------------------------------------------------------
    def _decompress_submit(self, req: Request, blocking: bool = False) -> _ring.Handle | None:
        """The call as ring requests, submitted now, or None: not for the ring (then ZeroMQ, as before).
        ``blocking``: as for :meth:`_compress_submit` (an asynchronous call's ``out=`` tensors are written in stream
        order once the daemon is done, as before; new results, which the caller cannot touch before ``result()``,
        are written in place either way)."""
        items, outs, single = req.items, req.outs, req.single
        if not self._rings.usable or not items:
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
            elif key not in groups and (req.ring_sm_budget(self._gpu(key).sms) is None
                                        or not self._gpu_reachable(self._gpu(key))):
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
                if self._rings.ring(key) is None:
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

        ring = self._rings.ring(key)
        if ring is None:
            return _done_handle(fallback, None)
        try:
            if key is None:
                return self._decompress_start_cpu(ring, cts, outs, verify, tag, post, fallback)
            g = self._gpu(key)
            return self._decompress_start_gpu(ring, g, cts, outs, verify, stream, req.ring_sm_budget(g.sms) or 0, tag, post,
                                              fallback, blocking)
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
            regions = self._rings.shm(ring, list(dict.fromkeys([seg.name, *files])) if files else [seg.name])
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
