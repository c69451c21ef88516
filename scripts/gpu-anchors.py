"""Anchor codecs on the same GPU data as tzip's GPU benchmark: nvCOMP 6 ANS and Bitcomp (whole GPU).

Run on the GPU host (offline) from the repo root, after installing the carried wheels:
    python3 scripts/gpu-anchors.py DATA_DIR [GIB]
DATA_DIR holds raw little-endian tensors named NAME.DTYPE.bin (real data: scripts/gpu-check.sh uses the same
files); each is tiled on the GPU to GIB GiB (default 2). Prints, per file and anchor: ratio (compressed /
original bytes), compress and decompress GB/s counting original bytes (median of 10 timed runs after 2 warm-ups,
wall clock around device synchronisation, since nvCOMP runs on its own stream), and checks every round trip
byte for byte. nvCOMP cannot be confined to an SM budget, so these are whole-GPU figures.
"""
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from nvidia import nvcomp

RUNS, WARMUP = 10, 2


def tiled(path: Path, gib: float) -> torch.Tensor:
    raw = torch.from_numpy(np.fromfile(path, dtype=np.uint8)).cuda()
    reps = max(1, int(gib * 2**30) // raw.numel())
    return raw.repeat(reps)


def timed(fn) -> tuple[float, object]:
    out = None
    times = []
    for i in range(WARMUP + RUNS):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        if i >= WARMUP:
            times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def main() -> int:
    data_dir = Path(sys.argv[1])
    gib = float(sys.argv[2]) if len(sys.argv) > 2 else 2.0
    print(f"nvCOMP {nvcomp.__version__} (CUDA {nvcomp.__cuda_version__}), torch {torch.__version__}, "
          f"{torch.cuda.get_device_name()}, {torch.cuda.get_device_properties(0).multi_processor_count} SMs")
    rows = []
    bad = 0
    for path in sorted(data_dir.glob("*.bin")):
        name, dtype = path.name.split(".")[:2]
        x = tiled(path, gib)
        width = {"BF16": "<u2", "F16": "<f2", "F32": "<u4"}.get(dtype, "|u1")
        anchors = [
            ("nvcomp ANS u8", dict(algorithm="ANS", data_type="|u1")),
            ("nvcomp ANS f16", dict(algorithm="ANS", data_type="<f2")),
            (f"nvcomp Bitcomp {width}", dict(algorithm="Bitcomp", data_type=width)),
        ]
        for label, opts in anchors:
            try:
                codec = nvcomp.Codec(**opts)
                arr = nvcomp.as_array(x)
                tc, enc = timed(lambda: codec.encode(arr))
                td, dec = timed(lambda: codec.decode(enc))
                back = torch.as_tensor(dec, device="cuda").view(torch.uint8).reshape(-1)
                same = back.numel() == x.numel() and bool(torch.equal(back, x))
                bad += not same
                ratio = enc.buffer_size / x.numel()
                rows.append((name, dtype, label, ratio, x.numel() / tc / 1e9, x.numel() / td / 1e9, same))
            except Exception as e:  # an anchor that does not support this data type is reported, not fatal
                rows.append((name, dtype, label, float("nan"), float("nan"), float("nan"), f"error: {e}"))
        del x
        torch.cuda.empty_cache()
    print(f"\n{'data':<22}{'dtype':<6}{'anchor':<22}{'ratio':>8}{'comp GB/s':>11}{'decomp GB/s':>13}  round trip")
    for name, dtype, label, ratio, c, d, same in rows:
        print(f"{name:<22}{dtype:<6}{label:<22}{ratio:>8.4f}{c:>11.1f}{d:>13.1f}  {same}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
