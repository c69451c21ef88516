"""The reference decoder (tzip.reference) against the golden vectors of test/golden/.

Every golden frame must decode to its golden input (sha256 from manifest.json), the canonical encoder written
from docs/format.md must reproduce every golden frame byte for byte, and malformed frames -- truncated, with a
flipped byte, of an unsupported format version, or with any header field out of range -- must raise ValueError and
never any other exception. Needs numpy and xxhash only (no torch, no native addon).
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path
from typing import Any

import pytest

from tzip import reference as ref

GOLDEN = Path(__file__).resolve().parents[2] / "test" / "golden"
MANIFEST = json.loads((GOLDEN / "manifest.json").read_text())
VECTORS: list[dict[str, Any]] = MANIFEST["vectors"]
BY_NAME = {v["name"]: v for v in VECTORS}


def frame_of(name: str) -> bytes:
    return (GOLDEN / BY_NAME[name]["frame"]).read_bytes()


def input_of(name: str) -> bytes:
    return (GOLDEN / BY_NAME[name]["input"]).read_bytes()


def sha256(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def table_offset(frame: bytes) -> int:
    return (48 + 8 * frame[8] + 15) & ~15


def header_bytes(frame: bytes) -> int:
    return table_offset(frame) + 16 * struct.unpack_from("<I", frame, 32)[0]


def reseal(frame: bytes | bytearray) -> bytes:
    """Recomputes the frame checksum and the header digest, so that a test reaches the check it aims at."""
    f = bytearray(frame)
    toff, n_chunks = table_offset(f), struct.unpack_from("<I", f, 32)[0]
    digests = b"".join(f[toff + 16 * i + 12 : toff + 16 * i + 16] for i in range(n_chunks))
    struct.pack_into("<I", f, 36, ref.xxh32(digests))
    struct.pack_into("<I", f, 40, 0)
    struct.pack_into("<I", f, 40, ref.xxh32(bytes(f[: header_bytes(f)])))
    return bytes(f)


def rejects(frame: bytes, match: str | None = None) -> str:
    """Asserts that decode_frame raises ValueError (and nothing else); returns the message."""
    with pytest.raises(ValueError, match=match) as err:
        ref.decode_frame(frame)
    return str(err.value)


# ---------------------------------------------------------------- golden frames decode


def test_manifest_is_for_format_version_2() -> None:
    assert MANIFEST["formatVersion"] == ref.FORMAT_VERSION == 2
    assert len(BY_NAME) == len(VECTORS)


@pytest.mark.parametrize("v", VECTORS, ids=[v["name"] for v in VECTORS])
def test_golden_frame_decodes_to_golden_input(v: dict[str, Any]) -> None:
    frame = (GOLDEN / v["frame"]).read_bytes()
    assert sha256(frame) == v["frameSha256"]
    data, info = ref.decode_frame(frame)
    assert sha256(data) == v["inputSha256"]
    assert data == (GOLDEN / v["input"]).read_bytes()
    assert info["dtype"] == v["dtype"]
    assert info["shape"] == v["shape"]
    assert info["codec"] == v["frameCodec"]
    assert info["nbytes"] == v["nbytes"] == len(data)
    assert info["frame_bytes"] == v["frameBytes"] == len(frame)
    assert info["chunk_size"] == v.get("chunkSize", 65536)
    assert len(frame) <= ref.max_compressed_size(v["nbytes"], len(v["shape"]), info["chunk_size"])
    if v["codec"] == "raw":  # all chunks stored raw: the bound is met exactly
        assert len(frame) == ref.max_compressed_size(v["nbytes"], len(v["shape"]), info["chunk_size"])


@pytest.mark.parametrize("v", VECTORS, ids=[v["name"] for v in VECTORS])
def test_canonical_encoder_reproduces_golden_frame(v: dict[str, Any]) -> None:
    frame = ref.encode_frame(
        (GOLDEN / v["input"]).read_bytes(), v["dtype"], v["shape"], v["codec"], v.get("chunkSize", 65536)
    )
    assert frame == (GOLDEN / v["frame"]).read_bytes()


def test_golden_vectors_cover_every_mode_and_layout() -> None:
    """The golden set exercises each stream mode, packed widths, raw chunks, multi-chunk frames and empty tensors."""
    seen: set[str] = set()
    for v in VECTORS:
        _, info = ref.decode_frame(frame_of(v["name"]))
        seen.add(f"codec:{v['codec']}:{v['dtype']}")
        if info["n_chunks"] == 0:
            seen.add("empty")
        if info["n_chunks"] >= 3 and info["chunks"][-1]["raw_size"] < info["chunk_size"]:
            seen.add("multi-chunk, short last chunk")
        for c in info["chunks"]:
            if c["stored"] == "raw":
                seen.add("raw chunk" if info["codec"] != "raw" else "raw codec")
                continue
            for j, s in enumerate(c["streams"]):
                seen.add(s["mode"])
                if s["mode"] == "RAW" and info["codec"] in ("fast", "max") and info["dtype"] == "F16" and j != 1:
                    seen.add(f"packed RAW {5 if j == 0 else 3}-bit")
                if s["mode"] == "LUT" and s["exceptions"]:
                    seen.add("LUT exceptions")
        if info["n_chunks"] > 1 and {c["stored"] for c in info["chunks"]} == {"raw", "coded"}:
            seen.add("raw and coded chunks in one frame")
    expected = {"CONST", "RAW", "LUT", "RANS", "packed RAW 5-bit", "packed RAW 3-bit", "LUT exceptions", "empty",
                "raw chunk", "raw codec", "multi-chunk, short last chunk", "raw and coded chunks in one frame"}
    expected |= {f"codec:{c}:{d}" for c in ("fast", "max", "bytes", "raw", "auto") for d in ("BF16", "F16", "F32")}
    assert expected <= seen, sorted(expected - seen)
    assert {v["dtype"] for v in VECTORS} >= {"BF16", "F16", "F32", "U8", "BOOL", "I64", "F64"}
    assert {"fast", "max"} <= {v["frameCodec"] for v in VECTORS if v["codec"] == "auto"}


class Lcg:
    """s <- s * 1664525 + 1013904223 (mod 2^32); next() returns the new state (test/golden/README.md)."""

    def __init__(self, seed: int) -> None:
        self.s = seed

    def next(self) -> int:
        self.s = (self.s * 1664525 + 1013904223) & 0xFFFFFFFF
        return self.s


def clz32(x: int) -> int:
    return 32 - x.bit_length()


def weights(dtype: str, n: int, seed: int) -> bytes:
    e0, g_max, m_bits, fmt = {"BF16": (125, 20, 7, "<H"), "F16": (14, 14, 10, "<H"), "F32": (126, 24, 23, "<I")}[dtype]
    width = 16 if fmt == "<H" else 32
    r, out = Lcg(seed), bytearray()
    for _ in range(n):
        a, b, c = r.next(), r.next(), r.next()
        exponent = e0 - min(clz32(b), g_max)
        out += struct.pack(fmt, (c >> 31) << (width - 1) | exponent << m_bits | a >> (32 - m_bits))
    return bytes(out)


def golden_inputs() -> dict[str, bytes]:
    """Every golden input rebuilt from the formula its manifest entry documents."""
    out: dict[str, bytes] = {}
    for dtype, n, seed in (("BF16", 2048, 1), ("F16", 2048, 2), ("F32", 1024, 3)):
        for codec in ("fast", "max", "bytes", "raw", "auto"):
            out[f"weights_{dtype.lower()}_{codec}"] = weights(dtype, n, seed)
    out["count_bf16_fast"] = b"".join(struct.pack("<f", float(i))[2:] for i in range(1, 17))
    out["ones_bf16_fast"] = struct.pack("<H", 0x3F80) * 64
    out["ffff_bf16_fast"] = out["ffff_bf16_max"] = b"\xff" * 2000
    for c in ("fast", "max", "auto"):
        out[f"alt01_f32_{c}"] = b"".join(struct.pack("<f", float(i % 2)) for i in range(1024))
    r = Lcg(4)
    uexp = bytearray()
    for _ in range(2048):
        a = r.next()
        uexp += struct.pack("<H", (a >> 31) << 15 | ((a >> 26) & 31) << 10 | ((a >> 24) & 3) << 8)
    for c in ("fast", "max", "auto"):
        out[f"uexp_f16_{c}"] = bytes(uexp)
    for c in ("fast", "max", "bytes"):
        out[f"multi_bf16_{c}"] = weights("BF16", 5000, 5)
    r = Lcg(6)
    mixed = bytearray()
    for _ in range(4096):
        a, b = r.next(), r.next()
        mixed.append(clz32(a | 1) + 3 * (b >> 31))
    mixed += bytes(r.next() >> 24 for _ in range(4096)) + b"\x5a" * 3808
    out["mixed_u8_bytes"] = out["mixed_u8_auto"] = bytes(mixed)
    r = Lcg(7)
    out["rans_u8_bytes"] = bytes({0: 1, 1: 2}.get(r.next() >> 27, 0) for _ in range(4096))
    out["empty_bf16_fast"] = out["empty_f32_max_2x0"] = out["empty_u8_auto"] = b""
    out["u8_33_bytes"] = bytes((i * i + 3) % 251 for i in range(33))
    out["bool_100_auto"] = bytes(int(i % 3 == 0) for i in range(100))
    out["i64_300_max"] = b"".join(struct.pack("<q", i * i - 1000) for i in range(300))
    out["f64_256_bytes"] = b"".join(struct.pack("<d", (i - 128) / 8) for i in range(256))
    out["u16_ramp_fast"] = b"".join(struct.pack("<H", i * 37 % 65536) for i in range(512))
    return out


def test_golden_inputs_follow_their_documented_formulas() -> None:
    rebuilt = golden_inputs()
    assert set(rebuilt) == set(BY_NAME)
    for name, data in rebuilt.items():
        assert sha256(data) == BY_NAME[name]["inputSha256"], name


# ---------------------------------------------------------------- rejection

SMALL = ["count_bf16_fast", "ones_bf16_fast", "bool_100_auto", "alt01_f32_max", "rans_u8_bytes", "f64_256_bytes",
         "u8_33_bytes", "empty_f32_max_2x0", "uexp_f16_fast", "i64_300_max"]
TRUNCATE = SMALL + ["mixed_u8_bytes", "multi_bf16_max"]


@pytest.mark.parametrize("name", TRUNCATE)
def test_every_truncation_is_rejected(name: str) -> None:
    frame = frame_of(name)
    for n in range(len(frame)):
        rejects(frame[:n])


@pytest.mark.parametrize("name", TRUNCATE)
def test_trailing_bytes_are_rejected(name: str) -> None:
    rejects(frame_of(name) + b"\0", "trailing")


@pytest.mark.parametrize("name", SMALL + ["multi_bf16_fast"])
def test_flipped_header_or_table_byte_is_rejected(name: str) -> None:
    frame = frame_of(name)
    for i in range(header_bytes(frame)):
        for mask in (0x01, 0x80):
            f = bytearray(frame)
            f[i] ^= mask
            rejects(bytes(f))


@pytest.mark.parametrize("name", SMALL)
def test_flipped_payload_byte_is_rejected_or_harmless(name: str) -> None:
    """A flipped payload byte raises ValueError, or -- only where the encoding has a redundancy, such as an unused
    LUT entry or a code that aliases it -- decodes to exactly the original bytes. Never wrong data, never
    another exception."""
    frame, original = frame_of(name), input_of(name)
    start = header_bytes(frame)
    harmless = 0
    for i in range(start, len(frame)):
        for mask in (0x01, 0x80):
            f = bytearray(frame)
            f[i] ^= mask
            try:
                data, _ = ref.decode_frame(bytes(f))
            except ValueError:
                continue
            assert data == original, f"byte {i} ^ {mask:#x} decoded to different bytes"
            harmless += 1
    assert harmless <= 2 * (len(frame) - start) // 4


def test_flipped_payload_bytes_in_each_region() -> None:
    frame = frame_of("multi_bf16_max")
    _, info = ref.decode_frame(frame)
    start = info["header_bytes"]
    for c in info["chunks"]:
        for where in (0, 8, 16, c["size"] // 2, c["size"] - 1):  # chunk header, descriptor, sections, last byte
            f = bytearray(frame)
            f[start + c["offset"] + where] ^= 0x10
            rejects(bytes(f))
    frame = frame_of("mixed_u8_bytes")  # chunk 0 ends unaligned: its padding must be zero
    _, info = ref.decode_frame(frame)
    c0 = info["chunks"][0]
    assert c0["size"] % 16
    f = bytearray(frame)
    f[info["header_bytes"] + c0["size"]] = 1
    rejects(bytes(f), "padding")
    f = bytearray(frame)  # a data byte of the raw-stored chunk: only the chunk digest can tell
    f[info["header_bytes"] + info["chunks"][1]["offset"] + 5] ^= 1
    rejects(bytes(f), "digest")


def test_other_versions_are_refused() -> None:
    for name in ("count_bf16_fast", "rans_u8_bytes", "empty_bf16_fast"):
        f = bytearray(frame_of(name))
        struct.pack_into("<H", f, 4, 3)
        for frame in (bytes(f), reseal(f)):
            msg = rejects(frame, "unsupported")
            assert "version 3" in msg and "version 2" in msg
        # Version 1 (pre-release, serial XXH32 chunk digests): refused as unsupported, never decoded, even when
        # the frame is otherwise well formed.
        struct.pack_into("<H", f, 4, 1)
        for frame in (bytes(f), reseal(f)):
            msg = rejects(frame, "unsupported")
            assert "version 1" in msg and "pre-release" in msg and "re-compress" in msg
    f = bytearray(frame_of("count_bf16_fast"))
    struct.pack_into("<H", f, 4, 0)
    rejects(reseal(f), "version 0")


def patch(name: str, fmt: str, offset: int, value: int) -> bytes:
    f = bytearray(frame_of(name))
    struct.pack_into(fmt, f, offset, value)
    return reseal(f)


@pytest.mark.parametrize(
    ("name", "fmt", "offset", "value", "match"),
    [
        ("count_bf16_fast", "<I", 0, 0x52465A55, "magic"),
        ("count_bf16_fast", "<B", 6, 15, "dtype"),
        ("count_bf16_fast", "<B", 7, 4, "codec id"),
        ("u8_33_bytes", "<B", 7, 1, "codec fast on dtype U8"),
        ("i64_300_max", "<B", 7, 2, "codec max on dtype I64"),
        ("count_bf16_fast", "<B", 8, 33, "ndim"),
        ("count_bf16_fast", "<B", 9, 1, "reserved"),
        ("count_bf16_fast", "<H", 10, 1, "reserved"),
        ("count_bf16_fast", "<I", 44, 1, "reserved"),
        ("count_bf16_fast", "<I", 12, 4000, "chunk size"),
        ("count_bf16_fast", "<I", 12, 65536 + 256, "chunk size"),
        ("count_bf16_fast", "<I", 12, 4096 + 16, "chunk size"),
        ("count_bf16_fast", "<Q", 16, 34, "shape"),
        ("count_bf16_fast", "<Q", 16, 65537, "chunks"),
        ("count_bf16_fast", "<Q", 16, 2**64 - 1, "chunks"),
        ("count_bf16_fast", "<I", 32, 2, "chunks"),
        ("count_bf16_fast", "<Q", 48, 17, "shape"),
        ("count_bf16_fast", "<Q", 56, 1, "padding"),
        ("ones_bf16_fast", "<Q", 24, 129, "payload"),
        ("ones_bf16_fast", "<Q", 24, 31, "payload"),
        ("multi_bf16_fast", "<Q", 64 + 16, 2880 + 1, "offset"),
        ("multi_bf16_fast", "<I", 64 + 8, 4097, "size"),
        ("multi_bf16_fast", "<I", 64 + 8, 0, "size"),
        ("empty_f32_max_2x0", "<Q", 56, 1, "shape"),
    ],
)
def test_resealed_bad_header_field_is_rejected(name: str, fmt: str, offset: int, value: int, match: str) -> None:
    rejects(patch(name, fmt, offset, value), match)


def test_digest_checks() -> None:
    f = bytearray(frame_of("ones_bf16_fast"))
    f[40] ^= 1
    rejects(bytes(f), "header digest")
    f = bytearray(frame_of("ones_bf16_fast"))
    f[36] ^= 1  # frame checksum, header digest recomputed
    f = bytearray(f)
    struct.pack_into("<I", f, 40, 0)
    struct.pack_into("<I", f, 40, ref.xxh32(bytes(f[: header_bytes(f)])))
    rejects(bytes(f), "checksum")
    f = bytearray(frame_of("ones_bf16_fast"))
    f[header_bytes(f) + 8 + 1] = 0x7E  # CONST exponent 127 -> 126: well-formed, wrong data
    rejects(bytes(f), "digest")
    data, _ = ref.decode_frame(bytes(f), verify=False)
    assert data == bytes.fromhex("003f") * 64


@pytest.mark.parametrize(
    ("name", "where", "value", "match"),
    [
        ("ones_bf16_fast", 0, b"\x02", "chunk kind"),
        ("ones_bf16_fast", 1, b"\x03", "streams"),
        ("ones_bf16_fast", 2, b"\x01", "reserved"),
        ("ones_bf16_fast", 4, b"\x3f", "elements"),
        ("ones_bf16_fast", 8, b"\x04", "unknown stream mode"),
        ("ones_bf16_fast", 10, b"\x01", "reserved"),
        ("ones_bf16_fast", 12, b"\x10", "runs past"),
        ("ones_bf16_fast", 24, b"\x01", "padding"),
        ("bool_100_auto", 9, b"\x00", "LUT code width"),
        ("bool_100_auto", 9, b"\x08", "LUT code width"),
        ("bool_100_auto", 16, b"\x01", "exceptions"),
        ("bool_100_auto", 16 + 7, b"\x01", "padding"),
        ("bool_100_auto", 16 + 16 + 24, b"\xff", "unused bits|escapes"),
        ("rans_u8_bytes", 9, b"\x01", "parameter"),
        ("rans_u8_bytes", 16, b"\x03", "sum to"),
        ("weights_f16_max", 32 + 4, b"\x01", "wider than its 5-bit stream"),
        ("rans_u8_bytes", 16 + 32, b"\x00\x10", "out of range"),
        ("rans_u8_bytes", 16 + 38, b"\x01", "padding"),
        ("rans_u8_bytes", 16 + 40 + 2, b"\x00\x00", "below 2\\^16"),
        ("rans_u8_bytes", 16 + 168, b"\x57", "words need"),
        ("rans_u8_bytes", 16 + 172, b"\x01", "padding"),
        ("rans_u8_bytes", 16 + 176, b"\x00\x00\x00\x00", "RANS|digest"),
        ("uexp_f16_fast", 9, b"\x01", "RAW stream with parameter"),
        ("uexp_f16_fast", 20, b"\x01", "CONST"),
    ],
)
def test_bad_chunk_field_is_rejected(name: str, where: int, value: bytes, match: str) -> None:
    """Chunk fields set out of range at byte ``where`` of chunk 0 (the frame's digests still describe the original)."""
    frame = bytearray(frame_of(name))
    start = header_bytes(frame) + where
    assert frame[start : start + len(value)] != value, "the patch must change the frame"
    frame[start : start + len(value)] = value
    rejects(bytes(frame), match)


def test_not_bytes_is_a_type_error() -> None:
    with pytest.raises(TypeError):
        ref.decode_frame("TZFR")  # type: ignore[arg-type]


# ---------------------------------------------------------------- helpers of the spec


def test_xxh32_known_values() -> None:
    assert ref.xxh32(b"") == 0x02CC5D05
    assert ref.xxh32(b"abc") == 0x32D153FF
    assert ref.xxh32(memoryview(b"abc")) == 0x32D153FF


#: docs/format.md, section 9: chunk digests of the pattern byte i = (31*i + 7) mod 256.
DIGEST_VECTORS = {0: 0x74AFA0FA, 1: 0x34421E72, 16: 0xF838C2E9, 17: 0x7EFB1FFD, 512: 0xDB7FC382, 513: 0x4BAB301E,
                  4096: 0xD35D33D1, 65536: 0x4FBB03E1}


def digest_pattern(n: int) -> bytes:
    return bytes((31 * i + 7) % 256 for i in range(n))


def test_chunk_digest_vectors() -> None:
    """The published vectors, the ones make_golden computed with the C++ chunk_digest, and the reference agree."""
    published = MANIFEST["chunkDigests"]
    assert published["pattern"] == "byte i = (31*i + 7) mod 256"
    assert {v["length"]: int(v["digest"], 16) for v in published["vectors"]} == DIGEST_VECTORS
    for n, digest in DIGEST_VECTORS.items():
        assert ref.chunk_digest(digest_pattern(n)) == digest, n


def test_chunk_digest_by_hand() -> None:
    """17 bytes: lane 0 holds bytes 0..15, lane 1 byte 16, lanes 2..31 nothing (XXH32 of b"")."""
    b = digest_pattern(17)
    lanes = [ref.xxh32(b[:16]), ref.xxh32(b[16:])] + [0x02CC5D05] * 30
    assert ref.chunk_digest(b) == ref.xxh32(struct.pack("<32I", *lanes)) == DIGEST_VECTORS[17]
    # 1040 bytes = 65 stripes: lane 0 holds stripes 0, 32 and 64 (bytes 0..15, 512..527, 1024..1039), lane 1
    # stripes 1 and 33, ...
    b = bytes(range(256)) * 4 + bytes(16)
    lanes = [ref.xxh32(b"".join(b[16 * s : 16 * s + 16] for s in range(lane, 65, 32))) for lane in range(32)]
    assert ref.chunk_digest(b) == ref.xxh32(struct.pack("<32I", *lanes))
    assert ref.chunk_digest(b) != ref.xxh32(b)
    assert ref.chunk_digest(b"") == ref.chunk_digest(memoryview(b"")) == 0x74AFA0FA


def test_golden_chunk_table_holds_chunk_digests() -> None:
    for v in VECTORS:
        frame, data = frame_of(v["name"]), input_of(v["name"])
        _, info = ref.decode_frame(frame)
        cs = info["chunk_size"]
        want = [ref.chunk_digest(data[i : i + cs]) for i in range(0, len(data), cs)]
        assert [c["digest"] for c in info["chunks"]] == want


def test_max_compressed_size() -> None:
    assert ref.max_compressed_size(0, 0) == 48
    assert ref.max_compressed_size(0, 1) == 64
    assert ref.max_compressed_size(32, 1) == 64 + 16 + 32
    assert ref.max_compressed_size(10000, 1, 4096) == 64 + 48 + 10000
    assert ref.max_compressed_size(2**40, 32, 65536) == 304 + 16 * 2**24 + 2**40
    with pytest.raises(ValueError):
        ref.max_compressed_size(1, 33)
    with pytest.raises(ValueError):
        ref.max_compressed_size(1, 1, 1000)


def test_log2_fixed16_values() -> None:
    assert [ref.log2_fixed16(x) for x in (1, 2, 3, 100, 4096, 5000)] == [0, 65536, 103872, 435411, 786432, 805287]
    with pytest.raises(ValueError):
        ref.log2_fixed16(0)


def test_encoder_round_trips_odd_inputs() -> None:
    cases = [
        (bytes(range(256)) * 40, "U8", [10240], "auto", 4096),
        (bytes(4) * 3000, "F32", [3000], "max", 4096),
        (bytes([0x80, 0x3F]) * 2050 + bytes([1, 2]), "BF16", [2051], "fast", 4096),
        (bytes(range(7)) * 6, "I16", [3, 7], "fast", 65536),
    ]
    for data, dtype, shape, codec, chunk in cases:
        frame = ref.encode_frame(data, dtype, shape, codec, chunk)
        out, info = ref.decode_frame(frame)
        assert out == data
        assert len(frame) <= ref.max_compressed_size(len(data), len(shape), chunk)
    with pytest.raises(ValueError):
        ref.encode_frame(b"\0" * 3, "BF16", [2])
    with pytest.raises(ValueError):
        ref.encode_frame(b"", "BF16", [0], chunk_size=1000)
