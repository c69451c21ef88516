"""The parts of the frame format (docs/format.md) the client needs without the daemon.

* :func:`max_compressed_size` -- the bound every output region is sized with.
* :func:`encode_raw` -- a frame of codec ``raw`` (bytes stored as they are), byte for byte what the
  codec writes for ``codec="raw"``: the fallback when the daemon is away.
* :func:`read_header` -- the fixed header and chunk table of a frame, checked (magic, version,
  sizes, header digest).
* :func:`decode_raw` -- the bytes of a ``raw`` frame, every chunk digest (32-lane, see ``_xxh32``) checked.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
import torch

from . import _generated_constants as _generated
from ._xxh32 import chunk_digests, xxh32

__all__ = ["MAGIC", "FORMAT_VERSION", "DEFAULT_CHUNK", "DTYPE_CODES", "CODEC_IDS", "FrameHeader", "LAYOUT_BYTES",
           "read_layout",
           "FrameError", "max_compressed_size", "encode_raw", "read_header", "decode_raw"]

MAGIC = _generated.MAGIC
FORMAT_VERSION = _generated.FORMAT_VERSION
DEFAULT_CHUNK = _generated.DEFAULT_CHUNK
_FIXED = _generated.FIXED_HEADER_BYTES
_ENTRY = _generated.CHUNK_ENTRY_BYTES
_HEADER = struct.Struct("<4sHBBBBHIQQIIII")

# Dtype codes and sizes, codec ids: src/errors.json, generated into tzip._generated_constants.
DTYPE_CODES = dict(_generated.DTYPE_CODES)
_DTYPE_NAMES = {v: k for k, v in DTYPE_CODES.items()}
_DTYPE_SIZES = dict(_generated.DTYPE_SIZES)
CODEC_IDS = dict(_generated.CODEC_IDS)
_CODEC_NAMES = {v: k for k, v in CODEC_IDS.items()}


def _align16(x: int) -> int:
    return (x + 15) & ~15


def max_compressed_size(nbytes: int, ndim: int, chunk_size: int = DEFAULT_CHUNK) -> int:
    """``align16(48 + 8*ndim) + 16*ceil(nbytes/chunk_size) + nbytes``: no frame of such a tensor is larger."""
    return _align16(_FIXED + 8 * ndim) + _ENTRY * (-(-nbytes // chunk_size)) + nbytes


@dataclass(frozen=True)
class FrameHeader:
    """What a frame says about itself."""

    dtype: str
    codec: str
    shape: tuple[int, ...]
    nbytes: int
    chunk_size: int
    n_chunks: int
    header_bytes: int
    payload_bytes: int
    frame_bytes: int
    checksum: int


def encode_raw(data: torch.Tensor, dtype: str, shape: list[int], chunk_size: int = DEFAULT_CHUNK) -> torch.Tensor:
    """The ``raw`` frame of the bytes ``data`` (contiguous uint8 CPU tensor) as a new uint8 tensor."""
    if dtype not in DTYPE_CODES:
        raise ValueError(f"unknown frame dtype {dtype!r}")
    n = data.numel()
    count = 1
    for d in shape:
        count *= d
    if count * _DTYPE_SIZES[dtype] != n:
        raise ValueError(f"{n} bytes do not match {dtype} {shape}")
    n_chunks = -(-n // chunk_size)
    table_off = _align16(_FIXED + 8 * len(shape))
    header_bytes = table_off + _ENTRY * n_chunks
    frame = torch.empty(header_bytes + n, dtype=torch.uint8)
    body = frame[header_bytes:]
    if n:
        np.copyto(body.numpy(), data.detach().numpy())  # one thread (see _dlpack.copy_bytes)
    digests = chunk_digests(body.numpy(), chunk_size) if n else []
    head = bytearray(header_bytes)
    checksum = xxh32(struct.pack(f"<{n_chunks}I", *digests))
    _HEADER.pack_into(head, 0, MAGIC, FORMAT_VERSION, DTYPE_CODES[dtype], CODEC_IDS["raw"], len(shape), 0, 0,
                      chunk_size, n, n, n_chunks, checksum, 0, 0)
    struct.pack_into(f"<{len(shape)}Q", head, _FIXED, *shape)
    for i, digest in enumerate(digests):
        struct.pack_into("<QII", head, table_off + _ENTRY * i, i * chunk_size, min(chunk_size, n - i * chunk_size), digest)
    struct.pack_into("<I", head, 40, xxh32(head))
    frame[:header_bytes].numpy()[:] = np.frombuffer(bytes(head), dtype=np.uint8)
    return frame


class FrameError(ValueError):
    """A frame this reader refuses. ``code`` is the error code the native decoder gives the same frame
    (cuda/src/core/frame.cpp; src/errors.json): TZIP_TRUNCATED (shorter than its header says), TZIP_UNSUPPORTED (a
    format version this reader does not read), TZIP_CHECKSUM (the bytes do not match their digests), else
    TZIP_CORRUPT."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


def _fail(what: str, code: str = "TZIP_CORRUPT") -> FrameError:
    return FrameError(code, f"invalid tzip frame: {what}")


#: Bytes that hold any frame's fixed header and shape (at most 32 dimensions): what read_layout needs at most.
LAYOUT_BYTES = _FIXED + 8 * 32


def _check_ident(magic: bytes, version: int, dtype_code: int, codec_id: int) -> None:
    """The checks of a fixed header that read_header and read_layout share: magic, version, dtype and codec codes."""
    if magic != MAGIC:
        raise _fail(f"bad magic {magic!r}")
    if version == 1:
        raise _fail("format version 1: pre-release version-1 frames are no longer read; re-compress the original tensor "
                    f"(this reader knows version {FORMAT_VERSION})", "TZIP_UNSUPPORTED")
    if version != FORMAT_VERSION:
        raise _fail(f"format version {version} (this reader knows {FORMAT_VERSION})", "TZIP_UNSUPPORTED")
    if dtype_code not in _DTYPE_NAMES or codec_id not in _CODEC_NAMES:
        raise _fail(f"unknown dtype code {dtype_code} or codec id {codec_id}")


def read_layout(head: bytes) -> tuple[str, list[int], int, str]:
    """A frame's (dtype, shape, nbytes, codec) from its first bytes (``head``: 48 + 8 * ndim of them at least; the
    first :data:`LAYOUT_BYTES` of a frame always do). Checks magic, version, the dtype and codec codes and ndim; the
    chunk table and digests are left to read_header and the decoder. Raises FrameError (TZIP_TRUNCATED when ``head``
    is short)."""
    if len(head) < _FIXED:
        raise _fail(f"{len(head)} bytes, the fixed header needs {_FIXED}", "TZIP_TRUNCATED")
    fields = _HEADER.unpack_from(head, 0)
    magic, version, dtype_code, codec_id, ndim, nbytes = fields[0], fields[1], fields[2], fields[3], fields[4], fields[8]
    _check_ident(magic, version, dtype_code, codec_id)
    if ndim > 32:
        raise _fail("more than 32 dimensions")
    if len(head) < _FIXED + 8 * ndim:
        raise _fail(f"{len(head)} bytes, the header's shape needs {_FIXED + 8 * ndim}", "TZIP_TRUNCATED")
    shape = list(struct.unpack_from(f"<{ndim}Q", head, _FIXED))
    return _DTYPE_NAMES[dtype_code], shape, nbytes, _CODEC_NAMES[codec_id]


def read_header(frame) -> FrameHeader:
    """Reads and checks a frame's header and chunk table (``frame``: bytes-like or uint8 tensor, at least the header)."""
    total = frame.numel() if isinstance(frame, torch.Tensor) else len(frame)

    def prefix(n: int) -> bytes:
        return frame[:n].numpy().tobytes() if isinstance(frame, torch.Tensor) else bytes(frame[:n])

    buf = prefix(_FIXED)
    if len(buf) < _FIXED:
        raise _fail(f"{len(buf)} bytes, the fixed header needs {_FIXED}", "TZIP_TRUNCATED")
    (magic, version, dtype_code, codec_id, ndim, flags, reserved10, chunk_size, nbytes, payload_bytes, n_chunks,
     checksum, header_digest, reserved44) = _HEADER.unpack_from(buf, 0)
    _check_ident(magic, version, dtype_code, codec_id)
    if flags or reserved10 or reserved44 or ndim > 32:
        raise _fail("reserved fields set or more than 32 dimensions")
    if not (4096 <= chunk_size <= 65536 and chunk_size % 256 == 0) or n_chunks != -(-nbytes // chunk_size):
        raise _fail(f"chunk size {chunk_size} / {n_chunks} chunks do not fit {nbytes} bytes")
    table_off = _align16(_FIXED + 8 * ndim)
    header_bytes = table_off + _ENTRY * n_chunks
    if total < header_bytes:
        raise _fail(f"{total} bytes, the header and chunk table need {header_bytes}", "TZIP_TRUNCATED")
    buf = prefix(header_bytes)
    shape = struct.unpack_from(f"<{ndim}Q", buf, _FIXED)
    count = 1
    for d in shape:
        count *= d
    dtype = _DTYPE_NAMES[dtype_code]
    if count * _DTYPE_SIZES[dtype] != nbytes or payload_bytes > nbytes:
        raise _fail(f"shape {list(shape)} of {dtype} does not match {nbytes} bytes / payload {payload_bytes}")
    if any(buf[_FIXED + 8 * ndim : table_off]):
        raise _fail("non-zero padding between the shape and the chunk table")
    if xxh32(buf[:40] + b"\0\0\0\0" + buf[44:header_bytes]) != header_digest:
        raise _fail("header digest does not match")
    return FrameHeader(dtype, _CODEC_NAMES[codec_id], tuple(shape), nbytes, chunk_size, n_chunks, header_bytes,
                       payload_bytes, header_bytes + payload_bytes, checksum)


def decode_raw(frame: torch.Tensor, header: FrameHeader, verify: bool = True) -> torch.Tensor:
    """The original bytes of a ``raw`` frame (a view into ``frame``), chunk digests checked when ``verify``."""
    if header.codec != "raw":
        raise ValueError(f"decode_raw needs a raw frame, this one is {header.codec}")
    if frame.numel() != header.frame_bytes:
        raise _fail(f"{frame.numel()} bytes, the frame is {header.frame_bytes}",
                    "TZIP_TRUNCATED" if frame.numel() < header.frame_bytes else "TZIP_CORRUPT")
    if header.payload_bytes != header.nbytes:  # every chunk of a raw frame is stored raw (docs/format.md, section 5)
        raise _fail(f"a raw frame's payload is its {header.nbytes} bytes, this one says {header.payload_bytes}")
    body = frame[header.header_bytes :]
    if verify and header.nbytes:
        table = frame[_align16(_FIXED + 8 * len(header.shape)) : header.header_bytes].numpy().tobytes()
        entries = [struct.unpack_from("<QII", table, _ENTRY * i) for i in range(header.n_chunks)]
        digests = chunk_digests(body.numpy(), header.chunk_size)
        for i, ((off, size, digest), actual) in enumerate(zip(entries, digests)):
            if off != i * header.chunk_size or size != min(header.chunk_size, header.nbytes - off):
                raise _fail(f"chunk {i} does not match its table entry")
            if digest != actual:
                raise _fail(f"chunk {i} does not match its digest", "TZIP_CHECKSUM")
        if xxh32(struct.pack(f"<{header.n_chunks}I", *digests)) != header.checksum:
            raise _fail("frame checksum does not match its chunk digests")  # the header disagrees with its table
    return body

