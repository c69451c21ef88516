"""The safetensors header of a ``.tzip`` file (and of a ``.safetensors`` file): its length prefix and JSON checked as
the TypeScript reader checks them (``src/safetensors.ts``), laid out as the ``safetensors`` package writes it, and
the plan of a container's entries (``src/entries.ts``): one per tensor, in its codec layout, and one per gap of bytes
no tensor covers (docs/container.md, "Header" and "Entries"). Errors are :class:`ContainerError`; the container
itself (prefix, frames, index, trailer) is :mod:`tzip._container`'s.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

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
