"""Helpers shared by the checkpoint tests (test_saving.py: tzip.save / tzip.load; test_checkpoint.py: the DCP
storage writer and reader): a strict client of the module's daemon, the real `tzip` CLI, file sizes that tolerate a
rename in flight, and tensors' raw bytes.

No tests of its own.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

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
