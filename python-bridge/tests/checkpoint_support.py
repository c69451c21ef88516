"""Helpers shared by the checkpoint tests (test_saving.py: tzip.save / tzip.load; test_checkpoint.py: the DCP
storage writer and reader): a strict client of the module's daemon, the real `tzip` CLI, file sizes that tolerate a
rename in flight, a writer process killed halfway through its file, and tensors' raw bytes.

No tests of its own.
"""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path
from typing import Callable

import pytest
import torch

import tzip.client as tz
from tzip._dlpack import int_alias

from test_client_support import MAIN, NODE, ROOT


@pytest.fixture(scope="module")
def client(shared_daemon):
    """A strict client of the module's shared daemon (a test module imports ``shared_daemon`` too)."""
    c = tz.connect(shared_daemon.socket, spawn=False, strict=True)
    yield c
    c.close()


def cli(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """Runs ``tzip ARGS`` (dist/src/cli/main.js); with ``check``, fails the test on a non-zero exit."""
    r = subprocess.run([NODE, str(MAIN), *args], capture_output=True, text=True, cwd=ROOT, timeout=300)
    if check:
        assert r.returncode == 0, f"tzip {' '.join(args)}: exit {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}"
    return r


def file_size(p: Path) -> int:
    """Bytes of ``p``, 0 once it is gone (renamed into place between the listing and the stat)."""
    try:
        return p.stat().st_size
    except FileNotFoundError:
        return 0


def raw_bytes(t: torch.Tensor) -> bytes:
    """The tensor's bytes in C order, through an integer view (so -0.0 and NaN payloads compare as bits)."""
    return int_alias(t.detach().cpu().contiguous()).numpy().tobytes()


def kill_while_writing(argv: list[str], temps: Callable[[], list[Path]], past_bytes: int = 20_000_000,
                       what: str = "the writer") -> list[Path]:
    """Starts ``argv`` (a process that prints ``writing`` before it writes), waits until the first of ``temps()`` (its
    temporary files) holds more than ``past_bytes``, kills it with SIGKILL and returns those files. Fails the test if
    the process finishes first."""
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert p.stdout.readline().strip() == b"writing", p.stderr.read().decode()[-3000:]
        while True:
            tmps = temps()
            if tmps and file_size(tmps[0]) > past_bytes:  # well into the file, not at its end
                break
            assert p.poll() is None, f"{what} finished before it could be killed: " + p.stderr.read().decode()[-2000:]
            time.sleep(0.002)
        p.send_signal(signal.SIGKILL)
        p.wait(30)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(30)
    assert p.returncode == -signal.SIGKILL
    return tmps
