"""The in-process codec library (libtzip.so through tzip._native): the golden frames byte for byte, every frame
decoding to its input, hostile frames refused with the error table's codes, and on a GPU the same bytes from the GPU
encoder and decoder (skipped with the reason without one).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tzip import _native
from tzip._native import NativeCodecError

GOLDEN = Path(__file__).resolve().parents[2] / "test" / "golden"
MANIFEST = json.loads((GOLDEN / "manifest.json").read_text())
CUDA = torch.cuda.is_available() and _native.available() and _native.library().tzip_gpu_count() > 0
needs_cuda = pytest.mark.skipif(not CUDA, reason="no CUDA GPU visible to PyTorch and libtzip.so: the GPU side of the "
                                                 "in-process library is tested on a GPU host")

_TORCH_OF = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "U8": torch.uint8,
             "BOOL": torch.bool, "I64": torch.int64, "F64": torch.float64, "U16": torch.uint16,
             "I32": torch.int32, "I8": torch.int8, "I16": torch.int16}


def golden(v) -> tuple[torch.Tensor, torch.Tensor]:
    data = (GOLDEN / v["input"]).read_bytes() if "input" in v else (GOLDEN / f"{v['name']}.bin").read_bytes()
    frame = (GOLDEN / v["frame"]).read_bytes() if "frame" in v else (GOLDEN / f"{v['name']}.tzf").read_bytes()
    t = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    t = t.view(_TORCH_OF[v["dtype"]]).reshape(v["shape"])
    f = torch.frombuffer(bytearray(frame), dtype=torch.uint8)
    return t, f


VECTORS = [v for v in MANIFEST["vectors"] if v["dtype"] in _TORCH_OF]


def test_library_loads_and_names_its_versions():
    lib = _native.library()
    assert lib.tzip_abi_version() == 1
    assert lib.tzip_format_version() == MANIFEST["formatVersion"]


@pytest.mark.parametrize("v", VECTORS, ids=[v["name"] for v in VECTORS])
def test_golden_frames_byte_for_byte(v):
    t, frame = golden(v)
    for threads in (1, 3):
        got = _native.cpu_encode(t, v["codec"], v.get("chunkSize", 65536), threads)
        assert torch.equal(got, frame), f"{v['name']}: {threads} thread(s)"
    out = torch.empty_like(t)
    _native.cpu_decode(frame, out)
    assert torch.equal(out.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))
    info = _native.frame_info(frame)
    assert info["frame_bytes"] == frame.numel() and info["nbytes"] == t.numel() * t.element_size()


def _some_frame() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    t = (torch.randn(3000, generator=g) * 0.02).to(torch.bfloat16)
    return t, _native.cpu_encode(t, "fast", 4096)


def test_truncated_and_corrupt_frames_are_refused_by_code():
    t, f = _some_frame()
    out = torch.empty_like(t)
    with pytest.raises(NativeCodecError) as e:
        _native.cpu_decode(f[:40].clone(), out)
    assert e.value.code == "TZIP_TRUNCATED"
    bad = f.clone()
    bad[0] ^= 0xFF  # magic
    with pytest.raises(NativeCodecError) as e:
        _native.cpu_decode(bad, out)
    assert e.value.code == "TZIP_CORRUPT"
    bad = f.clone()
    bad[-1] ^= 0x01  # payload: a chunk digest or the checksum catches it
    with pytest.raises(NativeCodecError) as e:
        _native.cpu_decode(bad, out)
    assert e.value.code in ("TZIP_CHECKSUM", "TZIP_CORRUPT")
    with pytest.raises(NativeCodecError) as e:
        _native.cpu_decode(f, torch.empty(10, dtype=torch.bfloat16))
    assert e.value.code == "TZIP_INVALID_ARGUMENT"


def test_every_byte_flip_of_a_header_is_refused_or_decodes_exactly():
    t, f = _some_frame()
    out = torch.empty_like(t)
    head = _native.frame_info(f)["frame_bytes"] - (f.numel() - 48)  # at least the fixed header
    for i in range(min(f.numel(), max(head, 96))):
        bad = f.clone()
        bad[i] ^= 0x5A
        try:
            _native.cpu_decode(bad, out)
        except NativeCodecError as e:
            assert e.code in ("TZIP_CORRUPT", "TZIP_TRUNCATED", "TZIP_CHECKSUM", "TZIP_UNSUPPORTED",
                              "TZIP_INVALID_ARGUMENT"), (i, e)
        else:
            assert torch.equal(out.view(torch.uint8), t.view(torch.uint8)), i


def test_unknown_codec_and_bad_chunk_size_are_argument_errors():
    t = torch.zeros(10, dtype=torch.float32)
    with pytest.raises(ValueError, match="unknown codec"):
        _native.cpu_encode(t, "zstd")
    with pytest.raises(NativeCodecError) as e:
        _native.cpu_encode(t, "fast", chunk_bytes=1000)
    assert e.value.code == "TZIP_INVALID_ARGUMENT"


@needs_cuda
@pytest.mark.parametrize("v", VECTORS, ids=[v["name"] for v in VECTORS])
def test_gpu_encode_and_decode_equal_the_golden_frames(v):
    t, frame = golden(v)
    dev = torch.device("cuda")
    td = t.to(dev)
    bound = _native.max_frame_bytes(t.numel() * t.element_size(), len(_native.frame_spec(t)[1]),
                                    v.get("chunkSize", 65536))
    out = torch.empty(bound, dtype=torch.uint8, device=dev)
    sizes = torch.zeros(1, dtype=torch.int64, device=dev)
    s = torch.cuda.current_stream()
    _native.gpu_encode([td], [v["codec"]], [out], sizes, s.cuda_stream, v.get("chunkSize", 65536))
    n = int(sizes[0])
    assert torch.equal(out[:n].cpu(), frame)
    back = torch.empty_like(td)
    err = torch.full((1,), -1, dtype=torch.int32, device=dev)
    fd = frame.to(dev)
    arrays = _native.PointerArrays([fd.data_ptr()], [fd.numel()], [back.data_ptr()], [frame_nbytes(t)])
    _native.gpu_decode(arrays, err, s.cuda_stream, verify=True)
    assert int(err[0]) == 0
    assert torch.equal(back.cpu().reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))


def frame_nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@needs_cuda
def test_gpu_decode_reports_a_corrupt_frame_per_frame():
    t, f = _some_frame()
    dev = torch.device("cuda")
    bad = f.clone()
    bad[-1] ^= 0x01
    frames = [f.to(dev), bad.to(dev)]
    outs = [torch.empty_like(t, device=dev) for _ in frames]
    err = torch.full((2,), -1, dtype=torch.int32, device=dev)
    arrays = _native.PointerArrays([x.data_ptr() for x in frames], [x.numel() for x in frames],
                                   [o.data_ptr() for o in outs], [frame_nbytes(t)] * 2)
    _native.gpu_decode(arrays, err, torch.cuda.current_stream().cuda_stream, verify=True)
    codes = err.tolist()
    assert codes[0] == 0 and _native.code_name(codes[1]) in ("TZIP_CHECKSUM", "TZIP_CORRUPT")
    assert torch.equal(outs[0].cpu().view(torch.uint8), t.view(torch.uint8))


@needs_cuda
def test_a_decode_plan_runs_many_times_like_decode():
    t, f = _some_frame()
    dev = torch.device("cuda")
    fd = f.to(dev)
    out = torch.full_like(t, 0, device=dev)
    err = torch.full((1,), -1, dtype=torch.int32, device=dev)
    arrays = _native.PointerArrays([fd.data_ptr()], [fd.numel()], [out.data_ptr()], [frame_nbytes(t)])
    plan = _native.DecodePlan(arrays, err, verify=True, tensors=(fd, out))
    s = torch.cuda.current_stream()
    for _ in range(3):
        out.zero_()
        plan.run(s.cuda_stream)
        assert int(err[0]) == 0
        assert torch.equal(out.cpu().view(torch.uint8), t.view(torch.uint8))
    fd[-1] ^= 1  # the same plan now reports the damage
    plan.run(s.cuda_stream)
    assert _native.code_name(int(err[0])) in ("TZIP_CHECKSUM", "TZIP_CORRUPT")
    torch.cuda.synchronize()
    plan.close()


_RANS_PROBE = r"""
import hashlib, sys, torch
from safetensors.torch import load_file
from tzip import _native
sd = load_file(sys.argv[1])
t = torch.cat([v.reshape(-1) for v in sd.values() if v.dtype == torch.bfloat16])
frame = _native.cpu_encode(t, "max", 16384, 1)
out = torch.empty_like(t)
_native.cpu_decode(frame, out, True, 1)
assert torch.equal(out.view(torch.uint8), t.view(torch.uint8))
codes = []
for i in range(0, frame.numel(), max(1, frame.numel() // 300)):  # byte flips across the frame, payload included
    bad = frame.clone()
    bad[i] ^= 0x5A
    try:
        _native.cpu_decode(bad, torch.empty_like(t), False, 1)
        codes.append("ok:" + hashlib.sha256(out.view(torch.uint8).numpy().tobytes()).hexdigest()[:8])
    except _native.NativeCodecError as e:
        codes.append(e.code)
print(hashlib.sha256(out.view(torch.uint8).numpy().tobytes()).hexdigest(), ",".join(codes))
"""


def test_rans_lane_steps_avx2_and_scalar_agree():
    """The rANS decoder's AVX2 lane steps (used where the CPU has AVX2) and its scalar loop (TZIP_RANS_SCALAR=1): the
    same bytes for real bf16 gradients coded with `max`, and the same outcome, error code or bytes, for 300 byte
    flips spread over the frame (digests off, so that the rANS checks themselves decide)."""
    import os
    import subprocess
    import sys
    src = Path(__file__).resolve().parents[2] / "data" / "demo" / "minilm-grads-bf16.safetensors"
    if not src.is_file():
        pytest.skip(f"{src} is missing: python -m tzip.demo_data --out data/demo makes it")
    env = {k: v for k, v in os.environ.items() if k != "TZIP_RANS_SCALAR"}
    env["PYTHONPATH"] = str(Path(_native.__file__).resolve().parents[1])
    runs = [subprocess.run([sys.executable, "-c", _RANS_PROBE, str(src)], env=e, capture_output=True, text=True,
                           timeout=300) for e in (env, {**env, "TZIP_RANS_SCALAR": "1"})]
    for r in runs:
        assert r.returncode == 0, r.stderr[-2000:]
    assert runs[0].stdout == runs[1].stdout
    assert "TZIP_CORRUPT" in runs[0].stdout
