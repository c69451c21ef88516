"""Replays the Python fuzz targets' reproducers (fuzz/regressions/py_*/) and real streams through their checks.

The checks are those the atheris targets run (fuzz/python/fuzz_reference.py, fuzz_container.py): the reference
decoder and the client's frame reader refuse hostile frames with ValueError only and agree with each other; what
decodes re-encodes to the same bytes; the container reader refuses with ContainerError only. The golden frames
(test/golden) and the .tzip files written here from real MiniLM tensors must pass them as accepted inputs.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from safetensors.torch import load_file
from test_client_support import daemon, sock_dir  # noqa: F401

import tzip
from tzip import _container, demo_data, reference

ROOT = Path(__file__).resolve().parents[2]
FUZZ = ROOT / "fuzz"


def _target(name: str):
    spec = importlib.util.spec_from_file_location(f"fuzz_{name}", FUZZ / "python" / f"fuzz_{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _reproducers(target: str) -> list[Path]:
    return sorted((FUZZ / "regressions" / target).glob("*"))


@pytest.mark.parametrize("path", _reproducers("py_reference") or [None], ids=lambda p: p.name if p else "none")
def test_reference_reproducers(path):
    if path is None:
        pytest.skip("no py_reference reproducers yet (no crash found)")
    _target("reference").check(path.read_bytes())


@pytest.mark.parametrize("path", _reproducers("py_container") or [None], ids=lambda p: p.name if p else "none")
def test_container_reproducers(path, tmp_path):
    if path is None:
        pytest.skip("no py_container reproducers yet (no crash found)")
    _target("container").check(path.read_bytes(), str(tmp_path))


def test_golden_frames_pass_the_reference_target():
    check = _target("reference").check
    frames = sorted((ROOT / "test" / "golden").glob("*.tzf"))
    assert frames
    for f in frames:
        data = f.read_bytes()
        check(data)
        reference.decode_frame(data)  # accepted, so check() above ran its re-encode property on it


def test_real_container_passes_the_container_target(daemon, tmp_path):  # noqa: F811
    weights = load_file(str(demo_data.source_weights_path()))
    names = sorted(weights)[:4]
    items = [_container.TensorItem(n, weights[n].flatten()[:300].contiguous()) for n in names]
    path = tmp_path / "real.tzip"
    client = tzip.connect(daemon.socket, spawn=False, strict=True)
    try:
        _container.write_tensors(path, items, codec="max", client=client, strict=True)
    finally:
        client.close()
    data = path.read_bytes()
    with _container.ContainerReader(path) as r:
        assert sorted(r.tensor_names()) == names
    _target("container").check(data, str(tmp_path))
    # A cut file is refused with ContainerError, not another exception.
    _target("container").check(data[: len(data) // 2], str(tmp_path))
