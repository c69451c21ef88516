"""The client's own frame code (tzip._frame, tzip._xxh32), used when the daemon is away: its raw frames must be
the codec's frames byte for byte (format version 2, 32-lane chunk digests), and its reader must refuse what the
codec refuses. Checked against the golden vectors and the independent reference (tzip.reference). No daemon."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from tzip import _frame, _xxh32
from tzip import reference as ref

GOLDEN = Path(__file__).resolve().parents[2] / "test" / "golden"
MANIFEST = json.loads((GOLDEN / "manifest.json").read_text())


def test_format_version_is_2() -> None:
    assert _frame.FORMAT_VERSION == ref.FORMAT_VERSION == MANIFEST["formatVersion"] == 2


def test_chunk_digest_published_vectors() -> None:
    for v in MANIFEST["chunkDigests"]["vectors"]:
        data = bytes((31 * i + 7) % 256 for i in range(v["length"]))
        want = int(v["digest"], 16)
        assert _xxh32.chunk_digest(data) == want, v
        assert _xxh32.chunk_digest(np.frombuffer(data, dtype=np.uint8)) == want, v
        assert _xxh32.chunk_digests(np.frombuffer(data, dtype=np.uint8), 65536) == ([want] if data else [])


@pytest.mark.parametrize("chunk", [4096, 4352, 65536])
def test_chunk_digests_match_the_reference(chunk: int) -> None:
    rng = np.random.default_rng(chunk)
    data = rng.integers(0, 256, 3 * chunk + 1000, dtype=np.uint8)
    for n in (0, 1, 15, 16, 17, 511, 512, 513, 1040, chunk - 1, chunk, chunk + 1, 2 * chunk + 700, len(data) - 1):
        for off in (0, 1):  # the fast path also works on unaligned views
            piece = data[off : off + n]
            want = [ref.chunk_digest(piece[i : i + chunk].tobytes()) for i in range(0, n, chunk)]
            assert _xxh32.chunk_digests(piece, chunk) == want, (n, off)


@pytest.mark.parametrize("name", [v["name"] for v in MANIFEST["vectors"] if v["codec"] == "raw"] + ["u8_33_bytes"])
def test_encode_raw_is_the_codec_raw_frame(name: str) -> None:
    v = next(v for v in MANIFEST["vectors"] if v["name"] == name)
    data = (GOLDEN / v["input"]).read_bytes()
    frame = _frame.encode_raw(torch.frombuffer(bytearray(data), dtype=torch.uint8), v["dtype"], v["shape"])
    want = ref.encode_frame(data, v["dtype"], v["shape"], "raw")
    assert frame.numpy().tobytes() == want
    if v["codec"] == "raw":
        assert want == (GOLDEN / v["frame"]).read_bytes()


@pytest.mark.parametrize(("n", "chunk"), [(0, 65536), (1, 4096), (5000, 4096), (9000, 4352), (70000, 65536)])
def test_encode_raw_round_trip(n: int, chunk: int) -> None:
    data = torch.from_numpy(np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8))
    frame = _frame.encode_raw(data, "U8", [n], chunk)
    assert frame.numpy().tobytes() == ref.encode_frame(data.numpy().tobytes(), "U8", [n], "raw", chunk)
    header = _frame.read_header(frame)
    assert (header.nbytes, header.chunk_size, header.frame_bytes) == (n, chunk, frame.numel())
    assert torch.equal(_frame.decode_raw(frame, header), data)
    if n:  # a changed data byte is caught by its chunk digest
        bad = frame.clone()
        bad[header.header_bytes + n // 2] ^= 1
        with pytest.raises(ValueError, match="digest"):
            _frame.decode_raw(bad, _frame.read_header(bad))


def _with_version(frame: bytes, version: int) -> bytes:
    f = bytearray(frame)
    struct.pack_into("<H", f, 4, version)
    n_chunks = struct.unpack_from("<I", f, 32)[0]
    header_bytes = ((48 + 8 * f[8] + 15) & ~15) + 16 * n_chunks
    struct.pack_into("<I", f, 40, 0)
    struct.pack_into("<I", f, 40, ref.xxh32(bytes(f[:header_bytes])))
    return bytes(f)


def test_read_header_refuses_version_1_and_others() -> None:
    frame = (GOLDEN / "weights_bf16_raw.tzf").read_bytes()
    assert _frame.read_header(frame).nbytes == 4096
    with pytest.raises(ValueError, match="version 1.*pre-release.*re-compress"):
        _frame.read_header(_with_version(frame, 1))
    for version in (0, 3):
        with pytest.raises(ValueError, match=f"format version {version}"):
            _frame.read_header(_with_version(frame, version))


def _code(fn) -> str:
    with pytest.raises(_frame.FrameError) as e:
        fn()
    return e.value.code


def test_refusals_carry_the_native_decoders_codes() -> None:
    """Each refusal's code is the one cuda/src/core/frame.cpp gives the same frame (src/errors.json): short is
    TZIP_TRUNCATED, a changed data byte TZIP_CHECKSUM, another version TZIP_UNSUPPORTED, a bad header TZIP_CORRUPT."""
    frame = (GOLDEN / "weights_bf16_raw.tzf").read_bytes()
    t = torch.frombuffer(bytearray(frame), dtype=torch.uint8)
    h = _frame.read_header(frame)
    assert _code(lambda: _frame.read_header(frame[:47])) == "TZIP_TRUNCATED"
    assert _code(lambda: _frame.read_header(frame[: h.header_bytes - 1])) == "TZIP_TRUNCATED"
    assert _code(lambda: _frame.decode_raw(t[:-1], h)) == "TZIP_TRUNCATED"
    assert _code(lambda: _frame.read_header(b"XXXX" + frame[4:])) == "TZIP_CORRUPT"
    assert _code(lambda: _frame.read_header(_with_version(frame, 3))) == "TZIP_UNSUPPORTED"
    assert _code(lambda: _frame.read_header(_with_version(frame, 1))) == "TZIP_UNSUPPORTED"
    flipped = bytearray(frame)
    flipped[12] ^= 1  # the chunk size field: the header digest no longer matches
    assert _code(lambda: _frame.read_header(bytes(flipped))) == "TZIP_CORRUPT"
    data = t.clone()
    data[h.header_bytes + 5] ^= 1
    assert _code(lambda: _frame.decode_raw(data, _frame.read_header(data))) == "TZIP_CHECKSUM"
