"""The codec in this process: ``compress`` and ``decompress`` as :class:`tzip.Client` has them, run by the in-process
library (``libtzip.so``, :mod:`tzip._native`) on the caller's own CUDA stream instead of by the daemon.

A blocking GPU request through the daemon costs about 0.45 ms however small it is (docs/benchmarks.md, "What one
blocking GPU request costs": the ring, the daemon's enqueue and its wait, the client's own bookkeeping); here a call is
one library call on the current stream and, for ``compress``, one wait for the frame sizes. The frames are the same
bytes the daemon writes (same kernels, same format), so either side of a transfer may use either.

It has what :mod:`tzip.distributed` and :class:`tzip.ddp.LosslessState` ask of a client (``compress`` and
``decompress`` of lists), so it is passed where they take ``client=``::

    codec = tzip.in_process.InProcessCodec()
    tzip.distributed.all_reduce(bucket, client=codec)

What it does not do, and the daemon does: job settings (``tzip set JOB codec=...``), the daemon's statistics, the
SM budget shared between processes. CPU tensors are coded by the library's CPU codec (``threads`` threads).

Raises :class:`tzip._native.NativeCodecError` (``TZIP_UNSUPPORTED`` when the library is missing: ``npm run
build:native`` builds it beside the addon; ``TZIP_CORRUPT``, ``TZIP_TRUNCATED``, ``TZIP_CHECKSUM`` for a bad frame).
"""

from __future__ import annotations

import torch

from . import _native
from ._call_args import check_compress_args, check_decompress_args, compress_request, decompress_request, _into_outs
from ._codec_choice import codec_for
from ._cuda import gpu_copy_from_bytes
from ._dlpack import copy_from_bytes, from_bytes
from ._frame import _CODEC_NAMES, DEFAULT_CHUNK
from ._job import _checked_sm_budget
from .compressed import CompressedTensor

__all__ = ["InProcessCodec"]

#: Byte offset of the codec id in a frame's fixed header (docs/format.md, section 3: magic 4, version 2, dtype 1).
_CODEC_AT = 7


class InProcessCodec:
    """``compress``/``decompress`` of CPU and CUDA tensors in this process (see the module docstring).

    ``sm_budget``: SMs the GPU kernels may use (None or 0: every SM; a call's ``sm_budget=`` wins; ValueError outside
    0..1024, as for a call). ``threads``: CPU
    codec threads. ``chunk_bytes``: the frames' chunk size (the format's default unless you know better).
    """

    def __init__(self, sm_budget: int | None = None, threads: int = 1, chunk_bytes: int = DEFAULT_CHUNK):
        _native.library()  # a missing library raises here, not at the first call
        self.sm_budget = _checked_sm_budget(sm_budget)  # (as a call's: ValueError outside 0..MAX_SM_BUDGET)
        self.threads = threads
        self.chunk_bytes = chunk_bytes

    def _budget(self, sm_budget: int | None) -> int:
        b = sm_budget if sm_budget is not None else self.sm_budget
        return 0 if b is None else int(b)

    # --- compress ------------------------------------------------------------------------------------------------------
    def compress(self, tensors, codec: str | None = None, *, sm_budget: int | None = None, out=None):
        """Frames of ``tensors`` (one tensor or a list): CompressedTensors as ``Client.compress`` returns, their
        payloads on each tensor's device. ``codec``: None gives ``fast`` for CUDA tensors and ``auto`` for CPU ones
        (tzip._codec_choice). ``out=``: uint8 buffers of at least ``Client.frame_bound(t)`` bytes, as for
        ``Client.compress``. A CUDA tensor is read in the current stream's order and the call returns once its frame
        is written (the frame sizes are needed on the host). Raises ValueError/TypeError for what Client.compress
        refuses, NativeCodecError for what the codec refuses."""
        req = compress_request(tensors, codec, sm_budget, out)
        items = req.items
        check_compress_args(items, codec)
        cts: list[CompressedTensor | None] = [None] * len(items)
        gpu: dict[torch.device, list[int]] = {}
        for i, t in enumerate(items):
            if t.is_cuda and t.numel():
                gpu.setdefault(t.device, []).append(i)
            else:
                cts[i] = self._compress_cpu(t, codec)
        outs = req.outs or [None] * len(items)
        for device, idx in gpu.items():
            for i, ct in zip(idx, self._compress_gpu(device, [items[i] for i in idx], [outs[i] for i in idx], codec,
                                                     self._budget(sm_budget))):
                cts[i] = ct
        return _into_outs(cts[0] if req.single else cts, req.outs, req.single)

    def _compress_cpu(self, t: torch.Tensor, codec: str | None) -> CompressedTensor:
        """One frame by the CPU codec (an empty CUDA tensor's too: nothing to launch; its frame goes to its device)."""
        c = codec_for(codec, t.is_cuda)
        frame = _native.cpu_encode(t.detach().cpu().contiguous(), c, self.chunk_bytes, self.threads)
        name = _CODEC_NAMES[_native.frame_info(frame)["codec"]]
        return CompressedTensor(frame.to(t.device), t.dtype, t.shape, name, t.numel() * t.element_size())

    def _compress_gpu(self, device: torch.device, ts: list[torch.Tensor], outs: list, codec: str | None,
                      budget: int) -> list[CompressedTensor]:
        """One library call for the CUDA tensors ``ts`` of ``device``, each frame written into its ``outs`` entry
        (checked to hold the frame bound) or a buffer of its own (of the frame bound: a payload is a view of it, never
        of another tensor's frame, so that torch.save of one writes one)."""
        c = codec_for(codec, True)
        with torch.cuda.device(device):
            srcs = [t.detach().contiguous() for t in ts]
            bounds = [_native.tensor_frame_bytes(t, self.chunk_bytes) for t in srcs]
            for i, (o, b) in enumerate(zip(outs, bounds)):
                if o is not None and o.numel() < b:  # (the encoder writes up to the bound: never past a buffer)
                    raise ValueError(f"out {i} holds {o.numel()} bytes; a frame of {b} bytes at most needs them "
                                     f"(chunks of {self.chunk_bytes} bytes)")
            frames = [o if o is not None else torch.empty(b, dtype=torch.uint8, device=device)
                      for o, b in zip(outs, bounds)]
            sizes = torch.zeros(len(srcs), dtype=torch.int64, device=device)
            _native.gpu_encode(srcs, [c] * len(srcs), frames, sizes, torch.cuda.current_stream(device).cuda_stream,
                               self.chunk_bytes, budget)
            if c == "auto":  # each frame says which codec auto chose: its header's codec byte, with the sizes
                got = torch.cat([sizes, torch.stack([f[_CODEC_AT] for f in frames]).to(torch.int64)]).tolist()
                n_bytes, names = got[: len(srcs)], [_CODEC_NAMES[x] for x in got[len(srcs):]]
            else:
                n_bytes, names = sizes.tolist(), [c] * len(srcs)
        return [CompressedTensor(f[:m], t.dtype, t.shape, name, t.numel() * t.element_size())
                for f, m, t, name in zip(frames, n_bytes, ts, names)]

    # --- decompress ----------------------------------------------------------------------------------------------------
    def decompress(self, cts, out=None, verify: bool = True, *, sm_budget: int | None = None):
        """The tensors of ``cts`` (one CompressedTensor or a list), bit-identical to what was compressed: written into
        ``out`` (a tensor or one entry per item, None for a new one) or new tensors on each payload's device (CUDA
        tensors for CUDA payloads; a CPU payload with a CUDA ``out`` is copied to that GPU first). ``verify`` checks the
        chunk digests. A CUDA result is complete when the call returns (the decoder's per-frame status is read back).
        Raises TypeError/ValueError for what Client.decompress refuses, NativeCodecError (TZIP_CORRUPT,
        TZIP_TRUNCATED, TZIP_CHECKSUM, ...) for a bad frame, naming its index in the call."""
        req = decompress_request(cts, out, verify, sm_budget)
        items, outs = req.items, req.outs
        check_decompress_args(items, outs)
        results: list[torch.Tensor | None] = [None] * len(items)
        gpu: dict[torch.device, list[int]] = {}
        for i, (ct, o) in enumerate(zip(items, outs)):
            device = o.device if o is not None else ct.payload.device
            if device.type == "cuda" and ct.nbytes:
                gpu.setdefault(device, []).append(i)
            else:
                results[i] = self._decompress_cpu(i, ct, o, verify)
        for device, idx in gpu.items():
            got = self._decompress_gpu(device, idx, [items[i] for i in idx], [outs[i] for i in idx], verify,
                                       self._budget(sm_budget))
            for i, t in zip(idx, got):
                results[i] = t
        return results[0] if req.single else results

    def _decompress_cpu(self, i: int, ct: CompressedTensor, o: torch.Tensor | None, verify: bool) -> torch.Tensor:
        flat = torch.empty(ct.nbytes, dtype=torch.uint8)
        try:
            _native.cpu_decode(ct.payload.detach().cpu().contiguous(), flat, verify, self.threads)
        except _native.NativeCodecError as e:
            raise _native.NativeCodecError(e.code, e.detail, i) from None
        if o is None:
            t = from_bytes(flat, ct.dtype, ct.shape)
            return t if ct.payload.is_cpu else t.to(ct.payload.device)
        if o.is_cpu:  # (else an empty CUDA out: nothing to write)
            copy_from_bytes(o, flat)
        return o

    def _decompress_gpu(self, device: torch.device, idx: list[int], cts: list[CompressedTensor], outs: list,
                        verify: bool, budget: int) -> list[torch.Tensor]:
        """One library call for the frames decoded on ``device``: into the outs where they are contiguous, else into
        new buffers (copied into an out that is not)."""
        with torch.cuda.device(device):
            frames = [ct.payload.detach().to(device).contiguous() for ct in cts]
            # where each frame is decoded: its out when contiguous, else a new buffer (copied into a strided out)
            dsts = [o if o is not None and o.is_contiguous() else torch.empty(ct.nbytes, dtype=torch.uint8, device=device)
                    for ct, o in zip(cts, outs)]
            errors = torch.zeros(len(cts), dtype=torch.int32, device=device)
            arrays = _native.PointerArrays([f.data_ptr() for f in frames], [f.numel() for f in frames],
                                           [d.data_ptr() for d in dsts], [ct.nbytes for ct in cts])
            _native.gpu_decode(arrays, errors, torch.cuda.current_stream(device).cuda_stream, budget, verify)
            codes = errors.tolist()  # waits for the decode: a bad frame is an error of this call, not a later one
        for k, code in enumerate(codes):
            if code:
                raise _native.NativeCodecError(_native.code_name(code), f"decoding frame {idx[k]} of the call", idx[k])
        results = []
        for ct, o, d in zip(cts, outs, dsts):
            if o is None:
                results.append(from_bytes(d, ct.dtype, ct.shape))
            else:
                if d is not o:
                    gpu_copy_from_bytes(o, d)  # through integer views: the bits move exactly
                results.append(o)
        return results
