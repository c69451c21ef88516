"""The SQE packing shortcuts and the frame helpers that both halves of the ring route (:mod:`tzip._ring_path`,
:mod:`tzip._ring_gpu`) and its one-tensor path (:mod:`tzip._ring_one`) use: module-level names for the hot loops that
pack one SQE per tensor (docs/ring.md, "Entries")."""

from __future__ import annotations

import torch

from . import _ring
from ._dlpack import int_alias
from ._wire import _ALIGN
from .compressed import CompressedTensor

#: SQE packing: the layout (tzip._ring.SQE) packed straight into a request's bytes, one call per SQE.
_PACK = _ring.SQE.pack_into
_U64 = _ring._U64.pack_into
_SQE_BYTES = _ring.SQE_BYTES
_OP_COMPRESS, _OP_DECOMPRESS, _LINK = _ring.OP_COMPRESS, _ring.OP_DECOMPRESS, _ring.F_LINK
_ZERO8 = (0,) * 8  # a decompress SQE's shape (6 dimensions), wait_value and signal_value
_A = _ALIGN - 1  # (n + _A) & ~_A: n rounded up to the alignment of the regions in a staging buffer (tzip._wire._align)
_new_compressed = CompressedTensor.__new__


def _ct(payload: torch.Tensor, dtype: torch.dtype, shape: torch.Size, codec: str, nbytes: int) -> CompressedTensor:
    """CompressedTensor(payload, dtype, shape, codec, nbytes) without its argument checks: for the frames made here
    (a new 1-D uint8 payload, the tensor's own torch.Size and int byte count)."""
    ct = _new_compressed(CompressedTensor)
    ct.payload, ct.dtype, ct.shape, ct.codec, ct.nbytes = payload, dtype, shape, codec, nbytes
    return ct


def _u8_of(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a 1-D uint8 view (any dtype: through its integer alias)."""
    return int_alias(t.detach()).reshape(-1).view(torch.uint8)
