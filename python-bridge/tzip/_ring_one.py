"""Blocking calls on one CUDA tensor through the submission ring, with as little Python as the request needs.

``Client.compress(t)`` of one CUDA tensor and ``Client.decompress(ct)`` of one frame on a GPU are the calls whose time
is mostly the client's own for small tensors (a 1-element compress: about 60 µs of Python per request before this
path, against the ring thread's 22 µs batch; docs/benchmarks.md, "Daemon fast lane"), and a tenth to a quarter of a
25 MB bucket's. :class:`RingOne` does them without the general path's planning for batches, device groups, staging
and asynchronous ordering: it reads the tensor and writes the result where they are (tzip._cuda_segments), packs one
SQE and waits for its completion on the calling thread.

Where a compress's frame goes: into ``out=`` when the caller gives one (no copy); else into a payload of the frame
bound, returned as a view of its frame bytes for tensors of at most :data:`tzip._ring_gpu.IN_PAYLOAD_MAX_BYTES` (a
few KiB of slack), and for larger ones copied into a payload of its exact size on the caller's stream (as the general
path copies it out of staging), so a CompressedTensor holds no more memory than its frame.

It takes a call only when all of that applies: the device's ring is open and serving, both ranges lie in allocations
the daemon can map, a decompressed result is a whole number of bytes of its dtype, and the request's two ranges
together are at most :data:`tzip._wire.MAX_STAGE_BYTES` (larger ones go through ZeroMQ, as on the general path). Any
other call, and any call it gives up on before submitting, takes the general path (:class:`tzip._ring_path.RingPath`),
as does a call whose ring stopped or whose region was released while it was queued (then through ZeroMQ, as there).
The SQE, its ordering after the caller's stream (``_gpu_submit``) and the completion are the general path's, so the
daemon cannot tell the two apart."""

from __future__ import annotations

import torch

from . import _ring
from ._codec_choice import codec_for
from ._cuda import copy_raw, current_stream, device_scope, plain, stream_scope
from ._errors import DaemonUnavailableError, TzipDaemonError
from ._request import Request
from ._ring_gpu import IN_PAYLOAD_MAX_BYTES, _region_gone
from ._ring_path import _WHOLE_BYTE_DTYPES, RingPath
from ._sqe import _OP_COMPRESS, _OP_DECOMPRESS, _PACK, _SQE_BYTES, _ZERO8, _ct
from ._wire import MAX_STAGE_BYTES, _align, _sqe_layout
from .compressed import CompressedTensor

#: What a finishing step returns when the request must be done again without the ring.
_AGAIN = object()


def _outcome(res, check):
    """The finishing step of a one-SQE request: ``check(codec, result)``'s value for a good completion; :data:`_AGAIN`
    where the ring stopped or a region went away (the call is then done without the ring); else raises the CQE's
    error."""
    if isinstance(res, BaseException):
        if isinstance(res, (DaemonUnavailableError, TzipDaemonError)):
            return _AGAIN
        raise res
    status, codec, result, message = res[0]
    if status:
        err = _ring.status_error(status, message, 0)
        if _region_gone(err):
            return _AGAIN
        raise err
    return check(codec, result)


class RingOne(RingPath):
    """The lean path for blocking single-tensor GPU calls (see the module docstring)."""

    def _one_ring(self, t: torch.Tensor, req: Request):
        """(ring, gpu, stream, SM budget, stream tag) for the request ``req`` on ``t``'s GPU through its ring as it
        stands (open and serving), or None."""
        index = t.get_device()
        ring = self._rings.get(index)
        if ring is None or ring.sid != self._session.sid or not ring.usable:
            return None
        g = self._gpus.get(index)
        budget = None if g is None else req.ring_sm_budget(g.sms)
        if budget is None or not self._gpu_reachable(g):
            return None
        return ring, g, current_stream(index), budget, req.ring_tag

    def _one_places(self, ring, g, src: int, sbytes: int, dst: int, dbytes: int):
        """(source, destination) places of the request's two ranges in the caller's memory (region id, generation,
        offset each), or None where either must be staged, or registering them failed (the general path then)."""
        try:
            places = self._caller_places(ring, g, [(src, sbytes), (dst, dbytes)])
        except (DaemonUnavailableError, TzipDaemonError):
            return None
        return None if places[0] is None or places[1] is None else places

    def _one_submit(self, ring, g, stream, h: _ring.Handle, sq: bytearray):
        """Submits ``h``'s one SQE, then waits for its value; :data:`_AGAIN` where the request never reached the ring
        or must be done again."""
        try:
            self._gpu_submit(ring, g, stream, h, sq, 1, [])
        except (DaemonUnavailableError, TzipDaemonError):
            return _AGAIN
        return self._wait_handle(h)

    def _compress_one(self, req: Request) -> CompressedTensor | None:
        """``req``, a compress of one CUDA tensor (its arguments checked), or None when it is not for this path."""
        t, codec, out = req.items[0], req.codec, req.outs[0] if req.outs else None
        lay = _sqe_layout(t.dtype, t.shape)
        if lay is None or not plain(t) or _align(lay[0]) + _align(lay[4]) > MAX_STAGE_BYTES:
            return None  # (the general path hands such a tensor over through ZeroMQ)
        ccode = _ring.CODEC_CODES.get(codec_for(codec, True))
        got = self._one_ring(t, req)
        if ccode is None or got is None:
            return None
        ring, g, stream, budget, tag = got
        nbytes, dcode, ndim, dims, cap = lay
        # The frame is written straight into out, or into a payload of the frame bound: returned as a view of its
        # first bytes when the tensor is small (a few KiB of slack), else copied into a payload of its exact size.
        payload = out if out is not None else torch.empty(cap, dtype=torch.uint8, device=g.device)
        cap = payload.numel()
        places = self._one_places(ring, g, t.data_ptr(), nbytes, payload.data_ptr(), cap)
        if places is None:
            return None
        h = _ring.Handle(ring, 1)
        sq = bytearray(_SQE_BYTES)
        _PACK(sq, 0, h.ud, _OP_COMPRESS, 0, ccode, dcode, ndim, budget, tag, *places[0], nbytes, *places[1], cap, *dims, 0, 0)
        dtype, shape = t.dtype, t.shape

        def check(c: int, m: int):
            if not 0 < m <= cap:
                raise TzipDaemonError("TZIP_CORRUPT", f"the ring reported a frame of {m} bytes (capacity {cap})")
            return _ct(payload[:m], dtype, shape, _ring.CODEC_NAMES.get(c, "raw"), nbytes)

        h._finish = lambda res: _outcome(res, check)
        got = self._one_submit(ring, g, stream, h, sq)
        if got is _AGAIN:
            return self._compress_zmq(req)
        if out is None and nbytes > IN_PAYLOAD_MAX_BYTES:
            # Here, not in check(): the thread that reaps the CQE may be another one (the ring's reaper), and the
            # payload must be allocated on the caller's stream, which the copy and the caller's uses follow.
            m = got.payload.numel()
            with device_scope(g.index), stream_scope(stream):
                frame = torch.empty(m, dtype=torch.uint8, device=g.device)
                if not copy_raw(frame.data_ptr(), payload.data_ptr(), m, g.index, stream.cuda_stream):
                    frame.copy_(got.payload)
            got.payload = frame
        return got

    def _decompress_one(self, req: Request) -> torch.Tensor | None:
        """``req``, a decompress of one frame on a GPU (its arguments checked), or None when it is not for this path."""
        ct, out, verify = req.items[0], req.outs[0], req.verify
        frame, nbytes = ct.payload, ct.nbytes
        fbytes = frame.numel()
        if not frame.is_cuda or nbytes == 0 or fbytes == 0 or not frame.is_contiguous():
            return None
        if out is not None and (out.get_device() != frame.get_device() or not plain(out)):
            return None
        if _align(fbytes) + _align(nbytes) > MAX_STAGE_BYTES:
            return None  # (the general path hands such a request over through ZeroMQ, as it would stage it)
        got = self._one_ring(frame, req)
        if got is None:
            return None
        ring, g, stream, budget, tag = got
        if out is None:
            if ct.dtype not in _WHOLE_BYTE_DTYPES:
                return None
            dst = torch.empty(ct.shape, dtype=ct.dtype, device=g.device)
            if dst.nbytes != nbytes:
                return None  # (a shape that does not hold nbytes: the general path raises for it)
        else:
            dst = out
        places = self._one_places(ring, g, frame.data_ptr(), fbytes, dst.data_ptr(), nbytes)
        if places is None:
            return None
        h = _ring.Handle(ring, 1)
        sq = bytearray(_SQE_BYTES)
        _PACK(sq, 0, h.ud, _OP_DECOMPRESS, _ring.F_VERIFY if verify else 0, 0, 0, 0, budget, tag, *places[0], fbytes,
              *places[1], nbytes, *_ZERO8)

        def check(_c: int, m: int):
            if m != nbytes:
                raise TzipDaemonError("TZIP_CORRUPT", f"the frame holds {m} bytes, the CompressedTensor says {nbytes}")
            return dst

        h._finish = lambda res: _outcome(res, check)
        got = self._one_submit(ring, g, stream, h, sq)
        if got is _AGAIN:
            return self._decompress_zmq(req)
        return got
