"""Fault injection with real processes around a real daemon (issue 15, item 2): a client SIGKILLed in the middle of
a large CPU request, the daemon SIGKILLed in the middle of a request and restarted (lenient, strict and spawning
clients), a forked child of a process with a connected client (os.fork and multiprocessing "fork"), and how fast a
client process whose daemon died exits. Every round trip is compared as integer views.

Forked children call ``torch.set_num_threads(1)`` first, as PyTorch's DataLoader workers do: PyTorch's OpenMP pool
is not fork-safe (a child of a process that ran a parallel op hangs in its first parallel op, tzip or not).
"""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import textwrap
import threading
import time
import warnings

import pytest
import torch

import tzip.client as tz
from tzip._dlpack import int_alias

from test_client_support import PYTHON, DaemonProcess, RawConn, daemon, sock_dir, wait_for, daemon_stats as stats  # noqa: F401


def bits(t: torch.Tensor) -> bytes:
    return int_alias(t.detach().cpu().contiguous()).numpy().tobytes()


def weights(n: int, seed: int) -> torch.Tensor:
    """``n`` bf16 values shaped like trained weights (a compressible float stream, not zeros)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g) * 0.02).to(torch.bfloat16)


def shm_files(prefix: str) -> list[str]:
    return glob.glob(f"/dev/shm/{prefix}*")


# --------------------------------------------------------------------------------------------- a client killed


VICTIM = textwrap.dedent("""
    import sys, torch
    import tzip.client as tz
    sock, op = sys.argv[1], sys.argv[2]
    # ZeroMQ requests (the session's "inflight" counts them; a client killed mid-submission on the submission ring:
    # test_ring.py)
    c = tz.connect(sock, spawn=False, strict=True, ring_entries=0)
    big = (torch.randn(16 << 20, generator=torch.Generator().manual_seed(1)) * 0.02).to(torch.bfloat16)  # 32 MiB
    ct = c.compress(big, codec="fast") if op == "decompress" else None
    print("READY", c.shm_prefix, c._session.sid, flush=True)
    while True:
        if op == "compress":
            c.compress(big, codec="max")
        else:
            c.decompress(ct)
""")


@pytest.mark.parametrize("op", ["compress", "decompress"])
def test_client_killed_mid_request(daemon, op):
    """The daemon serves another client while the victim's request runs and after the victim is killed in the middle
    of it; the victim's session and mappings go (stats), and its /dev/shm files are removed within its lease."""
    survivor = tz.connect(daemon.socket, spawn=False, strict=True)
    victim = subprocess.Popen([PYTHON, "-c", VICTIM, daemon.socket, op], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        line = victim.stdout.readline().decode().split()
        assert line[:1] == ["READY"], victim.stderr.read().decode()[-3000:]
        prefix, sid = line[1], line[2]
        assert wait_for(lambda: stats(daemon.socket, sid).get("session", {}).get("inflight", 0) >= 1, 60, 0.002)
        mid = stats(daemon.socket, sid)["session"]
        assert mid["mapped"]["files"] >= 1 and shm_files(prefix)
        # served while the victim's request runs
        t = weights(300_000, 2)
        assert bits(survivor.decompress(survivor.compress(t))) == bits(t)
        victim.send_signal(signal.SIGKILL)
        victim.wait(10)
        killed_at = time.monotonic()
        assert wait_for(lambda: "session" not in stats(daemon.socket, sid), 15), stats(daemon.socket, sid)
        assert wait_for(lambda: not shm_files(prefix), 15), shm_files(prefix)
        gone_after = time.monotonic() - killed_at
        s = wait_for(lambda: (lambda st: st if st["inflight"] == 0 else None)(stats(daemon.socket)), 30)
        mine = stats(daemon.socket, survivor._session.sid)["session"]
        assert s["sessions"] == 1 and s["mapped"] == mine["mapped"], (s, mine)  # nothing of the victim's is mapped
        assert s["sessions_ended"].get("disconnect", 0) + s["sessions_ended"].get("lease", 0) >= 1
        assert gone_after < 2.0 + 5.0  # within its lease (2 s) and the orphan checks
        u = torch.randint(-(1 << 62), 1 << 62, (70_001,), dtype=torch.int64)
        assert bits(survivor.decompress(survivor.compress(u))) == bits(u)
        assert daemon.alive()
    finally:
        if victim.poll() is None:
            victim.kill()
            victim.wait(10)
        victim.stdout.close()
        victim.stderr.close()
        survivor.close()


# --------------------------------------------------------------------------------------------- the daemon killed


def kill_when_busy(d: DaemonProcess, box: dict) -> threading.Thread:
    """A thread that SIGKILLs ``d`` as soon as it has a request in flight (records the time in ``box``)."""

    def run() -> None:
        try:
            wait_for(lambda: stats(d.socket)["inflight"] >= 1, 60, 0.002)
        finally:
            box["killed"] = time.monotonic()
            d.kill()

    th = threading.Thread(target=run, daemon=True)
    th.start()
    return th


def restart(d: DaemonProcess) -> None:
    again = DaemonProcess(d.socket, "--lease-ms", "2000").start()
    d.proc = again.proc  # the fixture stops the new one


def test_daemon_killed_mid_request_then_restarted(daemon):
    """Lenient: the request in flight comes back as raw frames (one warning); strict: DaemonUnavailableError; a
    non-raw decompress in flight: DaemonUnavailableError for both. After a restart each client reconnects and its
    next round trip is bit-exact and compressed."""
    # ZeroMQ requests (kill_when_busy watches the daemon's "inflight", which counts them; the same through the
    # submission ring: test_ring.py)
    lenient = tz.connect(daemon.socket, spawn=False, strict=False, ring_entries=0)
    strict = tz.connect(daemon.socket, spawn=False, strict=True, ring_entries=0)
    big = weights(12 << 20, 3)  # 24 MiB
    try:
        packed = strict.compress(big, codec="fast")
        assert packed.codec == "fast"
        slow = strict.compress(big, codec="max")
        assert slow.codec == "max"

        box: dict = {}
        th = kill_when_busy(daemon, box)
        with pytest.warns(RuntimeWarning, match="not available"):
            ct = lenient.compress(big, codec="max")
        noticed = time.monotonic() - box["killed"]
        th.join(10)
        assert not daemon.alive() and ct.codec == "raw"
        assert noticed < 5.0, noticed
        assert bits(lenient.decompress(ct)) == bits(big)  # decoded here, no daemon
        with pytest.raises(tz.DaemonUnavailableError):
            strict.compress(big)
        with pytest.raises(tz.DaemonUnavailableError):
            lenient.decompress(packed)

        for c in (strict, lenient):
            restart(daemon)
            time.sleep(tz.RETRY_INTERVAL_S)  # past the client's reconnection back-off: the call reaches the daemon
            th = kill_when_busy(daemon, box)
            with pytest.raises(tz.DaemonUnavailableError):
                # a max frame: its decode lasts long enough for kill_when_busy's 2 ms stats poll to see it in flight
                c.decompress(slow) if c is lenient else c.compress(big, codec="max")
            th.join(10)
            assert not daemon.alive()

        restart(daemon)
        time.sleep(tz.RETRY_INTERVAL_S)  # the reconnection back-off after the failures above
        for c in (lenient, strict):
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # no fallback any more
                again = c.compress(big, codec="max")
            assert again.codec == "max" and c.connected
            assert bits(c.decompress(again)) == bits(big)
            assert bits(c.decompress(packed)) == bits(big)
    finally:
        lenient.close()
        strict.close()


def test_spawning_client_redoes_a_request_cut_by_a_daemon_crash(sock_dir):
    """spawn=True (what the integrations' default client uses): the daemon killed mid-request is started again and the
    request redone within the same call: no fallback, bit-exact."""
    sock = os.path.join(sock_dir, "sp", "tzip.sock")
    c = tz.connect(sock, spawn=True, strict=True, ring_entries=0)  # ZeroMQ requests: "inflight" counts them
    first = DaemonProcess(sock)
    try:
        first_pid = c.daemon_info["pid"]
        big = weights(12 << 20, 4)

        def kill() -> None:
            wait_for(lambda: stats(sock)["inflight"] >= 1, 60, 0.002)
            os.kill(first_pid, signal.SIGKILL)

        th = threading.Thread(target=kill, daemon=True)
        th.start()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            ct = c.compress(big, codec="max")
        th.join(10)
        assert ct.codec == "max" and c.daemon_info["pid"] != first_pid
        assert bits(c.decompress(ct)) == bits(big)
        c.shutdown_daemon()
    finally:
        c.close()
        pid = first._lock_pid()
        if pid is not None:  # never leave a spawned daemon behind
            try:
                os.kill(pid, signal.SIGTERM)
            except OSError:
                pass


# --------------------------------------------------------------------------------------------- fork


FORKER = textwrap.dedent("""
    import faulthandler, json, multiprocessing as mp, os, sys, threading, time
    import torch
    import tzip, tzip._default, tzip._shm
    import tzip.client as tz
    from tzip._dlpack import int_alias
    sock = sys.argv[1]
    os.environ["TZIP_SOCKET"] = sock
    bits = lambda t: int_alias(t.contiguous()).numpy().tobytes()
    t = (torch.randn(300_000, generator=torch.Generator().manual_seed(5)) * 0.02).to(torch.bfloat16)

    def child_work(parent_client, parent_ct, parent_result):
        torch.set_num_threads(1)  # PyTorch's OpenMP pool is not fork-safe
        out = {}
        try:
            parent_client.compress(t)
            out["parent_client"] = "no error"
        except RuntimeError as e:
            out["parent_client"] = "RuntimeError: fork" if "fork" in str(e) else repr(e)
        with tz.connect(sock, spawn=False, strict=True) as fresh:  # a fresh connection of its own
            ct = fresh.compress(t, codec="max")
            out["fresh"] = ct.codec == "max" and bits(fresh.decompress(ct)) == bits(t) \\
                and bits(fresh.decompress(parent_ct)) == bits(t)
            # a tensor the parent got from the daemon, in the parent's shared memory: copied, not named as the child's
            again = fresh.compress(parent_result)
            out["parent_result"] = bits(fresh.decompress(again)) == bits(big)
        d = tzip._default.default_client(strict=True)  # the integrations' client: made again in the child
        out["default_new"] = d is not parent_client and d._pid == os.getpid()
        out["default"] = bits(d.decompress(d.compress(t))) == bits(t)
        return out

    def mp_target(q, parent_client, parent_ct, parent_result):
        q.put(child_work(parent_client, parent_ct, parent_result))

    c = tzip._default.default_client(strict=True)
    ct = c.compress(t, codec="max")
    assert bits(c.decompress(ct)) == bits(t)
    big = (torch.randn(1 << 20, generator=torch.Generator().manual_seed(7)) * 0.02).to(torch.bfloat16)
    res = c.decompress(c.compress(big))  # 2 MiB: a result in the client's own shared memory
    assert bits(res) == bits(big) and tzip._shm.find(res.data_ptr(), 2 << 20) is not None
    mine = sorted(os.path.basename(p) for p in os.listdir("/dev/shm") if p.startswith(c.shm_prefix))
    # another thread of the parent busy with requests while it forks, and one holding the segment registry's lock and
    # the default client's lock at the moment of the fork (as threads inside _shm.find() or default_client() would)
    stop = threading.Event()
    def busy():
        small = [torch.arange(i + 1, dtype=torch.int32) for i in range(50)]
        while not stop.is_set():
            c.decompress(c.compress(small))
    held, release = threading.Event(), threading.Event()
    def hold():
        # the segment registry's lock and the default client's lock, both held at the moment of the fork
        with tzip._shm._lock, tzip._default._lock:
            held.set()
            release.wait()
    threads = [threading.Thread(target=busy, daemon=True), threading.Thread(target=hold, daemon=True)]
    for th in threads:
        th.start()
    held.wait()
    results = {}
    t0 = time.monotonic()
    pid = os.fork()
    if pid == 0:
        faulthandler.dump_traceback_later(30, exit=True)  # a hang becomes a failure with its traceback
        r, code = {}, 0
        try:
            r = child_work(c, ct, res)
        except BaseException as e:
            r, code = {"error": repr(e)}, 1
        with open(sys.argv[2], "w") as f:
            json.dump(r, f)
        sys.exit(code)  # a normal interpreter exit: atexit, finalizers of the parent's client and segments
    _, status = os.waitpid(pid, 0)
    results["os_fork"] = {"status": status, "seconds": round(time.monotonic() - t0, 2),
                          **(json.load(open(sys.argv[2])) if os.path.exists(sys.argv[2]) else {})}
    release.set()
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    t0 = time.monotonic()
    p = ctx.Process(target=mp_target, args=(q, c, ct, res))
    p.start()
    try:
        got = q.get(timeout=60)
    except Exception as e:
        got = {"error": repr(e)}
    p.join(60)
    results["mp_fork"] = {"exitcode": p.exitcode, "seconds": round(time.monotonic() - t0, 2), **got}
    stop.set()
    for th in threads:
        th.join(30)
    results["parent_ok"] = bits(c.decompress(c.compress(t))) == bits(t) and bits(c.decompress(ct)) == bits(t)
    still = set(os.path.basename(p) for p in os.listdir("/dev/shm") if p.startswith(c.shm_prefix))
    results["parent_files_kept"] = set(mine) <= still
    print(json.dumps(results), flush=True)
""")


def test_forked_children_connect_afresh_and_the_parent_keeps_working(daemon, tmp_path):
    """os.fork (with a second thread of the parent in a request and another holding the shm registry lock) and
    multiprocessing's "fork": in the child the parent's client raises a clear RuntimeError, a fresh connection and the
    default client work bit-exact, the child exits normally; the parent's client and shm files are untouched."""
    r = subprocess.run([PYTHON, "-c", FORKER, daemon.socket, str(tmp_path / "child.json")], capture_output=True,
                       text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-4000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    child = {"parent_client": "RuntimeError: fork", "fresh": True, "parent_result": True, "default_new": True,
             "default": True}
    assert {k: out["os_fork"].get(k) for k in [*child, "status"]} == {**child, "status": 0}, (out, r.stderr[-3000:])
    assert {k: out["mp_fork"].get(k) for k in [*child, "exitcode"]} == {**child, "exitcode": 0}, (out, r.stderr[-3000:])
    assert out["parent_ok"] is True and out["parent_files_kept"] is True, out
    assert r.stderr.count("Traceback") == 0, r.stderr[-3000:]


# --------------------------------------------------------------------------------------------- exit time


EXITER = textwrap.dedent("""
    import sys, time, torch
    import tzip.client as tz
    sock, strict, close = sys.argv[1], sys.argv[2] == "strict", sys.argv[3] == "close"
    import warnings; warnings.simplefilter("ignore")
    c = tz.connect(sock, spawn=False, strict=strict, ring_entries=0)  # ZeroMQ requests: "inflight" counts them
    big = (torch.randn(12 << 20, generator=torch.Generator().manual_seed(6)) * 0.02).to(torch.bfloat16)
    c.compress(big[:1000])
    print("READY", flush=True)
    try:
        ct = c.compress(big, codec="max")  # the daemon is killed during this request
        what = ct.codec
    except tz.DaemonUnavailableError:
        what = "DaemonUnavailableError"
    fut = c.compress_async([big[:5000], big[5000:9000]])  # and more requests after it died
    fut.result(30) if not strict else fut.exception(30)
    if close:
        c.close()
    print("EXITING", what, flush=True)
    # no close: the interpreter's exit with the client's sockets, threads and segments still there
""")


@pytest.mark.parametrize("mode", [("lenient", "no-close"), ("strict", "close")], ids=lambda m: "-".join(m))
def test_a_client_whose_daemon_died_exits_at_once(daemon, mode, record_property):
    p = subprocess.Popen([PYTHON, "-c", EXITER, daemon.socket, *mode], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert p.stdout.readline().split() == [b"READY"], p.stderr.read().decode()[-3000:]
        box: dict = {}
        kill_when_busy(daemon, box).join(60)
        line = p.stdout.readline().decode().split()
        t_line = time.monotonic()
        p.wait(30)
        exit_s = time.monotonic() - t_line
        err = p.stderr.read().decode()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(10)
        p.stdout.close()
        p.stderr.close()
    assert line == ["EXITING", "raw" if mode[0] == "lenient" else "DaemonUnavailableError"], err[-3000:]
    assert p.returncode == 0, err[-3000:]
    noticed_s = t_line - box["killed"]
    record_property("noticed_s", round(noticed_s, 3))
    record_property("exit_s", round(exit_s, 3))
    print(f"{'-'.join(mode)}: request failed over {noticed_s:.2f} s after the kill; process exit {exit_s:.2f} s")
    assert noticed_s < 5.0 and exit_s < 5.0, (noticed_s, exit_s)


# --------------------------------------------------------------------------------------------- close under a slow daemon

CLOSER = textwrap.dedent("""
    import os, signal, sys, threading, time
    import tzip.client as tz
    clients = [tz.Client(sys.argv[1], spawn=False, strict=True) for _ in range(16)]
    dpid = int(sys.argv[2])
    os.kill(dpid, signal.SIGSTOP)  # the daemon stops answering, as one starved of CPU under load does
    try:
        for c in clients:
            c._wake.set()  # each heartbeat thread sends a heartbeat now and waits for its reply
        time.sleep(0.5)
        ts = [threading.Thread(target=c.close) for c in clients]
        for t in ts: t.start()
        for t in ts: t.join()
    finally:
        os.kill(dpid, signal.SIGCONT)
    print("closed", flush=True)
""")


def test_close_while_the_heartbeat_waits_on_a_slow_daemon(daemon):  # noqa: F811
    """Found by the load test (python -m tzip.bench.load): close() used to close the heartbeat thread's socket while
    that thread still waited for a reply, and libzmq aborted the process (signaler.cpp: pfd.revents & POLLIN); the
    late heartbeat then opened an orphaned session. Now close() interrupts the wait and joins the thread first."""
    p = subprocess.run([PYTHON, "-c", CLOSER, daemon.socket, str(daemon.pid)], capture_output=True, timeout=120)
    assert p.returncode == 0, (p.returncode, p.stderr.decode()[-2000:])
    assert p.stdout.decode().strip() == "closed"
    assert wait_for(lambda: stats(daemon.socket)["sessions"] == 0, 15)  # no session left, none orphaned
