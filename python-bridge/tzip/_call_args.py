"""The arguments of a compress or decompress call, checked once at the public API before any route runs and made into
its :class:`tzip._request.Request` there (:func:`compress_request`, :func:`decompress_request`): the items (lazily
conjugated or negated views resolved), ``out=`` as one entry per item, destinations that must not overlap each other
or the call's sources, and the frames written into their ``out=`` buffers afterwards."""

from __future__ import annotations

import torch

from ._codec_choice import check_codec
from ._dlpack import byte_range, check_supported, has_internal_overlap
from ._gpu_path import _caller_streams
from ._job import _checked_sm_budget, _stream_tag
from ._request import Request
from ._wire import _device, layout
from .compressed import CompressedTensor, check_layout


def frame_bound(t: torch.Tensor) -> int:
    """Bytes that hold any frame of ``t`` (any codec): the size of a ``compress(t, out=)`` buffer. The format's size
    bound (docs/format.md, section 10): ``align16(48 + 8*ndim) + 16*chunks + nbytes`` of the frame's shape."""
    return layout(t.dtype, tuple(t.shape)).capacity


def compress_request(tensors, codec: str | None, sm_budget: int | None, out=None, *, asynchronous: bool = False) -> Request:
    """The :class:`Request` of ``Client.compress(tensors, codec, sm_budget=, out=)`` (``compress_async`` when
    ``asynchronous``: the caller's current streams recorded, no ``out``), with the stream tag in force. Raises
    ValueError for an sm_budget that is not an int in 0..1024 and, when ``out`` is given, the errors of
    :func:`_compress_outs` (the inputs' own errors first); the inputs are otherwise checked by the route."""
    budget = _checked_sm_budget(sm_budget)
    single = isinstance(tensors, torch.Tensor)
    items = _resolved([tensors] if single else list(tensors))
    streams = _caller_streams(t for t in items if isinstance(t, torch.Tensor)) if asynchronous else None
    return Request(items, single, _compress_outs(items, out, single, codec), codec=codec, sm_budget=budget,
                   stream=_stream_tag.get(), streams=streams)


def _compress_outs(items: list, out, single: bool, codec: str | None) -> list | None:
    """``out=`` of a compress as one entry per item (None: no out at all), checked (see ``Client.compress``)."""
    if out is None:
        return None
    check_compress_args(items, codec)  # (the inputs first: their errors are the call's first)
    outs = _outs_per_item(out, len(items), single, "a uint8 tensor or None per tensor", "tensors")
    for i, (t, o) in enumerate(zip(items, outs)):
        if o is None:
            continue
        if not isinstance(o, torch.Tensor) or not isinstance(t, torch.Tensor):
            raise TypeError(f"out {i} is a {type(o).__name__} for a {type(t).__name__}: out= takes uint8 tensors for tensors")
        if o.is_inference() and not torch.is_inference_mode_enabled():
            raise ValueError(f"out {i} was made in inference mode: outside it, it cannot be written")
        if o.dtype != torch.uint8 or o.dim() != 1 or not o.is_contiguous():
            raise ValueError(f"out {i} is {o.dtype} of shape {tuple(o.shape)} (strides {o.stride()}): a frame goes into a "
                             "contiguous 1-D uint8 tensor")
        if o.device != t.device:
            raise ValueError(f"out {i} is on {o.device}, its tensor on {t.device}: the frame stays on the tensor's device")
        need = frame_bound(t)
        if o.numel() < need:
            raise ValueError(f"out {i} holds {o.numel()} bytes; a frame of a {t.dtype} {tuple(t.shape)} tensor needs up "
                             f"to {need} (Client.frame_bound)")
    _check_outs_apart(items, outs, "tensor")
    return outs


def decompress_request(cts, out, verify: bool, sm_budget: int | None, *, asynchronous: bool = False) -> Request:
    """The :class:`Request` of ``Client.decompress(cts, out, verify, sm_budget=)`` (``decompress_async`` when
    ``asynchronous``: the caller's current streams of the outs' and frames' GPUs recorded), with the stream tag in
    force; ``outs`` is always one entry per item. Raises TypeError for bytes instead of CompressedTensors or one
    tensor as ``out`` of a batch, ValueError for an sm_budget outside 0..1024 or an ``out`` list of another length;
    the items and outs are otherwise checked by the route (:func:`check_decompress_args`)."""
    budget = _checked_sm_budget(sm_budget)
    if isinstance(cts, (bytes, bytearray, memoryview)):
        raise TypeError(f"expected a CompressedTensor or a list of them, got {type(cts).__name__} "
                        "(bytes from CompressedTensor.to_bytes(): CompressedTensor.from_bytes(...) first)")
    single = isinstance(cts, CompressedTensor)
    items = [cts] if single else list(cts)
    if out is None and not single:
        outs = [None] * len(items)
    else:
        outs = _outs_per_item(out, len(items), single, "a tensor or None per compressed tensor", "compressed tensors")
    streams = None
    if asynchronous:
        streams = _caller_streams([*(o for o in outs if isinstance(o, torch.Tensor)),
                                   *(ct.payload for ct in items if isinstance(ct, CompressedTensor))])
    return Request(items, single, outs, verify=verify, sm_budget=budget, stream=_stream_tag.get(), streams=streams)


def check_compress_args(items: list, codec: str | None) -> None:
    """ValueError for an unknown codec; TypeError or ValueError for a tensor tzip does not carry (its dtype, layout
    or device: tzip._dlpack.check_supported, tzip._wire._device)."""
    check_codec(codec)
    for t in items:
        check_supported(t)
        if not (t.is_cpu or t.is_cuda):
            _device(t)  # raises for the devices tzip does not serve (CPU and CUDA tensors pass)


def check_decompress_args(items: list, outs: list) -> None:
    """TypeError for an item that is not a CompressedTensor; ValueError for an ``out=`` entry that cannot hold its
    item's values (dtype, shape or byte count, a lazy conjugate or negative view, elements sharing memory, memory
    shared with another destination or a frame) or a CPU frame whose header disagrees with its CompressedTensor."""
    any_out = False
    for ct, o in zip(items, outs):
        if not isinstance(ct, CompressedTensor):
            raise TypeError(f"expected CompressedTensor, got {type(ct).__name__}")
        if o is not None:
            check_supported(o)
            _device(o)
            if o.is_conj() or o.is_neg():
                raise ValueError("out is a lazy conjugate or negative view (its bytes are not its values): "
                                 "decompress into a plain tensor, then conj() or neg() it")
            if o.dtype != ct.dtype or tuple(o.shape) != tuple(ct.shape):
                raise ValueError(f"out is {o.dtype} {tuple(o.shape)}, the compressed tensor {ct.dtype} {tuple(ct.shape)}")
            holds = layout(o.dtype, tuple(o.shape)).nbytes
            if holds != ct.nbytes:
                # (a CompressedTensor made by hand: the daemon would write its nbytes into out's memory)
                raise ValueError(f"the compressed tensor says {ct.nbytes} bytes, out ({o.dtype} {tuple(o.shape)}) "
                                 f"holds {holds}")
            if has_internal_overlap(o):
                raise ValueError(f"out (strides {o.stride()}, shape {tuple(o.shape)}) has elements that share memory "
                                 "(e.g. made by expand): it cannot hold the decompressed values; pass a tensor whose "
                                 "elements are distinct, such as out.contiguous() or torch.empty_like(out)")
            any_out = True
        if not ct.payload.is_cpu:
            _device(ct.payload)
        else:
            # A CompressedTensor made by hand with another dtype or shape than its frame's: the ZeroMQ path refuses
            # it daemon-side, the ring decodes by byte count only. A CPU frame's header is checked here (a few
            # microseconds); a GPU frame's would cost a device-to-host copy per call.
            check_layout(ct)
    if any_out:
        _check_outs_apart(items, outs)


def _outs_per_item(out, n: int, single: bool, entry: str, items: str) -> list:
    """``out=`` of a call on ``n`` items as one entry per item: ``[out]`` for a single item; for a batch, the list
    given (TypeError for one tensor, ValueError for another length). ``entry``/``items`` name them in the errors."""
    if single:
        return [out]
    if isinstance(out, torch.Tensor):
        raise TypeError(f"out= of a batch is a list ({entry}), not one tensor")
    outs = list(out)
    if len(outs) != n:
        raise ValueError(f"out has {len(outs)} entries for {n} {items}")
    return outs


def _resolved(items: list) -> list:
    """``items`` with PyTorch's lazy conjugate and negative views resolved into copies: their bytes are not their
    values (a bit of the view says to flip a sign when reading), and the daemon reads bytes. Other items as they are."""
    if not any(isinstance(t, torch.Tensor) and (t.is_conj() or t.is_neg()) for t in items):
        return items
    return [t.resolve_conj().resolve_neg() if isinstance(t, torch.Tensor) else t for t in items]


def _into_outs(result, outs: list | None, single: bool):
    """``result`` of a compress (a CompressedTensor or a list) with each frame in its ``outs`` entry: the payload
    becomes ``out[:frame bytes]``, copied there (in the current stream's order for CUDA tensors) unless the daemon
    wrote it there already."""
    if outs is None:
        return result
    for ct, o in zip([result] if single else result, outs):
        if o is None:
            continue
        p = ct.payload
        m = p.numel()
        if p.data_ptr() != o.data_ptr() or p.device != o.device:
            o[:m].copy_(p)
        ct.payload = o[:m]
    return result


def _check_outs_apart(items: list, outs: list, source: str = "frame") -> None:
    """ValueError when a destination of a decompress (compress) shares memory with another destination or with a
    frame (tensor) of the call: the values written into one would overwrite the other's. ``items``:
    CompressedTensors, or the tensors a compress reads. As PyTorch's out= checks (at::assert_no_partial_overlap), only
    outs whose elements fill their memory range are compared (contiguous ones, transposed ones); the elements of
    others may interleave without sharing bytes, which a range cannot tell. A source counts as its whole range (a
    strided input with an out between its elements is refused too)."""
    spans = []
    for i, (item, o) in enumerate(zip(items, outs)):
        src = item.payload if isinstance(item, CompressedTensor) else item
        for t, what in ((o, f"out {i}"), (src, f"{source} {i}")):
            if t is not None and t.numel():
                lo, hi = byte_range(t)
                if t is not o or hi - lo == t.numel() * t.element_size():  # an out: only when dense
                    spans.append((str(t.device), lo, hi, t is o, what))
    spans.sort()
    furthest: dict[tuple[str, bool], tuple] = {}  # (device, is an out) -> the span reaching furthest so far
    for span in spans:
        device, lo, hi, is_out, what = span
        # An out may share no byte with anything; frames may share bytes with each other (both are only read).
        for other in ((device, True), (device, False)) if is_out else ((device, True),):
            f = furthest.get(other)
            if f is not None and lo < f[2]:
                raise ValueError(f"{what} shares memory with {f[4]}: every destination must lie apart from the other "
                                 f"destinations and from the {source}s of the call")
        if (device, is_out) not in furthest or hi > furthest[(device, is_out)][2]:
            furthest[(device, is_out)] = span
