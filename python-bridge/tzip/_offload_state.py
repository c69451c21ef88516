"""What :class:`tzip.optim.CompressedOffload` keeps between steps: the state tensors it offloads, packed by chunks
(:class:`_Chunk`: one flat buffer, one frame), each tensor's place in its chunk (:class:`OffloadedTensor`), the
pinned host slabs that hold a GPU optimizer's frames, and which tensors can be offloaded at all (plain tensors and
DTensors' local shards; not other wrapper subclasses)."""

from __future__ import annotations

import functools
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from .compressed import CompressedTensor

#: Frames start at multiples of this in the pinned slabs and in the GPU upload buffers (the daemon reads a frame
#: at its storage offset; 256 is cudaMalloc's alignment).
_FRAME_ALIGN = 256
#: Pinned slabs are sized in multiples of this; one is reallocated (with 1/8 headroom) when the frames of its chunk
#: need more than it has, or less than 2/3 of it.
_SLAB_GRAIN = 1 << 16


def _align(n: int) -> int:
    return (n + _FRAME_ALIGN - 1) & ~(_FRAME_ALIGN - 1)


def _dense_permutation(t: torch.Tensor) -> bool:
    """Whether ``t`` covers exactly ``numel`` elements with no overlap (contiguous in some order of its dims)."""
    if t.is_contiguous():
        return True
    order = sorted(range(t.dim()), key=lambda d: (-t.stride(d), -t.size(d)))
    return t.permute(order).is_contiguous()


@functools.cache
def _dtensor_class():
    """torch.distributed.tensor.DTensor, or None where torch was built without distributed (looked up once: every
    state tensor of every step asks)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return None
    return DTensor


def _is_dtensor(t) -> bool:
    cls = _dtensor_class()
    return cls is not None and isinstance(t, cls)


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose bytes are offloaded: a DTensor's local shard (FSDP2, tensor parallelism), else ``t``. The
    shard is an ordinary strided tensor with storage of its own, so it is packed, compressed and restored like any
    other state tensor, and the DTensor is rebuilt around the restored shard (OffloadedTensor.wrap)."""
    return t._local_tensor if _is_dtensor(t) else t


def _is_wrapper(t: torch.Tensor) -> bool:
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    return is_traceable_wrapper_subclass(t)


def _check_plain_parameters(optimizer: torch.optim.Optimizer) -> None:
    """TypeError for parameters that are wrapper tensor subclasses other than DTensor: their bytes need not live in
    one tensor of their own, so there is nothing this offload can pack (DTensor parameters are taken: their state's
    local shards are offloaded)."""
    for i, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if _is_wrapper(p) and not _is_dtensor(p):
                raise TypeError(f"the optimizer's param_groups[{i}] holds a {type(p).__name__} parameter, a tensor "
                                "subclass: tzip's optimizer offload takes plain tensors and DTensors (FSDP2, tensor "
                                "parallelism) only, so its state stays where it is")


def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    t = _local(t)  # a DTensor has no storage of its own: its shard's
    return (t.get_device(), t.untyped_storage().data_ptr())  # get_device: -1 for the CPU


# --------------------------------------------------------------------------- pinned host memory


def _unpin(u8: torch.Tensor, holder: dict) -> None:
    ev = holder.get("event")
    if ev is not None:
        ev.synchronize()  # no copy may still read or write the pages
    if holder.get("pinned"):
        torch.cuda.cudart().cudaHostUnregister(u8.data_ptr())
        holder["pinned"] = False


class _HostSlab:
    """``capacity`` bytes of host memory page-locked with cudaHostRegister (exact size, unlike PyTorch's pinned
    allocator, which rounds to a power of two). ``holder["event"]``: the last CUDA copy that uses it; the pages are
    unregistered once it is done, when the slab is released or collected. Where registering fails (e.g. a locked-
    memory limit) the slab stays pageable: copies are then synchronous, and still correct."""

    _warned = False

    def __init__(self, capacity: int):
        self.capacity = int(capacity)
        self.u8 = torch.empty(self.capacity, dtype=torch.uint8)
        self.holder: dict[str, Any] = {"event": None, "pinned": False}
        if self.capacity:
            err = int(torch.cuda.cudart().cudaHostRegister(self.u8.data_ptr(), self.capacity, 1))  # 1: portable
            if err == 0:
                self.holder["pinned"] = True
            elif not _HostSlab._warned:
                _HostSlab._warned = True
                warnings.warn(f"tzip.optim: cudaHostRegister of {self.capacity} bytes failed (cudaError {err}); the "
                              "offloaded frames stay in pageable host memory (synchronous copies)", RuntimeWarning,
                              stacklevel=4)
        self._finalizer = weakref.finalize(self, _unpin, self.u8, self.holder)

    @property
    def pinned(self) -> bool:
        return bool(self.holder["pinned"])

    def release(self) -> None:
        self._finalizer()


# --------------------------------------------------------------------------- bookkeeping


class OffloadedTensor:
    """What ``state[param][key]`` holds between steps in place of an offloaded state tensor: its dtype, shape,
    strides and device, and the chunk frame (:class:`~tzip.CompressedTensor` in host memory) that holds its values
    at element ``offset``. Valid until the next :meth:`CompressedOffload.step` (the frame's memory is reused);
    :meth:`CompressedOffload.state_dict` gives the values as tensors. Not picklable: save the state dict."""

    __slots__ = ("chunk", "offset", "dtype", "shape", "stride", "device", "spec")

    def __init__(self, chunk: "_Chunk", offset: int, t: torch.Tensor):
        local = _local(t)
        self.chunk = chunk
        self.offset = offset
        self.dtype = local.dtype
        self.shape = local.shape  # of the local shard, for a DTensor
        self.stride = tuple(local.stride())
        self.device = local.device
        # A DTensor's mesh, placements and global shape and strides: what rebuilds it around its restored shard.
        self.spec = (t.device_mesh, t.placements, t.shape, tuple(t.stride())) if local is not t else None

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor uncompressed."""
        return self.shape.numel() * self.dtype.itemsize

    @property
    def frame(self) -> CompressedTensor:
        """The frame of the chunk this tensor is part of (codec, ratio, payload in host memory)."""
        return self.chunk.ct  # type: ignore[return-value]

    def view_of(self, flat: torch.Tensor) -> torch.Tensor:
        """This tensor (a DTensor's local shard) as a view of its chunk's decompressed values ``flat`` (1-D, the
        chunk's dtype)."""
        return flat.as_strided(self.shape, self.stride, flat.storage_offset() + self.offset)

    def wrap(self, local: torch.Tensor) -> torch.Tensor:
        """``local`` as the state tensor the optimizer had: itself, or the DTensor around it (no copy)."""
        if self.spec is None:
            return local
        mesh, placements, shape, stride = self.spec
        return _dtensor_class().from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)

    def __reduce__(self):
        raise TypeError("an OffloadedTensor does not pickle: save CompressedOffload.state_dict(), which holds plain tensors")

    def __repr__(self) -> str:
        ct = self.chunk.ct
        return (f"OffloadedTensor(dtype={self.dtype}, shape={tuple(self.shape)}, device={self.device}, in a frame of "
                f"{ct.compressed_nbytes if ct is not None else '?'} bytes, codec {ct.codec if ct is not None else '?'!r})")


@dataclass
class _Chunk:
    """State tensors of one device, dtype and state key, packed in one flat buffer: one frame, one request."""

    device: torch.device
    dtype: torch.dtype
    numel: int = 0  # elements of the flat buffer (each tensor starts at a multiple of _FRAME_ALIGN bytes)
    entries: list[tuple[dict, Any, OffloadedTensor]] = field(default_factory=list)  # (state dict, key, placeholder)
    ct: CompressedTensor | None = None  # between steps: the frame, in host memory
    slab: _HostSlab | None = None  # CUDA state: the pinned memory holding the frame
