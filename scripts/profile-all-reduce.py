"""Where the time of one tzip.distributed.all_reduce goes, step by step: the steps of its pipeline
(tzip.distributed._all_reduce._AllReduce: prepare = checks and piece 0's encode, send, reduce_and_encode, finish,
the size gathers, waiting for the codec thread) timed on rank 0 by wrapping them, for one piece and for pieces.

    .venv/bin/python scripts/profile-all-reduce.py [--mb 100] [--dtype bfloat16] [--codec auto] [--piece-mb 0,25]
                                                   [--ranks 2] [--repeat 3]

Data: the real MiniLM gradients of tzip.bench.collectives (each rank its own backward pass), tiled to --mb MB; gloo
on 127.0.0.1, a private daemon. Prints, per piece size, the median over --repeat calls (after one warm-up) of the
call's wall time and of each step's summed time; the steps overlap (the codec thread, collectives in flight), so
they need not add up to the call.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile
import time
from statistics import median

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

STEPS = ("prepare", "take_encoded", "sizes", "send", "wait", "reduce_and_encode", "gather_row", "finish")


def _rank(rank: int, world: int, store: str, socket: str, args, out: str) -> None:
    os.environ["TZIP_SOCKET"] = socket
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    try:
        import tzip.distributed as tzd
        from tzip.bench.collectives import MB, _rank_gradients, _window
        from tzip.distributed import _all_reduce

        spent: dict[str, float] = {}

        def timed(name: str):
            fn = getattr(_all_reduce._AllReduce, name)

            def wrapper(self, *a, **k):
                t0 = time.perf_counter()
                try:
                    return fn(self, *a, **k)
                finally:
                    spent[name] = spent.get(name, 0.0) + time.perf_counter() - t0
            return wrapper

        for name in STEPS:
            setattr(_all_reduce._AllReduce, name, timed(name))
        flat = _rank_gradients(rank, world).to(getattr(torch, args.dtype))
        data = _window(flat, int(args.mb * MB) // flat.element_size())
        lines = []
        for pb in args.piece_mb:
            rows: list[dict[str, float]] = []
            for it in range(args.repeat + 1):
                x = data.clone()
                spent.clear()
                dist.barrier()
                t0 = time.perf_counter()
                tzd.all_reduce(x, codec=args.codec, piece_bytes=int(pb * MB))
                wall = time.perf_counter() - t0
                if it:
                    rows.append({"call": wall, **spent})
            keys = ["call", *(s for s in STEPS if any(s in r for r in rows))]
            lines.append(f"pieces of {pb:g} MB" if pb else "one piece")
            lines.append("  " + ", ".join(f"{k} {median(r.get(k, 0.0) for r in rows):.3f}" for k in keys))
        if rank == 0:
            with open(out, "w") as f:
                f.write("\n".join(lines) + "\n")
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=100.0, help="bucket size in MB (10^6 bytes)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--codec", default="auto", choices=["auto", "fast", "max", "raw"])
    ap.add_argument("--piece-mb", default="0,25", help="piece sizes in MB, comma-separated (0: one piece)")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)
    args.piece_mb = [float(x) for x in args.piece_mb.split(",")]
    from tzip.bench.collectives import _machine
    from tzip.bench.daemon import _daemon_socket

    with tempfile.TemporaryDirectory(prefix="tzip-profile-ar-") as d, _daemon_socket(None) as socket:
        out = os.path.join(d, "out.txt")
        mp.spawn(_rank, args=(args.ranks, os.path.join(d, "store"), socket, args, out), nprocs=args.ranks)
        print(f"machine: {_machine()}")
        print(f"command: {' '.join([sys.executable, *sys.argv])}")
        print(f"{args.ranks} gloo ranks, {args.mb:g} MB of {args.dtype} MiniLM gradients, codec {args.codec}; rank 0, "
              f"seconds, median of {args.repeat}:")
        with open(out) as f:
            print(f.read(), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
