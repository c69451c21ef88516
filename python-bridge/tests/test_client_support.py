"""Shared helpers of the daemon client tests (test_client_*.py): a daemon per test or module, started as
the real `tzip serve` process on a socket in a private temporary folder and stopped afterwards, plus a raw
protocol connection for sending the daemon whatever bytes a test likes.

This module has no tests of its own except a check that the helpers work.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch
import zmq

ROOT = Path(__file__).resolve().parents[2]
MAIN = ROOT / "dist" / "src" / "cli" / "main.js"
NODE = os.environ.get("TZIP_NODE", "node")
PYTHON = sys.executable


def _newest(path: Path) -> float:
    return max((p.stat().st_mtime for p in path.rglob("*") if p.is_file()), default=0.0)


def ensure_built() -> None:
    """Compiles the TypeScript (tsc) when dist/ is missing or older than src/ (scripts/setup.sh normally does it).
    Where there is no TypeScript compiler (a GPU host with production node_modules only), a dist/ that exists is used
    as it is (it was built where the sources were)."""
    tsc = ROOT / "node_modules" / "typescript" / "bin" / "tsc"
    if MAIN.exists() and (not tsc.exists() or _newest(ROOT / "dist" / "src") >= _newest(ROOT / "src")):
        return
    subprocess.run([NODE, str(tsc), "-p", str(ROOT / "tsconfig.json")], check=True, cwd=ROOT)


class DaemonProcess:
    """A `tzip serve` child process on ``socket``."""

    def __init__(self, socket: str, *args: str):
        self.socket = socket
        self.args = list(args)
        self.proc: subprocess.Popen | None = None
        self._log_start = 0
        # next to the socket folder (the daemon makes that folder itself, mode 0700)
        self.log = os.path.join(os.path.dirname(os.path.dirname(socket)), f"{os.path.basename(os.path.dirname(socket))}.{time.monotonic_ns()}.log")

    def start(self, timeout: float = 20.0) -> "DaemonProcess":
        ensure_built()
        logf = open(self.log, "ab")
        self._log_start = logf.tell()  # a restarted daemon appends: its ready line comes after this offset
        self.proc = subprocess.Popen([NODE, str(MAIN), "serve", "--socket", self.socket, *self.args],
                                     stdout=logf, stderr=logf, stdin=subprocess.DEVNULL, cwd=ROOT)
        logf.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if os.path.exists(self.socket) and self._lock_pid() == self.proc.pid and self.ready_line() is not None:
                return self
            if self.proc.poll() is not None:
                break
            time.sleep(0.02)
        raise RuntimeError(f"daemon did not start: {self.read_log()}")

    def _lock_pid(self) -> int | None:
        try:
            with open(self.socket + ".lock") as f:
                return int(json.load(f)["pid"])
        except (OSError, ValueError, KeyError):
            return None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL, reaped (the socket file and lock stay behind, as after a crash)."""
        if self.alive():
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()

    def ready_line(self) -> str | None:
        """The line `tzip serve` prints on stdout once every endpoint is bound (plain or --json), or None yet. Only
        this line counts: stderr's earlier lines (e.g. "also listening on tcp://...") can reach the shared log file
        before it."""
        try:
            with open(self.log, "rb") as f:
                f.seek(self._log_start)
                text = f.read().decode(errors="replace")
        except OSError:
            return None
        m = re.search(r'^(?:tzip serve: listening on |\{"event":"listening").*$', text, re.MULTILINE)
        return m.group(0) if m else None

    def read_log(self) -> str:
        try:
            return Path(self.log).read_text(errors="replace")
        except OSError:
            return ""


#: Every torch dtype the client round-trips (those this torch build has).
ALL_DTYPES = [d for d in [
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.uint16, torch.int32, torch.uint32, torch.int64, torch.uint64,
    torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex32, torch.complex64, torch.complex128,
    getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None), getattr(torch, "float8_e4m3fnuz", None),
    getattr(torch, "float8_e5m2fnuz", None), getattr(torch, "float8_e8m0fnu", None), getattr(torch, "float4_e2m1fn_x2", None),
    getattr(torch, "bits8", None), getattr(torch, "bits16", None), getattr(torch, "uint1", None), getattr(torch, "int4", None),
] if d is not None]


def daemon_stats(socket: str, sid: str | None = None) -> dict:
    """The daemon's `stats` reply, over a connection of its own (with `sid`: that session's part too)."""
    c = RawConn(socket)
    try:
        return c.req({"id": 1, "op": "stats", **({"sid": sid} if sid else {})})
    finally:
        c.close()


def run_in_threads(fn, n: int, timeout: float) -> None:
    """``fn(k)`` on ``n`` threads at once (k = 0..n-1), each joined within ``timeout`` seconds; ``fn`` records its
    own failures (an exception on a thread is not raised here)."""
    threads = [threading.Thread(target=fn, args=(k,)) for k in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout)


def wait_for(cond, timeout=10.0, step=0.02):
    """Polls ``cond()`` every ``step`` seconds until it returns something true (returned) or ``timeout`` seconds
    pass (then its last value is returned)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(step)
    return cond()


@pytest.fixture
def sock_dir():
    """A private temporary folder (0700) for one test's socket; its shm leftovers are checked."""
    with tempfile.TemporaryDirectory(prefix="tzip-t-") as d:
        os.chmod(d, 0o700)
        yield d


@pytest.fixture
def daemon(sock_dir):
    """A daemon for one test (lease 2 s)."""
    d = DaemonProcess(os.path.join(sock_dir, "s", "tzip.sock"), "--lease-ms", "2000").start()
    yield d
    d.stop()


@pytest.fixture(scope="module")
def shared_daemon():
    """A daemon for a whole test module."""
    with tempfile.TemporaryDirectory(prefix="tzip-m-") as d:
        dp = DaemonProcess(os.path.join(d, "s", "tzip.sock")).start()
        yield dp
        dp.stop()


class RawConn:
    """A bare DEALER speaking MessagePack to the daemon, for hostile and protocol-level tests."""

    def __init__(self, socket: str):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.linger = 0
        self.sock.rcvtimeo = 10_000
        self.sock.connect(f"ipc://{socket}")
        self.sid: str | None = None
        self.prefix = f"tzip-{os.getpid()}-{os.urandom(6).hex()}-"
        self.pid = os.getpid()

    def send_raw(self, *parts: bytes) -> dict[str, Any]:
        self.sock.send_multipart(list(parts))
        return msgpack.unpackb(self.sock.recv(), raw=False)

    def req(self, msg: dict[str, Any]) -> dict[str, Any]:
        return self.send_raw(msgpack.packb(msg, use_bin_type=True))

    def hello(self, **over) -> dict[str, Any]:
        msg = {"id": 1, "op": "hello", "versions": [1], "pid": self.pid, "shm_prefix": self.prefix, **over}
        r = self.req(msg)
        if r.get("ok"):
            self.sid = r["sid"]
        return r

    def call(self, op: str, **body) -> dict[str, Any]:
        return self.req({"id": 7, "op": op, "sid": self.sid, **body})

    def alive(self) -> bool:
        r = self.call("heartbeat")
        return r.get("ok") is True

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


def test_support_daemon_starts_and_answers(daemon):
    conn = RawConn(daemon.socket)
    try:
        assert conn.hello()["ok"]
        assert conn.alive()
        assert oct(os.stat(os.path.dirname(daemon.socket)).st_mode & 0o777) == "0o700"
    finally:
        conn.close()


def daemon_jobs(socket: str) -> dict:
    """The daemon's `jobs` reply (protocol version 3: the job registry), over a connection of its own."""
    c = RawConn(socket)
    try:
        return c.req({"id": 1, "op": "jobs"})
    finally:
        c.close()


def daemon_set(socket: str, **settings) -> dict:
    """The daemon's reply to a `set` op (protocol version 3; ``job=`` names the job, ``codec=`` / ``sm_budget=``
    the settings, None clears one), over a connection of its own."""
    c = RawConn(socket)
    try:
        return c.req({"id": 1, "op": "set", **settings})
    finally:
        c.close()
