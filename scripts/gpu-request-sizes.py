"""What one blocking GPU request costs through the daemon, by size and SM budget (docs/benchmarks.md, "First GPU
figures"): compress and decompress of one CUDA bf16 tensor (MiniLM's gradients of data/gpu, tiled to each size),
codec fast, each the median of 5 timed calls after one untimed, with the device synchronised around each call.
On a GPU host, from the repository root, after `bash scripts/gpu-data.sh`:

    python scripts/gpu-request-sizes.py [--sizes 1,4,12.5,50,200] [--budgets 10,0]

A daemon is started (or the one at $TZIP_SOCKET used); run that daemon with TZIP_TRACE=1 to see where each request's
time goes inside it. Prints one row per size and budget: ms and GB/s of original bytes, the frame's ratio; exits 1
when a round trip is not bit-identical."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python-bridge"))
import tzip  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1,4,12.5,50,200", help="tensor sizes, MB (10^6 bytes)")
    ap.add_argument("--budgets", default="10,0", help="sm_budget values (0: every SM)")
    ap.add_argument("--data", default="data/gpu/minilm-grads-bf16.BF16.bin")
    a = ap.parse_args()
    raw = np.fromfile(a.data, dtype=np.uint16)
    src = torch.from_numpy(raw.astype(np.int16)).view(torch.bfloat16)
    c = tzip.connect()
    print(f"{torch.cuda.get_device_name(0)}; {a.data} tiled; codec fast; median of 5")
    print("MB | sm_budget | compress ms | GB/s | decompress ms | GB/s | ratio")
    ok = True
    for mb in (float(x) for x in a.sizes.split(",")):
        n = int(mb * 1e6) // 2
        t = src.repeat(n // src.numel() + 1)[:n].cuda()
        for b in (int(x) for x in a.budgets.split(",")):
            tc, td = [], []
            for i in range(6):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                ct = c.compress([t], codec="fast", sm_budget=b)[0]
                torch.cuda.synchronize()
                t1 = time.perf_counter()
                back = c.decompress([ct], sm_budget=b)[0]
                torch.cuda.synchronize()
                t2 = time.perf_counter()
                if i:
                    tc.append(t1 - t0)
                    td.append(t2 - t1)
            ok = ok and torch.equal(back.view(torch.int16), t.view(torch.int16))
            mc, md = sorted(tc)[len(tc) // 2], sorted(td)[len(td) // 2]
            print(f"{mb:g} | {b} | {mc * 1e3:.3f} | {t.nbytes / mc / 1e9:.1f} | {md * 1e3:.3f} | "
                  f"{t.nbytes / md / 1e9:.1f} | {ct.compressed_nbytes / ct.nbytes:.3f}", flush=True)
    c.close()
    print("bit-identical:", "yes" if ok else "NO")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
