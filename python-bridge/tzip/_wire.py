"""The wire descriptors of the client's requests (docs/protocol.md, docs/ring.md), built in one place for ZeroMQ
requests and ring SQEs alike: a tensor's layout on the wire (:func:`layout`: the DLPack type and shape sent, the
frame's dtype and shape, the bound of its frame), the tensor, device, shared-memory and ring-region descriptors of
the JSON requests, the layout an SQE carries (:func:`_sqe_layout`), the 64-byte alignment of the regions a request
names in a staging buffer, and how a batch is split into requests under the daemon's limits."""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import torch

from . import _ring
from ._dlpack import DL_CPU, DL_CUDA, frame_layout, wire_dtype
from ._errors import TzipDaemonError
from ._frame import DTYPE_CODES, max_compressed_size

#: Staging bytes (inputs + output capacity) per request; larger batches are split (a single larger tensor goes alone).
MAX_STAGE_BYTES = 256 << 20
#: Estimated message bytes per tensor, to keep requests under the daemon's message cap.
_BYTES_PER_ITEM = 400
#: The same for GPU tensors (two CUDA IPC handles with ref-counter names and GPU UUIDs).
_BYTES_PER_GPU_ITEM = 800
_ALIGN = 64


def _align(n: int) -> int:
    return (n + _ALIGN - 1) & ~(_ALIGN - 1)


class Layout(NamedTuple):
    """How a tensor of some dtype and shape travels: ``nbytes`` of values, the DLPack type ``dl`` (code, bits,
    lanes) and shape ``wshape`` sent for it, the frame's dtype (safetensors name) and shape the daemon makes of it,
    and ``capacity``, the bound of its compressed frame (bytes)."""

    nbytes: int
    dl: tuple[int, int, int]
    wshape: tuple[int, ...]
    fdtype: str
    fshape: tuple[int, ...]
    capacity: int


@functools.lru_cache(maxsize=4096)
def layout(dtype: torch.dtype, shape: tuple[int, ...]) -> Layout:
    """The :class:`Layout` of a tensor of ``dtype`` and ``shape`` (any dtype tzip serves)."""
    nbytes = math.prod(shape) * dtype.itemsize
    dl, wshape = wire_dtype(dtype, shape)
    fdtype, fshape = frame_layout(*dl, wshape)
    return Layout(nbytes, dl, tuple(wshape), fdtype, tuple(fshape), max_compressed_size(nbytes, len(fshape)))


@functools.lru_cache(maxsize=4096)
def _sqe_layout(dtype: torch.dtype, shape: tuple[int, ...]) -> tuple[int, int, int, tuple[int, ...], int] | None:
    """(nbytes, frame dtype code, frame ndim, frame shape padded with zeros to the SQE's 6 dimensions, frame bound) of
    a compress SQE for a tensor of ``dtype`` and ``shape`` (a tuple or torch.Size: equal keys), or None when an SQE
    cannot describe it (no bytes; a frame of more than 6 dimensions)."""
    lay = layout(dtype, tuple(shape))
    ndim = len(lay.fshape)
    if lay.nbytes == 0 or ndim > _ring.MAX_NDIM:
        return None
    return lay.nbytes, DTYPE_CODES[lay.fdtype], ndim, (*lay.fshape, *(0,) * (_ring.MAX_NDIM - ndim)), lay.capacity


def _device(t: torch.Tensor) -> dict[str, int]:
    """The device descriptor of ``t``; TZIP_UNSUPPORTED for a device tzip does not serve."""
    if t.device.type == "cpu":
        return {"type": DL_CPU, "id": 0}
    if t.device.type == "cuda":
        return cuda_device(t.device.index or 0)
    raise TzipDaemonError("TZIP_UNSUPPORTED", f"{t.device.type} tensors are not served: tzip serves CPU and CUDA tensors; "
                                              "move the tensor to one of those")


def cuda_device(index: int) -> dict[str, int]:
    """The device descriptor of cuda:``index`` (the client's index in requests, the daemon's ordinal in ring ops)."""
    return {"type": DL_CUDA, "id": index}


def shm_data(name: str, offset: int, size: int) -> dict[str, Any]:
    """``size`` bytes at ``offset`` of the shared-memory file ``name`` (a tensor's data, a frame, an output)."""
    return {"kind": "shm", "name": name, "offset": offset, "size": size}


def tensor_desc(device: dict[str, int], dl: tuple[int, int, int], wshape: tuple[int, ...], data: dict[str, Any],
                byte_offset: int = 0) -> dict[str, Any]:
    """A tensor of a compress (its input) or decompress (its output) request: ``data`` is where its bytes are
    (:func:`shm_data`, a CUDA IPC share or a staging region), ``byte_offset`` bytes into it."""
    return {"device": device, "dtype": {"code": dl[0], "bits": dl[1], "lanes": dl[2]}, "shape": list(wshape),
            "byte_offset": byte_offset, "data": data}


def shm_region(name: str) -> dict[str, Any]:
    """The ``ring_register`` region of the whole shared-memory file ``name``."""
    return {"kind": "shm", "name": name}


def cuda_region(ordinal: int, handle: bytes, offset: int, nbytes: int) -> dict[str, Any]:
    """The ``ring_register`` region of ``nbytes`` of GPU memory: a CUDA IPC ``handle``'s allocation from ``offset``,
    on the daemon's GPU ``ordinal``."""
    return {"kind": "cuda", "device": cuda_device(ordinal), "handle": handle, "offset": offset, "bytes": nbytes}


def split_batches(items: list, stage_of, limits: dict[str, Any], per_item: int = _BYTES_PER_ITEM) -> list[list]:
    """``items`` in requests of at most the daemon's ``max_batch`` items, ``max_message_bytes`` (at ``per_item``
    bytes each) and :data:`MAX_STAGE_BYTES` of staging (``stage_of(item)``; a single larger item goes alone)."""
    max_batch = int(limits.get("max_batch", 4096))
    max_items = max(1, min(max_batch, int(limits.get("max_message_bytes", 1 << 20)) // per_item))
    batches: list[list] = []
    cur: list = []
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
