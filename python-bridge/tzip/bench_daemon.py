"""Benchmark of the daemon path: round-trip overhead and throughput through `tzip serve` vs the addon called directly.

    python -m tzip.bench_daemon [--socket PATH] [--n 5000] [--repeat 5] [--json]

Measures, on this machine:

* the transport floor: a ZeroMQ DEALER (pyzmq) to a bare zeromq.js ROUTER echo over ipc:// -- what
  any request costs before the daemon does anything;
* the round trip of an empty request (``heartbeat``) and of compress/decompress of a 1-element tensor
  through :class:`tzip.client.Client` (p50 and p99 over ``--n`` calls);
* throughput of a 25 MB bf16 bucket (real all-MiniLM-L6-v2 weights from data/demo when present, else
  synthetic weights) and of a batch of 200 parameters, through the daemon (a plain tensor: one copy
  into the shared-memory arena; a tensor made by ``Client.empty``: zero copy) and through the addon
  called directly from Node (the same bytes, the same default thread count; into a reused output buffer).
  Medians of ``--repeat`` runs; the daemon cases run interleaved, the direct runs before and after them
  (pooled), so that changes of machine load hit both alike.

Unless ``--socket`` is given, a private daemon is started for the run and stopped afterwards.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

import torch

from ._spawn import cli_command
from .client import Client

ROOT = Path(__file__).resolve().parents[2]
BUCKET_BYTES = 25_000_000

_NODE_ECHO = r"""
const zmq = require(process.argv[1]);
(async () => {
  const r = new zmq.Router({ linger: 0 });
  await r.bind(process.argv[2]);
  process.stdout.write('ready\n');
  for (;;) { const m = await r.receive(); await r.send(m); }
})();
"""

_NODE_DIRECT = r"""
const fs = require('fs');
const addon = require(process.argv[1]);
const [bucketPath, batchPath, repeat] = [process.argv[2], process.argv[3], Number(process.argv[4])];
const bucket = fs.readFileSync(bucketPath);
const batchSpec = JSON.parse(fs.readFileSync(batchPath + '.json', 'utf8'));
const batchBytes = fs.readFileSync(batchPath);
const parts = []; let off = 0;
for (const n of batchSpec) { parts.push(batchBytes.subarray(off, off + n * 2)); off += n * 2; }
const now = () => Number(process.hrtime.bigint()) / 1e9;
(async () => {
  const out = {};
  let t = [], frame, frames;
  for (let i = 0; i < repeat; i++) { const s = now(); frame = await addon.compress(bucket, { dtype: 'BF16', shape: [bucket.length / 2] }); t.push(now() - s); }
  out.bucket_compress_s = t; out.bucket_frame_bytes = frame.length; t = [];
  const dst = Buffer.alloc(bucket.length);
  for (let i = 0; i < repeat; i++) { const s = now(); await addon.decompress(frame, { out: dst }); t.push(now() - s); }
  out.bucket_decompress_s = t; t = [];
  for (let i = 0; i < repeat; i++) { const s = now(); frames = await Promise.all(parts.map((p) => addon.compress(p, { dtype: 'BF16', shape: [p.length / 2] }))); t.push(now() - s); }
  out.batch_compress_s = t; out.batch_frame_bytes = frames.reduce((a, f) => a + f.length, 0); t = [];
  const outs = parts.map((p) => Buffer.alloc(p.length));
  for (let i = 0; i < repeat; i++) { const s = now(); await Promise.all(frames.map((f, j) => addon.decompress(f, { out: outs[j] }))); t.push(now() - s); }
  out.batch_decompress_s = t;
  out.threads = addon.defaultThreads;
  process.stdout.write(JSON.stringify(out));
})();
"""


def _percentiles(samples: list[float]) -> dict[str, float]:
    s = sorted(samples)
    return {"p50_us": s[len(s) // 2] * 1e6, "p99_us": s[min(len(s) - 1, int(len(s) * 0.99))] * 1e6, "n": len(s)}


def _timed(fn, n: int, warmup: int = 200) -> dict[str, float]:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    return _percentiles(samples)


def _real_weights() -> list[torch.Tensor] | None:
    path = ROOT / "data" / "demo" / "minilm-weights-bf16.safetensors"
    if not path.exists():
        return None
    try:
        from safetensors.torch import load_file
    except ImportError:
        return None
    tensors = load_file(str(path))
    return [t for _, t in sorted(tensors.items()) if t.dtype == torch.bfloat16]


def _inputs() -> tuple[torch.Tensor, list[torch.Tensor], str]:
    weights = _real_weights()
    if weights is not None:
        flat = torch.cat([w.reshape(-1) for w in weights])
        source = "all-MiniLM-L6-v2 weights, bf16 (data/demo/minilm-weights-bf16.safetensors)"
    else:
        g = torch.Generator().manual_seed(0)
        flat = (torch.randn(BUCKET_BYTES // 2 * 2, generator=g) * 0.02).to(torch.bfloat16)
        weights = [flat[i * 60_000 : (i + 1) * 60_000].reshape(300, 200) for i in range(200)]
        source = "synthetic N(0, 0.02) weights, bf16"
    bucket = flat[: BUCKET_BYTES // 2].clone()
    params = [w.clone() for w in (weights * (200 // len(weights) + 1))[:200]]
    return bucket, params, source


def _median_times(fns: dict, repeat: int) -> dict[str, float]:
    """Median seconds of each function; rounds interleave the functions so load changes hit them alike."""
    for fn in fns.values():
        fn()  # warm-up (arena segments, mappings)
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeat):
        for k, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t)
    return {k: median(v) for k, v in times.items()}


def _transport_floor(n: int) -> dict[str, float] | None:
    import zmq

    node, _ = cli_command()
    zmq_js = ROOT / "node_modules" / "zeromq"
    with tempfile.TemporaryDirectory(prefix="tzip-bench-") as d:
        endpoint = f"ipc://{d}/echo.sock"
        proc = subprocess.Popen([node, "-e", _NODE_ECHO, str(zmq_js), endpoint], stdout=subprocess.PIPE)
        try:
            if proc.stdout.readline().strip() != b"ready":
                return None
            ctx = zmq.Context()
            s = ctx.socket(zmq.DEALER)
            s.linger = 0
            s.connect(endpoint)

            def once():
                s.send(b"x")
                s.recv()

            res = _timed(once, n)
            s.close()
            ctx.term()
            return res
        finally:
            proc.kill()
            proc.wait()


def _direct(bucket: torch.Tensor, params: list[torch.Tensor], repeat: int) -> dict:
    node, _ = cli_command()
    addon = ROOT / "build" / "Release" / "tzip.node"
    with tempfile.TemporaryDirectory(prefix="tzip-bench-") as d:
        bpath, ppath = os.path.join(d, "bucket.bin"), os.path.join(d, "batch.bin")
        bucket.view(torch.int16).numpy().tofile(bpath)
        torch.cat([p.reshape(-1) for p in params]).view(torch.int16).numpy().tofile(ppath)
        Path(ppath + ".json").write_text(json.dumps([p.numel() for p in params]))
        out = subprocess.run([node, "-e", _NODE_DIRECT, str(addon), bpath, ppath, str(repeat)], capture_output=True, check=True)
        return json.loads(out.stdout)


def run(socket: str | None, n: int, repeat: int) -> dict:
    result: dict = {"machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, torch {torch.__version__}"}
    tmp = None
    daemon = None
    if socket is None:
        tmp = tempfile.TemporaryDirectory(prefix="tzip-bench-")
        socket = os.path.join(tmp.name, "d", "tzip.sock")
        daemon = subprocess.Popen([*cli_command(), "serve", "--socket", socket], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        daemon.stdout.readline()
    try:
        client = Client(socket, spawn=False, strict=True)
        bucket, params, source = _inputs()
        result["input"] = source
        result["transport_floor"] = _transport_floor(n)
        result["empty_request"] = _timed(lambda: client._call("heartbeat", {}), n)
        one = torch.ones(1, dtype=torch.bfloat16)
        ct_one = client.compress(one)
        result["compress_1_element"] = _timed(lambda: client.compress(one), n)
        result["decompress_1_element"] = _timed(lambda: client.decompress(ct_one), n)

        gb = bucket.numel() * 2 / 1e9
        ct = client.compress(bucket)
        shm_bucket = client.empty(bucket.shape, bucket.dtype)
        shm_bucket.copy_(bucket)
        out_bucket = client.empty(bucket.shape, bucket.dtype)
        pbytes = sum(p.numel() for p in params) * 2
        cts = client.compress(params)
        # the direct addon runs before and after the daemon measurements; its samples are pooled
        direct_runs = [_direct(bucket, params, repeat)]
        daemon_t = _median_times({
            "bucket_compress": lambda: client.compress(bucket),
            "bucket_compress_zero_copy": lambda: client.compress(shm_bucket),
            "bucket_decompress": lambda: client.decompress(ct),
            "bucket_decompress_into_shm": lambda: client.decompress(ct, out=out_bucket),
            "batch_compress": lambda: client.compress(params),
            "batch_decompress": lambda: client.decompress(cts),
        }, repeat)
        direct_runs.append(_direct(bucket, params, repeat))
        direct = {k: (median(direct_runs[0][k] + direct_runs[1][k]) if isinstance(direct_runs[0][k], list) else direct_runs[0][k])
                  for k in direct_runs[0]}
        result["bucket"] = {
            "bytes": bucket.numel() * 2,
            "frame_bytes": ct.payload.numel(),
            "ratio": ct.ratio,
            "codec": ct.codec,
            "daemon_compress_s": daemon_t["bucket_compress"],
            "daemon_compress_zero_copy_s": daemon_t["bucket_compress_zero_copy"],
            "daemon_decompress_s": daemon_t["bucket_decompress"],
            "daemon_decompress_into_shm_s": daemon_t["bucket_decompress_into_shm"],
            "direct_compress_s": direct["bucket_compress_s"],
            "direct_decompress_s": direct["bucket_decompress_s"],
        }
        result["batch"] = {
            "tensors": len(params),
            "bytes": pbytes,
            "frame_bytes": sum(c.payload.numel() for c in cts),
            "daemon_compress_s": daemon_t["batch_compress"],
            "daemon_decompress_s": daemon_t["batch_decompress"],
            "direct_compress_s": direct["batch_compress_s"],
            "direct_decompress_s": direct["batch_decompress_s"],
        }
        result["direct"] = direct
        result["threads"] = direct["threads"]
        result["gb"] = {"bucket": gb, "batch": pbytes / 1e9}
        client.close()
    finally:
        if daemon is not None:
            daemon.terminate()
            daemon.wait(10)
        if tmp is not None:
            tmp.cleanup()
    return result


def _report(r: dict) -> str:
    lines = [f"machine: {r['machine']}; codec threads: {r['threads']}", f"input: {r['input']}", ""]
    lines.append("round trips (ipc://)                          p50 us    p99 us")
    rows = [("transport floor (pyzmq <-> zeromq.js echo)", r["transport_floor"]), ("empty request (heartbeat)", r["empty_request"]),
            ("compress 1-element bf16 tensor", r["compress_1_element"]), ("decompress 1-element bf16 tensor", r["decompress_1_element"])]
    for name, v in rows:
        if v:
            lines.append(f"  {name:<44}{v['p50_us']:8.1f}  {v['p99_us']:8.1f}")
    lines.append("")
    lines.append("throughput (GB/s = 1e9 original bytes / s; median)      daemon   direct addon")
    b, bt, gb = r["bucket"], r["batch"], r["gb"]

    def rate(nbytes_gb, s):
        return nbytes_gb / s

    lines.append(f"  25 MB bf16 bucket, compress (copy into arena)      {rate(gb['bucket'], b['daemon_compress_s']):7.2f}   {rate(gb['bucket'], b['direct_compress_s']):7.2f}")
    lines.append(f"  25 MB bf16 bucket, compress (zero copy, shm)       {rate(gb['bucket'], b['daemon_compress_zero_copy_s']):7.2f}")
    lines.append(f"  25 MB bf16 bucket, decompress (new tensor)         {rate(gb['bucket'], b['daemon_decompress_s']):7.2f}   {rate(gb['bucket'], b['direct_decompress_s']):7.2f}")
    lines.append(f"  25 MB bf16 bucket, decompress (into shm out=)      {rate(gb['bucket'], b['daemon_decompress_into_shm_s']):7.2f}")
    lines.append(f"  batch of {bt['tensors']} params ({bt['bytes'] / 1e6:.1f} MB), compress        {rate(gb['batch'], bt['daemon_compress_s']):7.2f}   {rate(gb['batch'], bt['direct_compress_s']):7.2f}")
    lines.append(f"  batch of {bt['tensors']} params ({bt['bytes'] / 1e6:.1f} MB), decompress      {rate(gb['batch'], bt['daemon_decompress_s']):7.2f}   {rate(gb['batch'], bt['direct_decompress_s']):7.2f}")
    lines.append(f"  bucket ratio {b['ratio']:.4f} ({b['codec']}); batch ratio {bt['frame_bytes'] / bt['bytes']:.4f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--socket", help="use the daemon on this socket instead of starting one")
    ap.add_argument("--n", type=int, default=5000, help="round trips per latency measurement (default 5000)")
    ap.add_argument("--repeat", type=int, default=5, help="runs per throughput measurement (default 5)")
    ap.add_argument("--json", action="store_true", help="print the raw results as JSON")
    args = ap.parse_args(argv)
    r = run(args.socket, args.n, args.repeat)
    print(json.dumps(r, indent=2) if args.json else _report(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
