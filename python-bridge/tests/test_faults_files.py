"""Fault injection on files (issue 15, item 2): real OS faults while writing a .tzip file with `tzip compress` (and
its safetensors back with `tzip decompress`), `tzip.save`, and a DCP checkpoint (tzip.checkpoint.Writer), and files
damaged on disk (truncated, bits flipped in the prefix, the header, the frames, the index and the trailer) read by
`tzip verify` / `tzip decompress`, tzip.load and DCP load.

The faults are the kernel's own: RLIMIT_FSIZE in a subprocess (writes past the limit fail with EFBIG; SIGXFSZ is
ignored so the writer sees the error), a full tmpfs (ENOSPC; mounted in a private user and mount namespace, skipped
where unshare cannot do that), a folder nobody may create files in (chattr +i for root, who ignores mode bits; mode
0555 otherwise), and stdout on /dev/full. What must hold: no file under the final name unless complete, an old file
of that name byte-identical afterwards, no temporary file left behind, the CLI's I/O exit code (3) and message; a
damaged file is always a TZIP_CHECKSUM / TZIP_CORRUPT / TZIP_TRUNCATED error, never different data.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import random
import re
import resource
import shutil
import signal
import subprocess
import tempfile
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from tzip._container import ContainerError, ContainerReader
from tzip.checkpoint import METADATA_FILE, Reader, Writer
from tzip.saving import load, save

from checkpoint_support import cli, client, raw_bytes  # noqa: F401
from test_client_support import MAIN, NODE, PYTHON, ROOT, shared_daemon  # noqa: F401

DAMAGE_CODES = ("TZIP_CHECKSUM", "TZIP_CORRUPT", "TZIP_TRUNCATED")


# --------------------------------------------------------------------------------------------- helpers


def real_weights(limit_bytes: int) -> dict[str, torch.Tensor]:
    """The bundled MiniLM's tensors in file order, up to about ``limit_bytes``."""
    from safetensors.torch import load_file

    from tzip.demo_data import source_weights_path

    out, total = {}, 0
    for k, v in load_file(str(source_weights_path())).items():
        if total >= limit_bytes:
            break
        out[k] = v
        total += v.numel() * v.element_size()
    return out


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    """A small and a larger safetensors file of real weights, and the .tzip of each (made by `tzip compress`)."""
    from safetensors.torch import save_file

    d = tmp_path_factory.mktemp("src")
    w = real_weights(1 << 40)
    names = [k for k in w if k != "embeddings.word_embeddings.weight"]  # the 47 MB table: not needed here
    small, total = {}, 0
    for k in names:  # biases, layer norms and two 384 x 384 matrices: ~1.3 MB
        if w[k].numel() <= 150_000 and total < 1_300_000:
            small[k] = w[k]
            total += w[k].numel() * w[k].element_size()
    out = {"small": d / "small.safetensors", "large": d / "large.safetensors"}
    save_file(small, str(out["small"]))
    save_file({k: w[k] for k in names[:31]}, str(out["large"]))  # ~10 MB
    for k in ("small", "large"):
        out[k + ".tzip"] = d / f"{k}.tzip"
        cli("compress", str(out[k]), "-o", str(out[k + ".tzip"]))
    return out


def fsize_limited(limit: int):
    """preexec_fn: RLIMIT_FSIZE of ``limit`` bytes, SIGXFSZ ignored (an ignored signal stays ignored across exec)."""

    def pre() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return pre


#: The `tzip` command as users run it: the native CLI (build/Release/tzip-native) when built, which hands every
#: failure to the Node CLI, so these faults reach both.
LAUNCHER = ROOT / "bin" / "tzip"


def tzip_cmd(*args: str) -> list[str]:
    return [str(LAUNCHER), *args]


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".tmp"))


@contextlib.contextmanager
def no_new_files(folder: Path):
    """``folder`` where no file can be created (chattr +i for root, mode 0555 otherwise); skips where neither works."""
    if os.geteuid() == 0:
        r = subprocess.run(["chattr", "+i", str(folder)], capture_output=True, text=True) if shutil.which("chattr") else None
        if r is None or r.returncode != 0:
            pytest.skip(f"root ignores mode bits and chattr +i is not available here: {r.stderr.strip() if r else 'no chattr'}")
        undo = ["chattr", "-i", str(folder)]
    else:
        os.chmod(folder, 0o555)
        undo = None
    try:
        try:
            (folder / ".probe").touch()
        except OSError:
            pass
        else:
            (folder / ".probe").unlink()
            pytest.skip(f"cannot make {folder} unwritable here")
        yield
    finally:
        if undo:
            subprocess.run(undo, check=True)
        else:
            os.chmod(folder, 0o755)


def _unshare_problem() -> str | None:
    if shutil.which("unshare") is None:
        return "no unshare command"
    with tempfile.TemporaryDirectory() as d:
        r = subprocess.run(["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=1m tmpfs {d}"], capture_output=True, text=True)
    return None if r.returncode == 0 else (r.stderr.strip() or f"exit {r.returncode}")


_NO_TMPFS = _unshare_problem()
needs_tmpfs = pytest.mark.skipif(_NO_TMPFS is not None, reason=f"needs unshare -rm and a tmpfs mount: {_NO_TMPFS}")


def in_small_tmpfs(mnt: Path, size: str, script: str, *args: str) -> subprocess.CompletedProcess:
    """Runs the shell ``script`` (with ``args`` as $1...) in a private mount namespace where ``mnt`` is a tmpfs of
    ``size``; what is in the tmpfs is gone afterwards, so the script checks it and prints what it saw."""
    mnt.mkdir(exist_ok=True)
    body = f"mount -t tmpfs -o size={size} tmpfs {mnt} && {script}"
    return subprocess.run(["unshare", "-rm", "sh", "-c", body, "sh", *args], capture_output=True, text=True, timeout=300)


# --------------------------------------------------------------------------------------------- the CLI writing


@pytest.mark.parametrize("fault", ["efbig", "no-new-files"])
def test_cli_compress_fault_keeps_the_old_file(sources, tmp_path, fault):
    out = tmp_path / "model.tzip"
    shutil.copy(sources["small.tzip"], out)
    old = out.read_bytes()
    if fault == "efbig":
        r = subprocess.run(tzip_cmd("compress", str(sources["large"]), "-o", str(out)), capture_output=True, text=True,
                           cwd=ROOT, timeout=300, preexec_fn=fsize_limited(2 << 20))
        assert "EFBIG" in r.stderr, r.stderr
    else:
        with no_new_files(tmp_path):
            r = subprocess.run(tzip_cmd("compress", str(sources["large"]), "-o", str(out)), capture_output=True, text=True,
                               cwd=ROOT, timeout=300)
    assert r.returncode == 3, (r.returncode, r.stderr)  # EXIT_IO
    assert str(out) in r.stderr
    assert out.read_bytes() == old and leftovers(tmp_path) == []
    assert cli("verify", str(out)).returncode == 0


def test_cli_decompress_efbig_keeps_the_old_file(sources, tmp_path):
    out = tmp_path / "model.safetensors"
    shutil.copy(sources["small"], out)
    old = out.read_bytes()
    r = subprocess.run(tzip_cmd("decompress", str(sources["large.tzip"]), "-o", str(out)), capture_output=True,
                       text=True, cwd=ROOT, timeout=300, preexec_fn=fsize_limited(2 << 20))
    assert r.returncode == 3 and "EFBIG" in r.stderr and str(out) in r.stderr, (r.returncode, r.stderr)
    assert out.read_bytes() == old and leftovers(tmp_path) == []


@needs_tmpfs
def test_cli_compress_on_a_full_tmpfs_keeps_the_old_file(sources, tmp_path):
    mnt = tmp_path / "mnt"
    script = ('cp "$1" "$3/model.tzip" && { "$4" compress "$2" -o "$3/model.tzip"; echo "rc=$?"; } && '
              'cmp -s "$1" "$3/model.tzip" && echo same; ls -a "$3" | tr "\\n" " "')
    r = in_small_tmpfs(mnt, "3m", script, str(sources["small.tzip"]), str(sources["large"]), str(mnt), str(LAUNCHER))
    assert "rc=3" in r.stdout and "ENOSPC" in r.stderr, (r.stdout, r.stderr)
    assert "same" in r.stdout, r.stdout  # the old file, byte for byte
    assert r.stdout.strip().splitlines()[-1].split() == [".", "..", "model.tzip"], r.stdout  # no temporary file left


@pytest.mark.parametrize("args", [["inspect"], ["--json", "inspect"], ["verify"], ["--json", "verify"]], ids=" ".join)
def test_cli_result_on_a_full_stdout_is_an_io_error(sources, args):
    """stdout on /dev/full (ENOSPC on write): exit 3 with the reason, not a crash with exit 1 (fixed in main.ts)."""
    with open("/dev/full", "w") as full:
        r = subprocess.run(tzip_cmd(*args, str(sources["small.tzip"])), stdout=full, stderr=subprocess.PIPE, text=True,
                           cwd=ROOT, timeout=120)
    assert r.returncode == 3 and "cannot write to stdout" in r.stderr and "ENOSPC" in r.stderr, (r.returncode, r.stderr)
    assert "at " not in r.stderr  # no stack trace


# --------------------------------------------------------------------------------------------- tzip.save and DCP writing


WRITE_UNDER_FAULT = textwrap.dedent("""
    import errno, json, os, re, resource, signal, sys, warnings, torch
    import torch.distributed.checkpoint as dcp
    import tzip.client as tz
    from tzip import _container
    from tzip.checkpoint import Reader, Writer
    from tzip.saving import load, save
    from tzip._dlpack import int_alias
    warnings.simplefilter("ignore")
    sock, kind, target, limit = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    c = tz.connect(sock, spawn=False, strict=True)
    _container.BATCH_BYTES = 2 << 20  # staging in /dev/shm stays far below the limit; the file does not
    g = torch.Generator().manual_seed(11)
    old = {"w": torch.randn(300, 100, generator=g), "step": torch.tensor(7)}
    folder = target if kind == "dcp" else os.path.dirname(target)
    if kind == "save" and not os.path.exists(target):
        save(old, target, client=c)
    if kind == "dcp" and not os.path.exists(os.path.join(target, ".metadata")):
        dcp.save(old, storage_writer=Writer(target, client=c))
    before = {n: open(os.path.join(folder, n), "rb").read() for n in sorted(os.listdir(folder))}
    if limit:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    big = {f"t{i}": torch.randn(500_000, generator=g) for i in range(6)}  # 12 MB: past the limit, the tmpfs
    out = {}
    try:
        if kind == "save":
            save(big, target, client=c)
        else:
            dcp.save(big, storage_writer=Writer(target, client=c))
        out["error"] = None
    except BaseException as e:  # OSError from tzip.save; DCP wraps it in a CheckpointException (a BaseException)
        code = getattr(e, "errno", None)
        m = re.search(r"Errno (\\d+)", str(e))
        code = code or (int(m.group(1)) if m else None)
        out["error"] = errno.errorcode.get(code, repr(e)[-500:]) if code else repr(e)[-500:]
    after = {n: open(os.path.join(folder, n), "rb").read() for n in sorted(os.listdir(folder))}
    out["old_intact"] = after == before
    if kind == "save":
        back = load(target, client=c)
    else:
        back = {"w": torch.zeros(300, 100), "step": torch.tensor(0)}
        dcp.load(back, storage_reader=Reader(target, client=c))
    out["loads_old"] = all(int_alias(back[k]).numpy().tobytes() == int_alias(old[k]).numpy().tobytes() for k in old)
    print(json.dumps(out), flush=True)
""")


def _write_under_fault(socket: str, kind: str, target: Path, limit: int = 0, prefix: list[str] | None = None) -> dict:
    r = subprocess.run([*(prefix or []), PYTHON, "-c", WRITE_UNDER_FAULT, socket, kind, str(target), str(limit)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_dcp_save_efbig_keeps_the_previous_checkpoint(shared_daemon, tmp_path):
    out = _write_under_fault(shared_daemon.socket, "dcp", tmp_path / "ckpt", limit=8 << 20)
    assert out == {"error": "EFBIG", "old_intact": True, "loads_old": True}, out


@needs_tmpfs
def test_dcp_save_on_a_full_tmpfs_keeps_the_previous_checkpoint(shared_daemon, tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    script = f'mount -t tmpfs -o size=8m tmpfs {mnt} && exec "$@"'
    r = subprocess.run(["unshare", "-rm", "sh", "-c", script, "sh", PYTHON, "-c", WRITE_UNDER_FAULT, shared_daemon.socket,
                        "dcp", str(mnt / "ckpt"), "0"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out == {"error": "ENOSPC", "old_intact": True, "loads_old": True}, out


@pytest.mark.parametrize("kind", ["save", "dcp"])
def test_writing_into_a_folder_that_takes_no_new_files(client, tmp_path, kind):
    """tzip.save and DCP into a folder where the temporary file cannot be made: an error, the old files untouched."""
    folder = tmp_path / "f"
    folder.mkdir()
    old = {"w": torch.randn(200, 50, generator=torch.Generator().manual_seed(12))}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        if kind == "save":
            save(old, folder / "m.tzip", client=client)
        else:
            dcp.save(old, storage_writer=Writer(folder, client=client))
        before = {p.name: p.read_bytes() for p in folder.iterdir()}
        with no_new_files(folder):
            with pytest.raises((OSError, CheckpointException)) as err:
                if kind == "save":
                    save({"w": torch.randn(10)}, folder / "m.tzip", client=client)
                else:
                    dcp.save({"w": torch.randn(10)}, storage_writer=Writer(folder, client=client))
        assert "EPERM" in repr(err.value) or "EACCES" in repr(err.value) or "Operation not permitted" in str(err.value) \
            or "Permission denied" in str(err.value), repr(err.value)
        assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
        if kind == "save":
            back = load(folder / "m.tzip", client=client)
        else:
            back = {"w": torch.zeros(200, 50)}
            dcp.load(back, storage_reader=Reader(folder, client=client))
    assert raw_bytes(back["w"]) == raw_bytes(old["w"])


# --------------------------------------------------------------------------------------------- damaged files


def regions(path: Path) -> dict[str, tuple[int, int]]:
    """Byte ranges of a .tzip file: the fixed prefix with the header's length, the safetensors JSON header (names,
    dtypes, shapes, metadata), the frames, the index and trailer."""
    size = path.stat().st_size
    with ContainerReader(path) as r:
        frames = sorted((e.frame_offset, e.frame_offset + e.frame_bytes) for e in r.entries if e.frame_bytes)
        n = len(r.entries)
        json_end = 24 + len(r.header_bytes)
    return {"prefix": (0, 32), "json": (32, json_end), "frames": (frames[0][0], frames[-1][1]),
            "index": (size - 32 - 32 * n, size)}


def flip_positions(path: Path, per_region: int, seed: int, skip: tuple[str, ...] = ()) -> list[tuple[str, int, int]]:
    """(region, byte, bit) for ``per_region`` random bytes of each region but ``skip`` (fixed seed)."""
    rng = random.Random(seed)
    out = []
    for name, (a, b) in regions(path).items():
        if name in skip:
            continue
        for pos in sorted(rng.sample(range(a, b), min(per_region, b - a))):
            out.append((name, pos, rng.randrange(8)))
    return out


def flipped(data: bytes, pos: int, bit: int) -> bytes:
    return data[:pos] + bytes([data[pos] ^ (1 << bit)]) + data[pos + 1:]


def test_cli_on_damaged_files_reports_damage_never_other_data(sources, tmp_path):
    """`tzip decompress` (every digest checked while the safetensors file is rebuilt) and `tzip verify` on truncated
    and bit-flipped copies of a `tzip compress` file (prefix, JSON header, frames, index, trailer): exit 2 with a damage
    code and no output file."""
    good = sources["small.tzip"].read_bytes()
    bad, out = tmp_path / "bad.tzip", tmp_path / "out.safetensors"
    cases = [("cut", n, 0) for n in (0, 9, len(good) // 2, len(good) - 1)] + flip_positions(sources["small.tzip"], 3, 15)
    for k, (region, pos, bit) in enumerate(cases):
        bad.write_bytes(good[:pos] if region == "cut" else flipped(good, pos, bit))
        r = subprocess.run(tzip_cmd("--json", "decompress", str(bad), "-o", str(out)), capture_output=True, text=True,
                           cwd=ROOT, timeout=120)
        assert r.returncode == 2, (region, pos, r.returncode, r.stderr)
        assert json.loads(r.stdout)["error"]["code"] in DAMAGE_CODES + ("TZIP_UNSUPPORTED",), (region, pos, r.stdout)
        assert not out.exists() and leftovers(tmp_path) == []
        if k % 3 == 0:
            v = subprocess.run(tzip_cmd("verify", str(bad)), capture_output=True, text=True, cwd=ROOT, timeout=120)
            assert v.returncode == 2, (region, pos, v.stdout, v.stderr)


def test_a_flip_in_the_stored_safetensors_header_is_detected(sources, tmp_path):
    """The gap of issue 15, closed by the prefix's header digest (docs/container.md, flag bit 0)."""
    good = sources["small.tzip"].read_bytes()
    original = sources["small"].read_bytes()
    a, b = regions(sources["small.tzip"])["json"]
    name_at = good.index(b'"', a) + 2  # the second letter of the first tensor name (the JSON starts '{"')
    assert good[name_at - 1 : name_at + 9] == b"embeddings", good[a : a + 80]
    bad, out = tmp_path / "bad.tzip", tmp_path / "out.safetensors"
    bad.write_bytes(flipped(good, name_at, 0))  # "embeddings..." -> "elbeddings..."
    r = subprocess.run(tzip_cmd("decompress", str(bad), "-o", str(out)), capture_output=True, text=True, cwd=ROOT,
                       timeout=120)
    assert r.returncode == 2 or out.read_bytes() == original, "exit 0 and a safetensors file that is not the original"


def test_tzip_load_of_damaged_files_always_raises_or_gives_the_same_tensors(client, sources, tmp_path):
    """tzip.load of a `tzip compress` file truncated at 40 lengths and with one bit flipped at 320 places of its
    prefix, JSON header, frames, index and trailer (fixed seeds): always a damage error."""
    src = sources["small.tzip"]
    good = src.read_bytes()
    bad = tmp_path / "bad.tzip"
    rng = random.Random(16)
    for n in sorted(rng.sample(range(len(good)), 40)):
        bad.write_bytes(good[:n])
        with pytest.raises(ContainerError) as err:
            load(bad, client=client)
        assert err.value.code in DAMAGE_CODES, (n, err.value)
    for region, pos, bit in flip_positions(src, 80, 17):
        bad.write_bytes(flipped(good, pos, bit))
        with pytest.raises(ContainerError) as err:
            load(bad, client=client)
        assert err.value.code in DAMAGE_CODES + ("TZIP_UNSUPPORTED",), (region, pos, err.value)


def test_dcp_load_of_damaged_files_always_raises(client, tmp_path):
    """DCP load of a checkpoint whose data file is truncated at 10 lengths and has one bit flipped at 60 places of its
    prefix, JSON header, frames, index and trailer, and whose .metadata has one bit flipped at 12 places (fixed seeds): always a
    damage error; the undamaged files load bit for bit."""
    folder = tmp_path / "ckpt"
    w = real_weights(1 << 40)
    sd = {k: w[k].clone() for k in ("encoder.layer.0.attention.self.query.weight", "encoder.layer.0.output.LayerNorm.bias")}
    sd["step"] = torch.tensor(12)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(sd, storage_writer=Writer(folder, client=client))
    data_file = next(folder.glob("__0_*.tzip"))
    meta = folder / METADATA_FILE
    good, good_meta = data_file.read_bytes(), meta.read_bytes()
    flips = flip_positions(data_file, 15, 19)

    def load_raises() -> bool:
        """True when the load raised a damage error, False when it gave the saved state (anything else fails)."""
        back = {k: torch.zeros_like(v) for k, v in sd.items()}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            try:
                dcp.load(back, storage_reader=Reader(folder, client=client))
            except (CheckpointException, ContainerError) as e:
                assert any(c in str(e) for c in DAMAGE_CODES + ("TZIP_UNSUPPORTED", "digest")), str(e)[-2000:]
                return True
        assert all(raw_bytes(back[k]) == raw_bytes(sd[k]) for k in sd), "the load gave different data"
        return False

    rng = random.Random(18)
    for n in sorted(rng.sample(range(len(good)), 10)):
        data_file.write_bytes(good[:n])
        assert load_raises(), n
    for region, pos, bit in flips:
        data_file.write_bytes(flipped(good, pos, bit))
        assert load_raises(), (region, pos)
    data_file.write_bytes(good)
    for pos in sorted(rng.sample(range(len(good_meta)), 12)):
        meta.write_bytes(flipped(good_meta, pos, rng.randrange(8)))
        assert load_raises(), pos  # .metadata carries a digest of all of it
    meta.write_bytes(good_meta)
    assert not load_raises()


# --------------------------------------------------------------------------------------------- the header digest


def _old_format(data: bytes) -> bytes:
    """The file as writers made it before the header digest (docs/container.md): flags 0, the u32 at offset 12 zero;
    every other byte is the same."""
    return data[:10] + bytes(6) + data[16:]


@pytest.fixture(scope="module")
def header_digest_files(sources, client, tmp_path_factory) -> dict[str, tuple[Path, dict[str, torch.Tensor]]]:
    """A .tzip of each writer, with its tensors: `tzip compress` (src/writer.ts) and tzip.save (tzip/_container.py),
    the latter with a __metadata__ of its own (tzip.save's tree) and an extra string value."""
    from safetensors.torch import load_file

    d = tmp_path_factory.mktemp("digest")
    state = {"embeddings.weight": real_weights(1 << 40)["embeddings.position_embeddings.weight"][:8].clone(),
             "step": torch.tensor(100)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        save(state, d / "saved.tzip", client=client)
    return {"compress": (sources["small.tzip"], load_file(str(sources["small"]))), "save": (d / "saved.tzip", state)}


def _header_flip(data: bytes, what: str) -> tuple[int, int]:
    """(byte, bit) of a flip in the stored header: a tensor name, the __metadata__ JSON or the length N."""
    n = int.from_bytes(data[24:32], "little")
    json_text = data[32 : 32 + n]
    if what == "name":  # a tensor's key, not its mention in tzip.save's tree (a string in __metadata__)
        m = re.search(rb'"embeddings[^"\\]*":\{"dtype"', json_text)
        assert m is not None, json_text[:300]
        return 32 + m.start() + 2, 0  # "embeddings..." -> "elbeddings..."
    if what == "metadata":
        at = json_text.index(b'"format":"pt"') + len(b'"format":"')
        return 32 + at, 0  # "pt" -> "qt": a value no reader looks at, so only the digest can tell
    return 24, 0  # N + 1 or N - 1: still within the file, so the digest is computed over the wrong bytes


@pytest.mark.parametrize("writer, what", [("compress", "name"), ("compress", "length"), ("save", "name"),
                                          ("save", "metadata"), ("save", "length")])  # save_file wrote no __metadata__
def test_a_flip_in_the_stored_header_is_a_checksum_error(header_digest_files, client, tmp_path, writer, what):
    """One bit flipped in a tensor name, in __metadata__ or in the header length of a file of either writer:
    TZIP_CHECKSUM from ContainerReader, tzip.load, `tzip verify` and `tzip decompress` (exit 2, no output file)."""
    path, _ = header_digest_files[writer]
    good = path.read_bytes()
    pos, bit = _header_flip(good, what)
    bad, out = tmp_path / "bad.tzip", tmp_path / "out.safetensors"
    bad.write_bytes(flipped(good, pos, bit))
    with pytest.raises(ContainerError) as err:
        ContainerReader(bad)
    assert err.value.code == "TZIP_CHECKSUM" and "header digest" in str(err.value) and str(bad) in str(err.value)
    with pytest.raises(ContainerError) as err:
        load(bad, client=client)
    assert err.value.code == "TZIP_CHECKSUM", err.value
    for args in (["--json", "verify", str(bad)], ["--json", "decompress", str(bad), "-o", str(out)]):
        r = subprocess.run(tzip_cmd(*args), capture_output=True, text=True, cwd=ROOT, timeout=120)
        assert r.returncode == 2, (args, r.returncode, r.stdout, r.stderr)
        assert json.loads(r.stdout)["error"]["code"] == "TZIP_CHECKSUM", r.stdout
    assert not out.exists() and leftovers(tmp_path) == []


@pytest.mark.parametrize("writer", ["compress", "save"])
def test_both_writers_store_the_header_digest(header_digest_files, writer):
    from tzip._container import FLAG_HEADER_DIGEST
    from tzip._xxh32 import xxh32

    data = header_digest_files[writer][0].read_bytes()
    n = int.from_bytes(data[24:32], "little")
    assert int.from_bytes(data[10:12], "little") == FLAG_HEADER_DIGEST
    assert int.from_bytes(data[12:16], "little") == xxh32(data[24 : 32 + n])


@pytest.mark.parametrize("writer", ["compress", "save"])
def test_a_file_written_before_the_header_digest_still_reads(header_digest_files, client, sources, tmp_path, writer):
    """Flags 0 and a zero field at offset 12 (what writers made before the digest): ContainerReader, tzip.load,
    `tzip verify` and `tzip decompress` read it as before, bit for bit. A flip that clears the flag of a new file leaves
    the digest in a field that must then be zero: TZIP_CORRUPT."""
    path, tensors = header_digest_files[writer]
    good = path.read_bytes()
    old = tmp_path / "old.tzip"
    old.write_bytes(_old_format(good))
    with ContainerReader(old) as r:
        assert r.header_bytes == good[24 : 32 + int.from_bytes(good[24:32], "little")]
    back = load(old, client=client)
    assert set(back) == set(tensors) and all(raw_bytes(back[k]) == raw_bytes(tensors[k]) for k in tensors)
    assert cli("verify", str(old)).returncode == 0
    if writer == "compress":
        cli("decompress", str(old), "-o", str(tmp_path / "old.safetensors"))
        assert (tmp_path / "old.safetensors").read_bytes() == sources["small"].read_bytes()
    cleared = tmp_path / "cleared.tzip"
    cleared.write_bytes(flipped(good, 10, 0))
    with pytest.raises(ContainerError) as err:
        load(cleared, client=client)
    assert err.value.code == "TZIP_CORRUPT" and "reserved prefix field" in str(err.value), err.value
