"""The client's CPU path through ZeroMQ requests: tensor bytes travel through POSIX shared memory the daemon maps,
zero copy for tensors already in shared memory, else one copy into the per-client staging arena; decompressed
tensors of :data:`DEDICATED_MIN_BYTES` and more are written by the daemon into shared memory of their own (see the
module docstring of :mod:`tzip.client` and :mod:`tzip._shm`). :class:`CpuPath` is a part of
:class:`tzip.client.Client` (it uses the Client's session and arenas: ``_call``, ``_arena``, ``_results``,
``_limits``, ``_copy_in``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import _shm
from ._dlpack import DL_CPU, copy_bytes, copy_from_bytes, from_bytes
from ._errors import TzipDaemonError
from ._request import Request
from ._wire import _align, _device, layout, shm_data, split_batches, tensor_desc
from .compressed import CompressedTensor


#: Decompressed tensors of at least this many bytes get their own shared-memory segment (no copy).
DEDICATED_MIN_BYTES = 1 << 20
#: Idle shared-memory bytes kept for reuse as decompressed tensors once the caller's tensors over them died (a fresh
#: /dev/shm file costs its page faults: tzip._shm.ResultPool). Client(result_pool_keep_bytes=...) overrides it.
RESULT_POOL_KEEP_BYTES = 512 << 20


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


class CpuPath:
    """Compress and decompress of CPU tensors through ZeroMQ requests."""

    def _plan(self, t: torch.Tensor) -> _Item:
        lay = layout(t.dtype, tuple(t.shape))
        return _Item(t, lay.dl, lay.wshape, lay.nbytes, lay.capacity, _zero_copy_handle(t, lay.nbytes))

    def _compress_cpu(self, tensors: list[torch.Tensor], codec: str, req: Request) -> list[CompressedTensor]:
        """``tensors`` (CPU, of the call ``req``) compressed with ``codec`` through ZeroMQ requests."""
        items = [self._plan(t) for t in tensors]

        def stage_of(it: _Item) -> int:
            return (0 if it.zero_copy else _align(it.nbytes)) + _align(it.capacity)

        results: list[CompressedTensor] = []
        for batch in split_batches(items, stage_of, self._session.limits):
            with self._arena.lease(max(1, sum(stage_of(it) for it in batch))) as seg:
                off = 0
                entries = []
                for it in batch:
                    if it.zero_copy is not None:
                        data = shm_data(it.zero_copy[0], it.zero_copy[1], it.nbytes)
                    else:
                        self._copy_in(seg, off, it.tensor, it.nbytes)
                        data = shm_data(seg.name, off, it.nbytes)
                        off += _align(it.nbytes)
                    it.out_off = off
                    off += _align(it.capacity)
                    entries.append({"tensor": tensor_desc(_device(it.tensor), it.dl, it.wshape, data),
                                    "out": shm_data(seg.name, it.out_off, it.capacity)})
                reply = self._session.call("compress", {"codec": codec, "tensors": entries}, req=req)
                for it, fr in zip(batch, reply["frames"]):
                    n = int(fr["bytes"])
                    payload = torch.empty(n, dtype=torch.uint8)
                    copy_bytes(payload, seg.u8[it.out_off : it.out_off + n])
                    results.append(CompressedTensor(payload, it.tensor.dtype, it.tensor.shape, str(fr["codec"]), it.nbytes))
        return results

    def _decompress_cpu(self, cts: list[CompressedTensor], outs: list[torch.Tensor | None], verify: bool,
                        req: Request) -> list[torch.Tensor]:
        """``cts`` (of the call ``req``) decompressed to the CPU through ZeroMQ requests."""
        lent: list[_shm.Segment] = []
        try:
            return self._decompress_cpu_planned(cts, outs, verify, lent, req)
        except TzipDaemonError:
            raise  # answered: the daemon is done with the segments, they may be reused
        except BaseException:
            for seg in lent:  # the daemon may not be done with them (no answer): never reuse
                self._results.discard(seg)
            raise

    def _decompress_cpu_planned(self, cts: list[CompressedTensor], outs: list[torch.Tensor | None], verify: bool,
                                lent: list[_shm.Segment], req: Request) -> list[torch.Tensor]:
        plans = []
        for ct, o in zip(cts, outs):
            frame = ct.payload if ct.payload.is_contiguous() else ct.payload.contiguous()
            lay = layout(ct.dtype, tuple(ct.shape))
            d = _Frame(ct, o, frame, _zero_copy_handle(frame, frame.numel()), lay.dl, lay.wshape)
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
        for batch in split_batches(plans, stage_of, self._session.limits):  # type: ignore[arg-type]
            with self._arena.lease(max(1, sum(stage_of(d) for d in batch))) as seg:
                off = 0
                entries = []
                for d in batch:
                    n = d.frame.numel()
                    if d.frame_zc is not None:
                        fh = shm_data(d.frame_zc[0], d.frame_zc[1], n)
                    else:
                        copy_bytes(seg.u8[off : off + n], d.frame)
                        fh = shm_data(seg.name, off, n)
                        d.frame_off = off
                        off += _align(n)
                    if d.dest is not None:
                        oh = shm_data(d.dest[0], d.dest[1], d.ct.nbytes)
                    else:
                        oh = shm_data(seg.name, off, d.ct.nbytes)
                        d.out_off = off
                        off += _align(d.ct.nbytes)
                    entries.append({"frame": fh, "out": tensor_desc({"type": DL_CPU, "id": 0}, d.dl, d.wshape, oh)})
                reply = self._session.call("decompress", {"frames": entries, "verify": verify}, req=req)
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
