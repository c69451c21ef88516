"""tzip.files.load_folder: a checkpoint folder that the real CLI (`tzip compress DIR`) wrote, read back in this process
as one dict of every tensor of every shard, compared by bytes with safetensors.torch.load_file of the original shards
(the MiniLM bf16 weights in 3 shards with model.safetensors.index.json). An index that disagrees with the shards, a
missing shard and a tensor in two shards are refused, naming the file and the tensor.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file as st_load_file, save_file

from tzip._container import ContainerError
from tzip.files import load_folder

from checkpoint_support import cli, raw_bytes
from test_files import DEVICES, SRC, needs_src

SHARDS = ["model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors", "model-00003-of-00003.safetensors"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> tuple[Path, Path]:
    """(the original sharded folder, the folder `tzip compress` wrote from it)."""
    if not SRC.is_file():
        pytest.skip(f"{SRC} is missing: python -m tzip.demo_data --out data/demo makes it")
    base = tmp_path_factory.mktemp("folders")
    ckpt = base / "ckpt"
    ckpt.mkdir()
    sd = st_load_file(SRC)
    names = list(sd)
    cuts = [0, 30, 75, len(names)]
    weight_map = {}
    for i, shard in enumerate(SHARDS):
        part = names[cuts[i]: cuts[i + 1]]
        save_file({n: sd[n] for n in part}, ckpt / shard, metadata={"format": "pt"})
        weight_map.update({n: shard for n in part})
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))
    (ckpt / "config.json").write_text('{"hidden_size": 384}')
    cli("compress", str(ckpt), "-o", str(base / "packed"))
    return ckpt, base / "packed"


def originals(ckpt: Path) -> dict[str, torch.Tensor]:
    out = {}
    for shard in SHARDS:
        out.update(st_load_file(ckpt / shard))
    return out


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        g = got[name]
        assert (g.dtype, tuple(g.shape)) == (t.dtype, tuple(t.shape)), name
        assert raw_bytes(g) == raw_bytes(t), name


@needs_src
@pytest.mark.parametrize("device", DEVICES)
def test_load_folder_gives_every_tensor_of_every_shard(folders, device):
    ckpt, packed = folders
    got = load_folder(packed, device)
    assert all(t.device.type == torch.device(device).type for t in got.values())
    assert_same(got, originals(ckpt))


@needs_src
def test_without_an_index_every_tzip_file_is_a_shard(folders, tmp_path):
    ckpt, packed = folders
    bare = tmp_path / "bare"
    shutil.copytree(packed, bare)
    (bare / "model.safetensors.index.json").unlink()
    assert_same(load_folder(bare), originals(ckpt))
    # The same tensor in two shards is ambiguous without an index: refused.
    shutil.copy(bare / "model-00002-of-00003.tzip", bare / "model-00004-of-00004.tzip")
    with pytest.raises(ContainerError, match="a tensor may be in one shard only") as e:
        load_folder(bare)
    assert e.value.file.endswith("model-00004-of-00004.tzip")


def _with_index(packed: Path, dst: Path, change) -> Path:
    shutil.copytree(packed, dst)
    index = dst / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    change(doc["weight_map"])
    index.write_text(json.dumps(doc))
    return dst


@needs_src
def test_an_index_that_disagrees_with_the_shards_is_refused(folders, tmp_path):
    _, packed = folders
    first = next(iter(json.loads((packed / "model.safetensors.index.json").read_text())["weight_map"]))

    moved = _with_index(packed, tmp_path / "moved", lambda wm: wm.update({first: SHARDS[2]}))
    with pytest.raises(ContainerError, match=f"is in model-00001-of-00003.tzip, but the index names {SHARDS[2]}") as e:
        load_folder(moved)
    assert (e.value.code, e.value.tensor) == ("TZIP_CORRUPT", first)

    left_out = _with_index(packed, tmp_path / "left-out", lambda wm: wm.pop(first))
    with pytest.raises(ContainerError, match="the index names no shard for it"):
        load_folder(left_out)

    extra = _with_index(packed, tmp_path / "extra", lambda wm: wm.update({"ghost.weight": SHARDS[0]}))
    with pytest.raises(ContainerError, match="not in its shard") as e:
        load_folder(extra)
    assert e.value.tensor == "ghost.weight"

    gone = _with_index(packed, tmp_path / "gone", lambda wm: None)
    (gone / "model-00003-of-00003.tzip").unlink()
    with pytest.raises(FileNotFoundError, match="model-00003-of-00003.safetensors"):
        load_folder(gone)
