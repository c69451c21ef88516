"""The host side of a GPU optimizer's offloaded state (:class:`tzip.optim.CompressedOffload`): the pinned host slabs
that hold its frames between steps, one per GPU and chunk position, and the side stream per GPU that copies frames
between them and the GPU while the daemon codes the neighbouring chunk."""

from __future__ import annotations

from typing import Callable

import torch

from ._offload_state import _SLAB_GRAIN, _Chunk, _HostSlab
from .client import Client
from .compressed import CompressedTensor


class OffloadCopies:
    """Slabs (``slabs[gpu index][chunk position]``) and copy streams of one offload.

    Args:
        client: the daemon client that encodes and decodes the chunks on the GPU.
    """

    def __init__(self, client: Client) -> None:
        self.client = client
        self.slabs: dict[int, list[_HostSlab | None]] = {}  # per GPU index: one slab per chunk position
        self._streams: dict[int, torch.cuda.Stream] = {}

    def held(self) -> list[_HostSlab]:
        """The slabs held now (their frames, and their headroom)."""
        return [s for lst in self.slabs.values() for s in lst if s is not None]

    def settle(self) -> None:
        """Waits for the copies into and out of the slabs (before the host reads them)."""
        for s in self.held():
            ev = s.holder.get("event")
            if ev is not None:
                ev.synchronize()

    def release(self) -> None:
        """Unpins and drops every slab (each waits for the copies that use it)."""
        for s in self.held():
            s.release()
        self.slabs = {}

    def _stream(self, index: int) -> torch.cuda.Stream:
        s = self._streams.get(index)
        if s is None:
            s = self._streams[index] = torch.cuda.Stream(device=index)
        return s

    def _slab(self, index: int, k: int, need: int) -> _HostSlab:
        """The slab of chunk position ``k`` on GPU ``index``, for ``need`` bytes: kept when it has them and is not
        over half again too large, else made anew with 1/8 headroom (rounded up to _SLAB_GRAIN)."""
        slabs = self.slabs.setdefault(index, [])
        while len(slabs) <= k:
            slabs.append(None)
        s = slabs[k]
        if s is None or s.capacity < need or s.capacity > need + need // 2 + _SLAB_GRAIN:
            if s is not None:
                s.release()  # waits for the copies that use it
            cap = need + need // 8
            s = slabs[k] = _HostSlab((cap + _SLAB_GRAIN - 1) // _SLAB_GRAIN * _SLAB_GRAIN)
        return s

    def offload(self, index: int, planned: list, codec: str | None, flat_of: Callable[[_Chunk, list], torch.Tensor],
                place: Callable[[_Chunk, list, torch.Tensor], None], sm_budget: int | None = None) -> None:
        """Per chunk of ``planned`` ((chunk, items, flat buffer or None) on GPU ``index``): the daemon encodes the flat
        buffer (``flat_of(chunk, items)`` when None) on the GPU, on ``sm_budget`` SMs (as Client.compress's), in the
        current stream's order, then the frame is copied into the chunk's pinned slab on the side stream while the next
        chunk is encoded, and ``place(chunk, items, flat)`` puts the chunk's placeholders into the state. Returns when
        the copies are done; slabs of chunk positions past the last are released."""
        with torch.cuda.device(index):
            compute = torch.cuda.current_stream(index)
            side = self._stream(index)
            in_flight: list[tuple[torch.cuda.Event, CompressedTensor]] = []  # GPU frames until copied
            done_with: torch.cuda.Event | None = None
            try:
                for k, (chunk, items, flat) in enumerate(planned):
                    while in_flight and in_flight[0][0].query():
                        in_flight.pop(0)  # copied: the frame's GPU memory goes back to the caching allocator
                    flat = flat if flat is not None else flat_of(chunk, items)
                    gpu_ct = self.client.compress(flat, codec=codec, sm_budget=sm_budget)
                    n = gpu_ct.compressed_nbytes
                    slab = self._slab(index, k, n)
                    side.wait_stream(compute)  # the frame is ready in the compute stream's order
                    with torch.cuda.stream(side):
                        slab.u8[:n].copy_(gpu_ct.payload, non_blocking=True)
                    done_with = side.record_event()
                    slab.holder["event"] = done_with
                    in_flight.append((done_with, gpu_ct))
                    chunk.ct = CompressedTensor(slab.u8[:n], gpu_ct.dtype, gpu_ct.shape, gpu_ct.codec, gpu_ct.nbytes)
                    chunk.slab = slab
                    del gpu_ct
                    place(chunk, items, flat)
                    del flat
            finally:
                if done_with is not None:
                    done_with.synchronize()
                in_flight.clear()
            slabs = self.slabs.get(index, [])
            for s in slabs[len(planned):]:
                if s is not None:
                    s.release()
            del slabs[len(planned):]

    def restore(self, index: int, chunks: list[_Chunk],
                sm_budget: int | None = None) -> list[tuple[_Chunk, torch.Tensor]]:
        """Per chunk (on GPU ``index``): its frame copied host to device on the side stream (the next chunk's copy runs
        while the daemon decodes this one on the GPU), then one decompress request in the compute stream's order, on
        ``sm_budget`` SMs (as Client.decompress's). Returns (chunk, decoded flat buffer) pairs."""
        out: list[tuple[_Chunk, torch.Tensor]] = []
        device = torch.device("cuda", index)
        with torch.cuda.device(index):
            compute = torch.cuda.current_stream(index)
            side = self._stream(index)

            def upload(c: _Chunk) -> tuple[CompressedTensor, torch.cuda.Event]:
                ct = c.ct
                buf = torch.empty(ct.compressed_nbytes, dtype=torch.uint8, device=device)  # compute stream's memory
                side.wait_stream(compute)  # earlier users of that memory are done before the copy writes it
                with torch.cuda.stream(side):
                    buf.copy_(ct.payload, non_blocking=True)
                ev = side.record_event()
                c.slab.holder["event"] = ev  # type: ignore[union-attr]
                return CompressedTensor(buf, ct.dtype, ct.shape, ct.codec, ct.nbytes), ev

            try:
                nxt = upload(chunks[0])
                for k, c in enumerate(chunks):
                    gpu_ct, ev = nxt
                    if k + 1 < len(chunks):
                        nxt = upload(chunks[k + 1])
                    compute.wait_event(ev)
                    out.append((c, self.client.decompress(gpu_ct, sm_budget=sm_budget)))
                    del gpu_ct
            except BaseException:
                side.synchronize()  # an upload in flight writes memory that is given back as the error unwinds
                raise
        return out
