"""tzip.files: .tzip files written and read in this process (libtzip.so), CPU and GPU.

compress_file writes the bytes the real CLI (`tzip compress`) writes, for every codec; load_file gives what
safetensors.torch.load_file gives for the original, compared by bytes, on the CPU and (skipped with the reason without
one) on a GPU, through several copy-and-decode batches; a damaged frame is refused naming the file and the tensor.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from tzip import _native
from tzip._container import ContainerError, ContainerReader
from tzip.files import compress_file, load_file

ROOT = Path(__file__).resolve().parents[2]
MAIN = ROOT / "dist" / "src" / "cli" / "main.js"
SRC = ROOT / "data" / "demo" / "minilm-weights-bf16.safetensors"
CUDA = torch.cuda.is_available() and _native.available() and _native.library().tzip_gpu_count() > 0
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not CUDA, reason="no CUDA GPU visible to PyTorch and libtzip.so: the GPU side is tested on a GPU host"))]
needs_src = pytest.mark.skipif(not SRC.is_file(), reason=f"{SRC} is missing: python -m tzip.demo_data --out data/demo")


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    bytes_of = lambda t: t.detach().contiguous().cpu().reshape(-1).view(torch.uint8)  # noqa: E731
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bytes_of(a), bytes_of(b))


@pytest.fixture(scope="module")
def tzip_file(tmp_path_factory) -> Path:
    if not SRC.is_file():
        pytest.skip(f"{SRC} is missing: python -m tzip.demo_data --out data/demo makes it")
    out = tmp_path_factory.mktemp("files") / "w.tzip"
    compress_file(SRC, out, "auto")
    return out


@needs_src
@pytest.mark.skipif(shutil.which("node") is None or not MAIN.is_file(), reason="the tzip CLI (node, dist/) is not built")
@pytest.mark.parametrize("codec", ["auto", "fast", "max", "raw"])
def test_compress_file_writes_the_cli_bytes(tmp_path, codec):
    cli_out, ours = tmp_path / "cli.tzip", tmp_path / "ours.tzip"
    r = subprocess.run(["node", str(MAIN), "compress", str(SRC), "-o", str(cli_out), "--codec", codec],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    size = compress_file(SRC, ours, codec, batch_bytes=4 << 20)
    assert size == ours.stat().st_size
    assert ours.read_bytes() == cli_out.read_bytes()


@needs_src
@pytest.mark.parametrize("device", DEVICES)
def test_gpu_and_cpu_encoders_write_the_same_file(tmp_path, device, tzip_file):
    out = tmp_path / "w.tzip"
    compress_file(SRC, out, "auto", device, batch_bytes=4 << 20)
    assert out.read_bytes() == tzip_file.read_bytes()


@pytest.mark.parametrize("device", DEVICES)
def test_load_file_equals_safetensors(tzip_file, device):
    from safetensors.torch import load_file as st_load
    ref = st_load(str(SRC))
    got = load_file(tzip_file, device, batch_bytes=4 << 20)  # several batches: both pinned buffers in use
    assert list(got) == list(ref)
    for k, v in ref.items():
        assert got[k].device.type == device and same_bits(got[k], v), k


@pytest.mark.parametrize("device", DEVICES)
def test_load_file_refuses_a_damaged_frame_naming_the_tensor(tzip_file, device, tmp_path):
    with ContainerReader(tzip_file) as r:
        e = max((e for e in r.entries if e.kind == "tensor"), key=lambda e: e.frame_bytes)
    data = bytearray(tzip_file.read_bytes())
    data[e.frame_offset + e.frame_bytes - 5] ^= 0x10  # inside the payload: only a chunk digest / the checksum see it
    bad = tmp_path / "bad.tzip"
    bad.write_bytes(bytes(data))
    with pytest.raises(ContainerError) as err:
        load_file(bad, device)
    assert err.value.code in ("TZIP_CHECKSUM", "TZIP_CORRUPT") and err.value.tensor == e.name
    data = bytearray(tzip_file.read_bytes())
    data[e.frame_offset + 16] ^= 0x01  # the frame header's nbytes: refused before anything is copied
    bad.write_bytes(bytes(data))
    with pytest.raises(ContainerError) as err:
        load_file(bad, device)
    assert err.value.tensor == e.name
