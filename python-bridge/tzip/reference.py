"""Reference decoder of a tzip frame, written from the specification (docs/format.md).

This module is an independent second implementation of the frame format, in
plain Python (numpy for bit unpacking and field merging). It exists to pin the
format down: the golden vectors in ``test/golden/`` must decode here to the
same bytes as in the C++ and CUDA codecs, and every malformed frame must be
refused with a :class:`ValueError` that says what is wrong. It is meant to be
simple and obviously right, not fast (the rANS loop runs one Python step per
symbol: about 0.1 s per 64 KiB chunk).

Everything is little-endian; every section starts on a multiple of 16 bytes
from the start of its frame or chunk. The decoder is *strict*: besides every
check the C++ decoder makes it also rejects non-zero padding (after the shape,
between chunks, between and inside stream sections, and unused bits of the
last byte of a packed bit string), so only frames a canonical encoder could
have written are accepted. docs/format.md, "What a decoder must reject", lists
every check.

Public API:

* :func:`decode_frame` -- frame bytes -> (original tensor bytes, header info).
* :func:`encode_frame` -- the canonical encoder, from the decision rules of docs/format.md ("Canonical encoder").
  Its frames must equal the C++ encoder's byte for byte; it proves that the specification is complete.
* :func:`xxh32` -- XXH32 with seed 0 (delegates to the ``xxhash`` package).
* :func:`chunk_digest` -- the digest of a chunk's original bytes (32 lanes of 16-byte stripes, docs/format.md 9).
* :func:`max_compressed_size` -- the exact bound of a frame's size.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np
import xxhash

__all__ = [
    "FORMAT_VERSION",
    "MAGIC",
    "DTYPES",
    "CODECS",
    "MODES",
    "decode_frame",
    "encode_frame",
    "xxh32",
    "chunk_digest",
    "max_compressed_size",
]

#: Bytes 0..3 of every frame.
MAGIC = b"TZFR"
#: The only format version this decoder reads; version 1 (pre-release) and newer versions are refused.
FORMAT_VERSION = 2

#: dtype code -> (safetensors name, element size in bytes).
DTYPES: dict[int, tuple[str, int]] = {
    0: ("BOOL", 1),
    1: ("U8", 1),
    2: ("I8", 1),
    3: ("F8_E4M3", 1),
    4: ("F8_E5M2", 1),
    5: ("I16", 2),
    6: ("U16", 2),
    7: ("F16", 2),
    8: ("BF16", 2),
    9: ("I32", 4),
    10: ("U32", 4),
    11: ("F32", 4),
    12: ("I64", 8),
    13: ("U64", 8),
    14: ("F64", 8),
}
#: codec id -> name.
CODECS: dict[int, str] = {0: "raw", 1: "fast", 2: "max", 3: "bytes"}
#: stream mode id -> name.
MODES: dict[int, str] = {0: "CONST", 1: "RAW", 2: "LUT", 3: "RANS"}

_SPLIT_FLOATS = ("BF16", "F16", "F32")
# Symbol width in bits of each stream when a float dtype is split (codecs fast and max).
_FLOAT_STREAM_BITS = {"BF16": (8, 8), "F16": (5, 8, 3), "F32": (8, 8, 8, 8)}

_FIXED_HEADER = 48
_TABLE_ENTRY = 16
_MAX_NDIM = 32
_MIN_CHUNK, _MAX_CHUNK, _CHUNK_MULTIPLE = 4096, 65536, 256
_CHUNK_KIND_CODED = 1
_CHUNK_HEADER = 8
_DESCRIPTOR = 8
_RANS_LANES = 32
_RANS_SCALE_BITS = 12
_RANS_SCALE = 1 << _RANS_SCALE_BITS  # 4096
_RANS_LOW = 1 << 16  # lower bound L of a normalised lane state
_RANS_BITMAP = 32


def xxh32(data: bytes | bytearray | memoryview) -> int:
    """XXH32 of ``data`` with seed 0, as an unsigned 32-bit int (``xxhash.xxh32_intdigest``)."""
    return xxhash.xxh32_intdigest(bytes(data), seed=0)


#: Lanes of the chunk digest and the bytes of one stripe (docs/format.md, "Checksums").
_DIGEST_LANES = 32
_DIGEST_STRIPE = 16


def chunk_digest(data: bytes | bytearray | memoryview) -> int:
    """The chunk digest of format version 2, straight from its definition (docs/format.md, "Checksums").

    The bytes are cut into 16-byte stripes (the last may be shorter); lane ``l`` (0..31) is the concatenation of
    stripes ``l, l+32, l+64, ...``; ``d_l = XXH32(lane l)``; the digest is XXH32 of ``d_0 .. d_31`` as 32
    little-endian ``u32`` (128 bytes). An empty lane has ``d_l = XXH32(b"") = 0x02CC5D05``.
    """
    data = bytes(data)
    n_stripes = -(-len(data) // _DIGEST_STRIPE)
    lanes = [
        b"".join(data[_DIGEST_STRIPE * s : _DIGEST_STRIPE * (s + 1)] for s in range(lane, n_stripes, _DIGEST_LANES))
        for lane in range(_DIGEST_LANES)
    ]
    return xxh32(struct.pack(f"<{_DIGEST_LANES}I", *(xxh32(b) for b in lanes)))


def _align16(x: int) -> int:
    return (x + 15) & ~15


def _packed_bytes(n: int, bits: int) -> int:
    """Bytes of ``n`` symbols of ``bits`` bits each, packed LSB-first."""
    return (n * bits + 7) // 8


def max_compressed_size(nbytes: int, ndim: int, chunk_size: int = 65536) -> int:
    """Exact upper bound, in bytes, of the frame of a tensor of ``nbytes`` bytes and ``ndim`` dimensions.

    ``align16(48 + 8*ndim) + 16*ceil(nbytes/chunk_size) + nbytes`` (docs/format.md, "Size bound").
    Raises ValueError for ndim > 32 or a chunk size outside the format's rules.
    """
    if not 0 <= ndim <= _MAX_NDIM:
        raise ValueError(f"ndim {ndim} out of range 0..32")
    if not (_MIN_CHUNK <= chunk_size <= _MAX_CHUNK and chunk_size % _CHUNK_MULTIPLE == 0):
        raise ValueError(f"chunk size {chunk_size} is not a multiple of 256 in [4096, 65536]")
    if nbytes < 0:
        raise ValueError("nbytes must be >= 0")
    return _align16(_FIXED_HEADER + 8 * ndim) + _TABLE_ENTRY * (-(-nbytes // chunk_size)) + nbytes


def _fail(what: str) -> ValueError:
    return ValueError(f"invalid tzip frame: {what}")


def _require_zero(buf: bytes, start: int, end: int, what: str) -> None:
    if any(buf[start:end]):
        raise _fail(f"{what}: padding bytes [{start}, {end}) are not zero")


def _unpack_bits(buf: bytes, n: int, bits: int, what: str) -> np.ndarray:
    """Unpacks ``n`` symbols of ``bits`` bits, LSB-first, from exactly ``_packed_bytes(n, bits)`` bytes.

    Symbol i is bits [i*bits, (i+1)*bits) of the little-endian bit string (bit j of the string is bit j % 8 of
    byte j // 8). Returns uint8 array of shape (n,). Raises ValueError when the unused high bits of the last
    byte are not zero.
    """
    assert len(buf) == _packed_bytes(n, bits)
    if n == 0:
        return np.zeros(0, dtype=np.uint8)
    allbits = np.unpackbits(np.frombuffer(buf, dtype=np.uint8), bitorder="little")
    if allbits[n * bits :].any():
        raise _fail(f"{what}: unused bits of the last packed byte are not zero")
    fields = allbits[: n * bits].reshape(n, bits).astype(np.uint16)
    weights = (1 << np.arange(bits, dtype=np.uint16)).astype(np.uint16)
    return (fields @ weights).astype(np.uint8)


def _stream_bits(dtype: str, codec: str) -> tuple[int, ...]:
    """Symbol widths of the streams of a coded chunk (docs/format.md, "Streams")."""
    if codec in ("fast", "max") and dtype in _SPLIT_FLOATS:
        return _FLOAT_STREAM_BITS[dtype]
    return (8,) * _element_size(dtype)


def _element_size(dtype: str) -> int:
    for name, size in DTYPES.values():
        if name == dtype:
            return size
    raise AssertionError(dtype)


def _merge(dtype: str, codec: str, streams: list[np.ndarray], n: int) -> bytes:
    """Rebuilds ``n`` little-endian elements from one symbol array per stream (inverse of the stream split)."""
    if codec in ("fast", "max") and dtype in _SPLIT_FLOATS:
        if dtype == "BF16":  # v = s<<15 | e<<7 | m7; E = e, R = s<<7 | m7
            e, r = (a.astype(np.uint16) for a in streams)
            v = ((r & 0x80) << 8) | (e << 7) | (r & 0x7F)
            return v.astype("<u2").tobytes()
        if dtype == "F16":  # v = s<<15 | e<<10 | m10; E = e, R0 = m[7:0], R1 = s<<2 | m[9:8]
            e, r0, r1 = (a.astype(np.uint16) for a in streams)
            v = ((r1 & 4) << 13) | (e << 10) | ((r1 & 3) << 8) | r0
            return v.astype("<u2").tobytes()
        # F32: v = s<<31 | e<<23 | m23; E = e, R0 = m[7:0], R1 = m[15:8], R2 = s<<7 | m[22:16]
        e, r0, r1, r2 = (a.astype(np.uint32) for a in streams)
        v = ((r2 & 0x80) << 24) | (e << 23) | ((r2 & 0x7F) << 16) | (r1 << 8) | r0
        return v.astype("<u4").tobytes()
    # Byte planes: stream j holds byte j of every element.
    planes = np.stack(streams, axis=1) if streams else np.zeros((n, 0), dtype=np.uint8)
    return planes.astype(np.uint8).tobytes()


# ---------------------------------------------------------------- stream sections


def _decode_raw(sec: bytes, n: int, bits: int, param: int) -> np.ndarray:
    if param != 0:
        raise _fail(f"RAW stream with parameter {param} (must be 0)")
    if len(sec) != _packed_bytes(n, bits):
        raise _fail(f"RAW stream of {len(sec)} bytes, {n} symbols of {bits} bits need {_packed_bytes(n, bits)}")
    if bits == 8:
        return np.frombuffer(sec, dtype=np.uint8).copy()
    return _unpack_bits(sec, n, bits, "RAW stream")


def _decode_lut(sec: bytes, n: int, bits: int, k: int) -> tuple[np.ndarray, dict[str, Any]]:
    # Section: u32 n_exc | 2^k - 1 LUT bytes | zero pad to 16 | n k-bit codes LSB-first | zero pad to 16 |
    # n_exc exception bytes. Code 2^k - 1 is the escape: the symbol is the next exception.
    if not 1 <= k < bits:
        raise _fail(f"LUT code width {k} out of range 1..{bits - 1}")
    cap = (1 << k) - 1
    codes_off = _align16(4 + cap)
    exc_off = _align16(codes_off + _packed_bytes(n, k))
    if len(sec) < codes_off:
        raise _fail(f"LUT section of {len(sec)} bytes is shorter than its table ({codes_off})")
    (n_exc,) = struct.unpack_from("<I", sec, 0)
    if n_exc > n or len(sec) != exc_off + n_exc:
        raise _fail(f"LUT section is {len(sec)} bytes, {n_exc} exceptions need {exc_off + n_exc}")
    lut = np.frombuffer(sec, dtype=np.uint8, count=cap, offset=4)
    if bits < 8 and (lut >> bits).any():
        raise _fail(f"LUT entry wider than its {bits}-bit stream")
    _require_zero(sec, 4 + cap, codes_off, "LUT section")
    codes_end = codes_off + _packed_bytes(n, k)
    _require_zero(sec, codes_end, exc_off, "LUT section")
    codes = _unpack_bits(sec[codes_off:codes_end], n, k, "LUT codes")
    exceptions = np.frombuffer(sec, dtype=np.uint8, count=n_exc, offset=exc_off)
    if bits < 8 and (exceptions >> bits).any():
        raise _fail(f"LUT exception wider than its {bits}-bit stream")
    escaped = codes == cap
    n_escapes = int(escaped.sum())
    if n_escapes != n_exc:
        raise _fail(f"LUT codes hold {n_escapes} escapes but the section has {n_exc} exceptions")
    table = np.concatenate([lut, np.zeros(1, dtype=np.uint8)])
    sym = table[codes]
    sym[escaped] = exceptions  # exceptions in element order
    return sym, {"k": k, "exceptions": n_exc}


def _decode_rans(sec: bytes, n: int, bits: int, param: int) -> tuple[np.ndarray, dict[str, Any]]:
    # Section: 32-byte presence bitmap | u16 freq per present symbol (ascending) | zero pad to 4 |
    # 32 x u32 lane states | u32 word count | zero pad to 16 | word count x u16 words.
    if param != 0:
        raise _fail(f"RANS stream with parameter {param} (must be 0)")
    if len(sec) < _RANS_BITMAP:
        raise _fail("RANS section shorter than its 32-byte symbol bitmap")
    present = [s for s in range(256) if (sec[s >> 3] >> (s & 7)) & 1]
    m = len(present)
    if m < 2:
        raise _fail(f"RANS table with {m} symbol(s) (at least 2)")
    if present[-1] >> bits:
        raise _fail(f"RANS symbol {present[-1]} wider than its {bits}-bit stream")
    freqs_end = _RANS_BITMAP + 2 * m
    states_off = (freqs_end + 3) & ~3
    count_off = states_off + 4 * _RANS_LANES
    words_off = _align16(count_off + 4)
    if len(sec) < words_off:
        raise _fail(f"RANS section of {len(sec)} bytes is shorter than its {m}-symbol table ({words_off})")
    freq = [0] * 256
    for j, s in enumerate(present):
        (f,) = struct.unpack_from("<H", sec, _RANS_BITMAP + 2 * j)
        if not 1 <= f < _RANS_SCALE:
            raise _fail(f"RANS frequency {f} of symbol {s} out of range 1..4095")
        freq[s] = f
    if sum(freq) != _RANS_SCALE:
        raise _fail(f"RANS frequencies sum to {sum(freq)}, not 4096")
    _require_zero(sec, freqs_end, states_off, "RANS section")
    state = list(struct.unpack_from(f"<{_RANS_LANES}I", sec, states_off))
    if min(state) < _RANS_LOW:
        raise _fail("RANS lane state below 2^16")
    (n_words,) = struct.unpack_from("<I", sec, count_off)
    _require_zero(sec, count_off + 4, words_off, "RANS section")
    if n_words > n or len(sec) != words_off + 2 * n_words:
        raise _fail(f"RANS section is {len(sec)} bytes, {n_words} words need {words_off + 2 * n_words}")
    words = struct.unpack_from(f"<{n_words}H", sec, words_off)
    cum = [0] * 257
    for s in range(256):
        cum[s + 1] = cum[s] + freq[s]
    slot_symbol = bytearray(_RANS_SCALE)
    for s in present:
        slot_symbol[cum[s] : cum[s + 1]] = bytes([s]) * freq[s]
    # Symbol i belongs to lane i % 32; lanes are visited in element order, so the word stream is read
    # step by step and, inside a step, by ascending lane.
    out = bytearray(n)
    pos = 0
    mask = _RANS_SCALE - 1
    for i in range(n):
        lane = i & (_RANS_LANES - 1)
        x = state[lane]
        s = slot_symbol[x & mask]
        out[i] = s
        x = freq[s] * (x >> _RANS_SCALE_BITS) + (x & mask) - cum[s]
        if x < _RANS_LOW:
            if pos >= n_words:
                raise _fail("RANS word stream exhausted")
            x = (x << 16) | words[pos]
            pos += 1
        state[lane] = x
    if pos != n_words:
        raise _fail(f"RANS stream left {n_words - pos} of {n_words} words unread")
    if any(x != _RANS_LOW for x in state):
        raise _fail("RANS lane did not end in its initial state 2^16")
    return np.frombuffer(bytes(out), dtype=np.uint8), {"symbols": m, "words": n_words}


def _decode_chunk(chunk: bytes, raw_len: int, dtype: str, codec: str) -> tuple[bytes, dict[str, Any]]:
    """Decodes one stored chunk into its ``raw_len`` original bytes; returns them and a description."""
    if len(chunk) == raw_len:
        return bytes(chunk), {"stored": "raw"}
    if codec == "raw":
        raise _fail("coded chunk in a frame of codec raw")
    esize = _element_size(dtype)
    n = raw_len // esize
    widths = _stream_bits(dtype, codec)
    sections_off = _align16(_CHUNK_HEADER + _DESCRIPTOR * len(widths))
    if len(chunk) < sections_off:
        raise _fail(f"coded chunk of {len(chunk)} bytes is shorter than its header ({sections_off})")
    kind, n_streams, reserved, n_elements = struct.unpack_from("<BBHI", chunk, 0)
    if kind != _CHUNK_KIND_CODED:
        raise _fail(f"unknown chunk kind {kind}")
    if n_streams != len(widths):
        raise _fail(f"chunk has {n_streams} streams, {dtype} under codec {codec} has {len(widths)}")
    if reserved != 0:
        raise _fail("reserved chunk header field is not zero")
    if n_elements != n:
        raise _fail(f"chunk says {n_elements} elements, its size says {n}")
    _require_zero(chunk, _CHUNK_HEADER + _DESCRIPTOR * n_streams, sections_off, "chunk header")
    streams: list[np.ndarray] = []
    described: list[dict[str, Any]] = []
    cursor = sections_off
    for j, bits in enumerate(widths):
        mode, param, reserved, size = struct.unpack_from("<BBHI", chunk, _CHUNK_HEADER + _DESCRIPTOR * j)
        if reserved != 0:
            raise _fail(f"stream {j}: reserved descriptor field is not zero")
        start = _align16(cursor)
        if start > len(chunk) or size > len(chunk) - start:
            raise _fail(f"stream {j}: section [{start}, {start + size}) runs past the {len(chunk)}-byte chunk")
        _require_zero(chunk, cursor, start, f"stream {j}")
        sec = chunk[start : start + size]
        cursor = start + size
        info: dict[str, Any] = {"mode": MODES.get(mode, mode), "param": param, "bytes": size}
        if mode == 0:  # CONST
            if size != 0 or param >> bits:
                raise _fail(f"stream {j}: CONST needs 0 section bytes and a value below 2^{bits}")
            sym = np.full(n, param, dtype=np.uint8)
        elif mode == 1:
            sym = _decode_raw(sec, n, bits, param)
        elif mode == 2:
            sym, extra = _decode_lut(sec, n, bits, param)
            info.update(extra)
        elif mode == 3:
            sym, extra = _decode_rans(sec, n, bits, param)
            info.update(extra)
        else:
            raise _fail(f"stream {j}: unknown stream mode {mode}")
        streams.append(sym)
        described.append(info)
    if cursor != len(chunk):
        raise _fail(f"chunk is {len(chunk)} bytes but its sections end at {cursor}")
    return _merge(dtype, codec, streams, n), {"stored": "coded", "streams": described}


# ---------------------------------------------------------------- frame


def decode_frame(frame: bytes | bytearray | memoryview, *, verify: bool = True) -> tuple[bytes, dict[str, Any]]:
    """Decodes one tzip frame (format version 2) and verifies every digest.

    Args:
        frame: exactly one whole frame (bytes-like). Trailing bytes are an error.
        verify: check each decoded chunk against its chunk digest (default True). The header digest and the
            frame checksum over the chunk digests are always checked. False only serves tests that compare
            decoders on structurally valid frames whose digests no longer match.

    Returns:
        ``(data, info)``: ``data`` is the original tensor bytes (``info["nbytes"]`` bytes, the element layout of
        the dtype, little-endian, C order of ``info["shape"]``); ``info`` is a dict with
        ``format_version`` (int), ``dtype`` (safetensors name, str), ``codec`` ('raw' | 'fast' | 'max' | 'bytes'),
        ``shape`` (list[int]), ``nbytes``, ``chunk_size``, ``n_chunks``, ``header_bytes``, ``payload_bytes``,
        ``frame_bytes`` (ints, bytes), ``checksum`` and ``header_digest`` (XXH32 values, int), and ``chunks``: one
        dict per chunk with ``offset`` (from the payload start), ``size`` (stored bytes), ``raw_size``, ``digest``,
        ``stored`` ('raw' | 'coded') and, for coded chunks, ``streams`` (mode, param, bytes, and LUT/RANS details).

    Raises:
        ValueError: the frame is truncated, malformed, of an unsupported format version (1: pre-release, or newer
            than 2), or a digest
            does not match. The message says which field or chunk is at fault.
        TypeError: ``frame`` is not bytes-like.
    """
    if not isinstance(frame, (bytes, bytearray, memoryview)):
        raise TypeError(f"frame must be bytes-like, not {type(frame).__name__}")
    buf = bytes(frame)
    if len(buf) < _FIXED_HEADER:
        raise _fail(f"truncated: {len(buf)} bytes, the fixed header needs {_FIXED_HEADER}")
    if buf[0:4] != MAGIC:
        raise _fail(f"bad magic {buf[0:4]!r} (expected {MAGIC!r})")
    (
        version,
        dtype_code,
        codec_id,
        ndim,
        flags,
        reserved10,
        chunk_size,
        nbytes,
        payload_bytes,
        n_chunks,
        checksum,
        header_digest,
        reserved44,
    ) = struct.unpack_from("<HBBBBHIQQIIII", buf, 4)
    if version == 0:
        raise _fail("format version 0")
    if version == 1:
        raise ValueError(
            "unsupported tzip frame format version 1: pre-release version-1 frames (serial XXH32 chunk digests) are no "
            f"longer read, re-compress the original tensor (this decoder reads version {FORMAT_VERSION} only)"
        )
    if version > FORMAT_VERSION:
        raise ValueError(
            f"unsupported tzip frame format version {version}: this decoder reads version {FORMAT_VERSION} only"
        )
    if dtype_code not in DTYPES:
        raise _fail(f"unknown dtype code {dtype_code}")
    if codec_id not in CODECS:
        raise _fail(f"unknown codec id {codec_id}")
    dtype, esize = DTYPES[dtype_code]
    codec = CODECS[codec_id]
    if codec in ("fast", "max") and dtype not in _SPLIT_FLOATS:
        raise _fail(f"codec {codec} on dtype {dtype} (only BF16, F16, F32; others are recorded as bytes)")
    if ndim > _MAX_NDIM:
        raise _fail(f"ndim {ndim} above {_MAX_NDIM}")
    if flags != 0 or reserved10 != 0 or reserved44 != 0:
        raise _fail("reserved header fields are not zero")
    if not (_MIN_CHUNK <= chunk_size <= _MAX_CHUNK and chunk_size % _CHUNK_MULTIPLE == 0):
        raise _fail(f"chunk size {chunk_size} is not a multiple of 256 in [4096, 65536]")
    if n_chunks != -(-nbytes // chunk_size):
        raise _fail(f"{n_chunks} chunks, but {nbytes} bytes in chunks of {chunk_size} make {-(-nbytes // chunk_size)}")
    table_off = _align16(_FIXED_HEADER + 8 * ndim)
    header_bytes = table_off + _TABLE_ENTRY * n_chunks
    if len(buf) < table_off:
        raise _fail(f"truncated: {len(buf)} bytes, the shape needs {table_off}")
    shape = list(struct.unpack_from(f"<{ndim}Q", buf, _FIXED_HEADER))
    count = 1
    for d in shape:
        count *= d
    if count * esize != nbytes:
        raise _fail(f"shape {shape} of {dtype} is {count * esize} bytes, the header says {nbytes}")
    _require_zero(buf, _FIXED_HEADER + 8 * ndim, table_off, "header")
    if payload_bytes > nbytes:
        raise _fail(f"payload of {payload_bytes} bytes is larger than the {nbytes}-byte tensor")
    if len(buf) < header_bytes:
        raise _fail(f"truncated: {len(buf)} bytes, the chunk table needs {header_bytes}")
    digest = xxh32(buf[:40] + b"\0\0\0\0" + buf[44:header_bytes])
    if digest != header_digest:
        raise _fail(f"header digest {header_digest:08x} does not match the header ({digest:08x})")

    chunks: list[dict[str, Any]] = []
    expect_off = 0
    for i in range(n_chunks):
        off, size, stored_digest = struct.unpack_from("<QII", buf, table_off + _TABLE_ENTRY * i)
        raw_len = min(chunk_size, nbytes - i * chunk_size)
        if off != expect_off:
            raise _fail(f"chunk {i} starts at {off}, the canonical offset is {expect_off}")
        if not 1 <= size <= raw_len:
            raise _fail(f"chunk {i} stored size {size} out of range 1..{raw_len}")
        chunks.append({"offset": off, "size": size, "raw_size": raw_len, "digest": stored_digest})
        expect_off = off + size if i + 1 == n_chunks else _align16(off + size)
    if expect_off != payload_bytes:
        raise _fail(f"chunks end at {expect_off}, the header says the payload is {payload_bytes} bytes")
    digests = struct.pack(f"<{n_chunks}I", *(c["digest"] for c in chunks))
    if xxh32(digests) != checksum:
        raise _fail(f"frame checksum {checksum:08x} does not match the chunk digests ({xxh32(digests):08x})")
    frame_bytes = header_bytes + payload_bytes
    if len(buf) < frame_bytes:
        raise _fail(f"truncated: {len(buf)} of {frame_bytes} bytes")
    if len(buf) > frame_bytes:
        raise _fail(f"{len(buf) - frame_bytes} trailing bytes after the {frame_bytes}-byte frame")

    payload = buf[header_bytes:]
    out = bytearray()
    for i, c in enumerate(chunks):
        end = c["offset"] + c["size"]
        if i + 1 < n_chunks:
            _require_zero(payload, end, chunks[i + 1]["offset"], f"payload after chunk {i}")
        try:
            data, described = _decode_chunk(payload[c["offset"] : end], c["raw_size"], dtype, codec)
        except ValueError as e:
            raise ValueError(f"chunk {i}: {e}") from None
        if verify and chunk_digest(data) != c["digest"]:
            raise _fail(f"chunk {i} (bytes {i * chunk_size}..{i * chunk_size + c['raw_size']}) does not match its digest")
        c.update(described)
        out += data
    info = {
        "format_version": version,
        "dtype": dtype,
        "codec": codec,
        "shape": shape,
        "nbytes": nbytes,
        "chunk_size": chunk_size,
        "n_chunks": n_chunks,
        "header_bytes": header_bytes,
        "payload_bytes": payload_bytes,
        "frame_bytes": frame_bytes,
        "checksum": checksum,
        "header_digest": header_digest,
        "chunks": chunks,
    }
    return bytes(out), info


# ---------------------------------------------------------------- canonical encoder


def log2_fixed16(x: int) -> int:
    """log2(x) for an integer x >= 1, in 16.16 fixed point, by the integer squaring rule of docs/format.md.

    ``floor(log2 x)`` is the integer part; the 16 fraction bits come from squaring a 33-bit mantissa
    (32 fraction bits, truncated) 16 times. Exactly the C++ ``log2_fixed16``.
    """
    if x < 1:
        raise ValueError("log2_fixed16 needs x >= 1")
    ip = x.bit_length() - 1
    m = x << (32 - ip) if ip <= 32 else x >> (ip - 32)
    frac = 0
    for b in range(15, -1, -1):
        m = (m >> 16) * (m >> 16)
        if m >= 2 << 32:
            frac |= 1 << b
            m >>= 1
    return (ip << 16) | frac


def order0_cost_fixed16(counts: list[int], n: int) -> int:
    """Order-0 cost in bits, 16.16 fixed point: sum over counts c > 0 of c * (log2_fixed16(n) - log2_fixed16(c))."""
    if n == 0:
        return 0
    ln = log2_fixed16(n)
    return sum(c * (ln - log2_fixed16(c)) for c in counts if c)


def _split(raw: bytes, dtype: str, codec: str) -> list[np.ndarray]:
    """Splits whole elements into one uint8 symbol array per stream (docs/format.md, "Streams")."""
    if codec in ("fast", "max") and dtype in _SPLIT_FLOATS:
        if dtype == "BF16":
            v = np.frombuffer(raw, dtype="<u2").astype(np.uint32)
            return [((v >> 7) & 0xFF).astype(np.uint8), (((v >> 8) & 0x80) | (v & 0x7F)).astype(np.uint8)]
        if dtype == "F16":
            v = np.frombuffer(raw, dtype="<u2").astype(np.uint32)
            return [
                ((v >> 10) & 0x1F).astype(np.uint8),
                (v & 0xFF).astype(np.uint8),
                (((v >> 13) & 4) | ((v >> 8) & 3)).astype(np.uint8),
            ]
        v = np.frombuffer(raw, dtype="<u4").astype(np.uint64)
        return [
            ((v >> 23) & 0xFF).astype(np.uint8),
            (v & 0xFF).astype(np.uint8),
            ((v >> 8) & 0xFF).astype(np.uint8),
            (((v >> 24) & 0x80) | ((v >> 16) & 0x7F)).astype(np.uint8),
        ]
    w = _element_size(dtype)
    planes = np.frombuffer(raw, dtype=np.uint8).reshape(-1, w)
    return [planes[:, j].copy() for j in range(w)]


def _pack_bits(sym: np.ndarray, bits: int) -> bytes:
    """Packs symbols of ``bits`` bits LSB-first; unused high bits of the last byte are zero."""
    if bits == 8:
        return sym.astype(np.uint8).tobytes()
    fields = ((sym.astype(np.uint16)[:, None] >> np.arange(bits, dtype=np.uint16)) & 1).astype(np.uint8)
    return np.packbits(fields.reshape(-1), bitorder="little").tobytes()


def _lut_section(sym: np.ndarray, n: int, k: int, lut: list[int]) -> bytes:
    cap = (1 << k) - 1
    code_of = [cap] * 256
    for j in range(cap - 1, -1, -1):  # the lowest LUT index of a symbol is its code
        code_of[lut[j]] = j
    codes = np.array(code_of, dtype=np.uint8)[sym]
    exceptions = sym[codes == cap].tobytes()
    codes_off = _align16(4 + cap)
    packed = _pack_bits(codes, k)
    exc_off = _align16(codes_off + len(packed))
    out = bytearray(exc_off)
    struct.pack_into("<I", out, 0, len(exceptions))
    out[4 : 4 + cap] = bytes(lut)
    out[codes_off : codes_off + len(packed)] = packed
    return bytes(out) + exceptions


def _normalize_freqs(counts: list[int], n: int) -> list[int]:
    freq = [0] * 256
    best = 0
    for s in range(256):
        if counts[s]:
            freq[s] = max(1, counts[s] * _RANS_SCALE // n)
            if counts[s] > counts[best]:
                best = s
    total = sum(freq)
    if total < _RANS_SCALE:
        freq[best] += _RANS_SCALE - total
    while total > _RANS_SCALE:
        top = max(range(256), key=lambda s: (freq[s], -s))  # largest frequency, lowest symbol on ties
        take = min(total - _RANS_SCALE, freq[top] - 1)
        freq[top] -= take
        total -= take
    return freq


def _rans_section(sym: np.ndarray, n: int, counts: list[int]) -> bytes:
    freq = _normalize_freqs(counts, n)
    cum = [0] * 257
    for s in range(256):
        cum[s + 1] = cum[s] + freq[s]
    state = [_RANS_LOW] * _RANS_LANES
    blocks: list[list[int]] = []
    symbols = sym.tolist()
    steps = -(-n // _RANS_LANES)
    for g in range(steps - 1, -1, -1):  # encode backwards: last step first
        block = []
        for lane in range(min(_RANS_LANES, n - g * _RANS_LANES)):
            s = symbols[g * _RANS_LANES + lane]
            f, x = freq[s], state[lane]
            if x >= f << 20:  # renormalise: x_max = ((L >> 12) << 16) * f
                block.append(x & 0xFFFF)
                x >>= 16
            state[lane] = ((x // f) << _RANS_SCALE_BITS) + (x % f) + cum[s]
        blocks.append(block)
    words = [w for block in reversed(blocks) for w in block]
    present = [s for s in range(256) if freq[s]]
    bitmap = bytearray(_RANS_BITMAP)
    for s in present:
        bitmap[s >> 3] |= 1 << (s & 7)
    out = bytearray(bitmap) + struct.pack(f"<{len(present)}H", *(freq[s] for s in present))
    out += bytes(-len(out) % 4)
    out += struct.pack(f"<{_RANS_LANES}I", *state) + struct.pack("<I", len(words))
    out += bytes(-len(out) % 16)
    return bytes(out) + struct.pack(f"<{len(words)}H", *words)


def _encode_chunk(raw: bytes, dtype: str, codec: str) -> bytes:
    """Canonical stored form of one chunk: its coded form, or ``raw`` itself when coding does not pay."""
    if codec == "raw":
        return raw
    n = len(raw) // _element_size(dtype)
    widths = _stream_bits(dtype, codec)
    plans: list[tuple[int, int, bytes]] = []  # (mode, param, section)
    for j, (bits, sym) in enumerate(zip(widths, _split(raw, dtype, codec))):
        lut_ok = codec in ("max", "bytes") or (codec == "fast" and j == 0)
        rans_ok = codec in ("max", "bytes")
        counts = np.bincount(sym, minlength=256).tolist()
        present = sum(1 for c in counts if c)
        if present == 1:
            plans.append((0, int(sym[0]), b""))
            continue
        best = (1, 0, _pack_bits(sym, bits))
        if lut_ok:
            order = sorted((s for s in range(256) if counts[s]), key=lambda s: (-counts[s], s))
            best_k, best_bytes = 0, None
            for k in range(1, bits):
                cap = (1 << k) - 1
                covered = sum(counts[s] for s in order[:cap])
                size = _align16(_align16(4 + cap) + _packed_bytes(n, k)) + (n - covered)
                if best_bytes is None or size < best_bytes:
                    best_k, best_bytes = k, size
            if best_bytes is not None and best_bytes < len(best[2]):
                cap = (1 << best_k) - 1
                lut = [order[j] if j < len(order) else 0 for j in range(cap)]
                best = (2, best_k, _lut_section(sym, n, best_k, lut))
        if rans_ok:
            table = _align16(((_RANS_BITMAP + 2 * present + 3) & ~3) + 4 * _RANS_LANES + 4)
            estimate = ((order0_cost_fixed16(counts, n) >> 16) + 7) // 8 + table
            if estimate < len(best[2]):
                sec = _rans_section(sym, n, counts)
                if len(sec) < len(best[2]):
                    best = (3, 0, sec)
        plans.append(best)
    head = bytearray(_align16(_CHUNK_HEADER + _DESCRIPTOR * len(widths)))
    struct.pack_into("<BBHI", head, 0, _CHUNK_KIND_CODED, len(widths), 0, n)
    body = bytearray()
    for j, (mode, param, sec) in enumerate(plans):
        struct.pack_into("<BBHI", head, _CHUNK_HEADER + _DESCRIPTOR * j, mode, param, 0, len(sec))
        body += bytes(_align16(len(head) + len(body)) - len(head) - len(body)) + sec
    coded = bytes(head + body)
    return raw if _align16(len(coded)) >= len(raw) else coded


def _resolve_auto(data: bytes, dtype: str) -> str:
    if dtype not in _SPLIT_FLOATS:
        return "bytes"
    n = len(data) // _element_size(dtype)
    if n == 0:
        return "fast"
    exponent = _split(data, dtype, "fast")[0]
    counts = np.bincount(exponent, minlength=256).tolist()
    w = _FLOAT_STREAM_BITS[dtype][0]
    ranked = sorted(counts, reverse=True)
    fast_bits = w * n
    for k in range(1, w):
        covered = sum(ranked[: (1 << k) - 1])
        fast_bits = min(fast_bits, k * n + 8 * (n - covered))
    max_bits = order0_cost_fixed16(counts, n) >> 16
    return "max" if fast_bits > max_bits and (fast_bits - max_bits) * 100 >= 2 * 8 * len(data) else "fast"


def encode_frame(
    data: bytes | bytearray | memoryview,
    dtype: str,
    shape: list[int] | tuple[int, ...],
    codec: str = "auto",
    chunk_size: int = 65536,
) -> bytes:
    """Canonical encoder: the frame a conforming tzip encoder writes for these bytes and options.

    Args:
        data: the tensor's bytes, ``prod(shape) * element size`` of them (little-endian elements, C order).
        dtype: safetensors dtype name (``DTYPES``).
        shape: dimensions (at most 32; 0 allowed).
        codec: 'auto' | 'fast' | 'max' | 'bytes' | 'raw'; 'fast'/'max' on a non-float dtype is recorded as 'bytes'.
        chunk_size: bytes of input per chunk, a multiple of 256 in [4096, 65536].

    Returns:
        The frame (``<= max_compressed_size(len(data), len(shape), chunk_size)`` bytes). Slow (pure Python rANS);
        meant for tests and small tensors.

    Raises:
        ValueError: unknown dtype or codec, bad chunk size, more than 32 dimensions, or a size that does not
            match the shape.
    """
    data = bytes(data)
    codes = {name: (code, size) for code, (name, size) in DTYPES.items()}
    if dtype not in codes:
        raise ValueError(f"unknown dtype {dtype!r}")
    dtype_code, esize = codes[dtype]
    if codec not in ("auto", "fast", "max", "bytes", "raw"):
        raise ValueError(f"unknown codec {codec!r}")
    if not (_MIN_CHUNK <= chunk_size <= _MAX_CHUNK and chunk_size % _CHUNK_MULTIPLE == 0):
        raise ValueError(f"chunk size {chunk_size} is not a multiple of 256 in [4096, 65536]")
    if len(shape) > _MAX_NDIM:
        raise ValueError(f"at most 32 dimensions, got {len(shape)}")
    count = 1
    for d in shape:
        if d < 0:
            raise ValueError("negative dimension")
        count *= d
    if count * esize != len(data):
        raise ValueError(f"{len(data)} bytes do not match shape {list(shape)} of {dtype}")
    if codec == "auto":
        codec = _resolve_auto(data, dtype)
    if codec in ("fast", "max") and dtype not in _SPLIT_FLOATS:
        codec = "bytes"
    n_chunks = -(-len(data) // chunk_size)
    if n_chunks >= 1 << 32:
        raise ValueError("tensor too large for one frame")
    table = bytearray()
    payload = bytearray()
    digests = []
    for i in range(n_chunks):
        raw = data[i * chunk_size : (i + 1) * chunk_size]
        stored = _encode_chunk(raw, dtype, codec)
        digests.append(chunk_digest(raw))
        table += struct.pack("<QII", len(payload), len(stored), digests[-1])
        payload += stored
        if i + 1 < n_chunks:
            payload += bytes(-len(payload) % 16)
    header = bytearray(_align16(_FIXED_HEADER + 8 * len(shape)))
    checksum = xxh32(struct.pack(f"<{n_chunks}I", *digests))
    struct.pack_into(
        "<4sHBBBBHIQQIIII", header, 0, MAGIC, FORMAT_VERSION, dtype_code, list(CODECS.values()).index(codec),
        len(shape), 0, 0, chunk_size, len(data), len(payload), n_chunks, checksum, 0, 0,
    )
    struct.pack_into(f"<{len(shape)}Q", header, _FIXED_HEADER, *shape)
    head = header + table
    struct.pack_into("<I", head, 40, xxh32(head))
    return bytes(head + payload)
