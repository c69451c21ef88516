"""Real processes around a real daemon: 8 clients at once, a client killed in the middle of a request,
the daemon killed and restarted (fallback and strict clients), the daemon started by connect(spawn=True),
and a second daemon refused on a socket that is taken.
"""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import textwrap
import time
import warnings

import pytest
import torch

import tzip._spawn as tz_spawn
import tzip.client as tz
from tzip._dlpack import int_alias

from test_client_support import MAIN, NODE, PYTHON, ROOT, DaemonProcess, RawConn, daemon, sock_dir, wait_for, daemon_stats as stats  # noqa: F401


WORKER = textwrap.dedent("""
    import os, sys, time, torch
    import tzip.client as tz
    from tzip._dlpack import int_alias
    sock, go, me = sys.argv[1], sys.argv[2], int(sys.argv[3])
    c = tz.connect(sock, spawn=False, strict=True)
    open(go + f".ready{me}", "w").close()
    while not os.path.exists(go):
        time.sleep(0.005)
    g = torch.Generator().manual_seed(me)
    n = 0
    for dtype in (torch.bfloat16, torch.float32, torch.float16, torch.int64, torch.uint8):
        ts = [torch.randint(0, 256, (4096 * (i + 1),), dtype=torch.uint8, generator=g).view(dtype) for i in range(4)]
        ts.append((torch.randn(300, 257, generator=g) * 0.02).to(dtype) if dtype.is_floating_point else ts[0][1:])
        back = c.decompress(c.compress(ts))
        for a, b in zip(ts, back):
            assert torch.equal(int_alias(a), int_alias(b)), (me, dtype)
            n += 1
    c.close()
    print("OK", me, n, flush=True)
""")


def test_eight_concurrent_client_processes(daemon, tmp_path):
    go = str(tmp_path / "go")
    procs = [subprocess.Popen([PYTHON, "-c", WORKER, daemon.socket, go, str(i)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for i in range(8)]
    try:
        assert wait_for(lambda: len(glob.glob(go + ".ready*")) == 8 or any(p.poll() is not None for p in procs), 120)
        assert len(glob.glob(go + ".ready*")) == 8, [p.communicate()[1].decode()[-2000:] for p in procs if p.poll() is not None]
        assert stats(daemon.socket)["sessions"] == 8
        open(go, "w").close()
        outs = [p.communicate(timeout=180) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for i, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, err.decode()[-3000:]
        assert out.decode().split() == ["OK", str(i), "25"]
    s = wait_for(lambda: (lambda st: st if st["sessions"] == 0 else None)(stats(daemon.socket)), 10)
    assert s["sessions_ended"].get("goodbye") == 8 and s["mapped"]["files"] == 0


VICTIM = textwrap.dedent("""
    import sys, torch
    import tzip.client as tz
    c = tz.connect(sys.argv[1], spawn=False, strict=True)
    big = torch.randn(64 << 20, dtype=torch.float32).to(torch.bfloat16)  # 128 MiB
    print("PREFIX", c.shm_prefix, flush=True)
    for _ in range(100):
        c.compress(big, codec="max")
""")


def test_client_killed_mid_request_frees_its_resources(daemon):
    survivor = tz.connect(daemon.socket, spawn=False, strict=True)
    try:
        t = torch.randn(1000)
        assert torch.equal(survivor.decompress(survivor.compress(t)), t)
        victim = subprocess.Popen([PYTHON, "-c", VICTIM, daemon.socket], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        line = victim.stdout.readline().decode().split()
        assert line[:1] == ["PREFIX"], victim.stderr.read().decode()[-2000:]
        prefix = line[1]
        # wait until the daemon is working on the victim's request, then kill the victim
        assert wait_for(lambda: stats(daemon.socket)["inflight"] >= 1, 60, 0.002)
        assert glob.glob(f"/dev/shm/{prefix}*")
        victim.send_signal(signal.SIGKILL)
        victim.wait(10)
        victim.stdout.close()
        victim.stderr.close()
        # the daemon ends the victim's session (disconnect), drops its mappings and removes its shm files
        assert wait_for(lambda: stats(daemon.socket)["sessions_ended"].get("disconnect", 0) >= 1, 15)
        assert wait_for(lambda: not glob.glob(f"/dev/shm/{prefix}*"), 15), glob.glob(f"/dev/shm/{prefix}*")
        s = wait_for(lambda: (lambda st: st if st["inflight"] == 0 else None)(stats(daemon.socket)), 30)
        assert s["sessions"] == 1
        # and keeps serving the others
        u = torch.randint(0, 1 << 30, (5000,), dtype=torch.int64)
        assert torch.equal(survivor.decompress(survivor.compress(u)), u)
        assert daemon.alive()
    finally:
        survivor.close()


def test_daemon_killed_and_restarted(daemon):
    lenient = tz.connect(daemon.socket, spawn=False, strict=False)
    strict = tz.connect(daemon.socket, spawn=False, strict=True)
    try:
        t = (torch.randn(4096) * 0.02).to(torch.bfloat16)
        packed = lenient.compress(t, codec="max")
        assert packed.codec == "max"
        daemon.kill()

        # fallback: raw frames made in Python, one warning per outage, decodable without the daemon
        with pytest.warns(RuntimeWarning, match="not available"):
            ct = lenient.compress(t)
        assert ct.codec == "raw" and ct.ratio > 1.0
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            ct2 = lenient.compress([t, t[1:]])
        assert [c.codec for c in ct2] == ["raw", "raw"]
        assert torch.equal(int_alias(lenient.decompress(ct)), int_alias(t))
        with pytest.raises(tz.DaemonUnavailableError):
            lenient.decompress(packed)  # a 'max' frame needs the daemon: no silent substitute
        with pytest.raises(tz.DaemonUnavailableError):
            strict.compress(t)
        assert not lenient.connected

        # a new daemon on the same path (the dead one's socket and lock are still there)
        again = DaemonProcess(daemon.socket, "--lease-ms", "2000").start()
        daemon.proc = again.proc  # so the fixture stops it
        assert "stale lock" in again.read_log()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert wait_for(lambda: lenient.compress(t).codec != "raw", 10, 0.1)
        assert lenient.connected
        assert torch.equal(int_alias(lenient.decompress(packed)), int_alias(t))
        assert torch.equal(int_alias(lenient.decompress(ct)), int_alias(t))

        def strict_ok():
            try:
                return strict.compress(t).codec != "raw"
            except tz.DaemonUnavailableError:
                return False
        assert wait_for(strict_ok, 10, 0.1)
    finally:
        lenient.close()
        strict.close()


def test_strict_connect_without_daemon_raises_and_lenient_warns(sock_dir):
    sock = os.path.join(sock_dir, "none", "tzip.sock")
    with pytest.raises(tz.DaemonUnavailableError, match="no tzip daemon"):
        tz.connect(sock, spawn=False, strict=True)
    with pytest.warns(RuntimeWarning):
        c = tz.connect(sock, spawn=False)
    try:
        t = torch.arange(10, dtype=torch.float64)
        ct = c.compress(t)
        assert ct.codec == "raw" and torch.equal(c.decompress(ct), t)
    finally:
        c.close()


def test_connect_spawns_one_daemon_and_a_second_daemon_is_refused(sock_dir):
    sock = os.path.join(sock_dir, "spawned", "tzip.sock")
    a = tz.connect(sock, spawn=True, strict=True)
    try:
        pid = a.daemon_info["pid"]
        b = tz.connect(sock, spawn=True, strict=True)
        assert b.daemon_info["pid"] == pid
        t = torch.randn(100)
        assert torch.equal(b.decompress(a.compress(t)), t)
        b.close()
        refused = subprocess.run([NODE, str(MAIN), "serve", "--socket", sock], capture_output=True, cwd=ROOT, timeout=30)
        assert refused.returncode == 1
        assert f"another tzip daemon (pid {pid}" in refused.stderr.decode()
        assert os.path.exists(sock)  # the refused daemon left the socket alone
        assert torch.equal(a.decompress(a.compress(t)), t)
        a.shutdown_daemon()
        assert wait_for(lambda: not os.path.exists(sock + ".lock"), 10)
    finally:
        a.close()
        lock = sock + ".lock"
        if os.path.exists(lock):  # never leave a spawned daemon behind
            import json

            try:
                os.kill(json.load(open(lock))["pid"], signal.SIGTERM)
            except (OSError, ValueError, KeyError):
                pass


def test_client_is_not_usable_after_fork(daemon):
    c = tz.connect(daemon.socket, spawn=False, strict=True)
    try:
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                c.compress(torch.zeros(1))
                os.write(w, b"no error")
            except RuntimeError as e:
                os.write(w, b"RuntimeError" if "fork" in str(e) else b"other")
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
        assert os.read(r, 100) == b"RuntimeError"
    finally:
        c.close()


def test_spawning_client_restarts_a_killed_daemon(sock_dir):
    sock = os.path.join(sock_dir, "respawn", "tzip.sock")
    c = tz.connect(sock, spawn=True, strict=True)
    try:
        first = c.daemon_info["pid"]
        os.kill(first, signal.SIGKILL)  # it may stay a zombie: the client and the next daemon must see it as dead
        t = torch.randn(2048)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no fallback: a new daemon is started within the same call
            ct = c.compress(t)
        assert ct.codec != "raw" and c.daemon_info["pid"] != first
        assert torch.equal(c.decompress(ct), t)
        assert f"replaced the stale lock of pid {first}" in open(sock + ".log").read()
        c.shutdown_daemon()
    finally:
        c.close()


def test_spawning_client_restarts_a_daemon_killed_again_and_again(sock_dir):
    # The new daemon's socket file often gets the inode number its dead predecessor's had (ext4): spawn_daemon took it
    # for the stale file, waited its whole 15 s and gave up on a daemon that was serving (strict: DaemonSpawnError;
    # lenient: raw frames, a DDP hook's bucket failed).
    sock = os.path.join(sock_dir, "respawn4", "tzip.sock")
    c = tz.connect(sock, spawn=True, strict=True)
    t = torch.randn(2048)
    try:
        for _ in range(4):
            dead = c.daemon_info["pid"]
            os.kill(dead, signal.SIGKILL)
            t0 = time.monotonic()
            ct = c.compress(t)  # strict: raises if no daemon could be started
            took = time.monotonic() - t0
            assert ct.codec != "raw" and c.daemon_info["pid"] != dead
            assert took < 10, f"restart took {took:.1f} s (spawn_daemon's timeout is 15 s)"
            assert torch.equal(c.decompress(ct), t)
        c.shutdown_daemon()
    finally:
        c.close()
        pid = tz_spawn.daemon_pid(sock)
        if pid is not None:  # never leave a spawned daemon behind
            os.kill(pid, signal.SIGTERM)
