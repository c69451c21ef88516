"""The load test (tzip.bench.load) in short: 8 client processes for 15 s against a real daemon, sizes up to 4 MiB.

Asserted: no errors, every round trip bit-exact (the workers compare integer views), every size class served, the
daemon's counters agree with what the workers sent (so nothing fell back to raw frames), and the daemon's memory after
the clients left is bounded. Nothing here is timed: latencies are printed by ``python -m tzip.bench.load``, never
asserted.

The memory bound: while the clients run, the daemon maps their shared-memory files (RssShmem: the clients' staging
arenas and result segments, several hundred MB); once their sessions end it must drop every mapping
(src/daemon/session.ts ends a session at the client's goodbye, shm-map.ts drops its mappings and gc.ts collects their
Buffers 50 ms later), so RssShmem returns to at most ``SHMEM_AFTER_MAX`` and the daemon reports no mapped file.
Its own memory (RssAnon: V8's heap, the addon, the malloc arenas of the codec threads, which keep their largest
scratch) may stay above its start by a bounded amount that does not depend on the bytes served: at most
``ANON_GROWTH_MAX``. A leak of the mappings would show several hundred MB in RssShmem; the 2 941 round trips of a run
here grew RssAnon by 14 MB.
"""

from __future__ import annotations

import os
import random
import tempfile

import pytest
import torch

from tzip.bench import load as bench_load

from test_client_support import DaemonProcess

SHMEM_AFTER_MAX = 4 << 20
ANON_GROWTH_MAX = 64 << 20


def test_size_classes_and_requests_are_fixed_and_in_bounds():
    classes = bench_load.size_classes(4 << 20)
    assert [c[0] for c in classes] == ["1 element", "<= 4 KiB", "<= 64 KiB", "<= 1 MiB", "<= 4 MiB"]
    assert classes[-1][2] == 4 << 20
    assert bench_load.size_classes(64 << 20)[-1][:3] == ("<= 64 MiB", (16 << 20) + 1, 64 << 20)

    def draws(seed):
        rng = random.Random(seed)
        return [bench_load.draw_request(rng, classes, 1000, cuda=False) for _ in range(2000)]

    a = draws(3)
    assert a == draws(3) and a != draws(4)
    seen = set()
    for req in a:
        total = sum(t["numel"] * getattr(torch, t["dtype"]).itemsize for t in req["tensors"])
        numel = sum(t["numel"] for t in req["tensors"])
        assert req["device"] == "cpu"
        assert 1 <= len(req["tensors"]) <= (bench_load.BATCH_TENSORS[1] if req["batch"] else 1)
        for t in req["tensors"]:
            n = t["numel"] * getattr(torch, t["dtype"]).itemsize
            assert 1 <= t["numel"] and n <= (bench_load.BATCH_TENSOR_MAX_BYTES if req["batch"] else 4 << 20)
            assert t["shape"] == [t["numel"]] if t["layout"] == "flat" else t["shape"] == [t["numel"] // 384, 384]
            assert 0 <= t["offset"] < 1000
        seen.add(bench_load.class_of(total, numel, classes))
    assert seen == {c[0] for c in classes}


def test_slices_wrap_around_the_pool():
    pool = torch.arange(10, dtype=torch.int16)
    t = bench_load._slice(pool, {"numel": 25, "offset": 7, "layout": "flat"})
    assert t.tolist() == [(7 + i) % 10 for i in range(25)]
    t = bench_load._slice(torch.arange(768 * 2, dtype=torch.int16), {"numel": 768, "offset": 5, "layout": "transposed"})
    assert t.shape == (2, 384) and not t.is_contiguous()


def _run(clients: int, seconds: float, cuda: bool = False) -> dict:
    with tempfile.TemporaryDirectory(prefix="tzip-load-t-") as d:
        daemon = DaemonProcess(os.path.join(d, "s", "tzip.sock")).start()
        try:
            r = bench_load.run(clients=clients, seconds=seconds, max_mb=4, cuda=cuda, socket=daemon.socket, settle=3,
                               min_available_mb=512, log=print)
            print(bench_load.report(r, f"tests/test_load.py: bench_load.run(clients={clients}, seconds={seconds}, max_mb=4)"))
            assert daemon.alive(), daemon.read_log()[-3000:]
        finally:
            daemon.stop()
    return r


def _check(r: dict) -> None:
    assert r["low_memory_stop"] is None, "the machine ran low on memory: the run was stopped early"
    assert r["error_counts"] == {}, r["errors"]
    assert r["round_trips"] > 0 and r["checked"] == r["round_trips"]
    assert all(n > 0 for n in r["per_worker_round_trips"]), r["per_worker_round_trips"]
    st = r["daemon_stats"]
    assert st["errors"] == {}
    # every tensor went through the daemon's codec both ways (a strict client never falls back to raw frames)
    assert st["compress"]["items"] == r["tensors"] and st["decompress"]["items"] == r["tensors"]
    assert st["sessions"] == 1 and st["mapped"]["files"] == 0  # only the monitor is left, and it maps nothing
    start, after = r["daemon_start"], r["daemon_after"]
    assert after["shmem"] <= SHMEM_AFTER_MAX, (start, after)
    assert after["anon"] <= start["anon"] + ANON_GROWTH_MAX, (start, after)


def test_eight_clients_mixed_sizes_bit_exact_and_the_daemon_lets_go():
    r = _run(clients=8, seconds=15)
    _check(r)
    assert {row["class"] for row in r["latency"]} == {c[0] for c in bench_load.size_classes(4 << 20)}
    assert r["batches"] > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_and_cpu_clients_bit_exact():
    r = _run(clients=4, seconds=15, cuda=True)
    _check(r)
    assert {row["device"] for row in r["latency"]} == {"cpu", "cuda"}
    assert r["daemon_stats"]["gpu"]["requests"] > 0
