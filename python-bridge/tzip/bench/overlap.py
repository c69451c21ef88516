"""Benchmark: the codec running beside training on one GPU (issue 12, "Sharing the GPU").

A bf16 matmul loop stands in for training in this process; a second process (its own ``Client``) has the daemon
compress a CUDA tensor over and over with an SM budget. Three phases of ``--seconds`` each, in one run: the loop
alone, the codec alone, both at once. Printed: the loop's step time alone and beside the codec (slowdown, goal
<= 5% under MPS), and the codec's rate alone and beside the loop (goal >= 80% of alone), with whether the daemon and
this process share an MPS server (the daemon's ``stats``: ``gpu.mps``).

Usage (GPU host; for MPS start ``nvidia-cuda-mps-control -d`` first, see README "Sharing the GPU")::

    python -m tzip.bench.overlap --seconds 5 --sm-budget 10 --codec fast [--training-share 92]

Input: the all-MiniLM-L6-v2 bf16 weights of ``data/demo`` tiled to ``--mib`` MiB on the GPU when present, else
synthetic N(0, 0.02) bf16 (the output says which). GB/s are of original bytes.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import sys
import time

import torch

from .daemon import _daemon_socket, _inputs
from ..client import Client

MATMUL_N = 8192


def _tiled(mib: int, device: torch.device) -> tuple[torch.Tensor, str]:
    bucket, _, source = _inputs()
    n = mib * (1 << 20) // 2
    flat = bucket.reshape(-1).to(device)
    reps = -(-n // flat.numel())
    return flat.repeat(reps)[:n].contiguous(), source


def _feeder(socket: str, mib: int, codec: str, sm_budget: int, go, stop, out) -> None:
    """The codec's process: compresses a ``mib`` MiB bf16 CUDA tensor until ``stop`` is set; reports bytes/seconds."""
    torch.cuda.set_device(0)
    c = Client(socket, spawn=False, strict=True)
    x, source = _tiled(mib, torch.device("cuda", 0))
    ratio = c.compress(x, codec=codec, sm_budget=sm_budget).payload.numel() / x.numel() / 2  # warm-up
    go.set()
    n, t0 = 0, time.perf_counter()
    while not stop.is_set():
        c.compress(x, codec=codec, sm_budget=sm_budget)
        n += 1
    el = time.perf_counter() - t0
    out.put({"calls": n, "seconds": el, "gbps": n * x.numel() * 2 / el / 1e9, "ratio": ratio, "source": source})
    c.close()


def _loop(seconds: float) -> dict[str, float]:
    """Runs bf16 matmuls of MATMUL_N^2 for ``seconds``; median and mean step time in ms (CUDA events)."""
    a = torch.randn(MATMUL_N, MATMUL_N, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(MATMUL_N, MATMUL_N, device="cuda", dtype=torch.bfloat16)
    for _ in range(5):
        a @ b
    torch.cuda.synchronize()
    times = []
    t_end = time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(10):
            a @ b
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 10)
    times.sort()
    return {"median_ms": times[len(times) // 2], "mean_ms": sum(times) / len(times), "steps": 10 * len(times)}


def _codec(socket: str, args, with_loop: bool) -> tuple[dict, dict | None]:
    ctx = mp.get_context("spawn")
    go, stop, out = ctx.Event(), ctx.Event(), ctx.Queue()
    p = ctx.Process(target=_feeder, args=(socket, args.mib, args.codec, args.sm_budget, go, stop, out))
    p.start()
    if not go.wait(120):
        p.kill()
        raise SystemExit("the codec process did not start within 120 s")
    loop = _loop(args.seconds) if with_loop else (time.sleep(args.seconds) or None)
    stop.set()
    r = out.get(timeout=120)
    p.join(30)
    return r, loop


def _training_context(percentage: int | None) -> None:
    """Creates this process's CUDA context, under MPS capped at ``percentage`` % of the GPU's threads
    (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE, which main() set before CUDA was initialised): the SMs the codec can count on
    beside training. The variable is removed afterwards so that the daemon and the codec's process (started later)
    are not capped."""
    torch.zeros(1, device="cuda")
    os.environ.pop("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", None)


def run(socket: str | None, args) -> dict:
    _training_context(args.training_share)
    with _daemon_socket(socket) as path:
        c = Client(path, spawn=False, strict=True)
        try:
            mps = (c.stats().get("gpu") or {}).get("mps")
        finally:
            c.close()
        alone = _loop(args.seconds)
        codec_alone, _ = _codec(path, args, with_loop=False)
        codec_beside, loop_beside = _codec(path, args, with_loop=True)
    return {"machine": f"{torch.cuda.get_device_name(0)}, {platform.node()}", "torch": torch.__version__,
            "mps": mps, "mps_env": os.environ.get("CUDA_MPS_PIPE_DIRECTORY"), "args": vars(args),
            "loop_alone": alone, "loop_beside": loop_beside, "codec_alone": codec_alone, "codec_beside": codec_beside}


def report(r: dict) -> str:
    a, b = r["loop_alone"], r["loop_beside"]
    ca, cb = r["codec_alone"], r["codec_beside"]
    args = r["args"]
    return "\n".join([
        f"machine: {r['machine']}; torch {r['torch']}; daemon MPS: {json.dumps(r['mps'])}",
        f"input: {ca['source']}, {args['mib']} MiB per call, codec {args['codec']}, sm_budget {args['sm_budget']}, "
        f"ratio {ca['ratio']:.4f}; loop: bf16 matmul {MATMUL_N}^2; {args['seconds']} s per phase; the loop's "
        f"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE: {args['training_share'] or 'not set'}",
        "| | alone | beside the other | beside / alone |",
        "|---|---:|---:|---:|",
        f"| matmul step, ms (median) | {a['median_ms']:.3f} | {b['median_ms']:.3f} | {b['median_ms'] / a['median_ms']:.3f} |",
        f"| codec, GB/s | {ca['gbps']:.1f} | {cb['gbps']:.1f} | {cb['gbps'] / ca['gbps']:.3f} |",
    ])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tzip.bench.overlap", description=__doc__.split("\n\n")[0])
    ap.add_argument("--socket", help="a running daemon's socket (default: start a private one)")
    ap.add_argument("--seconds", type=float, default=5.0, help="length of each phase, seconds (default 5)")
    ap.add_argument("--mib", type=int, default=256, help="MiB of bf16 per compress call (default 256)")
    ap.add_argument("--codec", default="fast", help="codec of the compress calls (default fast)")
    ap.add_argument("--sm-budget", type=int, default=10, help="SMs the codec may use (default 10)")
    ap.add_argument("--training-share", type=int, metavar="PCT",
                    help="under MPS: cap the matmul loop's context at PCT %% of the GPU's threads "
                         "(CUDA_MPS_ACTIVE_THREAD_PERCENTAGE), leaving the rest to the codec")
    ap.add_argument("--json", action="store_true", help="print the raw results as JSON as well")
    args = ap.parse_args(argv)
    if args.training_share is not None:
        os.environ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(args.training_share)  # before CUDA initialises
    if not torch.cuda.is_available():
        print("bench_overlap needs a CUDA GPU", file=sys.stderr)
        return 2
    r = run(args.socket, args)
    if args.json:
        print(json.dumps(r, indent=1))
    print(report(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
