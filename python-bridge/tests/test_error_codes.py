"""The Python side of tzip's one error vocabulary (issue 15, item 6): ``tzip._errors`` against the table
``src/errors.json`` (codes, values, the exception class of each code), every code literal of the package, and a
real daemon out of memory: its replies carry TZIP_OUT_OF_MEMORY and the client raises OutOfMemoryError.
(test/error-codes.test.ts checks the C++, TypeScript and docs sides.)"""

from __future__ import annotations

import json
import pickle
import re
import resource
import sys

import pytest
import torch
from safetensors.torch import load_file

import tzip
from tzip import _errors
from tzip._errors import ERROR_CODES, DeviceUnavailableError, OutOfMemoryError, TzipDaemonError

from test_client_support import ROOT, daemon, sock_dir  # noqa: F401

TABLE = json.loads((ROOT / "src" / "errors.json").read_text())["codes"]


def test_error_codes_are_the_tables_in_its_order():
    assert list(ERROR_CODES.items()) == [(r["name"], r["value"]) for r in TABLE]


def test_generated_constants_are_the_tables():
    """tzip._generated_constants (scripts/gen-constants.mjs) is src/errors.json, and the modules that kept their own
    names for the constants take them from it; the reference decoder (an independent implementation, kept by hand on
    purpose) agrees with it."""
    from tzip import _frame, _generated_constants as g, _job, _ring, reference

    spec = json.loads((ROOT / "src" / "errors.json").read_text())
    assert g.ERROR_CODES == {r["name"]: r["value"] for r in TABLE}
    assert g.ERROR_CLASS_NAMES == {r["name"]: r["python"] for r in TABLE if "python" in r}
    assert g.CODEC_IDS == {c["name"]: c["id"] for c in spec["codecs"]} == {"raw": 0, "fast": 1, "max": 2, "bytes": 3}
    assert g.DTYPE_CODES == {d["name"]: d["code"] for d in spec["dtypes"]}
    assert g.DTYPE_SIZES == {d["name"]: d["bytes"] for d in spec["dtypes"]}
    assert (g.SM_BUDGET_DEFAULT, g.MAX_SM_BUDGET) == (spec["sm_budget"]["default"], spec["sm_budget"]["max"]) == (10, 1024)
    assert (_frame.DTYPE_CODES, _frame.CODEC_IDS, _frame.MAGIC) == (g.DTYPE_CODES, g.CODEC_IDS, b"TZFR")
    assert _ring.CODEC_CODES == {"raw": 0, "fast": 1, "max": 2, "bytes": 3, "auto": 255}
    assert _ring.STREAM_TAGS == {None: 0, "other": 0, "gradients": 1, "optimizer": 2, "checkpoint": 3, "sendrecv": 4}
    assert (_job.STREAMS, _job.MAX_SM_BUDGET) == (("gradients", "optimizer", "checkpoint", "sendrecv", "other"), 1024)
    assert reference.CODECS == {v: k for k, v in g.CODEC_IDS.items()}
    assert reference.DTYPES == {g.DTYPE_CODES[n]: (n, g.DTYPE_SIZES[n]) for n in g.DTYPE_CODES}
    assert (reference.MAGIC, reference.FORMAT_VERSION) == (g.MAGIC, g.FORMAT_VERSION)


def test_each_code_raises_its_class():
    for r in TABLE:
        cls = getattr(_errors, r.get("python", "TzipDaemonError"))
        e = TzipDaemonError(r["name"], "why", 2, 64)
        assert type(e) is cls, r["name"]
        assert (e.code, e.detail, e.index, e.need, str(e)) == (r["name"], "why", 2, 64, f"{r['name']}: why")
        back = pickle.loads(pickle.dumps(e))  # multiprocessing and torch.distributed's object collectives pickle it
        assert type(back) is cls and (back.code, back.detail, back.index, back.need) == (e.code, e.detail, 2, 64)
    oom = TzipDaemonError("TZIP_OUT_OF_MEMORY", "x")
    assert isinstance(oom, OutOfMemoryError) and isinstance(oom, MemoryError) and isinstance(oom, RuntimeError)
    assert isinstance(TzipDaemonError("TZIP_NO_DEVICE", "x"), DeviceUnavailableError)


def test_every_code_literal_of_the_package_is_in_the_table():
    env = re.compile(r"""(?:environ(?:\.get)?\s*[\[(]|getenv\(|setenv\()\s*["'](TZIP_\w+)["']""")
    literal = re.compile(r"""["'](TZIP_[A-Z0-9_]+)["']""")
    files = sorted((ROOT / "python-bridge" / "tzip").rglob("*.py"))
    env_names = {m for f in files for m in env.findall(f.read_text())}
    unknown = [f"{f.name}: {m}" for f in files for m in literal.findall(f.read_text())
               if m not in ERROR_CODES and m not in env_names]
    assert unknown == []


def _vm_size(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(re.search(r"VmSize:\s+(\d+)", f.read()).group(1)) * 1024


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs Linux (prlimit, /proc)")
def test_daemon_out_of_memory_is_out_of_memory_error_and_the_daemon_serves_on(daemon):  # noqa: F811
    """The daemon's address space is capped (soft RLIMIT_AS, 64 MiB above what it maps) so that it cannot map a
    192 MiB tensor's shared memory: the reply is TZIP_OUT_OF_MEMORY, the client raises OutOfMemoryError; with the
    cap lifted the same tensor round-trips bit for bit on the same daemon."""
    from tzip.demo_data import source_weights_path

    trained = load_file(str(source_weights_path()))  # all-MiniLM-L6-v2's trained weights, as packaged
    weights = torch.cat([t.flatten() for t in trained.values()])
    big = weights.repeat((48 << 20) // weights.numel() + 1)[: 48 << 20].clone()  # 192 MiB
    c = tzip.connect(daemon.socket, spawn=False, strict=True)
    try:
        small = c.compress(weights[:4096].clone())
        assert torch.equal(c.decompress(small).view(torch.int32), weights[:4096].view(torch.int32))
        soft, hard = resource.prlimit(daemon.pid, resource.RLIMIT_AS)
        resource.prlimit(daemon.pid, resource.RLIMIT_AS, (_vm_size(daemon.pid) + (64 << 20), hard))
        try:
            with pytest.raises(OutOfMemoryError) as err:
                c.compress(big)
        finally:
            resource.prlimit(daemon.pid, resource.RLIMIT_AS, (soft, hard))
        assert err.value.code == "TZIP_OUT_OF_MEMORY" and isinstance(err.value, MemoryError), err.value
        assert daemon.alive()
        ct = c.compress(big)
        assert torch.equal(c.decompress(ct).view(torch.int32), big.view(torch.int32))
    finally:
        c.close()
