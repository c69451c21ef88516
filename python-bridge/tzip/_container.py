"""The ``.tzip`` container in Python: writing it atomically, and reading it with random access (docs/container.md).

A ``.tzip`` file holds one safetensors file losslessly: a 24-byte prefix, the safetensors file's ``8 + N`` header
bytes verbatim, one frame (docs/format.md) per *entry* at 16-byte aligned offsets, a 32-byte-per-entry index and a
32-byte trailer. This module and :mod:`tzip._safetensors_header` (the header checks of ``src/safetensors.ts`` and the
entry plan of ``src/entries.ts``) mirror the TypeScript implementation rule for rule (``src/container.ts`` for the
fixed parts, ``src/writer.ts`` and ``src/reader.ts``), so files written here are read by ``tzip decompress | verify |
inspect | extract`` and files written by ``tzip compress`` are read here. The frames themselves come from the daemon
(``Client.compress``); this module only places them, and checks each frame's header against its entry when writing
and reading.

* :func:`tzip._safetensors_header.encode_safetensors_header` lays out a safetensors header (JSON padded with spaces
  to a multiple of 8, as the ``safetensors`` package writes it) for tensors given by safetensors dtype, shape and byte
  length.
* :class:`ContainerWriter` writes prefix, header, frames (in entry order), index and trailer to an open file.
* :func:`atomic_file` is the crash-safe way to create any file here: a temporary file in the target's folder,
  ``fsync`` of the file, ``rename`` over the target, ``fsync`` of the folder. Until the rename the target keeps its
  old contents (or does not exist); an interrupted or failed write leaves at most a ``.NAME.*.tmp`` file, never a
  partial file under the target's name.
* :class:`ContainerReader` opens a file reading only the prefix, trailer, index and header (checked as the TS
  reader checks them), then reads any one entry's frame with one positioned read.
* :func:`write_tensors` and :func:`decode_entries` are the two ends that touch tensors: torch tensors (CPU or CUDA)
  compressed by the daemon into a new container file, and entries of an open container decoded by the daemon
  (onto the CPU or a GPU), in batches of about :data:`BATCH_BYTES`, the next batch coded while the current one is
  written or read.

Errors are :class:`ContainerError` with the TS codes: ``TZIP_CORRUPT``, ``TZIP_TRUNCATED``, ``TZIP_UNSUPPORTED``,
``TZIP_CHECKSUM`` (the stored safetensors header does not match its digest, or a chunk digest did not match while
decoding), ``TZIP_USAGE`` (no such tensor); each names the file
and, where it applies, the tensor.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import math
import os
import secrets
import struct
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

import torch

from ._dlpack import frame_layout_of, int_alias
from ._errors import TzipDaemonError
from ._fallback import _decompress_raw
from ._frame import FrameError, FrameHeader, read_header
from ._safetensors_header import (_LENGTH_PREFIX, _MAX_SAFE, CODEC_DTYPE_BYTES, CODEC_MAX_DIMS, MAX_HEADER_BYTES,
                                  ContainerError, Entry, HeaderTensor, SafetensorsHeader, codec_layout,
                                  encode_safetensors_header, frame_layout_fits, parse_header_length,
                                  parse_safetensors_header, plan_entries)
from ._xxh32 import xxh32
from .compressed import CompressedTensor

if TYPE_CHECKING:
    from .client import Client

__all__ = [
    "MAGIC", "TRAILER_MAGIC", "CONTAINER_VERSION", "PREFIX_BYTES", "FLAG_HEADER_DIGEST", "ALIGNMENT", "INDEX_ENTRY_BYTES", "TRAILER_BYTES",
    "MAX_HEADER_BYTES", "CODEC_MAX_DIMS", "CODEC_DTYPE_BYTES", "ContainerError", "HeaderTensor", "SafetensorsHeader",
    "Entry", "align16", "codec_layout", "frame_layout_fits", "parse_header_length", "parse_safetensors_header",
    "plan_entries", "encode_safetensors_header", "ContainerWriter", "ContainerReader", "atomic_file", "fsync_dir",
    "SAFETENSORS_DTYPES", "torch_dtype_of", "safetensors_layout", "byte_view", "reinterpret", "codec_view",
    "TensorItem", "write_tensors", "decode_entries", "BATCH_BYTES",
]

#: The 8 magic bytes at offset 0: "\x89TZIP\r\n\x1a".
MAGIC = b"\x89TZIP\r\n\x1a"
#: The 4 magic bytes near the end of the trailer.
TRAILER_MAGIC = b"TZIX"
#: Container version written and read.
CONTAINER_VERSION = 1
#: Bytes of the fixed prefix (magic, version, flags, header digest, original size).
PREFIX_BYTES = 24
#: Prefix flag bit: the u32 at offset 12 is the XXH32 (seed 0) of the safetensors header's ``8 + N`` bytes (no other
#: digest covers the tensor names, dtypes, offsets and ``__metadata__``). Files written before it have it clear.
FLAG_HEADER_DIGEST = 0x0001
_KNOWN_FLAGS = FLAG_HEADER_DIGEST
#: Frames and the index start at multiples of this many bytes.
ALIGNMENT = 16
INDEX_ENTRY_BYTES = 32
TRAILER_BYTES = 32
_PREFIX = struct.Struct("<8sHHIQ")
_INDEX = struct.Struct("<QQQQ")
_TRAILER = struct.Struct("<QIIQ4sI")


def align16(x: int) -> int:
    """``x`` rounded up to a multiple of 16."""
    return (x + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


def _check_frame(entry: Entry, h: FrameHeader, file: str | os.PathLike) -> FrameHeader:
    """The TS reader's checkFrame: a frame must describe its entry."""
    problems = []
    if entry.frame_bytes >= 0 and h.frame_bytes != entry.frame_bytes:
        problems.append(f"frame is {h.frame_bytes} bytes, index says {entry.frame_bytes}")
    if h.nbytes != entry.nbytes:
        problems.append(f"frame holds {h.nbytes} bytes, index says {entry.nbytes}")
    if not frame_layout_fits(entry, h.dtype, h.shape):
        if h.dtype != entry.dtype:
            problems.append(f"frame dtype {h.dtype}, header says {entry.dtype}")
        if tuple(h.shape) != tuple(entry.shape):
            problems.append(f"frame shape {list(h.shape)}, header says {list(entry.shape)}")
    if problems:
        raise ContainerError("TZIP_CORRUPT", "frame does not match its entry: " + "; ".join(problems), file,
                             entry.name if entry.kind == "tensor" else None)
    return h


def _frame_header(frame, entry: Entry, file) -> FrameHeader:
    try:
        h = read_header(frame)
    except ValueError as e:
        code = e.code if isinstance(e, FrameError) else "TZIP_CORRUPT"
        raise ContainerError(code, str(e), file, entry.name if entry.kind == "tensor" else None) from None
    return _check_frame(entry, h, file)


def _buffer(data) -> memoryview:
    """A byte view of a bytes-like object or a contiguous CPU tensor (any dtype)."""
    if isinstance(data, torch.Tensor):
        if data.device.type != "cpu":
            raise ValueError("frames are written from CPU memory")
        data = data.detach().contiguous()
        if data.numel() == 0:
            return memoryview(b"")
        return memoryview(byte_view(data).numpy())
    return memoryview(data).cast("B")


def _write_all(fd: int, data: memoryview) -> None:
    while len(data):
        n = os.write(fd, data)
        data = data[n:]


class ContainerWriter:
    """Writes one container to the file descriptor ``fd`` (open for writing, positioned at 0, empty), sequentially.

    ``header_bytes`` are the safetensors header (``8 + N`` bytes, see :func:`encode_safetensors_header`) of a file
    whose data section is ``data_length`` bytes long. :attr:`entries` is the entry plan; frames must be given to
    :meth:`write_frame` in that order (each frame's header is checked against its entry), then :meth:`finish` writes
    the index and trailer. The prefix carries :data:`FLAG_HEADER_DIGEST` and the XXH32 of ``header_bytes``. Nothing
    here syncs or renames: see :func:`atomic_file`.
    """

    def __init__(self, fd: int, header_bytes: bytes, data_length: int, file: str | os.PathLike = "<container>"):
        self.fd = fd
        self.file = file
        self.original_size = len(header_bytes) + data_length
        self.header = parse_safetensors_header(header_bytes, self.original_size, file)
        self.entries: list[Entry] = plan_entries(self.header)
        self._written: list[Entry] = []
        _write_all(fd, memoryview(_PREFIX.pack(MAGIC, CONTAINER_VERSION, FLAG_HEADER_DIGEST, xxh32(header_bytes),
                                               self.original_size)))
        _write_all(fd, memoryview(header_bytes))
        self.position = PREFIX_BYTES + len(header_bytes)

    def _pad_to(self, offset: int) -> None:
        if offset > self.position:
            _write_all(self.fd, memoryview(bytes(offset - self.position)))
            self.position = offset

    def write_frame(self, frame) -> Entry:
        """Writes the frame of the next entry (bytes-like or CPU uint8 tensor) at the next 16-byte boundary.
        Returns the entry with its frame's place. Raises ContainerError (TZIP_CORRUPT) when the frame does not
        describe the entry, ValueError when every entry has its frame already; OSError from the write."""
        i = len(self._written)
        if i >= len(self.entries):
            raise ValueError(f"all {len(self.entries)} entries are written")
        view = _buffer(frame)
        entry = self.entries[i]
        h = _frame_header(view, entry, self.file)
        if h.frame_bytes != len(view):
            raise ContainerError("TZIP_CORRUPT", f"frame header says {h.frame_bytes} bytes, {len(view)} given", self.file,
                                 entry.name if entry.kind == "tensor" else None)
        offset = align16(self.position)
        self._pad_to(offset)
        _write_all(self.fd, view)
        self.position += len(view)
        placed = dataclasses.replace(entry, frame_offset=offset, frame_bytes=len(view))
        self._written.append(placed)
        return placed

    def finish(self) -> int:
        """Writes the index and the trailer; returns the container's size in bytes. Raises ValueError when frames
        are missing."""
        if len(self._written) != len(self.entries):
            raise ValueError(f"{len(self._written)} of {len(self.entries)} frames written")
        index_offset = align16(self.position)
        self._pad_to(index_offset)
        index = b"".join(_INDEX.pack(e.begin, e.end, e.frame_offset, e.frame_bytes) for e in self._written)
        trailer = _TRAILER.pack(index_offset, len(index) // INDEX_ENTRY_BYTES, xxh32(index), self.original_size,
                                TRAILER_MAGIC, 0)
        _write_all(self.fd, memoryview(index + trailer))
        self.position += len(index) + len(trailer)
        return self.position


def fsync_dir(path: str | os.PathLike) -> None:
    """fsync of a folder, so that a rename or a new file in it survives a crash (where the OS allows it)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on folders; the rename is then as durable as they make it
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike) -> Iterator[int]:
    """Creates or replaces ``path`` atomically. Yields a file descriptor (``O_WRONLY``) of a new temporary file
    ``.NAME.PID.RANDOM.tmp`` in the same folder (so the rename never crosses filesystems). On a normal exit the file
    is fsynced, closed, renamed over ``path`` and the folder fsynced; on an exception it is removed and the
    exception propagates, ``path`` untouched. A process killed in between leaves only the temporary file.

    Raises OSError (the folder is not writable, ENOSPC / EFBIG from the writes or the fsync).
    """
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(folder, f".{os.path.basename(path)}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        yield fd
        os.fsync(fd)  # the bytes are on disk before the name points at them
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    os.close(fd)
    try:
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(folder)


def _pread_into(fd: int, buf: memoryview, offset: int, file, tensor: str | None = None) -> None:
    done = 0
    while done < len(buf):
        n = os.preadv(fd, [buf[done:]], offset + done)
        if n == 0:
            raise ContainerError("TZIP_TRUNCATED", f"file ends before byte {offset + len(buf)}", file, tensor)
        done += n


@dataclass
class _State:
    file_size: int
    original_size: int
    header_bytes: bytes
    header: SafetensorsHeader
    entries: list[Entry] = field(default_factory=list)


class ContainerReader:
    """An open ``.tzip`` file (random access). Opening reads and checks the prefix, the safetensors header (its XXH32
    where the prefix has :data:`FLAG_HEADER_DIGEST`), the trailer, the index (its XXH32) and every frame's placement, as docs/container.md ("Reading") requires; frames
    are read only when asked for. Use as a context manager or call :meth:`close`.

    Attributes: ``path``, ``file_size``, ``original_size`` (bytes of the safetensors file it holds),
    ``header_bytes`` (its ``8 + N`` header bytes), ``header`` (:class:`SafetensorsHeader`), ``entries`` (all
    entries, data-section order), ``metadata`` (``__metadata__`` or None).

    Raises ContainerError (TZIP_CORRUPT / TZIP_TRUNCATED / TZIP_UNSUPPORTED; TZIP_CHECKSUM when the stored
    safetensors header does not match its digest) naming the file; OSError when it cannot be opened.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self._fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            s = self._validate()
        except BaseException:
            self.close()  # and forget the number: __del__ must never close a descriptor that is reused by then
            raise
        self.file_size = s.file_size
        self.original_size = s.original_size
        self.header_bytes = s.header_bytes
        self.header = s.header
        self.entries: list[Entry] = s.entries
        self.metadata = s.header.metadata
        self._by_name = {e.name: e for e in s.entries if e.kind == "tensor"}

    def _read(self, offset: int, length: int) -> bytes:
        buf = bytearray(length)
        _pread_into(self._fd, memoryview(buf), offset, self.path)
        return bytes(buf)

    def _validate(self) -> _State:
        file = self.path
        file_size = os.fstat(self._fd).st_size
        fixed = self._read(0, min(file_size, PREFIX_BYTES + _LENGTH_PREFIX))
        if file_size < PREFIX_BYTES + _LENGTH_PREFIX + TRAILER_BYTES:
            seen = fixed[: len(MAGIC)]
            if seen and MAGIC.startswith(seen):
                raise ContainerError("TZIP_TRUNCATED", f"file of {file_size} bytes is too short to be a .tzip", file)
            raise ContainerError("TZIP_CORRUPT", "not a .tzip file (bad magic bytes)", file)
        magic, version, flags, reserved, original_size = _PREFIX.unpack_from(fixed, 0)
        if magic != MAGIC:
            raise ContainerError("TZIP_CORRUPT", "not a .tzip file (bad magic bytes)", file)
        if version > CONTAINER_VERSION:
            raise ContainerError("TZIP_UNSUPPORTED", f"container version {version} is newer than the supported "
                                                     f"{CONTAINER_VERSION}", file)
        if version != CONTAINER_VERSION:
            raise ContainerError("TZIP_CORRUPT", f"bad container version {version}", file)
        if flags & ~_KNOWN_FLAGS:
            raise ContainerError("TZIP_UNSUPPORTED", f"unknown container flags 0x{flags:x}", file)
        # Without the flag the field is reserved and zero; a non-zero one also catches a flip that cleared the flag.
        if not flags & FLAG_HEADER_DIGEST and reserved:
            raise ContainerError("TZIP_CORRUPT", "reserved prefix field is not zero (and the header digest flag is not "
                                                 "set)", file)
        if original_size > _MAX_SAFE:
            raise ContainerError("TZIP_CORRUPT", f"original file size {original_size} is out of range", file)
        n = parse_header_length(fixed[PREFIX_BYTES:], original_size, file)
        header_end = PREFIX_BYTES + _LENGTH_PREFIX + n
        if header_end + TRAILER_BYTES > file_size:
            raise ContainerError("TZIP_TRUNCATED", f"the {n}-byte safetensors header and trailer need more than the "
                                                   f"file's {file_size} bytes", file)
        # Checked before N or the JSON are used for anything else, so a flipped bit in the length, a tensor name or
        # __metadata__ is reported as what it is, not as a layout mismatch (docs/container.md, "Reading").
        header_bytes = self._read(PREFIX_BYTES, _LENGTH_PREFIX + n)
        if flags & FLAG_HEADER_DIGEST:
            actual = xxh32(header_bytes)
            if actual != reserved:
                raise ContainerError("TZIP_CHECKSUM", f"safetensors header digest mismatch (stored 0x{reserved:x}, "
                                                      f"computed 0x{actual:x} over its {len(header_bytes)} bytes): the "
                                                      "stored header length, tensor names, dtypes, shapes, offsets or "
                                                      "__metadata__ are damaged", file)
        tb = self._read(file_size - TRAILER_BYTES, TRAILER_BYTES)
        index_offset, count, digest, original2, tmagic, treserved = _TRAILER.unpack(tb)
        if tmagic != TRAILER_MAGIC:
            raise ContainerError("TZIP_CORRUPT", "no 'TZIX' trailer at the end of the file (truncated or incompletely "
                                                 "written?)", file)
        if treserved:
            raise ContainerError("TZIP_CORRUPT", "reserved trailer field is not zero", file)
        for what, v in (("index offset", index_offset), ("original file size", original2)):
            if v > _MAX_SAFE:
                raise ContainerError("TZIP_CORRUPT", f"{what} {v} is out of range", file)
        if index_offset % ALIGNMENT or index_offset + count * INDEX_ENTRY_BYTES + TRAILER_BYTES != file_size:
            raise ContainerError("TZIP_CORRUPT", f"trailer places {count} index entries at offset {index_offset}, which "
                                                 f"does not end at the trailer of this {file_size}-byte file", file)
        if original2 != original_size:
            raise ContainerError("TZIP_CORRUPT", f"trailer says the original is {original2} bytes, prefix says "
                                                 f"{original_size}", file)
        if index_offset < align16(header_end):
            raise ContainerError("TZIP_CORRUPT", f"index offset {index_offset} lies inside the safetensors header", file)
        index = self._read(index_offset, count * INDEX_ENTRY_BYTES)
        actual = xxh32(index)
        if actual != digest:
            raise ContainerError("TZIP_CORRUPT", f"index digest mismatch (stored 0x{digest:x}, computed 0x{actual:x})", file)
        rows = [_INDEX.unpack_from(index, INDEX_ENTRY_BYTES * i) for i in range(count)]
        for row in rows:
            for what, v in zip(("data_begin", "data_end", "frame_offset", "frame_bytes"), row):
                if v > _MAX_SAFE:
                    raise ContainerError("TZIP_CORRUPT", f"index {what} {v} is out of range", file)
        header = parse_safetensors_header(header_bytes, original_size, file)
        plan = plan_entries(header)
        if len(plan) != len(rows):
            raise ContainerError("TZIP_CORRUPT", f"index has {len(rows)} entries, the safetensors header needs {len(plan)}", file)
        frames_end = align16(header_end)
        entries = []
        for i, (p, (begin, end, offset, nbytes)) in enumerate(zip(plan, rows)):
            tensor = p.name if p.kind == "tensor" else None
            if begin != p.begin or end != p.end:
                raise ContainerError("TZIP_CORRUPT", f"index entry {i} covers data bytes [{begin}, {end}), the header "
                                                     f"says [{p.begin}, {p.end})", file, tensor)
            if offset % ALIGNMENT or offset < frames_end or offset + nbytes > index_offset:
                raise ContainerError("TZIP_CORRUPT", f"index entry {i} puts its {nbytes}-byte frame at offset {offset}, "
                                                     f"outside the free, aligned frame area [{frames_end}, {index_offset})",
                                     file, tensor)
            frames_end = offset + nbytes
            entries.append(dataclasses.replace(p, frame_offset=offset, frame_bytes=nbytes))
        return _State(file_size, original_size, header_bytes, header, entries)

    # --- lookup --------------------------------------------------------------------------------
    def tensor_names(self) -> list[str]:
        """Names of the tensors, in data-section order."""
        return [e.name for e in self.entries if e.kind == "tensor"]

    def entry(self, name: str) -> Entry:
        """The entry of tensor ``name``. Raises ContainerError TZIP_USAGE when there is none."""
        e = self._by_name.get(name)
        if e is None:
            raise ContainerError("TZIP_USAGE", f"no tensor named '{name}' ({len(self._by_name)} tensors)", self.path, name)
        return e

    # --- frames ---------------------------------------------------------------------------------
    def read_frame(self, entry: Entry, out: torch.Tensor | None = None) -> torch.Tensor:
        """The entry's whole frame (one positioned read) as a 1-D uint8 CPU tensor (``out`` when given: a contiguous
        uint8 CPU tensor of ``entry.frame_bytes`` elements, e.g. in shared memory), its header checked against the
        entry. Raises ContainerError (TZIP_TRUNCATED, TZIP_CORRUPT) naming the file and tensor."""
        frame = torch.empty(entry.frame_bytes, dtype=torch.uint8) if out is None else out
        if frame.numel() != entry.frame_bytes:
            raise ValueError(f"out has {frame.numel()} bytes for a {entry.frame_bytes}-byte frame")
        if entry.frame_bytes:
            _pread_into(self._fd, memoryview(frame.numpy()), entry.frame_offset, self.path,
                        entry.name if entry.kind == "tensor" else None)
        _frame_header(frame, entry, self.path)
        return frame

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> "ContainerReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


# --------------------------------------------------------------------------------------------- tensors


def _dt(name: str) -> torch.dtype | None:
    value = getattr(torch, name, None)
    return value if isinstance(value, torch.dtype) else None


#: torch dtype -> the safetensors dtype name it is stored under: those the ``safetensors`` package reads back as that
#: torch dtype. Every other dtype is stored as its bytes, ``U8 [nbytes]`` (see :func:`safetensors_layout`).
SAFETENSORS_DTYPES: dict[torch.dtype, str] = {d: n for d, n in [
    (torch.bool, "BOOL"), (torch.uint8, "U8"), (torch.int8, "I8"), (torch.int16, "I16"), (_dt("uint16"), "U16"),
    (torch.int32, "I32"), (_dt("uint32"), "U32"), (torch.int64, "I64"), (_dt("uint64"), "U64"),
    (torch.float16, "F16"), (torch.bfloat16, "BF16"), (torch.float32, "F32"), (torch.float64, "F64"),
    (_dt("float8_e4m3fn"), "F8_E4M3"), (_dt("float8_e5m2"), "F8_E5M2"), (_dt("float8_e4m3fnuz"), "F8_E4M3FNUZ"),
    (_dt("float8_e5m2fnuz"), "F8_E5M2FNUZ"), (torch.complex64, "C64"),
] if d is not None}
_TORCH_OF_NAME = {n: d for d, n in SAFETENSORS_DTYPES.items()}

#: Bytes of tensor data per compress or decompress request. Two requests are in flight: one being coded by the
#: daemon while the other's frames are written (or read).
BATCH_BYTES = 32 << 20


def torch_dtype_of(name: str) -> torch.dtype | None:
    """The torch dtype of a safetensors dtype name (None when there is none here)."""
    return _TORCH_OF_NAME.get(name)


def safetensors_layout(dtype: torch.dtype, shape: Sequence[int]) -> tuple[str, tuple[int, ...], int]:
    """(safetensors dtype, shape, bytes) under which a tensor of ``dtype`` and ``shape`` is stored: its own dtype
    name and shape when :data:`SAFETENSORS_DTYPES` has it, else ``U8 [nbytes]``."""
    nbytes = math.prod(shape) * dtype.itemsize
    st = SAFETENSORS_DTYPES.get(dtype)
    return (st, tuple(int(d) for d in shape), nbytes) if st else ("U8", (nbytes,), nbytes)


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor (any dtype and shape, 0-dim included) as a 1-D uint8 view of it."""
    return int_alias(t.detach()).reshape(-1).view(torch.uint8)


def reinterpret(flat: torch.Tensor, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    """A decoded tensor (the codec layout) seen as ``dtype`` and ``shape``: the same bytes, no copy when it is
    contiguous."""
    if flat.dtype == dtype and tuple(flat.shape) == tuple(shape):
        return flat
    if flat.numel() == 0:
        return torch.empty(tuple(shape), dtype=dtype, device=flat.device)
    return byte_view(flat.contiguous()).view(dtype).reshape(tuple(shape))


def codec_view(t: torch.Tensor, codec_dtype: str, codec_shape: Sequence[int]) -> torch.Tensor:
    """``t`` as the daemon must see it so that its frame has the entry's codec layout: ``t`` itself when the daemon
    frames it so (tzip._dlpack.frame_layout_of; every tensor stored under its own safetensors dtype: the container's
    rule is the daemon's, complex64 as float32 pairs included), else its bytes in C order as a 1-D uint8 tensor (a
    dtype stored as ``U8`` bytes, such as complex128; same device; a copy when ``t`` is not contiguous)."""
    t = t.detach()
    if frame_layout_of(t.dtype, tuple(t.shape)) == (codec_dtype, list(codec_shape)):
        return t.resolve_conj().resolve_neg()  # no-ops (and no copies) unless the conj/neg bit is set
    return byte_view(t.resolve_conj().resolve_neg().contiguous())


def _batches(entries: Sequence[Entry], limit: int | None = None) -> list[list[Entry]]:
    limit = BATCH_BYTES if limit is None else limit  # read at call time: BATCH_BYTES may be set by the caller
    out: list[list[Entry]] = []
    cur: list[Entry] = []
    size = 0
    for e in entries:
        if cur and size + e.nbytes > limit:
            out.append(cur)
            cur, size = [], 0
        cur.append(e)
        size += e.nbytes
    if cur:
        out.append(cur)
    return out


@dataclass(frozen=True)
class TensorItem:
    """One tensor to write: its name in the safetensors header, the tensor (any device, dtype and layout; stored as
    its values in C order), and its codec (None: the call's)."""

    name: str
    tensor: torch.Tensor
    codec: str | None = None


def write_tensors(path: str | os.PathLike, items: Sequence[TensorItem], metadata: dict[str, str] | None = None,
                  codec: str | None = None, client: "Client | None" = None, strict: bool = False) -> list[Entry]:
    """Writes ``items`` as the ``.tzip`` file ``path`` (atomically, :func:`atomic_file`): a safetensors file of these
    tensors (largest elements first, then in the given order; ``metadata`` as its ``__metadata__``), each tensor one
    frame compressed by the daemon with its own dtype (a CUDA tensor on its GPU; its frame is then copied to the
    host). While the daemon codes one batch, the previous batch's frames are written and flushed to disk.

    Returns the container's entries with their frame offsets and sizes (``entries[-1].frame_offset +
    entries[-1].frame_bytes`` plus the index and trailer is the file size; see :attr:`ContainerWriter.position`).

    Raises:
        ValueError: a duplicate name, an unknown codec. OSError: writing failed (``path`` untouched).
        DaemonUnavailableError / DeviceUnavailableError: ``strict`` and the default client, no daemon (otherwise raw
            frames and one warning). TzipDaemonError: the daemon refused a tensor.
    """
    by_name: dict[str, TensorItem] = {}
    layouts = []
    for it in items:
        if it.name in by_name:
            raise ValueError(f"tensor name {it.name!r} is used twice")
        by_name[it.name] = it
        layouts.append(safetensors_layout(it.tensor.dtype, tuple(it.tensor.shape)))
    # Biggest elements first, as the safetensors package orders them, so every tensor starts at a multiple of its
    # element size (the data section starts at a multiple of 8). sorted() is stable: given order otherwise.
    order = sorted(range(len(items)), key=lambda i: -min(8, items[i].tensor.element_size() if layouts[i][0] != "U8" else 1))
    header_bytes, _ = encode_safetensors_header([(items[i].name, *layouts[i]) for i in order], metadata)
    data_length = sum(layouts[i][2] for i in order)
    from ._default import resolve_client  # here: the daemon client (and pyzmq) only for what needs a daemon
    c = resolve_client(client, strict) if items else None
    with atomic_file(path) as fd:
        writer = ContainerWriter(fd, header_bytes, data_length, path)
        flusher = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tzip-fdatasync")
        flushing: concurrent.futures.Future | None = None
        try:
            def submit(batch: list[Entry]) -> list[tuple[concurrent.futures.Future, list[int]]]:
                groups: dict[str, list[int]] = {}
                for k, e in enumerate(batch):
                    groups.setdefault(by_name[e.name].codec or codec, []).append(k)
                return [(c.compress_async([codec_view(by_name[batch[k].name].tensor, batch[k].dtype, batch[k].shape)
                                           for k in ks], codec=cd), ks) for cd, ks in groups.items()]

            batches = _batches(writer.entries)
            pending = submit(batches[0]) if batches else []
            for b in range(len(batches)):
                current = pending
                # The next batch is staged and queued while the daemon codes this one and its frames are written.
                pending = submit(batches[b + 1]) if b + 1 < len(batches) else []
                frames: list[CompressedTensor | None] = [None] * len(batches[b])
                for fut, ks in current:
                    for k, ct in zip(ks, fut.result()):
                        frames[k] = ct
                for ct in frames:
                    writer.write_frame(ct.payload if ct.payload.device.type == "cpu" else ct.payload.cpu())
                # Start writing back what is written so far while the next batch is coded, so the final fsync has
                # little left to do. One flush at a time.
                if flushing is None or flushing.done():
                    if flushing is not None:
                        flushing.result()
                    flushing = flusher.submit(os.fdatasync, fd)
            writer.finish()
            if flushing is not None:
                # Its error must surface here: a write-back error reported to one fdatasync is not reported again
                # to the final fsync of the same file.
                flushing.result()
        finally:
            if flushing is not None:
                concurrent.futures.wait([flushing])
            flusher.shutdown(wait=True)
    return writer._written  # noqa: SLF001


def _daemon_error(e: BaseException, reader: "ContainerReader", batch: Sequence[Entry], positions: Sequence[int]) -> BaseException:
    """A decoding failure as a ContainerError naming the file and tensor (other errors as they are)."""
    if isinstance(e, TzipDaemonError) and e.code in ("TZIP_CORRUPT", "TZIP_TRUNCATED", "TZIP_CHECKSUM", "TZIP_UNSUPPORTED"):
        # The daemon's index; a raw frame the client decoded itself has none, which names the one frame of a batch of one.
        i = e.index if e.index is not None else (0 if len(positions) == 1 else None)
        at = batch[positions[i]] if i is not None and 0 <= i < len(positions) else None
        return ContainerError(e.code, e.detail, reader.path, at.name if at is not None and at.kind == "tensor" else None)
    return e


def decode_entries(reader: ContainerReader, entries: Sequence[Entry], client: "Client | None" = None,
                   device: Callable[[Entry], torch.device] | None = None,
                   out: Callable[[Entry], torch.Tensor | None] | None = None,
                   strict: bool = False) -> Iterator[tuple[Entry, torch.Tensor]]:
    """Decodes ``entries`` of ``reader``, yielding ``(entry, tensor)`` in the given order. Each tensor has the
    entry's codec dtype and shape (``entry.dtype``, ``entry.shape``) and lies on ``device(entry)`` (default: the
    CPU; a GPU entry's frame is copied to the GPU and decoded there), or is ``out(entry)`` filled, when that
    returns a contiguous tensor of that dtype and shape. A frame in the ``U8`` layout that earlier writers gave
    some tensors (C64, more than 32 dimensions; :func:`frame_layout_fits`) is decoded as bytes and given in the
    entry's layout all the same. CPU results are ordinary (private) memory, not shared memory. Every chunk digest is
    checked. Frames of codec ``raw`` need no daemon.

    Raises ContainerError (TZIP_CORRUPT, TZIP_TRUNCATED, TZIP_CHECKSUM, TZIP_UNSUPPORTED) naming the file and
    tensor; DaemonUnavailableError when compressed frames must be decoded and no daemon can be reached.
    """
    batches = _batches(entries)
    c = client

    def submit(batch: list[Entry]):
        nonlocal c
        cts, outs = [], []
        for e in batch:
            frame = reader.read_frame(e)
            h = read_header(frame)
            dtype = torch_dtype_of(e.dtype)
            dev = device(e) if device is not None else torch.device("cpu")
            o = out(e) if out is not None else None
            if o is not None:
                dev = o.device
            elif dev.type == "cpu":
                # Decoding into private memory: a result in shared memory would hold /dev/shm for as long as the
                # caller keeps the tensor (a whole checkpoint's worth).
                o = torch.empty(e.shape, dtype=dtype)
            shape = e.shape
            if (h.dtype, tuple(h.shape)) != (e.dtype, tuple(e.shape)):
                # A frame in the U8 layout of an earlier writer (read_frame let only that through): decoded as bytes
                # into the same memory, and yielded in the entry's layout below.
                dtype, shape = torch.uint8, (e.nbytes,)
                if o is not None and not o.is_contiguous():
                    raise ValueError(f"out for tensor '{e.name}' is not contiguous")
                o = byte_view(o) if o is not None else None
            cts.append(CompressedTensor(frame if dev.type == "cpu" else frame.to(dev), dtype, shape, h.codec, h.nbytes))
            outs.append(o)
        if c is None and any(ct.codec != "raw" for ct in cts):
            from ._default import resolve_client  # as in write_tensors
            c = resolve_client(None, strict)
        if c is None:  # raw frames only and no client given: decoded here
            fut: concurrent.futures.Future = concurrent.futures.Future()
            try:
                fut.set_result([_decompress_raw(ct, o, True) for ct, o in zip(cts, outs)])
            except Exception as err:  # noqa: BLE001 (raised by fut.result())
                fut.set_exception(err)
            return fut, batch, cts, outs
        return c.decompress_async(cts, out=outs), batch, cts, outs

    pending = submit(batches[0]) if batches else None
    for b in range(len(batches)):
        fut, batch, cts, outs = pending
        # The next batch's frames are read (and queued) while the daemon decodes this one.
        try:
            pending = submit(batches[b + 1]) if b + 1 < len(batches) else None
        except BaseException:
            concurrent.futures.wait([fut])  # nothing may still be writing into the caller's tensors once we raise
            raise
        try:
            tensors = fut.result()
        except (TzipDaemonError, ValueError) as err:
            raise _locate(err, reader, batch, cts, outs, c) from None
        for e, t in zip(batch, tensors):
            yield e, reinterpret(t, torch_dtype_of(e.dtype), e.shape)  # t itself unless its frame had an earlier layout


def _locate(err: BaseException, reader: ContainerReader, batch: list[Entry], cts: list[CompressedTensor], outs: list,
            c: "Client | None") -> BaseException:
    """The error of a failed batch as a ContainerError naming the tensor at fault: the daemon's index, or (raw
    frames, checked in this process, say nothing of their place) the first frame that fails alone."""
    found = _daemon_error(err, reader, batch, list(range(len(batch))))
    if not isinstance(found, ContainerError) or found.tensor is not None or len(batch) == 1:
        return found
    for k, (ct, o) in enumerate(zip(cts, outs)):
        try:
            if c is None:
                _decompress_raw(ct, None, True)
            else:
                c.decompress(ct)
        except (TzipDaemonError, ValueError) as e:
            return _daemon_error(e, reader, [batch[k]], [0])
    return found
