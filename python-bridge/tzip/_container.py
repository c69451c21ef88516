"""The ``.tzip`` container in Python: writing it atomically, and reading it with random access (docs/container.md).

A ``.tzip`` file holds one safetensors file losslessly: a 24-byte prefix, the safetensors file's ``8 + N`` header
bytes verbatim, one frame (docs/format.md) per *entry* at 16-byte aligned offsets, a 32-byte-per-entry index and a
32-byte trailer. This module mirrors the TypeScript implementation rule for rule (``src/container.ts`` for the
fixed parts, ``src/safetensors.ts`` for the header checks, ``src/entries.ts`` for the entry plan, ``src/writer.ts``
and ``src/reader.ts``), so files written here are read by ``tzip decompress | verify | inspect | extract`` and files
written by ``tzip compress`` are read here. The frames themselves come from the daemon (``Client.compress``); this
module only places them, and checks each frame's header against its entry when writing and reading.

* :func:`encode_safetensors_header` lays out a safetensors header (JSON padded with spaces to a multiple of 8, as
  the ``safetensors`` package writes it) for tensors given by safetensors dtype, shape and byte length.
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
import json
import math
import os
import re
import secrets
import struct
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

import numpy as np
import torch

from ._dlpack import frame_layout_of, int_alias
from ._errors import TzipDaemonError
from ._fallback import _decompress_raw
from ._frame import FrameError, FrameHeader, read_header
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
#: Largest safetensors JSON header accepted, in bytes (the reference implementation's limit).
MAX_HEADER_BYTES = 100_000_000
#: Most dimensions a frame records; tensors with more are coded 1-D.
CODEC_MAX_DIMS = 32
#: The safetensors dtypes the codec knows, and their element sizes in bytes (docs/container.md, "Entries").
CODEC_DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
                     "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
#: Complex safetensors dtypes and the dtype of their parts: coded as float pairs with a trailing dimension of 2, as the
#: daemon codes a complex tensor (tzip._dlpack.frame_layout), so that ``tzip compress``, ``tzip.save`` and
#: ``Client.compress`` give one tensor one codec layout. Safetensors names only C64 (src/safetensors.ts COMPLEX_PARTS).
_COMPLEX_PARTS = {"C64": "F32"}
_LENGTH_PREFIX = 8
_MAX_SAFE = (1 << 53) - 1  # offsets and sizes are read as u64 but must be at most 2^53 - 1 (the TS reader's numbers)
_PREFIX = struct.Struct("<8sHHIQ")
_INDEX = struct.Struct("<QQQQ")
_TRAILER = struct.Struct("<QIIQ4sI")


class ContainerError(ValueError):
    """A ``.tzip`` file that cannot be read as it is: ``code`` is ``TZIP_CORRUPT``, ``TZIP_TRUNCATED``,
    ``TZIP_UNSUPPORTED``, ``TZIP_CHECKSUM`` or ``TZIP_USAGE``; ``file`` and ``tensor`` (or None) say where."""

    def __init__(self, code: str, message: str, file: str | os.PathLike | None = None, tensor: str | None = None):
        where = "".join([f"{os.fspath(file)}: " if file is not None else "", f"tensor '{tensor}': " if tensor else ""])
        super().__init__(f"{where}{code}: {message}")
        self.code = code
        self.detail = message
        self.file = None if file is None else os.fspath(file)
        self.tensor = tensor


def align16(x: int) -> int:
    """``x`` rounded up to a multiple of 16."""
    return (x + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


def codec_layout(dtype: str, shape: Sequence[int], nbytes: int) -> tuple[str, list[int]]:
    """The codec dtype and shape of a safetensors tensor of ``dtype`` and ``shape`` whose data is ``nbytes`` long
    (docs/container.md, "Entries"; the daemon's rule, tzip._dlpack.frame_layout): its own for a dtype the codec knows
    whose byte length matches; ``F32 shape + [2]`` for such a C64 tensor; 1-D (``[elements]``, ``[2 * elements]``)
    where the frame shape would have more than 32 dimensions; else ``U8 [nbytes]``."""
    elements = math.prod(shape)
    size = CODEC_DTYPE_BYTES.get(dtype)
    if size is not None and elements * size == nbytes:
        return dtype, (list(shape) if len(shape) <= CODEC_MAX_DIMS else [elements])
    part = _COMPLEX_PARTS.get(dtype)
    if part is not None and elements * 2 * CODEC_DTYPE_BYTES[part] == nbytes:
        return part, ([*shape, 2] if len(shape) + 1 <= CODEC_MAX_DIMS else [2 * elements])
    return "U8", [nbytes]


def frame_layout_fits(entry: "Entry", dtype: str, shape: Sequence[int]) -> bool:
    """Whether a frame recording ``dtype`` and ``shape`` may hold ``entry``: its codec layout, or ``U8 [nbytes]`` for
    a tensor that writers before issue 36 coded as bytes (C64, more than 32 dimensions; docs/container.md, "Earlier
    layouts"). Both decode to the same bytes."""
    if dtype == entry.dtype and tuple(shape) == tuple(entry.shape):
        return True
    return (entry.kind == "tensor" and (entry.file_dtype in _COMPLEX_PARTS or len(entry.file_shape) > CODEC_MAX_DIMS)
            and dtype == "U8" and tuple(shape) == (entry.nbytes,))


@dataclass(frozen=True)
class HeaderTensor:
    """One tensor of a validated safetensors header; offsets in bytes relative to the data section."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int
    codec_dtype: str
    codec_shape: tuple[int, ...]


@dataclass(frozen=True)
class SafetensorsHeader:
    """A validated safetensors header: N (``header_length``), where the data starts (``8 + N``), the data section's
    length, the tensors sorted by (begin, end, name as UTF-8 bytes), and ``__metadata__`` (or None)."""

    header_length: int
    data_offset: int
    data_length: int
    tensors: tuple[HeaderTensor, ...]
    metadata: dict[str, Any] | None


@dataclass(frozen=True)
class Entry:
    """One entry of a container: a tensor (``kind == "tensor"``) or a gap of bytes no tensor covers (``"gap"``,
    named ``(gap @BEGIN)``). ``dtype``/``shape`` are what the frame must record (the codec layout); ``file_dtype`` /
    ``file_shape`` what the safetensors header says. ``frame_offset``/``frame_bytes`` locate the frame (-1 until
    written)."""

    kind: str
    name: str
    begin: int
    end: int
    file_dtype: str
    file_shape: tuple[int, ...]
    dtype: str
    shape: tuple[int, ...]
    index: int
    frame_offset: int = -1
    frame_bytes: int = -1

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


#: Deepest nesting of arrays and objects accepted in a safetensors header: serde_json's recursion limit (the
#: safetensors crate's), as the TypeScript reader (src/safetensors.ts MAX_JSON_DEPTH).
MAX_JSON_DEPTH = 128

_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)


def _json_depth(text: str) -> int:
    """How deep the arrays and objects of the JSON ``text`` nest: brackets outside strings, counted with numpy (a
    header may be 100 MB). Text that is not JSON gives some number; json.loads refuses it afterwards."""
    b = np.frombuffer(_JSON_STRING.sub('""', text).encode("utf-8", "surrogatepass"), dtype=np.uint8)
    if b.size == 0:
        return 0
    step = (b == ord("{")).astype(np.int32) + (b == ord("[")) - (b == ord("}")) - (b == ord("]"))
    return int(np.cumsum(step).max(initial=0))


def _well_formed(text: str) -> bool:
    """True when ``text`` has no lone surrogate (JSON's \\ud800-\\udfff escapes may make one; UTF-8 cannot hold it, and
    the safetensors crate refuses it, as the TypeScript reader does: docs/container.md)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _bad_metadata_key(metadata: dict) -> str | None:
    """The first key of ``metadata`` that breaks the format's rule for ``__metadata__`` (strings to strings, Unicode
    text without lone surrogates), as JSON (a key that is not a string: its repr), or None when none does. The reader
    refuses such a header, the writer such a map."""
    for k, v in metadata.items():
        if not isinstance(k, str) or not isinstance(v, str) or not _well_formed(k) or not _well_formed(v):
            return json.dumps(k) if isinstance(k, str) else repr(k)
    return None


def _utf8(name: str) -> bytes:
    return name.encode("utf-8", "surrogatepass")


def _is_offset(v: Any) -> bool:
    # JSON numbers are JavaScript numbers in the TS reader: 3.0 is the integer 3; booleans are not numbers.
    if isinstance(v, bool):
        return False
    if isinstance(v, int):
        return 0 <= v <= _MAX_SAFE
    return isinstance(v, float) and v.is_integer() and 0 <= v <= _MAX_SAFE


def _text_prefix_note(prefix: bytes) -> str:
    """"not a safetensors file: it starts with text ..." when the 8 bytes where a safetensors file keeps its header
    length are all printable ASCII or whitespace (a config.json or README passed by mistake: read as a u64 they give
    lengths like 7234013700659612283, which alone told a user nothing); "" otherwise. A real header length is below
    2^27 (100 MB): its high bytes are 0, never printable; 8 printable bytes always read as more than 100 MB (the top
    byte is at least 0x09), so only the TZIP_CORRUPT case needs the note. The same words as the TypeScript reader's."""
    head = bytes(prefix[:_LENGTH_PREFIX])
    if not all(0x20 <= b <= 0x7E or b in (0x09, 0x0A, 0x0D) for b in head):
        return ""
    return (f"not a safetensors file: it starts with text ({json.dumps(head.decode('latin-1'))}) where a safetensors "
            "file starts with the length of its JSON header, an 8-byte little-endian integer; ")


def parse_header_length(prefix: bytes, file_size: int, file: str | os.PathLike) -> int:
    """N from the first 8 bytes of a safetensors file of ``file_size`` bytes.

    Raises ContainerError: TZIP_TRUNCATED (fewer than 8 bytes, or N > file_size - 8), TZIP_CORRUPT (N > 100,000,000;
    when those 8 bytes are text, a JSON or text file that is not safetensors, the message starts with "not a
    safetensors file: it starts with text").
    """
    if len(prefix) < _LENGTH_PREFIX or file_size < _LENGTH_PREFIX:
        raise ContainerError("TZIP_TRUNCATED", f"safetensors file of {file_size} bytes has no 8-byte header length", file)
    (n,) = struct.unpack_from("<Q", prefix, 0)
    if n > MAX_HEADER_BYTES:
        raise ContainerError("TZIP_CORRUPT", f"{_text_prefix_note(prefix)}safetensors header length {n} exceeds the "
                                             f"{MAX_HEADER_BYTES}-byte limit", file)
    if n > file_size - _LENGTH_PREFIX:
        raise ContainerError("TZIP_TRUNCATED", f"safetensors header length {n} exceeds the {file_size - _LENGTH_PREFIX} "
                                               "bytes after the length prefix", file)
    return n


def _reject_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def parse_safetensors_header(prefix: bytes, file_size: int, file: str | os.PathLike) -> SafetensorsHeader:
    """Parses and checks the first ``8 + N`` bytes of a safetensors file of ``file_size`` bytes, with the rules of
    docs/container.md ("The safetensors input").

    Raises ContainerError: TZIP_TRUNCATED (header or a tensor past the end), TZIP_CORRUPT (not UTF-8 JSON, a bad
    field, overlapping tensors), naming the file and tensor.
    """
    n = parse_header_length(prefix, file_size, file)
    if len(prefix) < _LENGTH_PREFIX + n:
        raise ContainerError("TZIP_TRUNCATED", f"safetensors header needs {_LENGTH_PREFIX + n} bytes, got {len(prefix)}", file)
    data_offset = _LENGTH_PREFIX + n
    data_length = file_size - data_offset
    try:
        text = bytes(prefix[_LENGTH_PREFIX:data_offset]).decode("utf-8")
        depth = _json_depth(text)
        if depth > MAX_JSON_DEPTH:
            raise ValueError(f"nested {depth} levels deep, more than {MAX_JSON_DEPTH}")
        obj = json.loads(text.rstrip("\0"), parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ContainerError("TZIP_CORRUPT", f"safetensors header is not UTF-8 JSON: {e}", file) from None
    if not isinstance(obj, dict):
        raise ContainerError("TZIP_CORRUPT", "safetensors header is not a JSON object", file)
    metadata = None
    tensors: list[HeaderTensor] = []
    for name, value in obj.items():
        if name == "__metadata__":
            if not isinstance(value, dict):
                raise ContainerError("TZIP_CORRUPT", "__metadata__ is not a JSON object", file)
            bad = _bad_metadata_key(value)
            if bad is not None:
                raise ContainerError("TZIP_CORRUPT", f"__metadata__ entry {bad} is not a string of Unicode "
                                     "text (the format's map of strings to strings)", file)
            metadata = value
            continue
        if not _well_formed(name):
            raise ContainerError("TZIP_CORRUPT", "tensor name with a lone UTF-16 surrogate (\\ud800-\\udfff unpaired): "
                                 "not Unicode text", file, name)
        if not isinstance(value, dict):
            raise ContainerError("TZIP_CORRUPT", "bad tensor entry: not an object", file, name)
        dtype, shape, offsets = value.get("dtype"), value.get("shape"), value.get("data_offsets")
        if not isinstance(dtype, str) or not dtype:
            raise ContainerError("TZIP_CORRUPT", "bad tensor entry: dtype is not a non-empty string", file, name)
        if not isinstance(shape, list) or not all(_is_offset(d) for d in shape):
            raise ContainerError("TZIP_CORRUPT", "bad tensor entry: shape is not a list of integers from 0 to 2^53 - 1", file, name)
        if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_offset(d) for d in offsets):
            raise ContainerError("TZIP_CORRUPT", "bad tensor entry: data_offsets is not two integers from 0 to 2^53 - 1", file, name)
        begin, end = int(offsets[0]), int(offsets[1])
        shape_t = tuple(int(d) for d in shape)
        if begin > end:
            raise ContainerError("TZIP_CORRUPT", f"data_offsets [{begin}, {end}] are reversed", file, name)
        if end > data_length:
            raise ContainerError("TZIP_TRUNCATED", f"data_offsets [{begin}, {end}] reach past the {data_length}-byte "
                                                   "data section", file, name)
        cd, cs = codec_layout(dtype, shape_t, end - begin)
        tensors.append(HeaderTensor(name, dtype, shape_t, begin, end, cd, tuple(cs)))
    tensors.sort(key=lambda t: (t.begin, t.end, _utf8(t.name)))
    cursor = 0
    previous: HeaderTensor | None = None
    for t in tensors:
        if previous is not None and t.begin < cursor:
            raise ContainerError("TZIP_CORRUPT", f"data_offsets [{t.begin}, {t.end}] overlap tensor '{previous.name}' at "
                                                 f"[{previous.begin}, {previous.end}]", file, t.name)
        if t.end > cursor:
            cursor, previous = t.end, t
    return SafetensorsHeader(n, data_offset, data_length, tuple(tensors), metadata)


def plan_entries(header: SafetensorsHeader) -> list[Entry]:
    """The entries of a validated header (docs/container.md, "Entries"): tensors in their sorted order, a U8 gap
    entry before a tensor that does not start where the previous one ended and after the last one."""
    entries: list[Entry] = []
    cursor = 0

    def gap_until(end: int) -> None:
        nonlocal cursor
        if end > cursor:
            shape = (end - cursor,)
            entries.append(Entry("gap", f"(gap @{cursor})", cursor, end, "U8", shape, "U8", shape, len(entries)))
            cursor = end

    for t in header.tensors:
        gap_until(t.begin)
        entries.append(Entry("tensor", t.name, t.begin, t.end, t.dtype, t.shape, t.codec_dtype, t.codec_shape, len(entries)))
        cursor = t.end
    gap_until(header.data_length)
    return entries


def encode_safetensors_header(tensors: Sequence[tuple[str, str, Sequence[int], int]],
                              metadata: dict[str, str] | None = None) -> tuple[bytes, list[tuple[int, int]]]:
    """The ``8 + N`` header bytes of a safetensors file holding ``tensors`` (name, safetensors dtype, shape, byte
    length), their data laid out back to back in the given order, and each tensor's ``(begin, end)``.

    The JSON is compact, ASCII (``json.dumps``'s escapes), ``__metadata__`` first, and padded with spaces so the
    data section starts at a multiple of 8 bytes, as the ``safetensors`` package writes it.
    Raises ValueError for a duplicate name or a name ``__metadata__``, a ``metadata`` that is not a map of strings to
    strings (the format's rule: the readers refuse anything else), or a name or metadata string with a lone surrogate.
    """
    body: dict[str, Any] = {}
    if metadata is not None:
        if not isinstance(metadata, dict) or _bad_metadata_key(metadata) is not None:
            raise ValueError(f"metadata must map strings to strings (safetensors' __metadata__), got {metadata!r:.200}")
        body["__metadata__"] = metadata
    offsets = []
    at = 0
    for name, dtype, shape, nbytes in tensors:
        if name in body or name == "__metadata__":
            raise ValueError(f"tensor name {name!r} is used twice (or is __metadata__)")
        if not _well_formed(name):
            raise ValueError(f"tensor name {name!r} has a lone surrogate: not Unicode text")
        body[name] = {"dtype": dtype, "shape": [int(d) for d in shape], "data_offsets": [at, at + int(nbytes)]}
        offsets.append((at, at + int(nbytes)))
        at += int(nbytes)
    text = json.dumps(body, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode("ascii")
    text += b" " * (-(len(text) + _LENGTH_PREFIX) % 8)
    return struct.pack("<Q", len(text)) + text, offsets


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
