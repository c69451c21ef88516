"""Tensors in DLPack's terms, and the frame each becomes (docs/protocol.md, "Tensors and frames").

The daemon protocol describes a tensor as DLPack does: a device (type, index), a data type
(code, bits, lanes), a shape, strides and a byte offset. This module maps every ``torch.dtype``
onto a DLPack data type, mirrors the daemon's rule that turns a DLPack type and shape into the
frame's dtype and shape (clients size output regions with it), and gives bit-exact byte access
to a tensor of any dtype and layout (integer aliases: copying never goes through float
arithmetic, so -0.0 and NaN payloads stay as they are).
"""

from __future__ import annotations

import math

import numpy as np
import torch

__all__ = [
    "DL_INT",
    "DL_UINT",
    "DL_FLOAT",
    "DL_BFLOAT",
    "DL_COMPLEX",
    "DL_BOOL",
    "DL_CPU",
    "DL_CUDA",
    "MAX_FRAME_NDIM",
    "dl_dtype",
    "has_internal_overlap",
    "byte_range",
    "frame_layout",
    "frame_layout_of",
    "int_alias",
    "check_supported",
    "tensor_nbytes",
    "wire_dtype",
    "copy_bytes",
    "copy_into_bytes",
    "copy_from_bytes",
    "from_bytes",
]

# DLDataTypeCode (dlpack.h)
DL_INT, DL_UINT, DL_FLOAT, DL_OPAQUE, DL_BFLOAT, DL_COMPLEX, DL_BOOL = 0, 1, 2, 3, 4, 5, 6
DL_F8_E4M3FN, DL_F8_E4M3FNUZ, DL_F8_E5M2, DL_F8_E5M2FNUZ, DL_F8_E8M0FNU = 10, 11, 12, 13, 14
# DLDeviceType (dlpack.h)
DL_CPU, DL_CUDA = 1, 2

#: Most dimensions of a frame (docs/format.md); tensors with more are framed 1-D.
MAX_FRAME_NDIM = 32


def _dt(name: str) -> torch.dtype | None:
    value = getattr(torch, name, None)
    return value if isinstance(value, torch.dtype) else None


#: torch dtype -> DLPack (code, bits, lanes). Dtypes missing here travel as opaque bytes (uint8, [nbytes]).
_DLPACK: dict[torch.dtype, tuple[int, int, int]] = {}
for _name, _code, _bits in [
    ("bool", DL_BOOL, 8),
    ("uint8", DL_UINT, 8), ("int8", DL_INT, 8),
    ("int16", DL_INT, 16), ("uint16", DL_UINT, 16),
    ("int32", DL_INT, 32), ("uint32", DL_UINT, 32),
    ("int64", DL_INT, 64), ("uint64", DL_UINT, 64),
    ("float16", DL_FLOAT, 16), ("bfloat16", DL_BFLOAT, 16),
    ("float32", DL_FLOAT, 32), ("float64", DL_FLOAT, 64),
    ("complex32", DL_COMPLEX, 32), ("complex64", DL_COMPLEX, 64), ("complex128", DL_COMPLEX, 128),
    ("float8_e4m3fn", DL_F8_E4M3FN, 8), ("float8_e4m3fnuz", DL_F8_E4M3FNUZ, 8),
    ("float8_e5m2", DL_F8_E5M2, 8), ("float8_e5m2fnuz", DL_F8_E5M2FNUZ, 8),
    ("float8_e8m0fnu", DL_F8_E8M0FNU, 8),
]:
    _d = _dt(_name)
    if _d is not None:
        _DLPACK[_d] = (_code, _bits, 1)

# The daemon's table: DLPack (code, bits) with a safetensors twin.
_TWINS: dict[tuple[int, int], str] = {
    (DL_INT, 8): "I8", (DL_INT, 16): "I16", (DL_INT, 32): "I32", (DL_INT, 64): "I64",
    (DL_UINT, 8): "U8", (DL_UINT, 16): "U16", (DL_UINT, 32): "U32", (DL_UINT, 64): "U64",
    (DL_FLOAT, 16): "F16", (DL_FLOAT, 32): "F32", (DL_FLOAT, 64): "F64",
    (DL_BFLOAT, 16): "BF16", (DL_BOOL, 8): "BOOL",
    (DL_F8_E4M3FN, 8): "F8_E4M3", (DL_F8_E5M2, 8): "F8_E5M2",
}
_COMPLEX_PARTS = {32: "F16", 64: "F32", 128: "F64"}

_INT_BY_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def check_supported(t: torch.Tensor) -> None:
    """Raises TypeError for tensors whose bytes cannot be taken as they are (quantized, sparse, meta, nested)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(t).__name__}")
    if t.is_quantized:
        raise TypeError("quantized tensors are not supported: compress t.int_repr() and keep q_scale()/q_zero_point() yourself")
    if t.layout != torch.strided:
        raise TypeError(f"only strided (dense) tensors are supported, not {t.layout}")
    if t.is_meta:
        raise TypeError("meta tensors have no data")
    if getattr(t, "is_nested", False):
        raise TypeError("nested tensors are not supported")


def has_internal_overlap(t: torch.Tensor) -> bool:
    """Whether two elements of ``t`` share memory (a stride of 0 on a dimension of more than one element, as
    ``expand`` makes, or strides that interleave, as ``as_strided`` can): a destination no decoder can fill with
    distinct values. Exact for every layout whose strides, sorted, each step past the span of the smaller ones
    (every layout PyTorch's views make); a layout that fails that test is taken to overlap."""
    span = 1  # elements spanned by the dimensions of smaller stride
    for stride, size in sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz > 1):
        if stride < span:
            return True
        span += (size - 1) * stride
    return False


def byte_range(t: torch.Tensor) -> tuple[int, int]:
    """[start, end) of the memory ``t``'s elements lie in, as addresses (end == start for a tensor without elements)."""
    start = t.data_ptr()
    if t.numel() == 0:
        return start, start
    return start, start + (sum((sz - 1) * st for st, sz in zip(t.stride(), t.shape)) + 1) * t.element_size()


def dl_dtype(dtype: torch.dtype) -> tuple[int, int, int] | None:
    """DLPack (code, bits, lanes) of ``dtype``; None for dtypes sent as opaque bytes."""
    return _DLPACK.get(dtype)


def tensor_nbytes(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> int:
    """Bytes of a compact tensor of ``shape`` and ``dtype``."""
    return math.prod(shape) * dtype.itemsize


def frame_layout(code: int, bits: int, lanes: int, shape: tuple[int, ...] | list[int]) -> tuple[str, list[int]]:
    """The frame dtype (safetensors name) and shape the daemon makes of a DLPack type and shape.

    Twins keep dtype and shape; complex numbers become float pairs (trailing dimension 2); anything
    else is U8 [nbytes]; a frame with more than 32 dimensions is flattened to 1-D.
    """
    if (bits * lanes) % 8:
        raise TypeError(f"DLPack type code {code} of {bits} bits x {lanes} lanes is not a whole number of bytes")
    elements = math.prod(shape)
    if lanes == 1:
        twin = _TWINS.get((code, bits))
        if twin is not None:
            return twin, ([elements] if len(shape) > MAX_FRAME_NDIM else list(shape))
        if code == DL_COMPLEX and bits in _COMPLEX_PARTS:
            return _COMPLEX_PARTS[bits], ([elements * 2] if len(shape) + 1 > MAX_FRAME_NDIM else [*shape, 2])
    return "U8", [elements * bits * lanes // 8]


def wire_dtype(dtype: torch.dtype, shape: tuple[int, ...]) -> tuple[tuple[int, int, int], tuple[int, ...]]:
    """The DLPack type and shape sent for a tensor: its own, or (uint8, [nbytes]) for dtypes DLPack lacks."""
    dl = _DLPACK.get(dtype)
    if dl is None:
        return (DL_UINT, 8, 1), (math.prod(shape) * dtype.itemsize,)
    return dl, tuple(shape)


def frame_layout_of(dtype: torch.dtype, shape: tuple[int, ...] | torch.Size) -> tuple[str, list[int]]:
    """The frame dtype and shape of a torch tensor of ``dtype`` and ``shape`` (as the daemon frames it)."""
    (code, bits, lanes), wshape = wire_dtype(dtype, tuple(shape))
    return frame_layout(code, bits, lanes, wshape)


def int_alias(t: torch.Tensor) -> torch.Tensor:
    """A view of ``t`` as unsigned/signed integers of the same width (complex: its real pairs), same layout.

    Copies between integer aliases move bits exactly (no float canonicalisation), and work for
    dtypes whose own copy kernels do not exist (uint1..7 and friends).
    """
    if t.is_complex():
        t = torch.view_as_real(t)
    return t.view(_INT_BY_SIZE[t.element_size()])


# Copies go through numpy (one thread, GIL released): torch's copy_ fans out to its intra-op threads,
# which on a busy machine makes many small copies dramatically slower (spinning thread barriers).


def copy_bytes(dst_u8: torch.Tensor, src_u8: torch.Tensor) -> None:
    """memcpy between two contiguous CPU uint8 tensors of one length."""
    if src_u8.numel():
        np.copyto(dst_u8.detach().numpy(), src_u8.detach().numpy())


def copy_into_bytes(dst_u8: torch.Tensor, t: torch.Tensor) -> None:
    """Writes the values of ``t`` (any layout) in C order into the contiguous uint8 tensor ``dst_u8`` (exactly nbytes long)."""
    src = int_alias(t.detach())
    if src.numel() == 0:
        return
    np.copyto(dst_u8.view(src.dtype).view(src.shape).numpy(), src.numpy())


def copy_from_bytes(out: torch.Tensor, src_u8: torch.Tensor) -> None:
    """Writes C-order bytes ``src_u8`` (contiguous uint8, exactly out's nbytes) into ``out`` (any layout)."""
    dst = int_alias(out.detach())
    if dst.numel() == 0:
        return
    np.copyto(dst.numpy(), src_u8.detach().view(dst.dtype).view(dst.shape).numpy())


def from_bytes(flat_u8: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...] | torch.Size) -> torch.Tensor:
    """``flat_u8`` (contiguous, nbytes long) seen as a tensor of ``dtype`` and ``shape`` (no copy)."""
    if flat_u8.numel() == 0:
        return torch.empty(tuple(shape), dtype=dtype)
    return flat_u8.view(dtype).reshape(tuple(shape))
