"""The README's "With Hugging Face Trainer", "With Accelerate" and "With torchrun" examples, run as a user runs them:
``torchrun --standalone --nproc-per-node 2 examples/<name>.py`` (2 gloo ranks on the CPU, small settings). Each
example trains twice itself, without and with tzip, and exits 1 unless the losses (float bits) and the final
parameters of every rank (bytes) agree; these tests also check from its output that the gradients really travelled
compressed (fewer bytes sent than plain DDP's ring all-reduce would send).

One real daemon for the module (`tzip serve` on a private socket); the examples' clients can never start one of
their own ($TZIP_CLI names no file). torchrun and its ranks run in a process group of their own, killed when a run
overstays its timeout.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from test_client_support import shared_daemon as daemon  # noqa: F401  (one daemon for the module)

pytest.importorskip("accelerate")  # the test extra pins it
pytest.importorskip("transformers")  # the demo extra pins it

ROOT = Path(__file__).resolve().parents[2]


def torchrun(daemon, script: str, *args: str, timeout: float = 300.0) -> subprocess.CompletedProcess:
    """``python -m torch.distributed.run --standalone --nproc-per-node 2 examples/<script> ARGS`` from the repository
    root, its clients on the module's daemon; the whole process group is killed after ``timeout`` seconds."""
    with tempfile.TemporaryDirectory(prefix="tzip-nocli-") as d:
        env = dict(os.environ)
        bridge = str(ROOT / "python-bridge")
        env.update({"TZIP_SOCKET": daemon.socket, "TZIP_CLI": os.path.join(d, "no-cli.js"),
                    "PYTHONPATH": os.pathsep.join([bridge, env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
                    "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                    "TOKENIZERS_PARALLELISM": "false"})
        if os.path.exists("/sys/class/net/lo"):
            env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(k, None)  # torchrun sets them for its ranks
        p = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                              str(ROOT / "examples" / script), *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            out, err = p.communicate()
            pytest.fail(f"{script} not done within {timeout} s; killed:\n{out[-3000:]}\n{err[-3000:]}")
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def json_line(cp: subprocess.CompletedProcess) -> dict:
    lines = [ln for ln in cp.stdout.splitlines() if ln.startswith('{"ranks"')]
    assert len(lines) == 1, (cp.stdout[-3000:], cp.stderr[-3000:])
    return json.loads(lines[0])


def test_trainer_callback_example(daemon):
    """examples/trainer_callback.py: two real Trainer runs (without and with TzipCallback) agree bit for bit, and
    the Trainer's logs carry the callback's figures with fewer bytes sent than plain DDP's."""
    cp = torchrun(daemon, "trainer_callback.py", "--layers", "1", "--steps", "2")
    assert cp.returncode == 0, (cp.stdout[-3000:], cp.stderr[-3000:])
    assert "bit-identical (losses by their float bits, parameters by their bytes, every rank): yes" in cp.stdout
    logged = [json.loads(ln.replace("'", '"')) for ln in cp.stdout.splitlines()
              if ln.startswith("{'loss'") and "tzip/bytes_raw" in ln]
    assert len(logged) == 2, cp.stdout[-3000:]
    assert all(0 < int(e["tzip/bytes_sent"]) < int(e["tzip/bytes_raw"]) for e in logged), logged


def test_accelerate_example(daemon):
    """examples/accelerate_ddp.py: Accelerate's prepared model is a DistributedDataParallel that takes tzip's hook;
    with gradient accumulation 2 (accelerator.accumulate: no_sync between steps) every micro-batch's loss and the
    final parameters of both ranks equal plain Accelerate's, bit for bit, and the buckets went compressed."""
    cp = torchrun(daemon, "accelerate_ddp.py", "--layers", "1", "--steps", "2", "--accumulation", "2", "--json")
    assert cp.returncode == 0, (cp.stdout[-3000:], cp.stderr[-3000:])
    s = json_line(cp)
    assert s["identical"] is True and s["ranks"] == 2 and s["ddp"] == "DistributedDataParallel"
    assert s["micro_batches"] == 4 and s["loss_bits"]["tzip"] == s["loss_bits"]["plain"]
    assert len(set(s["loss_bits"]["plain"])) > 1  # real training: the losses move
    assert all(v["plain"] == v["tzip"] for v in s["params_sha256"].values())
    assert s["buckets"] > 0 and 0 < s["bytes_sent"] < s["bytes_raw"]


def test_torchrun_example(daemon):
    """examples/torchrun_ddp.py: torchrun's environment, init_process_group(), DDP and the two lines of the hook;
    the losses and final parameters equal plain DDP's bit for bit, and the buckets went compressed."""
    cp = torchrun(daemon, "torchrun_ddp.py", "--steps", "2", "--json")
    assert cp.returncode == 0, (cp.stdout[-3000:], cp.stderr[-3000:])
    s = json_line(cp)
    assert s["identical"] is True and s["ranks"] == 2
    assert len(s["loss_bits"]["tzip"]) == 2 and s["loss_bits"]["tzip"] == s["loss_bits"]["plain"]
    assert s["buckets"] > 0 and 0 < s["bytes_sent"] < s["bytes_raw"]
