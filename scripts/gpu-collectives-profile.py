"""Where a 2-rank all-reduce of a 25 MB CUDA bf16 bucket spends its time, on a GPU host (gloo over 127.0.0.1 carrying
CUDA tensors, both ranks on cuda:0; docs/benchmarks.md, "First GPU figures" and "Coding in the rank's own process").
From the repository root, after `bash scripts/gpu-data.sh` (and `npm run build:native`: the addon and libtzip.so):

    python scripts/gpu-collectives-profile.py

One run prints, rank 0's milliseconds, median of 7 after one untimed call, each call between a barrier and a device
synchronisation:
* plain ``dist.all_reduce`` against ``tzip.distributed.all_reduce`` (codec raw and fast, one piece and the default
  pieces), through the daemon and coded in-process (``client=InProcessCodec()``), the in-process result checked bit
  for bit against plain;
* what an all-reduce is made of: gloo's all_to_all of 6.25 MB (CPU and CUDA tensors) and a small all_gather, the copies
  between the GPU and pageable or page-locked host memory, the codec's compress and decompress of one rank's 12.5 MB
  shard through the daemon and in-process (libtzip at 10 SMs and at all SMs);
* cProfile of five daemon-coded one-piece all-reduces on rank 0, by own time and by cumulative time.
A private daemon is started (tzip.bench.daemon's) and stopped. Exits non-zero when a result is not bit-identical."""

from __future__ import annotations

import cProfile
import datetime
import io
import os
import pstats
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python-bridge"))

MB = 1_000_000


def _timed(fn, n: int = 7) -> float:
    """Median milliseconds of ``fn`` over ``n`` calls after one untimed, each between a barrier and a sync."""
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(n):
        dist.barrier()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return median(ts) * 1e3


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


def _rank(rank: int, world: int, store: str, sock: str) -> None:
    os.environ["TZIP_SOCKET"] = sock
    torch.set_num_threads(1)
    torch.cuda.set_device(0)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    from tzip import _native
    from tzip import distributed as tzd
    from tzip._default import default_client
    from tzip.in_process import InProcessCodec

    client, local = default_client(), InProcessCodec()
    raw = np.fromfile("data/gpu/minilm-grads-bf16.BF16.bin", dtype=np.uint8)
    src = torch.from_numpy(raw).view(torch.bfloat16).roll(rank * 4099)  # each rank its own, as in the benchmarks
    n = 25 * MB // 2
    x = src.repeat(n // src.numel() + 1)[:n].cuda()
    shard = x[: n // 2].contiguous()
    rows: list[tuple[str, float]] = []
    ok = True

    plain = x.clone()
    dist.all_reduce(plain)
    for name, kw in (("daemon", {}), ("in-process", {"client": local})):
        for pb in (0, None):
            y = x.clone()
            tzd.all_reduce(y, codec="fast", piece_bytes=pb, **kw)
            torch.cuda.synchronize()
            ok = ok and _same(y, plain)
    rows.append(("plain dist.all_reduce", _timed(lambda: dist.all_reduce(x.clone()))))
    rows.append(("tzip raw, one piece", _timed(lambda: tzd.all_reduce(x.clone(), codec="raw", piece_bytes=0))))
    for name, kw in (("daemon", {}), ("in-process", {"client": local})):
        rows.append((f"tzip fast, one piece, {name}", _timed(lambda: tzd.all_reduce(x.clone(), codec="fast", piece_bytes=0, **kw))))
        rows.append((f"tzip fast, default pieces, {name}", _timed(lambda: tzd.all_reduce(x.clone(), codec="fast", **kw))))
    half = 6_250_000
    for where in ("cpu", "cuda"):
        b = torch.empty(2 * half, dtype=torch.uint8, device=where)
        o = torch.empty_like(b)
        rows.append((f"gloo all_to_all, 6.25 MB each way, {where} tensors",
                     _timed(lambda: dist.all_to_all_single(o, b, [half, half], [half, half]))))
    s, o3 = torch.zeros(3, dtype=torch.int64), torch.empty(3 * world, dtype=torch.int64)
    rows.append(("gloo all_gather of 3 int64", _timed(lambda: dist.all_gather_into_tensor(o3, s))))
    g = torch.empty(half, dtype=torch.uint8, device="cuda")
    pageable, pinned = torch.empty(half, dtype=torch.uint8), torch.empty(half, dtype=torch.uint8, pin_memory=True)
    rows.append(("GPU to pageable host, 6.25 MB", _timed(lambda: pageable.copy_(g))))
    rows.append(("GPU to page-locked host, 6.25 MB", _timed(lambda: pinned.copy_(g))))
    rows.append(("page-locked host to GPU, 6.25 MB", _timed(lambda: g.copy_(pinned))))
    out = torch.empty_like(shard)
    for name, cod in (("daemon", client), ("in-process", local)):
        ct = cod.compress(shard, "fast")
        rows.append((f"compress 12.5 MB, {name} (ratio {ct.payload.numel() / (2 * shard.numel()):.3f})",
                     _timed(lambda: cod.compress(shard, "fast"))))
        rows.append((f"decompress 12.5 MB, {name}", _timed(lambda: cod.decompress(ct, out=out))))
        ok = ok and _same(out, shard)
    for sms in (10, 0):
        rows.append((f"libtzip encode 12.5 MB, {sms or 'all'} SMs, with the wait for its size",
                     _timed(lambda: _native.gpu_encode_frames([shard], "fast", sm_budget=sms))))
    prof = cProfile.Profile()
    dist.barrier()
    if rank == 0:
        prof.enable()
    for _ in range(5):
        tzd.all_reduce(x.clone(), codec="fast", piece_bytes=0)
        torch.cuda.synchronize()
    if rank == 0:
        prof.disable()
        for key, count in (("tottime", 22), ("cumulative", 30)):
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats(key).print_stats(count)
            print(f"==== cProfile of 5 daemon-coded one-piece all-reduces, rank 0, by {key}\n{text.getvalue()[-7000:]}")
        print(f"{torch.cuda.get_device_name(0)}; MiniLM bf16 gradients of data/gpu tiled to 25 MB; 2 gloo ranks on cuda:0")
        for name, ms in rows:
            print(f"{name:70s} {ms:9.3f} ms")
        print(f"bit-identical to plain dist.all_reduce and to the shard: {'yes' if ok else 'NO'}")
    dist.barrier()
    dist.destroy_process_group()
    if not ok:
        raise SystemExit(1)


def main() -> int:
    from tzip.bench.daemon import _daemon_socket

    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="tzip-coll-prof-") as d, _daemon_socket(None) as sock:
        mp.spawn(_rank, args=(2, os.path.join(d, "store"), sock), nprocs=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
