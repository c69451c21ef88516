"""Benchmark of the daemon path: round-trip overhead and throughput through `tzip serve` vs the addon called directly.

    python -m tzip.bench.daemon [--socket PATH] [--n 5000] [--repeat 5] [--json] [--cuda]

Measures, on this machine:

* the transport floor: a ZeroMQ DEALER (pyzmq) to a bare zeromq.js ROUTER echo over ipc:// -- what
  any request costs before the daemon does anything;
* the round trip of an empty request (``heartbeat``) and of compress/decompress of a 1-element tensor
  through :class:`tzip.client.Client` over ZeroMQ (``ring_entries=0``; p50 and p99 over ``--n`` calls);
* the same through the submission ring (protocol version 4, docs/ring.md), when the daemon offers it: an empty
  (nop) SQE round trip, compress/decompress of a 1-element tensor, and the bucket and the 200 parameters both ways;
  next to them a Unix socketpair ping-pong between this process and a forked child (1 byte each way, Python on both
  sides), measured in the same run: the CPU path's goal is a 1-element round trip within 6x of it (issue 12);
* the client's CPU time per asynchronous submission (issue 12's goal: <= 20 us + 1 us per tensor): the thread CPU
  time (``time.thread_time_ns``) of the ``compress_async`` / ``decompress_async`` call alone, not of ``result()``
  (which reaps), median over many calls, for 1 tensor and for the 200 parameters; on the CPU also with the tensors
  (frames) in the session's shared memory (``Client.empty``), where no staging copy is made, and for 1 tensor after
  an idle millisecond (the daemon's ring thread asleep: the submission rings its futex doorbell);
* throughput of a 25 MB bf16 bucket (real all-MiniLM-L6-v2 weights from data/demo when present, else
  synthetic weights) and of a batch of 200 parameters, through the daemon (a plain tensor: one copy
  into the shared-memory arena; a tensor made by ``Client.empty``: zero copy) and through the addon
  called directly from Node (the same bytes, the same default thread count; into a reused output buffer).
  Medians of ``--repeat`` runs; the daemon cases run interleaved, the direct runs before and after them
  (pooled), so that changes of machine load hit both alike.

With ``--cuda`` the same on the GPU (cuda:0): the round trips of an empty request and of a 1-element CUDA
tensor, the 25 MB bucket and the 200 parameters as CUDA tensors through the daemon over ZeroMQ (CUDA IPC handles,
the tensors staying on the GPU; timed to the end of the work queued on the stream) and through the GPU ring
(staged through the registered arena, ordered by the ring's stream memory words), against the addon's
gpuCompress/gpuDecompress called directly from a Node process on the same GPU (device buffers allocated once,
one batched call for the 200 parameters; default SM budget in both; the codec a CUDA tensor gets by default, `fast`
(tzip._codec_choice), in both). The ring's throughput rows run back to back, after the ZeroMQ rows (whose deferred
work in the daemon, closing CUDA IPC mappings, would otherwise run beside them); the bucket's both ways also into
buffers kept across calls (``compress(out=)``, ``decompress(out=)``), as the direct call writes into its own.

Unless ``--socket`` is given, a private daemon is started for the run and stopped afterwards.
"""

from __future__ import annotations

import argparse
import contextlib
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

from .._codec_choice import GPU_DEFAULT_CODEC
from .._spawn import cli_command
from ..client import Client

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


_NODE_GPU_DIRECT = r"""
const fs = require('fs');
const addon = require(process.argv[1]);
const [uuid, bucketPath, batchPath, repeat, n, codec] = [process.argv[2], process.argv[3], process.argv[4], Number(process.argv[5]), Number(process.argv[6]), process.argv[7]];
// The codec the daemon's GPU requests get by default (tzip._codec_choice), named on every item: the same work both ways.
const gpuCompress = (items, opts) => addon.gpuCompress(items.map((it) => ({ ...it, codec })), opts);
const norm = (u) => u.toLowerCase().replace(/^(gpu|mig)-/, '');
const dev = addon.gpuDevices().find((d) => norm(d.uuid) === norm(uuid));
if (!dev) { process.stderr.write(`no GPU ${uuid} visible to the addon\n`); process.exit(2); }
const device = dev.ordinal;
const now = () => Number(process.hrtime.bigint()) / 1e9;
const upload = (buf) => { const p = addon.gpuAlloc(device, buf.length); addon.gpuCopyToDevice(p, buf, device); return p; };
const bound = (nbytes, ndim) => addon.maxCompressedSize(nbytes, ndim);
(async () => {
  const out = { device, name: dev.name };
  const bucket = fs.readFileSync(bucketPath);
  const sizes = JSON.parse(fs.readFileSync(batchPath + '.json', 'utf8'));
  const batch = fs.readFileSync(batchPath);
  // one element
  const one = upload(Buffer.from([0x80, 0x3f]));
  const oneFrame = addon.gpuAlloc(device, bound(2, 1));
  const oneBack = addon.gpuAlloc(device, 2);
  let t = [];
  let sz;
  for (let i = 0; i < n + 200; i++) {
    const s = now();
    sz = await gpuCompress([{ data: one, nbytes: 2, dtype: 'BF16', shape: [1], frame: oneFrame, frameCapacity: bound(2, 1) }], { device });
    if (i >= 200) t.push(now() - s);
  }
  out.one_compress_s = t; t = [];
  for (let i = 0; i < n + 200; i++) {
    const s = now();
    await addon.gpuDecompress([{ frame: oneFrame, frameBytes: sz[0].frameBytes, out: oneBack, outBytes: 2 }], { device });
    if (i >= 200) t.push(now() - s);
  }
  out.one_decompress_s = t; t = [];
  // the bucket
  const b = upload(bucket);
  const bFrame = addon.gpuAlloc(device, bound(bucket.length, 1));
  const bBack = addon.gpuAlloc(device, bucket.length);
  const bItem = { data: b, nbytes: bucket.length, dtype: 'BF16', shape: [bucket.length / 2], frame: bFrame, frameCapacity: bound(bucket.length, 1) };
  await gpuCompress([bItem], { device });
  for (let i = 0; i < repeat; i++) { const s = now(); sz = await gpuCompress([bItem], { device }); t.push(now() - s); }
  out.bucket_compress_s = t; out.bucket_frame_bytes = Number(sz[0].frameBytes); t = [];
  const bDec = [{ frame: bFrame, frameBytes: sz[0].frameBytes, out: bBack, outBytes: bucket.length }];
  await addon.gpuDecompress(bDec, { device });
  for (let i = 0; i < repeat; i++) { const s = now(); await addon.gpuDecompress(bDec, { device }); t.push(now() - s); }
  out.bucket_decompress_s = t; t = [];
  // 200 parameters, one batched call
  const items = []; let off = 0;
  for (const k of sizes) {
    const part = batch.subarray(off, off + k * 2); off += k * 2;
    items.push({ data: upload(part), nbytes: part.length, dtype: 'BF16', shape: [k], frame: addon.gpuAlloc(device, bound(part.length, 1)), frameCapacity: bound(part.length, 1) });
  }
  let fs_ = await gpuCompress(items, { device });
  for (let i = 0; i < repeat; i++) { const s = now(); fs_ = await gpuCompress(items, { device }); t.push(now() - s); }
  out.batch_compress_s = t; out.batch_frame_bytes = fs_.reduce((a, x) => a + Number(x.frameBytes), 0); t = [];
  const dec = items.map((it, j) => ({ frame: it.frame, frameBytes: fs_[j].frameBytes, out: addon.gpuAlloc(device, Number(it.nbytes)), outBytes: it.nbytes }));
  await addon.gpuDecompress(dec, { device });
  for (let i = 0; i < repeat; i++) { const s = now(); await addon.gpuDecompress(dec, { device }); t.push(now() - s); }
  out.batch_decompress_s = t;
  process.stdout.write(JSON.stringify(out));
})().catch((e) => { process.stderr.write(String(e && e.stack || e) + '\n'); process.exit(1); });
"""


def _socketpair_pingpong(n: int) -> dict[str, float]:
    """Round trips of 1 byte over a Unix socketpair between this process and a forked child echoing it."""
    import socket

    a, b = socket.socketpair()
    pid = os.fork()
    if pid == 0:  # the child: echo until the parent closes its end
        a.close()
        try:
            while True:
                m = b.recv(16)
                if not m:
                    break
                b.send(m)
        finally:
            os._exit(0)
    b.close()
    try:
        def once():
            a.send(b"x")
            a.recv(16)

        return _timed(once, n)
    finally:
        a.close()
        os.waitpid(pid, 0)


def _ring_nop(client: Client):
    """A function doing one empty (nop) SQE round trip on ``client``'s CPU ring (opened by a first request)."""
    from .. import _ring

    client.compress(torch.ones(1))
    ring = client._rings[None]
    nop = _ring.sqe(_ring.OP_NOP)

    def once():
        h = _ring.Handle(ring, 1, None)
        ring.submit([[nop]], h)
        h.result()

    return once


def _submit_cpu(submit, tensors: int, n: int, warmup: int = 20, idle_s: float = 0.0) -> dict:
    """Thread CPU time of ``submit()`` (an asynchronous call returning a Handle) alone, median over ``n`` calls; each
    handle's ``result()`` is taken outside the timed part (``idle_s``: seconds slept before each call). ``ring``:
    whether the last call went through the submission ring (else ZeroMQ's worker threads: the figure is then not the
    ring's)."""
    from .. import _ring

    for _ in range(warmup):
        submit().result()
    samples = []
    h = None
    for _ in range(n):
        if idle_s:
            time.sleep(idle_s)
        t = time.thread_time_ns()
        h = submit()
        samples.append(time.thread_time_ns() - t)
        h.result()
    us = median(samples) / 1e3
    through_ring = h is not None and (getattr(h, "_ring", None) is not None or getattr(h, "_parts", None) is not None)
    return {"us": us, "us_per_tensor": us / tensors, "tensors": tensors, "goal_us": 20.0 + tensors, "n": n,
            "ring": bool(through_ring), "p90_us": sorted(samples)[int(len(samples) * 0.9)] / 1e3}


def _in_shm(client: Client, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of ``tensors`` in ``client``'s shared memory (``Client.empty``: zero copy through the ring)."""
    out = []
    for t in tensors:
        e = client.empty(t.shape, t.dtype)
        e.copy_(t)
        out.append(e)
    return out


def _submit_rows(client: Client, one: torch.Tensor, ct_one, params: list[torch.Tensor], cts: list, n: int,
                 shm: bool) -> dict:
    """The rows "client CPU time per async submission" (see the module docstring); ``shm``: CPU tensors, also
    measured with the inputs in shared memory."""
    from ..compressed import CompressedTensor

    few = max(10, n // 100)
    rows = {
        "compress_1": _submit_cpu(lambda: client.compress_async(one), 1, n),
        "decompress_1": _submit_cpu(lambda: client.decompress_async(ct_one), 1, n),
        "compress_batch": _submit_cpu(lambda: client.compress_async(params), len(params), few),
        "decompress_batch": _submit_cpu(lambda: client.decompress_async(cts), len(cts), few),
    }
    if shm:
        rows["compress_1_idle"] = _submit_cpu(lambda: client.compress_async(one), 1, max(200, n // 10), idle_s=1e-3)
        shm_params = _in_shm(client, params)
        shm_cts = [CompressedTensor(f, ct.dtype, ct.shape, ct.codec, ct.nbytes)
                   for f, ct in zip(_in_shm(client, [ct.payload for ct in cts]), cts)]
        rows["compress_batch_shm"] = _submit_cpu(lambda: client.compress_async(shm_params), len(params), few)
        rows["decompress_batch_shm"] = _submit_cpu(lambda: client.decompress_async(shm_cts), len(cts), few)
    return rows


def _report_submit(r: dict) -> list[str]:
    """The rows of :func:`_submit_rows`."""
    if "submit_cpu" not in r:
        return []
    kind = r.get("one_kind", "bf16 tensor")
    labels = [("compress_1", f"compress_async, 1-element {kind}"),
              ("compress_1_idle", f"compress_async, 1-element {kind}, after 1 ms idle"),
              ("decompress_1", f"decompress_async, 1-element {kind}"),
              ("compress_batch", "compress_async, {k} params"),
              ("compress_batch_shm", "compress_async, {k} params in shared memory"),
              ("decompress_batch", "decompress_async, {k} params"),
              ("decompress_batch_shm", "decompress_async, {k} params, frames in shared memory")]
    lines = ["", "client CPU time per async submission (thread CPU time of the call alone, median)",
             f"  {'':<60}{'us':>9} {'us/tensor':>10} {'goal us':>8}"]
    for key, label in labels:
        v = r["submit_cpu"].get(key)
        if v is None:
            continue
        note = "" if v["ring"] else "  (not through the ring)"
        lines.append(f"  {label.format(k=v['tensors']):<60}{v['us']:9.1f} {v['us_per_tensor']:10.2f} {v['goal_us']:8.0f}{note}")
    return lines


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


def _median_times(fns: dict, repeat: int, back_to_back: bool = False, spread: dict | None = None) -> dict[str, float]:
    """Median seconds of each function; rounds interleave the functions so load changes hit them alike, or, with
    ``back_to_back``, each function runs its ``repeat`` calls in a row (as the direct addon calls do). ``spread``, when
    given, gets each function's 10th, 50th and 90th percentile in µs."""
    for fn in fns.values():
        fn()  # warm-up (arena segments, mappings)
    times: dict[str, list[float]] = {k: [] for k in fns}
    order = [k for k in fns for _ in range(repeat)] if back_to_back else [k for _ in range(repeat) for k in fns]
    for k in order:
        fn = fns[k]
        t = time.perf_counter()
        fn()
        times[k].append(time.perf_counter() - t)
    if spread is not None:
        for k, v in times.items():
            v = sorted(v)
            spread[k] = [round(v[int(q * (len(v) - 1))] * 1e6, 1) for q in (0.1, 0.5, 0.9)]
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


def _direct_gpu(uuid: str, bucket: torch.Tensor, params: list[torch.Tensor], repeat: int, n: int) -> dict:
    node, _ = cli_command()
    addon = ROOT / "build" / "Release" / "tzip.node"
    with tempfile.TemporaryDirectory(prefix="tzip-bench-") as d:
        bpath, ppath = os.path.join(d, "bucket.bin"), os.path.join(d, "batch.bin")
        bucket.cpu().view(torch.int16).numpy().tofile(bpath)
        torch.cat([p.reshape(-1).cpu() for p in params]).view(torch.int16).numpy().tofile(ppath)
        Path(ppath + ".json").write_text(json.dumps([p.numel() for p in params]))
        out = subprocess.run([node, "-e", _NODE_GPU_DIRECT, str(addon), uuid, bpath, ppath, str(repeat), str(n), GPU_DEFAULT_CODEC],
                             capture_output=True, check=False)
        if out.returncode != 0:
            raise RuntimeError(f"the direct GPU addon run failed: {out.stderr.decode(errors='replace')[-2000:]}")
        return json.loads(out.stdout)


def _timed_cuda(fn, n: int, warmup: int = 200) -> dict[str, float]:
    """Round trips of ``fn`` timed to the end of the work it queued on the current stream (looked up once: the lookup
    costs 6.7 µs on the H200 host, an idle synchronize 1.4)."""
    stream = torch.cuda.current_stream()

    def once():
        fn()
        stream.synchronize()

    return _timed(once, n, warmup)


def _median_times_cuda(fns: dict, repeat: int, back_to_back: bool = False, spread: dict | None = None) -> dict[str, float]:
    stream = torch.cuda.current_stream()

    def synced(fn):
        def run_():
            fn()
            stream.synchronize()
        return run_

    return _median_times({k: synced(f) for k, f in fns.items()}, repeat, back_to_back, spread)


@contextlib.contextmanager
def _daemon_socket(socket: str | None):
    """``socket`` as given, or, when None, the socket of a private daemon started in a temporary folder for the
    duration (stopped with SIGTERM afterwards). Raises RuntimeError with the daemon's last words when it exits
    before listening, and DaemonSpawnError (tzip._errors) when no CLI is found to start it."""
    if socket is not None:
        yield socket
        return
    with tempfile.TemporaryDirectory(prefix="tzip-bench-") as d:
        path = os.path.join(d, "d", "tzip.sock")
        log = os.path.join(d, "daemon.log")
        with open(log, "wb") as err:
            daemon = subprocess.Popen([*cli_command(), "serve", "--socket", path], stdout=subprocess.PIPE, stderr=err)
        try:
            if not daemon.stdout.readline():  # the "listening" line; end of file: it exited before listening
                daemon.wait(10)
                with open(log, "rb") as f:
                    tail = f.read()[-2000:].decode(errors="replace").strip()
                raise RuntimeError(f"the tzip daemon did not start (`{' '.join(daemon.args)}` exited with status "
                                   f"{daemon.returncode}): {tail or 'no message'}")
            yield path
        finally:
            daemon.terminate()
            daemon.wait(10)


def run_cuda(socket: str | None, n: int, repeat: int, ring_spin_s: float | None = None) -> dict:
    """The GPU measurements (see the module docstring)."""
    from .._cuda import device_uuid

    if not torch.cuda.is_available():
        raise SystemExit("--cuda: no CUDA GPU visible to PyTorch")
    result: dict = {"machine": f"{platform.node()}, {torch.cuda.get_device_name(0)}, Python {platform.python_version()}, torch {torch.__version__}"}
    with _daemon_socket(socket) as socket:
        client = Client(socket, spawn=False, strict=True, **({} if ring_spin_s is None else {"ring_spin_s": ring_spin_s}))
        if not client.daemon_info.get("gpu"):
            raise SystemExit(f"--cuda: the daemon serves no GPU ({client.daemon_info.get('gpu_reason')})")
        handing = Client(socket, spawn=False, strict=True, gpu_share_min_bytes=0, ring_entries=0)
        ring = client
        client = Client(socket, spawn=False, strict=True, ring_entries=0)  # ZeroMQ requests: the rows of before
        has_ring = ring.ring_info["offered"] is not None
        bucket_h, params_h, source = _inputs()
        result["input"] = source
        bucket = bucket_h.cuda()
        params = [p.cuda() for p in params_h]
        result["empty_request"] = _timed(lambda: client._session.call("heartbeat", {}), n)
        one = torch.ones(1, dtype=torch.bfloat16, device="cuda")
        ct_one = client.compress(one)
        result["compress_1_element"] = _timed_cuda(lambda: client.compress(one), n)
        result["decompress_1_element"] = _timed_cuda(lambda: client.decompress(ct_one), n)
        result["compress_1_element_handed_over"] = _timed_cuda(lambda: handing.compress(one), n)
        if has_ring:
            ring.compress(one)
            if "cuda:0" not in ring.ring_info["rings"]:  # e.g. no driver entry points: the ring client used ZeroMQ
                result["ring_refused"] = ring.ring_info["refused"]
                has_ring = False
        if has_ring:
            result["one_kind"] = "bf16 CUDA tensor"
            result["ring_nop"] = _timed(_ring_nop(ring), n)
            result["ring_compress_1_element"] = _timed_cuda(lambda: ring.compress(one), n)
            result["ring_decompress_1_element"] = _timed_cuda(lambda: ring.decompress(ct_one), n)
            result["ring_gpu"] = ring.ring_info["rings"].get("cuda:0")
            result["submit_cpu"] = _submit_rows(ring, one, ct_one, params, client.compress(params), n, shm=False)
            torch.cuda.synchronize()

        ct = client.compress(bucket)
        out_bucket = torch.empty_like(bucket)
        frame_buf = torch.empty(Client.frame_bound(bucket), dtype=torch.uint8, device=bucket.device)
        cts = client.compress(params)
        torch.cuda.synchronize()
        direct_runs = [_direct_gpu(device_uuid(0), bucket, params, repeat, n)]
        fns = {
            "bucket_compress": lambda: client.compress(bucket),
            "bucket_decompress": lambda: client.decompress(ct),
            "bucket_decompress_into": lambda: client.decompress(ct, out=out_bucket),
            "batch_compress": lambda: client.compress(params),
            "batch_compress_handed_over": lambda: handing.compress(params),
            "batch_decompress": lambda: client.decompress(cts),
            "batch_decompress_handed_over": lambda: handing.decompress(cts),
        }
        daemon_t = _median_times_cuda(fns, repeat)
        if has_ring:
            # The ring's rows in a loop of their own: interleaved with the ZeroMQ rows, they ran beside the daemon's
            # deferred work for those (closing CUDA IPC mappings, freeing), and the ring thread's codec call for the
            # bucket took 84 us instead of 23 (TZIP_TRACE, H200, docs/benchmarks.md). A job on the ring has no such
            # neighbour. Each row's calls run back to back, as the direct addon calls they are compared with do: a call
            # right after the same call is faster than one after other work or after idle time (the ring's bucket
            # compress: 515 us back to back, 660 interleaved with the other rows, 617-682 after 1-10 ms idle; H200,
            # docs/benchmarks.md), so only the same pattern on both sides compares like with like.
            daemon_t.update(_median_times_cuda({
                "ring_bucket_compress": lambda: ring.compress(bucket),
                # into buffers kept across calls, as the direct addon call writes into its reused buffers
                "ring_bucket_compress_into": lambda: ring.compress(bucket, out=frame_buf),
                "ring_bucket_decompress": lambda: ring.decompress(ct),
                "ring_bucket_decompress_into": lambda: ring.decompress(ct, out=out_bucket),
                "ring_batch_compress": lambda: ring.compress(params),
                "ring_batch_decompress": lambda: ring.decompress(cts),
            }, repeat, back_to_back=True, spread=result.setdefault("ring_spread_us", {})))
        direct_runs.append(_direct_gpu(device_uuid(0), bucket, params, repeat, n))
        direct = {k: (median(direct_runs[0][k] + direct_runs[1][k]) if isinstance(direct_runs[0][k], list) else direct_runs[0][k])
                  for k in direct_runs[0] if not k.startswith("one_")}
        result["direct_runs_us"] = {k.removesuffix("_s"): [median(run[k]) * 1e6 for run in direct_runs]
                                    for k in direct_runs[0] if k.endswith("_s") and not k.startswith("one_")}
        for k in ("one_compress_s", "one_decompress_s"):
            direct[k] = _percentiles(direct_runs[0][k] + direct_runs[1][k])
        pbytes = sum(p.numel() for p in params) * 2
        if has_ring:
            result["ring"] = {k.removeprefix("ring_") + "_s": v for k, v in daemon_t.items() if k.startswith("ring_")}
        result["bucket"] = {"bytes": bucket.numel() * 2, "frame_bytes": ct.payload.numel(), "ratio": ct.ratio, "codec": ct.codec,
                            **{f"daemon_{k.removeprefix('bucket_')}_s": v for k, v in daemon_t.items() if k.startswith("bucket_")},
                            "direct_compress_s": direct["bucket_compress_s"], "direct_decompress_s": direct["bucket_decompress_s"]}
        result["batch"] = {"tensors": len(params), "bytes": pbytes, "frame_bytes": sum(c.payload.numel() for c in cts),
                           **{f"daemon_{k.removeprefix('batch_')}_s": v for k, v in daemon_t.items() if k.startswith("batch_")},
                           "direct_compress_s": direct["batch_compress_s"], "direct_decompress_s": direct["batch_decompress_s"]}
        result["direct"] = direct
        result["gb"] = {"bucket": bucket.numel() * 2 / 1e9, "batch": pbytes / 1e9}
        handing.close()
        client.close()
        ring.close()
    return result


def _report_cuda(r: dict) -> str:
    lines = [f"GPU: {r['machine']}; device buffers, default SM budget", f"input: {r['input']}", ""]
    lines.append("round trips (ipc://, to the end of the stream's work)     p50 us    p99 us")
    d = r["direct"]
    rows = [("empty request (heartbeat)", r["empty_request"]),
            ("compress 1-element bf16 CUDA tensor (staged)", r["compress_1_element"]),
            ("compress 1-element bf16 CUDA tensor (handed over)", r["compress_1_element_handed_over"]),
            ("decompress 1-element bf16 CUDA tensor", r["decompress_1_element"]),
            ("direct addon: gpuCompress of 1 element", {"p50_us": d["one_compress_s"]["p50_us"], "p99_us": d["one_compress_s"]["p99_us"]}),
            ("direct addon: gpuDecompress of 1 element", {"p50_us": d["one_decompress_s"]["p50_us"], "p99_us": d["one_decompress_s"]["p99_us"]})]
    for name, v in rows:
        lines.append(f"  {name:<56}{v['p50_us']:8.1f}  {v['p99_us']:8.1f}")
    lines.append("")
    lines.append("throughput (GB/s = 1e9 original bytes / s; median)            daemon   direct addon")
    b, bt, gb = r["bucket"], r["batch"], r["gb"]

    def row(name: str, nbytes_gb: float, daemon_s: float, direct_s: float | None = None) -> str:
        direct_txt = f"{nbytes_gb / direct_s:9.2f}" if direct_s else ""
        return f"  {name:<60}{nbytes_gb / daemon_s:7.2f}  {direct_txt}"

    lines.append(row("25 MB bf16 bucket, compress (handed over)", gb["bucket"], b["daemon_compress_s"], b["direct_compress_s"]))
    lines.append(row("25 MB bf16 bucket, decompress (new tensor)", gb["bucket"], b["daemon_decompress_s"], b["direct_decompress_s"]))
    lines.append(row("25 MB bf16 bucket, decompress (into out=)", gb["bucket"], b["daemon_decompress_into_s"]))
    mb = bt["bytes"] / 1e6
    lines.append(row(f"{bt['tensors']} params ({mb:.1f} MB), compress (staged)", gb["batch"], bt["daemon_compress_s"], bt["direct_compress_s"]))
    lines.append(row(f"{bt['tensors']} params ({mb:.1f} MB), compress (handed over)", gb["batch"], bt["daemon_compress_handed_over_s"]))
    lines.append(row(f"{bt['tensors']} params ({mb:.1f} MB), decompress (staged)", gb["batch"], bt["daemon_decompress_s"], bt["direct_decompress_s"]))
    lines.append(row(f"{bt['tensors']} params ({mb:.1f} MB), decompress (handed over)", gb["batch"], bt["daemon_decompress_handed_over_s"]))
    lines.append(f"  bucket ratio {b['ratio']:.4f} ({b['codec']}); batch ratio {bt['frame_bytes'] / bt['bytes']:.4f}")
    lines.extend(_report_ring(r))
    if "ring" in r:
        for key, dkey, label in [("bucket_compress_s", "direct_compress_s", "bucket compress"),
                                 ("bucket_compress_into_s", "direct_compress_s", "bucket compress into out="),
                                 ("bucket_decompress_s", "direct_decompress_s", "bucket decompress"),
                                 ("bucket_decompress_into_s", "direct_decompress_s", "bucket decompress into out="),
                                 ("batch_compress_s", "direct_compress_s", "200 params compress"),
                                 ("batch_decompress_s", "direct_decompress_s", "200 params decompress")]:
            src = b if key.startswith("bucket") else bt
            lines.append(f"  {label}: ring / direct addon time {r['ring'][key] / src[dkey]:.2f} (goal <= 1.10)")
        for k, (p10, p50, p90) in r.get("ring_spread_us", {}).items():
            d = r["direct_runs_us"].get(k.removeprefix("ring_"))
            lines.append(f"  {k.removeprefix('ring_')}: ring p10/p50/p90 {p10:.0f}/{p50:.0f}/{p90:.0f} us"
                         + (f"; direct addon, median of each run {' / '.join(f'{x:.0f}' for x in d)} us" if d else ""))
    return "\n".join(lines)


def run(socket: str | None, n: int, repeat: int) -> dict:
    result: dict = {"machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, torch {torch.__version__}"}
    with _daemon_socket(socket) as socket:
        client = Client(socket, spawn=False, strict=True, ring_entries=0)  # ZeroMQ requests: the rows of before
        ring = Client(socket, spawn=False, strict=True)
        has_ring = ring.ring_info["offered"] is not None
        bucket, params, source = _inputs()
        result["input"] = source
        result["transport_floor"] = _transport_floor(n)
        result["socketpair"] = _socketpair_pingpong(n)
        result["empty_request"] = _timed(lambda: client._session.call("heartbeat", {}), n)
        one = torch.ones(1, dtype=torch.bfloat16)
        ct_one = client.compress(one)
        result["compress_1_element"] = _timed(lambda: client.compress(one), n)
        result["decompress_1_element"] = _timed(lambda: client.decompress(ct_one), n)
        if has_ring:
            result["ring_nop"] = _timed(_ring_nop(ring), n)
            result["ring_compress_1_element"] = _timed(lambda: ring.compress(one), n)
            result["ring_decompress_1_element"] = _timed(lambda: ring.decompress(ct_one), n)
            result["submit_cpu"] = _submit_rows(ring, one, ct_one, params, client.compress(params), n, shm=True)

        gb = bucket.numel() * 2 / 1e9
        ct = client.compress(bucket)
        shm_bucket = client.empty(bucket.shape, bucket.dtype)
        shm_bucket.copy_(bucket)
        out_bucket = client.empty(bucket.shape, bucket.dtype)
        pbytes = sum(p.numel() for p in params) * 2
        cts = client.compress(params)
        # the direct addon runs before and after the daemon measurements; its samples are pooled
        direct_runs = [_direct(bucket, params, repeat)]
        fns = {
            "bucket_compress": lambda: client.compress(bucket),
            "bucket_compress_zero_copy": lambda: client.compress(shm_bucket),
            "bucket_decompress": lambda: client.decompress(ct),
            "bucket_decompress_into_shm": lambda: client.decompress(ct, out=out_bucket),
            "batch_compress": lambda: client.compress(params),
            "batch_decompress": lambda: client.decompress(cts),
        }
        if has_ring:
            ring_shm_bucket = ring.empty(bucket.shape, bucket.dtype)
            ring_shm_bucket.copy_(bucket)
            fns.update({
                "ring_bucket_compress": lambda: ring.compress(bucket),
                "ring_bucket_compress_zero_copy": lambda: ring.compress(ring_shm_bucket),
                "ring_bucket_decompress": lambda: ring.decompress(ct),
                "ring_batch_compress": lambda: ring.compress(params),
                "ring_batch_decompress": lambda: ring.decompress(cts),
            })
        daemon_t = _median_times(fns, repeat)
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
        if has_ring:
            result["ring"] = {k.removeprefix("ring_") + "_s": v for k, v in daemon_t.items() if k.startswith("ring_")}
            result["ring"]["vs_socketpair"] = result["ring_compress_1_element"]["p50_us"] / result["socketpair"]["p50_us"]
        result["direct"] = direct
        result["threads"] = direct["threads"]
        result["gb"] = {"bucket": gb, "batch": pbytes / 1e9}
        client.close()
        ring.close()
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
    lines.extend(_report_ring(r))
    if "ring" in r:
        lines.append("")
        for key, src, dkey, label in [("bucket_compress_s", b, "direct_compress_s", "bucket compress"),
                                      ("bucket_decompress_s", b, "direct_decompress_s", "bucket decompress"),
                                      ("batch_compress_s", bt, "direct_compress_s", f"{bt['tensors']} params compress"),
                                      ("batch_decompress_s", bt, "direct_decompress_s", f"{bt['tensors']} params decompress")]:
            lines.append(f"  {label}: ring / direct addon time {r['ring'][key] / src[dkey]:.2f} (goal <= 1.10)")
    return "\n".join(lines)


def _report_ring(r: dict) -> list[str]:
    """The submission ring's rows (docs/ring.md), when the daemon offered it."""
    lines = ["", "submission ring (protocol version 4)                       p50 us    p99 us"]
    if "ring_nop" not in r:
        if r.get("ring_refused"):
            return lines + [f"  no ring: {r['ring_refused']}"]
        return lines + ["  the daemon offers no ring (an addon without ringOpen, or protocol version < 4)"]
    rows = [("empty (nop) SQE round trip", r["ring_nop"]), (f"compress 1-element {r.get('one_kind', 'bf16 tensor')}", r["ring_compress_1_element"]),
            (f"decompress 1-element {r.get('one_kind', 'bf16 tensor')}", r["ring_decompress_1_element"])]
    if "socketpair" in r:
        rows.append(("Unix socketpair ping-pong (Python <-> forked Python)", r["socketpair"]))
    for name, v in rows:
        lines.append(f"  {name:<56}{v['p50_us']:8.1f}  {v['p99_us']:8.1f}")
    if "vs_socketpair" in r["ring"]:
        lines.append(f"  1-element compress / socketpair ping-pong: {r['ring']['vs_socketpair']:.1f}x (goal: <= 6x)")
    g, rg = r["gb"], r["ring"]
    lines.append("throughput through the ring (GB/s, median)")
    for key, label, gbk in [("bucket_compress_s", "25 MB bf16 bucket, compress", "bucket"),
                            ("bucket_compress_zero_copy_s", "25 MB bf16 bucket, compress (zero copy, shm)", "bucket"),
                            ("bucket_compress_into_s", "25 MB bf16 bucket, compress (into out=, kept)", "bucket"),
                            ("bucket_decompress_s", "25 MB bf16 bucket, decompress (new tensor)", "bucket"),
                            ("bucket_decompress_into_s", "25 MB bf16 bucket, decompress (into out=)", "bucket"),
                            ("batch_compress_s", f"{r['batch']['tensors']} params, compress", "batch"),
                            ("batch_decompress_s", f"{r['batch']['tensors']} params, decompress", "batch")]:
        if key in rg:
            lines.append(f"  {label:<60}{g[gbk] / rg[key]:7.2f}")
    return lines + _report_submit(r)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--socket", help="use the daemon on this socket instead of starting one")
    ap.add_argument("--n", type=int, default=5000, help="round trips per latency measurement (default 5000)")
    ap.add_argument("--repeat", type=int, default=5, help="runs per throughput measurement (default 5)")
    ap.add_argument("--json", action="store_true", help="print the raw results as JSON")
    ap.add_argument("--cuda", action="store_true", help="measure CUDA tensors on cuda:0 instead (daemon vs the addon's GPU codec)")
    ap.add_argument("--ring-spin-us", type=float, default=None,
                    help="--cuda: µs the ring client polls for a completion before it sleeps (default: the client's, 200)")
    args = ap.parse_args(argv)
    if args.cuda:
        r = run_cuda(args.socket, args.n, args.repeat, None if args.ring_spin_us is None else args.ring_spin_us * 1e-6)
        print(json.dumps(r, indent=2) if args.json else _report_cuda(r))
        return 0
    r = run(args.socket, args.n, args.repeat)
    print(json.dumps(r, indent=2) if args.json else _report(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
