"""The client's GPU path through ZeroMQ requests: CUDA tensors stay on their GPU, handed over where they are (a CUDA
IPC share of their storage) or copied on the GPU into the per-client staging arena, ordered on the caller's stream by
interprocess events (see the module docstring of :mod:`tzip.client` and :mod:`tzip._cuda`), and what happens when the
daemon cannot serve a GPU (raw frames, or decompression through the CPU). :class:`GpuPath` is a part of
:class:`tzip.client.Client` (it uses the Client's session: ``_call``, ``_daemon``, ``_limits``, ``_version``)."""

from __future__ import annotations

import contextlib
import sys
import warnings
from dataclasses import dataclass
from typing import Any, Iterable

import torch

from ._cuda import current_stream, stream_scope
from ._dlpack import from_bytes
from ._errors import DaemonUnavailableError, DeviceUnavailableError, TzipDaemonError
from ._fallback import _compress_raw, _decompress_raw, _on_cpu, _place, _to_device
from ._request import Request
from ._wire import _BYTES_PER_GPU_ITEM, _align, cuda_device, layout, split_batches, tensor_desc
from .compressed import CompressedTensor

#: GPU tensors of at least this many bytes are handed over where they are (a CUDA IPC share); smaller ones are
#: copied into the staging arena (cheaper than a share). Client(gpu_share_min_bytes=...) overrides it.
GPU_SHARE_MIN_BYTES = 1 << 20
#: Idle GPU staging bytes kept per GPU. Client(gpu_arena_keep_bytes=...) overrides it.
GPU_ARENA_KEEP_BYTES = 128 << 20


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
        if t is not None and t.is_cuda:
            i = t.get_device()
            if i not in streams:
                streams[i] = current_stream(i)
    return streams


def _stream_for(streams: dict[int, Any] | None, index: int):
    if streams and index in streams:
        return streams[index]
    return current_stream(index)


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
    #: streaming multiprocessors of the GPU (what an SM budget of "all" means on it)
    sms: int
    #: _gpu_reachable's answer and the daemon hello (``Client._daemon``, replaced on reconnect) it was read from
    reach: tuple[Any, bool] | None = None


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


class GpuPath:
    """Compress and decompress of CUDA tensors through ZeroMQ requests, and the per-GPU state (:class:`_Gpu`) the
    ring's GPU requests use too."""

    def _daemon_ordinal(self, g: "_Gpu") -> int | None:
        """The daemon's ordinal of ``g`` (hello's ``daemon.gpus[].index``, matched by UUID), or None."""
        for d in self._session.daemon.get("gpus") or []:
            if isinstance(d, dict) and _normalize_uuid(d.get("uuid", "")) == g.norm and isinstance(d.get("index"), int):
                return int(d["index"])
        return None

    def _staging_take(self, g: "_Gpu", nbytes: int, stream):
        """A staging buffer of ``g``'s arena (given back by the request's finishing step); PyTorch refusing to share
        one is TZIP_UNSUPPORTED."""
        from ._cuda import ShareError

        try:
            return g.arena.take(max(1, nbytes), stream)
        except ShareError as e:
            raise TzipDaemonError("TZIP_UNSUPPORTED", f"cannot stage CUDA tensors for the daemon: {e}") from None

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
                         _cuda.EventPool(device), _cuda.DaemonEvents(device),
                         torch.cuda.get_device_properties(index).multi_processor_count)
                self._gpus[index] = g
            if self._shares is None:
                self._shares = _cuda.ShareCache()
        return g

    def _gpu_reachable(self, g: _Gpu) -> bool:
        """Whether the daemon's hello lists ``g`` (and no request found it unreachable since)."""
        if g.norm in self._gpu_unreachable:
            return False
        info = self._session.daemon
        if g.reach is not None and g.reach[0] is info:
            return g.reach[1]
        ok = any(_normalize_uuid(d.get("uuid", "")) == g.norm for d in (info.get("gpus") or []) if isinstance(d, dict))
        g.reach = (info, ok)
        return ok

    def _gpu_reason(self, g: _Gpu) -> str:
        if not self._session.daemon.get("gpu"):
            return f"the daemon has no GPU ({self._session.daemon.get('gpu_reason', 'no reason given')})"
        seen = ", ".join(str(d.get("uuid")) for d in (self._session.daemon.get("gpus") or []) if isinstance(d, dict))
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

    def _gpu_request(self, g: _Gpu, op: str, body: dict[str, Any], stream, buf, shares: list, req: Request) -> dict[str, Any]:
        """One GPU request of the call ``req``: records the wait event, calls, settles PyTorch's counters, waits on
        the daemon's event."""
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
            reply = self._session.call(op, body, req=req)
        except TzipDaemonError as e:
            settle()  # an answer
            if e.code == "TZIP_NO_DEVICE":
                self._gpu_unreachable.add(g.norm)
                raise _NoDevice(e.detail) from None
            raise
        except BaseException as e:
            if isinstance(e, DaemonUnavailableError) and not self._session.alive():
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
        lay = layout(t.dtype, tuple(t.shape))
        share = self._share(t) if lay.nbytes >= self.gpu_share_min_bytes and t.is_contiguous() else None
        return _GpuItem(t, lay.dl, lay.wshape, lay.nbytes, lay.capacity, share)

    def _compress_gpu(self, g: _Gpu, tensors: list[torch.Tensor], codec: str, stream, req: Request) -> list[CompressedTensor]:
        """``tensors`` (on ``g``, of the call ``req``) compressed with ``codec`` through ZeroMQ requests."""
        if not self._gpu_reachable(g):
            return self._compress_gpu_fallback(g, tensors, self._gpu_reason(g))
        out: list[CompressedTensor] = [None] * len(tensors)  # type: ignore[list-item]
        remote = []
        for i, t in enumerate(tensors):
            if t.numel() == 0:
                # no bytes to share: the frame is the CPU path's (the codec writes the same bytes everywhere)
                ct = self._compress_cpu([torch.empty(t.shape, dtype=t.dtype)], codec, req)[0]
                out[i] = CompressedTensor(ct.payload.to(g.device), t.dtype, t.shape, ct.codec, 0)
            else:
                remote.append(i)
        try:
            with torch.cuda.device(g.index), stream_scope(stream):
                items = [self._plan_gpu(tensors[i]) for i in remote]

                def stage_of(it: _GpuItem) -> int:
                    return (0 if it.share is not None else _align(it.nbytes)) + _align(it.capacity)

                done: list[CompressedTensor] = []
                for batch in split_batches(items, stage_of, self._session.limits, _BYTES_PER_GPU_ITEM):
                    done.extend(self._compress_gpu_batch(g, batch, codec, stream, sum(stage_of(it) for it in batch), req))
        except _NoDevice as e:
            return self._compress_gpu_fallback(g, tensors, str(e))
        for i, ct in zip(remote, done):
            out[i] = ct
        return out

    def _compress_gpu_batch(self, g: _Gpu, batch: list[_GpuItem], codec: str, stream, stage: int,
                            req: Request) -> list[CompressedTensor]:
        from ._cuda import StagingRegions, gpu_bytes_of, gpu_copy_many, regions_of

        with self._staging(g, stage, stream) as buf:
            arena = StagingRegions(buf.share, g.uuid, g.index, self._session.version >= 2)
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
                entries.append({"tensor": tensor_desc(cuda_device(g.index), it.dl, it.wshape, data, byte_offset),
                                "out": arena.region(it.out_off, it.capacity)})
            gpu_copy_many(regions_of(buf.u8, staged), staged_src)
            reply = self._gpu_request(g, "compress", arena.body({"codec": codec, "tensors": entries}), stream, buf,
                                      [it.share for it in batch if it.share is not None], req)
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
        return [_compress_raw(t) for t in tensors]

    def _decompress_gpu(self, g: _Gpu, cts: list[CompressedTensor], outs: list, verify: bool, stream,
                        req: Request) -> list[torch.Tensor]:
        """``cts`` (of the call ``req``) decompressed to ``g`` through ZeroMQ requests."""
        if not self._gpu_reachable(g):
            return self._decompress_gpu_via_cpu(g, cts, outs, verify, self._gpu_reason(g), req)
        results: list[torch.Tensor | None] = [None] * len(cts)
        try:
            with torch.cuda.device(g.index), stream_scope(stream):
                plans = []
                for k, (ct, o) in enumerate(zip(cts, outs)):
                    if ct.nbytes == 0:
                        # no bytes: the frame is checked by the CPU path, the result made here
                        self._decompress_cpu([_on_cpu(ct)], [None], verify, req)
                        results[k] = o if o is not None else torch.empty(ct.shape, dtype=ct.dtype, device=g.device)
                    else:
                        plans.append(self._plan_gpu_frame(g, k, ct, o))

                def stage_of(d: _GpuFrame) -> int:
                    return (0 if d.fshare is not None else _align(d.frame.numel())) + (0 if d.dshare is not None else _align(d.ct.nbytes))

                for batch in split_batches(plans, stage_of, self._session.limits, _BYTES_PER_GPU_ITEM):
                    self._decompress_gpu_batch(g, batch, verify, stream, sum(stage_of(d) for d in batch), results, req)
        except _NoDevice as e:
            return self._decompress_gpu_via_cpu(g, cts, outs, verify, str(e), req)
        return results  # type: ignore[return-value]

    def _plan_gpu_frame(self, g: _Gpu, k: int, ct: CompressedTensor, o: torch.Tensor | None) -> _GpuFrame:
        frame = ct.payload.detach()
        if frame.device != g.device:
            frame = frame.to(g.device)
        if not frame.is_contiguous():
            frame = frame.contiguous()
        lay = layout(ct.dtype, tuple(ct.shape))
        d = _GpuFrame(k, ct, o, frame, lay.dl, lay.wshape)
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

    def _decompress_gpu_batch(self, g: _Gpu, batch: list[_GpuFrame], verify: bool, stream, stage: int, results: list,
                              req: Request) -> None:
        from ._cuda import StagingRegions, gpu_copy_from_bytes, gpu_copy_many, regions_of

        with self._staging(g, stage, stream) as buf:
            arena = StagingRegions(buf.share, g.uuid, g.index, self._session.version >= 2)
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
                entries.append({"frame": fh, "out": tensor_desc(cuda_device(g.index), d.dl, d.wshape, data, byte_offset)})
            gpu_copy_many(regions_of(buf.u8, staged), staged_src)
            reply = self._gpu_request(g, "decompress", arena.body({"frames": entries, "verify": verify}), stream, buf, shares,
                                      req)
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

    def _decompress_gpu_via_cpu(self, g: _Gpu, cts: list[CompressedTensor], outs: list, verify: bool, reason: str,
                                req: Request) -> list[torch.Tensor]:
        """The daemon cannot reach this GPU: frames are decoded through the CPU path and copied back."""
        self._warn_gpu_fallback(g, reason)
        hosts: list[torch.Tensor | None] = [None] * len(cts)
        rest = []
        for k, ct in enumerate(cts):
            if ct.codec == "raw":
                hosts[k] = _decompress_raw(_on_cpu(ct), None, verify)
            else:
                rest.append(k)
        if rest:
            done = self._decompress_cpu([_on_cpu(cts[k]) for k in rest], [None] * len(rest), verify, req)
            for k, h in zip(rest, done):
                hosts[k] = h
        out: list[torch.Tensor] = []
        for h, o in zip(hosts, outs):
            out.append(_place(h, o) if o is not None else _to_device(h, g.device))  # type: ignore[arg-type]
        return out

    def release_gpu(self) -> int:
        """Asks the daemon to close its mappings of this client's GPU memory (they are opened again when needed).
        Call it after ``torch.cuda.empty_cache()``: a segment the caching allocator freed stays allocated on the GPU
        while the daemon maps it. This covers the allocations named in ZeroMQ requests and those registered on the
        submission rings (tzip._cuda_segments). Returns how many of this session's allocations were let go of: those
        the daemon reports for the ZeroMQ requests' (one that another session also maps, or that a running request
        uses, is counted but closed later), plus the ring registrations released.

        Raises:
            TzipDaemonError: the daemon refused the request (e.g. an unknown session).
            DaemonUnavailableError: the daemon did not answer within 10 s."""
        self._check_pid()
        with self._release_lock:
            handles = list(self._gpu_handles)
            self._gpu_handles.clear()
        # The caller's allocations registered on the rings (tzip._cuda_segments): released too, registered again when
        # a request needs them.
        segments = 0
        for ring in list(self._rings.values()):
            if ring.device is not None:
                keys = ring.segments.clear()
                segments += len(keys)
                self._rings.release_keys(ring, keys)
        if self._session.sid is None:
            return 0
        if segments:
            self._rings.flush_releases()
        if not handles:
            return segments
        reply = self._session.call("release", {"handles": handles}, timeout=10.0)
        return int(reply.get("released", 0)) + segments
