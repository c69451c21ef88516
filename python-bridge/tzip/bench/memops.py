"""Benchmark behind the ring's GPU ordering design (docs/ring.md, "GPU ordering flags"): what a hand-off through CUDA
stream memory operations costs in one process and across two.

Rows (H200 figures in docs/benchmarks.md, "Daemon fast lane"):

* one process, two streams, a ping-pong of ``cuStreamWaitValue64`` / ``cuStreamWriteValue64`` on device words, and on
  words of pinned host memory;
* a stream waiting on a host word that the CPU then stores (the client's ``wait(stream)`` on the ring's ``done``);
* a kernel followed by ``cuStreamWriteValue64`` to pinned memory that the CPU polls, against ``Event.query`` polling;
* two processes, the same ping-pong on device words shared by CUDA IPC (every wait blocked when it is queued): what a
  GPU-side wait on another process's GPU work costs.

Usage (GPU host; under MPS as well, to compare)::

    python -m tzip.bench.memops [--n 2000]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import time

import torch

from .. import _memops


def _pingpong(s1, s2, a: int, b: int, n: int) -> float:
    """µs per round trip: s1 waits a >= i then writes b = i; s2 writes a = i then waits b >= i."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(1, n + 1):
        _memops.wait_value64(s1, a, i)
        _memops.write_value64(s1, b, i)
        _memops.write_value64(s2, a, i)
        _memops.wait_value64(s2, b, i)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


def _median_us(samples: list[float]) -> float:
    samples.sort()
    return samples[len(samples) // 2] * 1e6


def _peer(q, n: int) -> None:
    torch.cuda.set_device(0)
    flag = q.get()
    s = torch.cuda.Stream()
    for i in range(1, n + 1):
        _memops.wait_value64(s, flag.data_ptr(), i)
        _memops.write_value64(s, flag.data_ptr() + 8, i)
    s.synchronize()
    q.put("done")
    q.get()


def run(n: int) -> dict[str, float]:
    r: dict[str, float] = {}
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    dev = torch.zeros(2, dtype=torch.int64, device="cuda")
    r["one process, device words: ping-pong round trip"] = _pingpong(s1, s2, dev.data_ptr(), dev.data_ptr() + 8, n)
    host = torch.zeros(2, dtype=torch.int64).pin_memory()
    r["one process, pinned host words: ping-pong round trip"] = _pingpong(s1, s2, host.data_ptr(), host.data_ptr() + 8, n)
    hv = host.numpy()
    cur = torch.cuda.current_stream()
    lat = []
    for i in range(1, 501):
        torch.cuda.synchronize()
        _memops.wait_value64(cur, host.data_ptr() + 8, 20_000 + i)
        _memops.write_value64(cur, host.data_ptr(), 30_000 + i)
        time.sleep(0.0002)
        t0 = time.perf_counter()
        hv[1] = 20_000 + i
        while hv[0] != 30_000 + i:
            pass
        lat.append(time.perf_counter() - t0)
    r["CPU stores a host word, a waiting stream goes on and writes back, CPU sees it (p50)"] = _median_us(lat)
    x = torch.zeros(1024, device="cuda")
    lat = []
    for i in range(1, 501):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        x.add_(1)
        _memops.write_value64(cur, host.data_ptr(), 40_000 + i)
        while hv[0] != 40_000 + i:
            pass
        lat.append(time.perf_counter() - t0)
    r["a kernel, then a write to pinned memory the CPU polls (p50)"] = _median_us(lat)
    ev = torch.cuda.Event()
    lat = []
    for _ in range(500):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        x.add_(1)
        ev.record()
        while not ev.query():
            pass
        lat.append(time.perf_counter() - t0)
    r["a kernel, then an event the CPU polls with query() (p50)"] = _median_us(lat)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_peer, args=(q, n))
    p.start()
    flag = torch.zeros(2, dtype=torch.int64, device="cuda")
    q.put(flag)
    time.sleep(3)  # the peer has queued its waits
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(1, n + 1):
        _memops.write_value64(cur, flag.data_ptr(), i)
        _memops.wait_value64(cur, flag.data_ptr() + 8, i)
    torch.cuda.synchronize()
    r["two processes, device words (CUDA IPC): ping-pong round trip"] = (time.perf_counter() - t0) / n * 1e6
    q.get()
    q.put(None)
    p.join(30)
    return r


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tzip.bench.memops", description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=2000, help="round trips per ping-pong row (default 2000)")
    args = ap.parse_args(argv)
    why = "no CUDA GPU" if not torch.cuda.is_available() else _memops.available()
    if why is not None:
        print(f"bench_memops needs a CUDA GPU and its driver's stream memory operations: {why}", file=sys.stderr)
        return 2
    torch.cuda.set_device(0)
    r = run(args.n)
    print(f"machine: {torch.cuda.get_device_name(0)}; torch {torch.__version__}")
    for k, v in r.items():
        print(f"{v:9.1f} us  {k}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
