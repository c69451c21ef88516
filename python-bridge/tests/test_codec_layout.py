"""One tensor, one codec layout (issue 36, item 5b): `tzip compress`, tzip.save / tzip.files.compress_file and
Client.compress give a tensor the same codec dtype and shape (docs/container.md, "Entries"), so `auto` makes the same
choice for it; complex64 is float32 pairs (shape + [2]) everywhere. Files written before that (C64 in U8 frames,
test/golden/containers/legacy_c64.tzip) still decompress, verify and load bit for bit.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import warnings
from pathlib import Path

import pytest
import torch

import tzip.client as tz
from tzip._container import ContainerReader, codec_layout, decode_entries, safetensors_layout
from tzip._dlpack import frame_layout_of, int_alias
from tzip._frame import read_header
from tzip.files import compress_file, load_file
from tzip.saving import load, save

from test_client_support import ALL_DTYPES, MAIN, NODE, ROOT, shared_daemon  # noqa: F401  (fixture)

LEGACY = ROOT / "test" / "golden" / "containers" / "legacy_c64.tzip"
LEGACY_INPUT = LEGACY.with_suffix(".safetensors")
needs_cli = pytest.mark.skipif(shutil.which(NODE) is None or not MAIN.is_file(), reason="the tzip CLI (node, dist/) is not built")
#: Dtypes safetensors has no name for whose frame the client makes float pairs: tzip.save stores them as U8 bytes (the
#: only way a safetensors reader, and `tzip compress`, can see them), so the container codes those bytes.
STORED_AS_BYTES_BUT_PAIRS_IN_CLIENT = {torch.complex32, torch.complex128}


@pytest.fixture(scope="module")
def client(shared_daemon):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning: the daemon is there
        c = tz.connect(shared_daemon.socket, spawn=False, strict=True)
    yield c
    c.close()


def bits(t: torch.Tensor) -> bytes:
    return int_alias(t.detach().cpu().contiguous()).numpy().tobytes()


def sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def c64(*shape: int, seed: int = 0) -> torch.Tensor:
    """A complex64 tensor with weight-like parts (small values of varied exponents, as trained weights have)."""
    g = torch.Generator().manual_seed(seed)
    return torch.complex(torch.randn(shape, generator=g) * 0.05, torch.randn(shape, generator=g) * 0.01)


def complex_file(path: Path) -> dict[str, torch.Tensor]:
    """A safetensors file (the `safetensors` package's writer) with C64 tensors among others."""
    from safetensors.torch import save_file
    tensors = {"c64.w": c64(64, 48), "c64.scalar": c64(seed=1).reshape(()), "c64.empty": c64(0, 3),
               "c64.deep": c64(*([1] * 31), 3, seed=2), "f32": torch.randn(100) * 0.1, "u8": torch.arange(5, dtype=torch.uint8)}
    save_file(tensors, str(path))
    return tensors


SHAPES = [(), (0, 3), (7, 13), (1,) * 31 + (3,), (1,) * 32 + (3,)]


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_the_container_rule_is_the_clients_for_every_dtype(dtype):
    """The codec layout a tensor gets in a container (stored under safetensors_layout, coded under codec_layout, the
    rule `tzip compress` shares) equals the frame layout Client.compress gets from the daemon (frame_layout_of)."""
    for shape in SHAPES:
        st, fshape, nbytes = safetensors_layout(dtype, shape)
        container = codec_layout(st, fshape, nbytes)
        client = frame_layout_of(dtype, shape)
        if dtype in STORED_AS_BYTES_BUT_PAIRS_IN_CLIENT:
            parts = {torch.complex32: "F16", torch.complex128: "F64"}[dtype]
            assert container == ("U8", [nbytes]) and client[0] == parts, (shape, container, client)
            continue
        assert container == client, (shape, container, client)
    if dtype == torch.complex64:
        assert codec_layout(*safetensors_layout(dtype, (4, 5))[:2], 160) == ("F32", [4, 5, 2])


def test_client_compress_frames_complex64_as_the_container_does(client, tmp_path):
    """Client.compress's frame of a complex64 tensor records F32 [..., 2], and is the frame tzip.save writes."""
    t = c64(64, 48)
    ct = client.compress(t, codec="auto")
    h = read_header(ct.payload)
    assert (h.dtype, list(h.shape)) == ("F32", [64, 48, 2])
    assert h.codec != "bytes"
    save({"t": t}, tmp_path / "s.tzip", codec="auto", client=client)
    with ContainerReader(tmp_path / "s.tzip") as r:
        e = r.entry("t")
        assert (e.file_dtype, e.dtype, list(e.shape)) == ("C64", "F32", [64, 48, 2])
        assert bytes(r.read_frame(e).numpy()) == bytes(ct.payload.numpy())
        # the frame's own view of the tensor: float32 pairs, bit for bit
        (_, flat), = decode_entries(r, [e], client)
        assert flat.dtype == torch.float32 and bits(flat) == bits(torch.view_as_real(t))


@needs_cli
@pytest.mark.parametrize("codec", ["auto", "fast", "max", "bytes", "raw"])
def test_cli_and_python_write_the_same_file_with_complex64(tmp_path, codec, client):
    src = tmp_path / "c.safetensors"
    tensors = complex_file(src)
    cli_out, ours = tmp_path / "cli.tzip", tmp_path / "ours.tzip"
    r = subprocess.run([NODE, str(MAIN), "compress", str(src), "-o", str(cli_out), "--codec", codec],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    compress_file(src, ours, codec)
    assert ours.read_bytes() == cli_out.read_bytes()
    with ContainerReader(ours) as rd:
        for name, shape in [("c64.w", [64, 48, 2]), ("c64.scalar", [2]), ("c64.empty", [0, 3, 2]), ("c64.deep", [6])]:
            h = read_header(rd.read_frame(rd.entry(name)))
            assert (h.dtype, list(h.shape)) == ("F32", shape), name
        if codec == "auto":
            # auto chooses for C64 what it chooses for the same tensor from the client (not 'bytes')
            h = read_header(rd.read_frame(rd.entry("c64.w")))
            assert h.codec == read_header(client.compress(tensors["c64.w"], codec="auto").payload).codec != "bytes"
    restored = tmp_path / "back.safetensors"
    r = subprocess.run([NODE, str(MAIN), "decompress", str(ours), "-o", str(restored)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert sha(restored) == sha(src)
    got = load_file(ours, "cpu")
    for name, t in tensors.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape and bits(got[name]) == bits(t), name


@needs_cli
def test_cli_and_python_agree_on_a_complex64_tensor_at_an_odd_offset(tmp_path):
    """Safetensors offsets need not be multiples of the element size (other writers than the `safetensors` package):
    a C64 tensor after a 3-byte one is still coded as F32 pairs, by both, to the same bytes."""
    from tzip._container import encode_safetensors_header
    t = c64(16, 16, seed=5)
    header, spans = encode_safetensors_header([("u8", "U8", [3], 3), ("c", "C64", [16, 16], t.numel() * 8)])
    assert spans[1][0] == 3
    src = tmp_path / "odd.safetensors"
    src.write_bytes(header + b"\x01\x02\x03" + bits(t))
    cli_out, ours = tmp_path / "cli.tzip", tmp_path / "ours.tzip"
    r = subprocess.run([NODE, str(MAIN), "compress", str(src), "-o", str(cli_out)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    compress_file(src, ours, "auto")
    assert ours.read_bytes() == cli_out.read_bytes()
    with ContainerReader(ours) as rd:
        h = read_header(rd.read_frame(rd.entry("c")))
        assert (h.dtype, list(h.shape)) == ("F32", [16, 16, 2])
    assert bits(load_file(ours, "cpu")["c"]) == bits(t)


@needs_cli
def test_tzip_save_of_complex64_is_what_the_cli_writes_for_its_safetensors_file(tmp_path, client):
    """tzip.save's container and `tzip compress` of the safetensors file it holds are one file, byte for byte."""
    state = {"a": c64(40, 40), "b": c64(3, seed=4), "r": torch.randn(9)}
    saved = tmp_path / "s.tzip"
    save(state, saved, codec="auto", client=client)
    plain, again = tmp_path / "s.safetensors", tmp_path / "again.tzip"
    for args in (["decompress", str(saved), "-o", str(plain)], ["compress", str(plain), "-o", str(again), "--codec", "auto"]):
        r = subprocess.run([NODE, str(MAIN), *args], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
    assert again.read_bytes() == saved.read_bytes()
    back = load(saved, client=client)
    assert all(bits(back[k]) == bits(v) and back[k].dtype == v.dtype for k, v in state.items())


@needs_cli
def test_legacy_complex64_file_still_decompresses_verifies_and_loads(tmp_path, client):
    """test/golden/containers/legacy_c64.tzip: C64 and a 33-dim tensor in U8 frames, as `tzip compress` wrote them
    before issue 36."""
    from safetensors.torch import load_file as st_load
    assert sha(LEGACY) == "db0cc58addbcd45f2f1c7d56eeacb47e10b6307b8970e1a037cd3b90b750549f"
    restored = tmp_path / "legacy.safetensors"
    for args in (["decompress", str(LEGACY), "-o", str(restored)], ["verify", str(LEGACY)]):
        r = subprocess.run([NODE, str(MAIN), *args], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
    assert sha(restored) == sha(LEGACY_INPUT)
    ref = st_load(str(LEGACY_INPUT))
    for got in (load_file(LEGACY, "cpu"), load(LEGACY, client=client)):
        assert list(got) == list(ref)
        for k, v in ref.items():
            assert got[k].dtype == v.dtype and got[k].shape == v.shape and bits(got[k]) == bits(v), k
    with ContainerReader(LEGACY) as r:
        e = r.entry("c64.weight")
        h = read_header(r.read_frame(e))
        assert (e.dtype, list(e.shape), h.dtype, list(h.shape)) == ("F32", [8, 8, 2], "U8", [512])
        # decoded into a caller's tensor of the entry's layout, as the DCP reader does
        out = torch.full((8, 8, 2), float("nan"))
        (_, t), = decode_entries(r, [e], client, out=lambda _: out)
        assert t.data_ptr() == out.data_ptr() and bits(out) == bits(torch.view_as_real(ref["c64.weight"]))
    inspect = json.loads(subprocess.run([NODE, str(MAIN), "inspect", "--json", str(LEGACY)], capture_output=True,
                                        text=True, timeout=300, check=True).stdout)
    rows = {e["name"]: e for e in inspect["entries"]}
    assert (rows["c64.weight"]["codecDtype"], rows["c64.weight"]["codec"]) == ("U8", "bytes")


def test_a_u8_frame_is_refused_for_a_tensor_that_never_had_that_layout(tmp_path):
    """The earlier layout is accepted for the tensors it was written for (C64, more than 32 dimensions), and only
    there, with their byte count: the frame check (_check_frame, shared by ContainerReader and ContainerWriter)
    refuses a U8 frame of an F32 tensor's bytes."""
    import os

    from tzip._container import ContainerError, ContainerWriter, encode_safetensors_header, frame_layout_fits
    from tzip._frame import encode_raw
    header, _ = encode_safetensors_header([("c", "C64", [4], 32), ("f", "F32", [8], 32)])
    fd = os.open(tmp_path / "x.tzip", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        w = ContainerWriter(fd, header, 64, tmp_path / "x.tzip")
        c, f = w.entries
        assert frame_layout_fits(c, "U8", [32]) and frame_layout_fits(c, "F32", [4, 2])
        assert not frame_layout_fits(c, "U8", [31]) and not frame_layout_fits(c, "F32", [8])
        assert frame_layout_fits(f, "F32", [8]) and not frame_layout_fits(f, "U8", [32])
        data = torch.arange(32, dtype=torch.uint8)
        w.write_frame(encode_raw(data, "U8", [32]))  # the C64 tensor in the earlier layout: accepted
        with pytest.raises(ContainerError) as err:
            w.write_frame(encode_raw(data, "U8", [32]))
        assert err.value.code == "TZIP_CORRUPT" and err.value.tensor == "f" and "frame dtype U8" in str(err.value)
    finally:
        os.close(fd)
