"""CompressedTensor: one tensor's tzip frame and what it takes to rebuild the tensor.

``payload`` is the frame (docs/format.md) as a 1-D uint8 tensor, on the device of the tensor it
came from (a CUDA tensor's frame stays on its GPU). The frame is self-describing, but only in the codec's dtypes; the
torch ``dtype`` and ``shape`` kept here are the tensor's own (a complex64 tensor's frame is F32 with
a trailing dimension of 2, a float8_e8m0fnu tensor's frame is U8 bytes: docs/protocol.md,
"Tensors and frames").

A CompressedTensor pickles (``torch.save``; ``torch.load(weights_only=True)`` accepts it once
``tzip.compressed`` is imported; a CUDA payload loads onto the GPU it was saved from, or where
``map_location`` says, as any tensor does) and converts to and from plain bytes (:meth:`to_bytes`,
which copies a CUDA payload to the host; :meth:`from_bytes`, which gives a CPU payload unless
``device=`` says otherwise): ``b"TZCT"``, a version byte, 3 zero bytes, the little-endian u32
length of a MessagePack map ``{dtype, shape, codec, nbytes}``, the map, then the frame. The frame
and the metadata do not depend on the device.
"""

from __future__ import annotations

import struct

import msgpack
import torch

from ._dlpack import frame_layout_of
from ._frame import LAYOUT_BYTES, read_header, read_layout

__all__ = ["CompressedTensor"]

_MAGIC = b"TZCT"
_VERSION = 1
_PREFIX = struct.Struct("<4sB3xI")
#: Most bytes of the metadata map accepted by from_bytes.
_MAX_META = 1 << 16


def _dtype_from_name(name) -> torch.dtype:
    if not isinstance(name, str):
        raise ValueError(f"dtype {name!r} is not a name")
    value = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"unknown torch dtype {name!r}")
    return value


class CompressedTensor:
    """A tensor compressed by tzip (see the module docstring)."""

    __slots__ = ("payload", "dtype", "shape", "codec", "nbytes")

    def __init__(self, payload: torch.Tensor, dtype: torch.dtype, shape, codec: str, nbytes: int):
        if not isinstance(payload, torch.Tensor) or payload.dtype != torch.uint8 or payload.dim() != 1:
            raise TypeError("payload must be a 1-D uint8 tensor (the frame)")
        self.payload = payload
        self.dtype = dtype
        self.shape = torch.Size(shape)
        self.codec = codec
        self.nbytes = int(nbytes)

    @property
    def device(self) -> torch.device:
        """Device of the payload (that of the original tensor)."""
        return self.payload.device

    @property
    def compressed_nbytes(self) -> int:
        """Bytes of the frame."""
        return self.payload.numel()

    @property
    def ratio(self) -> float | None:
        """compressed / original bytes (lower is better, as in the CLI); None for an empty tensor (``nbytes == 0``:
        a frame of header bytes over nothing has no ratio), as the CLI's ``--json`` says ``null`` and its tables
        ``-`` (src/cli/format.ts formatRatio). It used to be NaN, which printed as ``nan`` and poisoned sums."""
        return self.payload.numel() / self.nbytes if self.nbytes else None

    def __repr__(self) -> str:
        ratio = "-" if self.ratio is None else f"{self.ratio:.4f}"
        return (f"CompressedTensor(dtype={self.dtype}, shape={tuple(self.shape)}, codec={self.codec!r}, "
                f"nbytes={self.nbytes}, compressed={self.payload.numel()}, ratio={ratio}, device={self.device})")

    # --- pickling (torch.save) --------------------------------------------------------------------
    def __getstate__(self):
        return {"payload": self.payload, "dtype": self.dtype, "shape": self.shape, "codec": self.codec, "nbytes": self.nbytes}

    def __setstate__(self, state) -> None:
        """Rebuilds a pickled CompressedTensor (torch.load) and checks that its frame is what the metadata says.

        Raises ValueError when the payload is not a 1-D uint8 tensor or its frame header's dtype, shape, byte count or
        codec differ from the metadata (a file altered or damaged since torch.save): otherwise decompress would give the
        frame's bytes under the wrong dtype or shape. A CUDA payload's header (at most a few hundred bytes) is copied to
        the host for the check.
        """
        payload = state["payload"]
        if not isinstance(payload, torch.Tensor) or payload.dtype != torch.uint8 or payload.dim() != 1:
            raise ValueError("pickled CompressedTensor: payload is not a 1-D uint8 tensor (the frame)")
        self.payload = payload
        self.dtype = state["dtype"]
        self.shape = torch.Size(state["shape"])
        self.codec = state["codec"]
        self.nbytes = int(state["nbytes"])
        if not isinstance(self.dtype, torch.dtype) or not isinstance(self.codec, str):
            raise ValueError(f"pickled CompressedTensor: dtype {self.dtype!r} / codec {self.codec!r} of the wrong type")
        check_layout(self)

    # --- bytes ------------------------------------------------------------------------------------
    def to_bytes(self) -> bytes:
        """The container bytes (header, metadata, frame); the frame is copied to the CPU when needed."""
        meta = msgpack.packb({"dtype": str(self.dtype).removeprefix("torch."), "shape": list(self.shape),
                              "codec": self.codec, "nbytes": self.nbytes}, use_bin_type=True)
        frame = self.payload.detach().cpu().contiguous().numpy().tobytes()
        return _PREFIX.pack(_MAGIC, _VERSION, len(meta)) + meta + frame

    @classmethod
    def from_bytes(cls, data, device: torch.device | str | None = None) -> "CompressedTensor":
        """Reads :meth:`to_bytes` output. The frame's header is checked against the metadata. The payload is a CPU
        tensor, or is copied to ``device`` when given (decompressing then gives a tensor there).

        Raises ValueError when the bytes are not such a container or do not agree with themselves, or when
        ``device`` is neither the CPU nor a CUDA GPU (tzip serves those two; a meta tensor, for one, has no bytes).
        """
        if device is not None and torch.device(device).type not in ("cpu", "cuda"):
            raise ValueError(f"device {device!r}: a CompressedTensor's payload lies on the CPU or a CUDA GPU")
        mv = memoryview(data).cast("B")
        if len(mv) < _PREFIX.size:
            raise ValueError("not a tzip CompressedTensor: too short")
        magic, version, meta_len = _PREFIX.unpack_from(mv, 0)
        if magic != _MAGIC:
            raise ValueError(f"not a tzip CompressedTensor: magic {bytes(magic)!r}")
        if version != _VERSION:
            raise ValueError(f"CompressedTensor container version {version} (this reader knows {_VERSION})")
        if meta_len > _MAX_META or _PREFIX.size + meta_len > len(mv):
            raise ValueError("CompressedTensor metadata length out of range")
        try:
            meta = msgpack.unpackb(mv[_PREFIX.size : _PREFIX.size + meta_len], raw=False)
            dtype = _dtype_from_name(meta["dtype"])
            shape = tuple(int(d) for d in meta["shape"])
            codec = str(meta["codec"])
            nbytes = int(meta["nbytes"])
        except (ValueError, KeyError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as e:
            raise ValueError(f"bad CompressedTensor metadata: {e}") from None
        frame = torch.frombuffer(bytearray(mv[_PREFIX.size + meta_len :]), dtype=torch.uint8) if len(mv) > _PREFIX.size + meta_len \
            else torch.empty(0, dtype=torch.uint8)
        header = read_header(frame)
        if header.frame_bytes > frame.numel():
            raise ValueError(f"truncated CompressedTensor bytes: the frame is {header.frame_bytes} bytes long, only "
                             f"{frame.numel()} follow the metadata")
        if header.frame_bytes < frame.numel():
            raise ValueError(f"{frame.numel() - header.frame_bytes} bytes follow the {header.frame_bytes}-byte frame: "
                             "not the bytes of one CompressedTensor")
        _check_header(header.dtype, list(header.shape), header.nbytes, header.codec, dtype, shape, nbytes, codec)
        if device is not None and torch.device(device).type != "cpu":
            frame = frame.to(device)
        return cls(frame, dtype, shape, codec, nbytes)


def _check_header(fdtype: str, fshape: list, fnbytes: int, fcodec: str, dtype, shape, nbytes: int, codec: str) -> None:
    want_dtype, want_shape = frame_layout_of(dtype, tuple(shape))
    if fnbytes != nbytes or fcodec != codec or fdtype != want_dtype or fshape != want_shape:
        raise ValueError(f"the frame ({fdtype} {fshape}, {fnbytes} bytes, {fcodec}) does not match the metadata "
                         f"({dtype} {list(shape)}, {nbytes} bytes, {codec})")


def check_layout(ct: CompressedTensor) -> None:
    """Checks that ``ct``'s frame header gives its dtype, shape, byte count and codec (docs/protocol.md, "Tensors and
    frames"), reading only the fixed header and the shape (the first LAYOUT_BYTES, 304, at most: a CUDA payload's are
    copied to the host in one copy). The chunk table, digests and data are the decoder's to check.

    Raises ValueError (a FrameError for a header that is not a frame's) when they differ.
    """
    head = ct.payload[:LAYOUT_BYTES]
    fdtype, fshape, fnbytes, fcodec = read_layout((head if head.is_cpu else head.cpu()).numpy().tobytes())
    _check_header(fdtype, fshape, fnbytes, fcodec, ct.dtype, ct.shape, ct.nbytes, ct.codec)


try:  # let torch.load(weights_only=True) rebuild CompressedTensors
    torch.serialization.add_safe_globals([CompressedTensor])
except AttributeError:  # pragma: no cover - older torch
    pass
