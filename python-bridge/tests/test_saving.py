"""tzip.save / tzip.load and the Python .tzip container (tzip._container), against a real daemon, the real
`tzip` CLI (both directions: files written here read by `tzip decompress | verify | extract | inspect`, files
written by `tzip compress` read here), the real model's state dict, real processes killed with SIGKILL mid-write,
and real full disks (RLIMIT_FSIZE in a subprocess; a small tmpfs in a private mount namespace where unshare works).
Every comparison is of raw bytes.
"""

from __future__ import annotations

import collections
import hashlib
import json
import math
import os
import pickle
import shutil
import struct
import subprocess
import tempfile
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

import tzip
import tzip.client as tz
from tzip import _container, _default
from tzip._container import ContainerError, ContainerReader, decode_entries
from tzip._frame import read_header
from tzip.saving import load, save

from checkpoint_support import cli, client, kill_while_writing, raw_bytes  # noqa: F401
from test_client_support import ALL_DTYPES, PYTHON, shared_daemon  # noqa: F401

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


# --------------------------------------------------------------------------------------------- helpers


def assert_same(a, b, path: str = "obj") -> None:
    """``b`` is ``a`` again: same types, same structure and order, tensors of the same dtype, shape and bytes."""
    assert type(a) is type(b), f"{path}: {type(a).__name__} vs {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert (a.dtype, tuple(a.shape)) == (b.dtype, tuple(b.shape)), path
        assert a.requires_grad == b.requires_grad, path
        assert raw_bytes(a) == raw_bytes(b), f"{path}: bytes differ"
    elif isinstance(a, dict):
        assert list(a.keys()) == list(b.keys()), path
        for k in a:
            assert_same(a[k], b[k], f"{path}.{k}")
        assert getattr(a, "_metadata", None) == getattr(b, "_metadata", None), path
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}.{i}")
    elif isinstance(a, float):
        assert struct.pack("<d", a) == struct.pack("<d", b), path
    else:
        assert a == b, path


def random_tensor(dtype: torch.dtype, shape, gen: torch.Generator) -> torch.Tensor:
    """Every bit pattern for floats (NaN payloads, -0.0, subnormals), valid values for bool."""
    n = math.prod(shape) * dtype.itemsize
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(shape) if n else torch.empty(shape, dtype=dtype)


def nested_state(gen: torch.Generator) -> dict:
    """Every dtype in several shapes (empty, 0-dim, ordinary, > 32 dims, non-contiguous), inside nested containers,
    with every kind of plain value."""
    tensors = {}
    for dtype in ALL_DTYPES:
        name = str(dtype).removeprefix("torch.")
        tensors[name] = {
            "matrix": random_tensor(dtype, (37, 19), gen),
            "scalar": random_tensor(dtype, (), gen),
            "empty": [random_tensor(dtype, (0,), gen), random_tensor(dtype, (4, 0, 3), gen)],
        }
    floats = (torch.randn(300, 70, generator=gen) * 0.02)
    state = collections.OrderedDict()
    state["tensors"] = tensors
    state["real"] = {"f32": floats, "bf16": floats.bfloat16(), "f16": floats.half(), "t": floats.t(),
                     "strided": floats[::3, 5:40:2], "deep": torch.arange(6.0).reshape(*([1] * 33), 6)}
    state["param"] = torch.nn.Parameter(torch.randn(5, 3, generator=gen))
    state["frozen"] = torch.nn.Parameter(torch.randn(2, generator=gen), requires_grad=False)
    state["grad_leaf"] = torch.randn(4, generator=gen).requires_grad_(True)
    state["values"] = {1: "one", (2, "b"): [None, True, False], -3: 2 ** 70, "f": [0.1, -0.0, float("inf"), float("-inf"),
                       struct.unpack("<d", bytes.fromhex("0100000000f8ff7f"))[0], 5e-324], "s": "päth\u2603 \"q\" \\",
                       "b": b"\x00\xffbytes", "dt": torch.bfloat16, "dev": torch.device("cpu"), "size": torch.Size([3, 4]),
                       "tuple": (1, (2.5, "x"), [])}
    state["empty_dict"] = {}
    state._metadata = {"": {"version": 1}, "layer": {"version": 2}}  # as nn.Module.state_dict() sets it
    return state


# --------------------------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("codec", ["auto", "raw"])
def test_nested_state_every_dtype_round_trips_bitwise(client, tmp_path, codec):
    gen = torch.Generator().manual_seed(1)
    state = nested_state(gen)
    path = tmp_path / "s.tzip"
    size = save(state, path, codec=codec, client=client)
    assert size == path.stat().st_size
    back = load(path, client=client)
    assert_same(state, back)
    assert isinstance(back["param"], torch.nn.Parameter) and back["param"].requires_grad
    assert isinstance(back["frozen"], torch.nn.Parameter) and not back["frozen"].requires_grad
    assert back["real"]["t"].is_contiguous()  # values in C order; strides are not kept
    with ContainerReader(path) as r:
        codecs = {e.name: read_header(r.read_frame(e)).codec for e in r.entries}
    if codec == "raw":
        assert set(codecs.values()) == {"raw"}
    else:
        assert codecs["real.f32"] in ("fast", "max") and codecs["tensors.int64.matrix"] == "bytes"


def test_cli_accepts_python_files_and_restores_the_same_tensors(client, tmp_path):
    """tzip verify / inspect / extract / decompress on a file written here; the safetensors file it restores holds
    every tensor with its bytes (under its safetensors dtype, or as U8 bytes for dtypes safetensors lacks)."""
    from safetensors.torch import load_file

    gen = torch.Generator().manual_seed(2)
    state = nested_state(gen)
    path = tmp_path / "s.tzip"
    save(state, path, client=client)
    assert "OK" in cli("verify", str(path)).stdout
    listed = json.loads(cli("inspect", "--json", str(path)).stdout)
    names = {e["name"] for e in listed["entries"] if e["kind"] == "tensor"}
    assert listed["metadata"][tzip.saving.TREE_KEY]  # the object tree travels in __metadata__
    out = tmp_path / "s.safetensors"
    cli("decompress", str(path), "-o", str(out))
    restored = load_file(str(out))
    with ContainerReader(path) as r:
        assert r.original_size == out.stat().st_size
        assert sorted(restored) == sorted(r.tensor_names())
        assert names == set(r.tensor_names())
    flat = {"real.f32": state["real"]["f32"], "real.strided": state["real"]["strided"], "param": state["param"],
            "tensors.bfloat16.matrix": state["tensors"]["bfloat16"]["matrix"],
            "tensors.float8_e4m3fn.scalar": state["tensors"]["float8_e4m3fn"]["scalar"],
            "tensors.complex128.matrix": state["tensors"]["complex128"]["matrix"],  # U8 bytes in the file
            "tensors.bool.empty.1": state["tensors"]["bool"]["empty"][1]}
    for name, t in flat.items():
        assert raw_bytes(restored[name]) == raw_bytes(t), name
    assert restored["real.f32"].dtype == torch.float32 and restored["tensors.complex128.matrix"].dtype == torch.uint8
    one = tmp_path / "one.bin"
    cli("extract", str(path), "real.bf16", "-o", str(one))
    assert one.read_bytes() == raw_bytes(state["real"]["bf16"])


@pytest.fixture(scope="module")
def model_state():
    """The real model (all-MiniLM-L6-v2) after one AdamW step on real text: its state dict and the optimizer's."""
    from tzip import demo_data

    model = demo_data.load_model()
    model.train()
    tok = demo_data.load_tokenizer(max_length=32)
    pairs = demo_data.sentence_pairs(demo_data.readme_sentences())[:4]
    a = demo_data.tokenize([p[0] for p in pairs], tok)
    b = demo_data.tokenize([p[1] for p in pairs], tok)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    torch.manual_seed(0)
    ea = demo_data.mean_pool_normalize(model(**a).last_hidden_state, a["attention_mask"])
    eb = demo_data.mean_pool_normalize(model(**b).last_hidden_state, b["attention_mask"])
    demo_data.contrastive_loss(ea, eb).backward()
    opt.step()
    return model, opt


def test_real_model_and_optimizer_through_the_cli(client, tmp_path, model_state):
    from safetensors.torch import load_file

    model, opt = model_state
    sd = model.state_dict()
    ckpt = {"model": sd, "optim": opt.state_dict(), "step": 1, "bf16": {k: v.bfloat16() for k, v in sd.items()
                                                                        if v.is_floating_point()}}
    path = tmp_path / "minilm.tzip"
    size = save(ckpt, path, client=client)
    back = load(path, client=client)
    assert_same(ckpt, back)
    raw = 0
    with ContainerReader(path) as r:
        raw = r.original_size
    assert size < 0.85 * raw  # float weights and optimizer state compress
    fresh = type(model)(model.config)
    fresh.load_state_dict(back["model"])  # OrderedDict with its _metadata: what load_state_dict expects
    for k, v in fresh.state_dict().items():
        assert raw_bytes(v) == raw_bytes(sd[k]), k
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-4)
    fresh_opt.load_state_dict(back["optim"])
    assert "OK" in cli("verify", str(path)).stdout
    out = tmp_path / "minilm.safetensors"
    cli("decompress", str(path), "-o", str(out))
    restored = load_file(str(out))
    for k, v in sd.items():
        assert raw_bytes(restored[f"model.{k}"]) == raw_bytes(v), k
    for pid, st in ckpt["optim"]["state"].items():
        for k, v in st.items():
            assert raw_bytes(restored[f"optim.state.{pid}.{k}"]) == raw_bytes(v)


def test_files_from_tzip_compress_load_here(client, tmp_path):
    """The TS writer's file of the real weights: tzip.load gives every tensor; the entries (gaps included) rebuild
    the original safetensors file byte for byte; a file with a gap and an unknown dtype is read entry by entry."""
    from safetensors.torch import load_file

    from tzip.demo_data import source_weights_path

    src = source_weights_path()
    path = tmp_path / "w.tzip"
    cli("compress", str(src), "-o", str(path))
    got = load(path, client=client)
    want = load_file(str(src))
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and raw_bytes(got[k]) == raw_bytes(v), k

    # A hand-made safetensors file: a gap between tensors, trailing bytes, an unknown dtype, an empty tensor.
    payload = os.urandom(64)
    header = {"__metadata__": {"k": "v"}, "a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
              "odd": {"dtype": "X7", "shape": [3], "data_offsets": [24, 30]},
              "e": {"dtype": "I8", "shape": [0], "data_offsets": [30, 30]}}
    text = json.dumps(header).encode()
    blob = struct.pack("<Q", len(text)) + text + payload[:40]
    src2 = tmp_path / "odd.safetensors"
    src2.write_bytes(blob)
    path2 = tmp_path / "odd.tzip"
    cli("compress", str(src2), "-o", str(path2))
    with ContainerReader(path2) as r:
        kinds = [(e.kind, e.begin, e.end) for e in r.entries]
        assert kinds == [("tensor", 0, 16), ("gap", 16, 24), ("tensor", 24, 30), ("tensor", 30, 30), ("gap", 30, 40)]
        rebuilt = bytearray(r.header_bytes) + bytearray(r.header.data_length)
        for e, t in decode_entries(r, r.entries, client):
            rebuilt[r.header.data_offset + e.begin : r.header.data_offset + e.end] = raw_bytes(t)
    assert hashlib.sha256(rebuilt).digest() == hashlib.sha256(blob).digest()
    with pytest.raises(ContainerError) as err:
        load(path2, client=client)
    assert err.value.code == "TZIP_UNSUPPORTED" and err.value.tensor == "odd"


def test_shared_tensors_are_stored_once_and_come_back_shared(client, tmp_path):
    w = torch.randn(64, 32)
    view_a, view_b = w.detach(), w.detach()  # two objects, the same view of one storage (tied weights)
    part = w[1:]  # overlaps, another view: stored on its own
    obj = {"w": w, "again": w, "tied": [view_a, view_b], "part": part, "e1": torch.empty(0), "e2": torch.empty(0)}
    path = tmp_path / "shared.tzip"
    save(obj, path, client=client)
    with ContainerReader(path) as r:
        assert sorted(r.tensor_names()) == ["e1", "e2", "part", "w"]
    back = load(path, client=client)
    assert back["again"] is back["w"]
    assert back["tied"][0] is not back["tied"][1] and back["tied"][0] is not back["w"]
    assert back["tied"][0].data_ptr() == back["tied"][1].data_ptr() == back["w"].data_ptr()
    assert back["part"].data_ptr() != back["w"].data_ptr() and raw_bytes(back["part"]) == raw_bytes(part)
    assert back["e1"] is not back["e2"]
    assert_same(obj, back)


def test_other_objects_need_allow_pickle_and_weights_only_false(client, tmp_path):
    path = tmp_path / "p.tzip"
    obj = {"w": torch.ones(3), "when": collections.Counter("aab")}
    with pytest.raises(TypeError, match="allow_pickle"):
        save(obj, path, client=client)
    assert not path.exists()
    save(obj, path, client=client, allow_pickle=True)
    with pytest.raises(pickle.UnpicklingError, match="weights_only=False"):
        load(path, client=client)
    assert load(path, client=client, weights_only=False)["when"] == collections.Counter("aab")


def test_lazy_module_attributes(client, tmp_path):
    assert tzip.save is save and tzip.load is load
    tzip.save({"x": torch.arange(5)}, tmp_path / "x.tzip", client=client)
    assert raw_bytes(tzip.load(tmp_path / "x.tzip", client=client)["x"]) == raw_bytes(torch.arange(5))


def test_map_location_forms_on_the_cpu(client, tmp_path):
    obj = {"a": torch.randn(10, 10), "b": [torch.arange(3)]}
    path = tmp_path / "m.tzip"
    save(obj, path, client=client)
    seen = []

    def fn(storage, location):
        seen.append((type(storage).__name__, location))
        return storage

    for ml in (None, "cpu", torch.device("cpu"), {"cpu": "cpu"}, fn):
        assert_same(obj, load(path, map_location=ml, client=client))
    assert seen == [("UntypedStorage", "cpu")] * 2
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="is_available"):
            load(path, map_location="cuda", client=client)
    with pytest.raises(TypeError):
        load(path, map_location=3, client=client)


# --------------------------------------------------------------------------------------------- damaged files


def _small_file(client, path: Path, codec: str = "auto") -> dict:
    gen = torch.Generator().manual_seed(3)
    obj = {"w": (torch.randn(24, 40, generator=gen) * 0.1), "b": torch.randn(50, generator=gen).bfloat16(),
           "i": torch.arange(30), "meta": {"lr": 0.1, "name": "x"}}
    save(obj, path, codec=codec, client=client)
    return obj


@pytest.mark.parametrize("codec", ["auto", "raw"])
def test_truncated_files_raise(client, tmp_path, codec):
    path = tmp_path / "t.tzip"
    _small_file(client, path, codec)
    data = path.read_bytes()
    bad = tmp_path / "bad.tzip"
    for n in sorted({0, 1, 7, 8, 23, 24, 40, 63, 64, len(data) - 33, len(data) - 32, len(data) - 1, *range(0, len(data), 97)}):
        bad.write_bytes(data[:n])
        with pytest.raises(ContainerError) as err:
            load(bad, client=client)
        assert err.value.code in ("TZIP_TRUNCATED", "TZIP_CORRUPT"), (n, err.value)
        assert str(bad) in str(err.value)


@pytest.mark.parametrize("codec", ["auto", "raw"])
def test_bit_flips_raise_or_change_nothing(client, tmp_path, codec):
    """One flipped bit anywhere: a ContainerError, or (padding, an unused metadata byte) the same data. Flips inside
    the prefix, the frames, the index and the trailer always raise; `tzip verify` agrees on a flipped payload."""
    path = tmp_path / "f.tzip"
    obj = _small_file(client, path, codec)
    data = bytearray(path.read_bytes())
    with ContainerReader(path) as r:
        frames = [(e.frame_offset, e.frame_offset + e.frame_bytes) for e in r.entries]
        header_end = _container.PREFIX_BYTES + len(r.header_bytes)
        index_at = len(data) - 32 - 32 * len(r.entries)
    must_raise = set(range(0, 24)) | set(range(index_at, len(data)))
    for a, b in frames:
        must_raise |= set(range(a, b))
    positions = sorted(set(range(0, header_end, 3)) | set(range(header_end, len(data), 5)) | set(range(index_at, len(data))))
    bad = tmp_path / "bad.tzip"
    silent = 0
    for k, pos in enumerate(positions):
        flipped = bytearray(data)
        flipped[pos] ^= 1 << (k % 8)
        bad.write_bytes(flipped)
        try:
            back = load(bad, client=client)
        except ContainerError as e:
            assert e.code in ("TZIP_CORRUPT", "TZIP_CHECKSUM", "TZIP_TRUNCATED", "TZIP_UNSUPPORTED"), (pos, e)
            continue
        assert pos not in must_raise, f"a flip at byte {pos} was not detected"
        assert_same(obj, back)
        silent += 1
    assert silent < len(positions) // 10
    a, b = frames[0]
    flipped = bytearray(data)
    flipped[b - 3] ^= 0x10  # the last payload bytes of the first frame
    bad.write_bytes(flipped)
    with pytest.raises(ContainerError) as err:
        load(bad, client=client)
    assert err.value.code in ("TZIP_CHECKSUM", "TZIP_CORRUPT") and err.value.tensor is not None
    r = cli("verify", str(bad), check=False)
    assert r.returncode == 2, r.stdout + r.stderr


# --------------------------------------------------------------------------------------------- crashes and full disks


def _big_state(mb: int) -> dict:
    """About ``mb`` MB of real float data: the real weights tiled (never zeros)."""
    from safetensors.torch import load_file

    from tzip.demo_data import source_weights_path

    w = load_file(str(source_weights_path()))
    flat = torch.cat([v.reshape(-1) for v in w.values() if v.dtype == torch.float32])
    n = mb * 1_000_000 // 4
    reps = -(-n // flat.numel())
    data = flat.repeat(reps)[:n]
    return {f"t{i}": c.clone() for i, c in enumerate(data.split(4_000_000))}


WRITER = textwrap.dedent("""
    import os, sys, torch
    import tzip.client as tz
    from tzip import _container
    from tzip.saving import save
    sys.path.insert(0, sys.argv[4])
    from test_saving import _big_state
    sock, path, mb = sys.argv[1], sys.argv[2], int(sys.argv[3])
    _container.BATCH_BYTES = 8 << 20  # many batches: the kill lands between and inside them
    state = _big_state(mb)
    c = tz.connect(sock, spawn=False, strict=True)
    print("writing", flush=True)
    save(state, path, client=c)
    print("done", flush=True)
""")


def _kill_while_writing(socket: str, path: Path, mb: int) -> list[Path]:
    return kill_while_writing(
        [PYTHON, "-c", WRITER, socket, str(path), str(mb), str(Path(__file__).parent)],
        lambda: [q for q in path.parent.iterdir() if q.name.startswith(f".{path.name}.") and q.name.endswith(".tmp")])


def test_sigkill_halfway_keeps_the_old_checkpoint(client, shared_daemon, tmp_path):
    path = tmp_path / "ckpt.tzip"
    old = _small_file(client, path)
    before = path.read_bytes()
    tmps = _kill_while_writing(shared_daemon.socket, path, 120)
    assert tmps and all(t.exists() for t in tmps)  # it was killed while writing: the temporary file is left
    assert path.read_bytes() == before
    assert_same(old, load(path, client=client))

    fresh = tmp_path / "new.tzip"
    _kill_while_writing(shared_daemon.socket, fresh, 120)
    assert not fresh.exists()


FULL_DISK = textwrap.dedent("""
    import errno, json, os, resource, signal, sys, torch
    import tzip.client as tz
    from tzip import _container
    from tzip.saving import load, save
    sock, path, limit = sys.argv[1], sys.argv[2], int(sys.argv[3])
    c = tz.connect(sock, spawn=False, strict=True)
    _container.BATCH_BYTES = 2 << 20  # shared-memory staging stays far below the limit; the .tzip file does not
    g = torch.Generator().manual_seed(5)
    if not os.path.exists(path):  # the tmpfs case: the old checkpoint is written here
        save({"old": torch.randn(1000, 100, generator=g)}, path, client=c)
    old = open(path, "rb").read()
    if limit:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG instead of killing us
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    big = {f"t{i}": torch.randn(1_000_000, generator=g) for i in range(12)}
    out = {}
    try:
        save(big, path, client=c)
        out["saved"] = True
    except OSError as e:
        out["errno"] = errno.errorcode.get(e.errno, str(e.errno))
    out["old_intact"] = open(path, "rb").read() == old
    back = load(path, client=c)
    out["loads"] = sorted(back)
    out["left"] = sorted(n for n in os.listdir(os.path.dirname(path)))
    print(json.dumps(out), flush=True)
""")


def test_file_size_limit_keeps_the_old_checkpoint(client, shared_daemon, tmp_path):
    """RLIMIT_FSIZE (the kernel refuses writes past it with EFBIG) in a subprocess saving over a checkpoint."""
    path = tmp_path / "ckpt.tzip"
    save({"old": torch.randn(1000, 100, generator=torch.Generator().manual_seed(5))}, path, client=client)
    r = subprocess.run([PYTHON, "-c", FULL_DISK, shared_daemon.socket, str(path), str(16 << 20)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out == {"errno": "EFBIG", "old_intact": True, "loads": ["old"], "left": ["ckpt.tzip"]}, out


def _unshare_problem() -> str | None:
    """None when this machine lets an unprivileged process mount a tmpfs in a private namespace, else why not."""
    if shutil.which("unshare") is None:
        return "no unshare command"
    with tempfile.TemporaryDirectory() as d:
        r = subprocess.run(["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=1m tmpfs {d}"], capture_output=True,
                           text=True)
    return None if r.returncode == 0 else (r.stderr.strip() or f"exit {r.returncode}")


_NO_TMPFS = _unshare_problem()


@pytest.mark.skipif(_NO_TMPFS is not None, reason=f"needs unshare -rm and a tmpfs mount (user and mount namespaces): "
                                                  f"{_NO_TMPFS}")
def test_full_tmpfs_keeps_the_old_checkpoint(shared_daemon, tmp_path):
    """A real full filesystem (ENOSPC): an 8 MiB tmpfs mounted in a private mount namespace."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    script = f"mount -t tmpfs -o size=8m tmpfs {mnt} && exec {PYTHON} -c \"$0\" \"$@\""
    r = subprocess.run(["unshare", "-rm", "sh", "-c", script, FULL_DISK, shared_daemon.socket, str(mnt / "ckpt.tzip"), "0"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out == {"errno": "ENOSPC", "old_intact": True, "loads": ["old"], "left": ["ckpt.tzip"]}, out


# --------------------------------------------------------------------------------------------- the daemon away


def test_daemon_away_stores_raw_frames_with_one_warning(tmp_path):
    obj = {"w": torch.randn(100, 100), "i": torch.arange(10)}
    path = tmp_path / "raw.tzip"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dead = tz.connect(str(tmp_path / "nobody" / "tzip.sock"), spawn=False)  # lenient: falls back
        try:
            save(obj, path, client=dead)
            save(obj, path, client=dead)
        finally:
            dead.close()
    assert len([w for w in caught if "not available" in str(w.message)]) == 1
    with ContainerReader(path) as r:
        assert {read_header(r.read_frame(e)).codec for e in r.entries} == {"raw"}
    assert_same(obj, load(path))  # raw frames: no daemon needed (none is started)
    assert "OK" in cli("verify", str(path)).stdout


def test_daemon_away_strict_raises_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("TZIP_SOCKET", str(tmp_path / "nobody" / "tzip.sock"))
    monkeypatch.setenv("TZIP_NODE", "/bin/false")  # no daemon can be started either
    monkeypatch.setattr(_default, "_clients", {})
    path = tmp_path / "x.tzip"
    with pytest.raises(tz.DaemonUnavailableError):
        save({"w": torch.randn(10)}, path, strict=True)
    assert not path.exists() and not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]
    with pytest.warns(RuntimeWarning, match="not available"):
        save({"w": torch.randn(10)}, path)  # the default lenient client
    assert load(path)["w"].shape == (10,)
    for c in _default._clients.values():
        c.close()


# --------------------------------------------------------------------------------------------- GPU


@needs_cuda
def test_cuda_tensors_are_compressed_on_their_gpu_and_restored_where_asked(client, tmp_path):
    gen = torch.Generator().manual_seed(7)
    w = (torch.randn(512, 384, generator=gen) * 0.02)
    obj = {"gpu": {"f32": w.cuda(), "bf16": w.bfloat16().cuda(), "i": torch.arange(100, device="cuda"),
                   "e": torch.empty(0, 3, device="cuda"), "s": torch.tensor(2.5, device="cuda")},
           "cpu": w.clone(), "step": 4}
    path = tmp_path / "cuda.tzip"
    save(obj, path, client=client)
    with ContainerReader(path) as r:
        codecs = {e.name: read_header(r.read_frame(e)).codec for e in r.entries}
    assert codecs["gpu.f32"] in ("fast", "max") and codecs["gpu.bf16"] in ("fast", "max")
    back = load(path, client=client)
    assert back["gpu"]["f32"].device == torch.device("cuda", 0) and back["cpu"].device.type == "cpu"
    assert_same(obj, back)
    on_cpu = load(path, map_location="cpu", client=client)
    assert all(t.device.type == "cpu" for t in on_cpu["gpu"].values())
    for k, t in obj["gpu"].items():
        assert raw_bytes(on_cpu["gpu"][k]) == raw_bytes(t), k
    mapped = load(path, map_location={"cuda:0": "cpu"}, client=client)
    assert mapped["gpu"]["bf16"].device.type == "cpu"
    to_gpu = load(path, map_location="cuda", client=client)
    assert to_gpu["cpu"].device.type == "cuda" and raw_bytes(to_gpu["cpu"]) == raw_bytes(w)
    moved = load(path, map_location=lambda s, loc: s.cpu(), client=client)
    assert moved["gpu"]["i"].device.type == "cpu" and raw_bytes(moved["gpu"]["i"]) == raw_bytes(obj["gpu"]["i"])
