"""The CUDA half of the ring route (:mod:`tzip._ring_path`): a GPU request's SQEs point at the caller's own
allocations where they are registered on the ring (CUDA IPC handles, ``ring_register``) and at a staging buffer
otherwise; the daemon's stream is ordered after the caller's by a 64-bit value the caller's stream writes and the
daemon's waits for, and the caller's stream after the daemon's by the reverse (docs/ring.md, "GPU ordering").
:class:`RingGpu` is a part of :class:`tzip._ring_path.RingPath` (it uses the ring, the session and the GPU state of
:class:`tzip.client.Client`)."""

from __future__ import annotations

import logging
import threading

import torch

from . import _ring
from ._cuda import (copy_raw, current_stream, device_scope, gpu_bytes_of, gpu_copy_from_bytes, gpu_copy_many, plain,
                    regions_of, stream_scope)
from ._cuda_segments import segment_key
from ._dlpack import from_bytes
from ._errors import TzipDaemonError
from ._gpu_path import _Gpu, _NoDevice
from ._memops import (allocation_of, available, host_register, host_unregister, ipc_handle, wait_value64,
                      write_value64)
from ._sqe import _A, _LINK, _OP_COMPRESS, _OP_DECOMPRESS, _PACK, _SQE_BYTES, _U64, _ZERO8, _ct, _u8_of
from ._wire import _align, cuda_device, cuda_region
from .compressed import CompressedTensor

_log = logging.getLogger("tzip")

#: The [version]["c"] head of PyTorch's shareable handle (c10/cuda/CUDACachingAllocator.cpp), before the 64-byte
#: cudaIpcMemHandle_t: the form in which the daemon takes CUDA IPC handles (src/daemon/schema.ts).
_IPC_HANDLE_HEAD = bytes([2, ord("c")])
#: Tensors of at most this many bytes get their frame written by the daemon straight into a payload of the frame bound
#: (maxCompressedSize) in the caller's memory, returned as a view of its first frame bytes: no staging buffer and no copy
#: out, for at most a few KiB of slack per payload (a larger frame is copied into a payload of its exact size).
IN_PAYLOAD_MAX_BYTES = 4096


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


class RingGpu:
    """GPU requests through the session's rings: staging and caller regions, submission and ordering."""

    def _ring_gpu_buffer(self, ring: _ring.Ring, g: "_Gpu", buf) -> _ring.Region:
        """The region of the whole staging buffer ``buf`` on ``ring`` (registered once per buffer)."""
        with self._rings.region_lock:
            known = ring.regions.get(("gpubuf", buf))
        if known is not None:
            return known
        ordinal = self._daemon_ordinal(g)
        spec = cuda_region(ordinal, buf.share.handle, buf.share.offset, buf.size)
        return self._rings.regions(ring, [(("gpubuf", buf), spec)])[0]

    def _staging_for(self, ring: _ring.Ring, g: "_Gpu", stream, places: list, sizes: list[tuple[int, int]]):
        """The staging of one GPU batch of n items: ``places`` (n source places, then n destination places, from
        :meth:`_caller_places`) split in two, and one staging buffer of ``g``'s arena for what is not in place, each
        item's source and destination bytes (``sizes``) at aligned offsets, with its region on ``ring``. Returns
        (source places, destination places, the buffer or None, its region id, its generation; 0, 0 without one). A
        buffer whose registration fails goes back to the arena before the error is raised."""
        n = len(sizes)
        src_places, dst_places = places[:n], places[n:]
        stage = sum((_align(s) if sp is None else 0) + (_align(d) if dp is None else 0)
                    for (s, d), sp, dp in zip(sizes, src_places, dst_places))
        buf = self._staging_take(g, stage, stream) if stage else None
        if buf is None:
            return src_places, dst_places, None, 0, 0
        try:
            region = self._ring_gpu_buffer(ring, g, buf)
        except BaseException:
            g.arena.give(buf, stream)
            raise
        return src_places, dst_places, buf, region.id, region.generation

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
                self._rings.regions(ring, specs)
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
                    self._rings.release_keys(ring, drop)
        regions = ring.regions
        out: list = []
        with self._rings.region_lock:
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
            self._rings.release_keys(ring, keys)

    def _open_gpu_ring(self, ring: _ring.Ring, index: int) -> str:
        """Readies the new ring file ``ring`` for the tensors of cuda:``index`` (:class:`tzip._rings.Rings` calls it
        before ``ring_open``) and returns the daemon's name of that GPU. The GPU ordering words (produced, done) live
        in the ring's header page: our GPU writes and waits on them there (:meth:`_gpu_submit`). Raises _NoDevice
        when the daemon does not serve this GPU or the driver cannot map host memory for the GPU."""
        g = self._gpu(index)
        ordinal = self._daemon_ordinal(g)
        if ordinal is None:
            raise _NoDevice(self._gpu_reason(g))
        why = available()
        if why is not None:
            raise _NoDevice(why)
        with torch.cuda.device(index):
            dptr = host_register(ring.base, _ring.HEADER_BYTES)
        ring.before_unmap.append(lambda base=ring.base: host_unregister(base))
        ring.produced_dptr = dptr + _ring.OFF_PRODUCED  # type: ignore[attr-defined]
        ring.done_dptr = dptr + _ring.OFF_DONE  # type: ignore[attr-defined]
        ring.seq = 0  # type: ignore[attr-defined]  # the last produced / signal value used
        ring.gpu_lock = threading.Lock()  # type: ignore[attr-defined]
        ring.order_stream = torch.cuda.Stream(device=g.device)  # type: ignore[attr-defined]  # see _gpu_submit
        ring.home_stream = None  # type: ignore[attr-defined]  # the one stream that submitted so far (_gpu_submit)
        with torch.cuda.device(index):
            # One event for every submission: recorded and waited for under gpu_lock, so each wait takes the record
            # just before it (an event's wait uses its state when queued).
            ring.order_event = torch.cuda.Event()  # type: ignore[attr-defined]
        return cuda_device(ordinal)

    def _gpu_submit(self, ring: _ring.Ring, g: "_Gpu", stream, h: _ring.Handle, sq: bytearray, n: int, vbox: list,
                    buf=None) -> _ring.Handle:
        """Submits a GPU batch (``n`` SQEs packed in ``sq`` for ``h``, whose finishing step and GPU wait are set)
        ordered after the work queued so far on ``stream`` (its inputs): ``produced = v`` is written once that work is
        done, the batch is marked WAIT (first SQE) / SIGNAL (last) with ``v`` (put in ``vbox``, read by the finishing
        step and the GPU wait), and published. The batch's staging buffer ``buf`` (or None) goes back to the arena
        when nothing of the batch reached the ring; once it did, the finishing step gives it back.

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
                # Nothing of the batch reached the ring: its staging buffer goes back. (The value is spent; later
                # batches wait for later values, which produced reaches in order all the same.)
                vbox.clear()
                _give_staging(g, buf, stream)
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
            src_places, dst_places, buf, rid, rgen = self._staging_for(ring, g, stream, places,
                                                                       [(p[3][0], p[3][4]) for p in plan])
            try:
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
        return self._gpu_submit(ring, g, stream, h, sq, n, vbox, buf)

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
            src_places, dst_places, buf, rid, rgen = self._staging_for(ring, g, stream, places,
                                                                       [(f.numel(), ct.nbytes) for f, ct in zip(frames, cts)])
            try:
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
        return self._gpu_submit(ring, g, stream, h, sq, n, vbox, buf)
