"""Smoke test of ``python -m tzip.bench.training --quick --device cpu``: the whole command in a subprocess (its own
daemon, the real model, 2 gloo ranks, real checkpoint files), and the one table it prints last: its columns, a row
for every case, every row that ran bit-identical, and a reason in every row that could not run here. Nothing is
timed here: the times are whatever this machine gives; only their presence and the bit-identity are checked.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tzip.bench import training as bench_training

BRIDGE = Path(__file__).resolve().parents[1]


def _cells(line: str) -> list[str]:
    assert line.startswith("|") and line.endswith("|"), line
    return [c.strip() for c in line[1:-1].split("|")]


def _last_table(out: str) -> list[str]:
    lines = out.rstrip("\n").split("\n")
    end = len(lines)
    start = end
    while start > 0 and lines[start - 1].startswith("|"):
        start -= 1
    assert start < end, f"no table at the end of the output:\n{out}"
    return lines[start:end]


def test_quick_cpu_run_prints_one_bit_identical_table(tmp_path):
    try:
        from tzip.demo_data import source_weights_path

        source_weights_path()
    except Exception as e:  # the demo package (the real model) is what every case trains and saves
        pytest.skip(f"the bundled model is not installed: {e}")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(BRIDGE), os.environ.get("PYTHONPATH")])))
    out_json = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, "-m", "tzip.bench.training", "--quick", "--device", "cpu",
                           "--json", str(out_json)], capture_output=True, text=True, timeout=600, env=env)
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    table = _last_table(proc.stdout)
    assert _cells(table[0]) == list(bench_training.HEAD)
    assert set(table[1]) <= set("|-")
    rows = [_cells(line) for line in table[2:]]
    assert all(len(r) == len(bench_training.HEAD) for r in rows), rows
    ran = [r for r in rows if not r[1].startswith("skipped:")]
    skipped = [r for r in rows if r[1].startswith("skipped:")]
    assert not [r for r in rows if r[1].startswith("ERROR")], rows
    for case, baseline, tzip, ratio, saved, identical in ran:
        assert identical == "yes", (case, identical)
        assert baseline.endswith(" ms") and tzip.endswith(" ms"), (baseline, tzip)
        assert float(ratio) > 0
        assert saved.endswith(")") and " MB " in saved, saved
    for r in skipped:
        assert len(r[1]) > len("skipped: ") and r[2:] == ["-"] * 4, r
    names = [r[0] for r in ran]
    for prefix in ("offload, train step", "all-reduce bf16", "all-reduce fp32", "DDP fwd+bwd step",
                   "checkpoint minilm-bf16 save+fsync: vs torch.save", "checkpoint minilm-bf16 load: vs safetensors"):
        assert any(n.startswith(prefix) for n in names), (prefix, names)
    # without a GPU: torchao and the NCCL ranks say why instead of running
    why = {r[0]: r[1] for r in skipped}
    assert "cuda" in why["offload: vs torchao CPUOffloadOptimizer"]
    assert "GPU" in why["all-reduce and DDP, 2 NCCL ranks"]
    # the JSON holds the same rows, with the figures behind the cells
    r = json.loads(out_json.read_text())
    assert [bench_training.cells(x) for x in r["rows"]] == rows
    assert all(x["identical"] is True for x in r["rows"] if not x["skipped"])
    assert r["machine"]["cores"] == os.cpu_count() and r["machine"]["gpus"] == []


def test_quick_collectives_coded_in_process(tmp_path):
    try:
        from tzip.demo_data import source_weights_path

        source_weights_path()
    except Exception as e:  # the DDP row trains the bundled model
        pytest.skip(f"the bundled model is not installed: {e}")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(BRIDGE), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-m", "tzip.bench.training", "--quick", "--device", "cpu", "--cases",
                           "collectives", "--in-process"], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    rows = [_cells(line) for line in _last_table(proc.stdout)[2:]]
    assert rows and all(r[5] == "yes" and ", in-process" in r[2] for r in rows), rows
    assert any(r[0].startswith("DDP fwd+bwd step") for r in rows), rows


def test_a_row_that_is_not_bit_identical_fails_the_run():
    """What the smoke test relies on: a row whose tzip run differs prints NO and makes the exit status 1; a skipped
    row does not."""
    same = bench_training._row("a", "x", 1.0, "y", 0.5, 10, "on disk", 0.5, True)
    skipped = bench_training._row("b", skipped="needs a GPU")
    differs = bench_training._row("c", "x", 1.0, "y", 0.5, 10, "on disk", 0.5, False)
    assert bench_training.ok({"rows": [same, skipped]})
    assert not bench_training.ok({"rows": [same, skipped, differs]})
    assert not bench_training.ok({"rows": [same, bench_training._row("d", error="RuntimeError: boom")]})
    assert bench_training.cells(differs)[-1] == "NO"
    assert bench_training.cells(same) == ["a", "x 1000 ms", "y 500 ms", "0.50", "0.0 MB on disk (ratio 0.500)", "yes"]
    assert bench_training.cells(skipped) == ["b", "skipped: needs a GPU", "-", "-", "-", "-"]
