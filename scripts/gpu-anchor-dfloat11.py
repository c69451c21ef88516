"""Anchor: DFloat11's GPU decoder (PyPI `dfloat11`, Huffman-coded bf16 exponents) on tzip's GPU benchmark data.

Run on the GPU host (offline) from the repo root, with the wheels of `dfloat11` and `dahuffman` installed (the host
image has CuPy, which DFloat11's decoder runs on):
    python3 scripts/gpu-anchor-dfloat11.py DATA_DIR [MIB]
DATA_DIR holds raw little-endian tensors named NAME.DTYPE.bin (scripts/gpu-check.sh uses the same files); DFloat11
codes bf16 only, so only the BF16 files are used. Each is tiled on the host to MIB MiB (default 256: DFloat11's encoder
is a Python loop over every element, about 4 million elements a second) and encoded with DFloat11's own functions as
its `compress_model` calls them (one Huffman code of the exponents, 8 bytes per thread, 512 threads per block). Prints
the ratio as DFloat11 counts it (encoded exponents + sign/mantissa bytes + block output positions + thread gaps, over
the bf16 bytes; its lookup tables are left out) and the decode time of its kernel on the whole GPU (median of 20
timed runs after 3 warm-ups, wall clock around device synchronisation), GB/s counting original bytes, and checks the
decoded tensor against the original bit for bit (int16 views).
"""
import contextlib
import importlib.metadata
import importlib.util
import io
import statistics
import sys
import time
from pathlib import Path

import cupy as cp
import numpy as np
import torch

RUNS, WARMUP = 20, 3
BYTES_PER_THREAD, THREADS_PER_BLOCK = 8, 512  # dfloat11 0.5.0's constants (dfloat11/dfloat11.py)


def dfloat11_parts():
    """DFloat11's encoder functions and its decode kernel, loaded from the installed package's files (the package's
    __init__ also pulls in transformers and accelerate for model loading, which this script does not need)."""
    spec = importlib.util.find_spec("dfloat11")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("dfloat11 is not installed (pip install dfloat11 dahuffman)")
    root = Path(list(spec.submodule_search_locations)[0])
    uspec = importlib.util.spec_from_file_location("dfloat11_utils", root / "dfloat11_utils.py")
    utils = importlib.util.module_from_spec(uspec)
    uspec.loader.exec_module(utils)
    kernel = cp.RawModule(path=str(root / "decode.ptx")).get_function("decode")
    return utils, kernel


def timed(fn) -> float:
    times = []
    for i in range(WARMUP + RUNS):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        if i >= WARMUP:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> int:
    data_dir = Path(sys.argv[1])
    mib = float(sys.argv[2]) if len(sys.argv) > 2 else 256.0
    utils, kernel = dfloat11_parts()
    dev = torch.device("cuda", 0)
    print(f"DFloat11 decoder (dfloat11 {importlib.metadata.version('dfloat11')}), CuPy {cp.__version__}, "
          f"torch {torch.__version__}, {torch.cuda.get_device_name()}, "
          f"{torch.cuda.get_device_properties(0).multi_processor_count} SMs (whole GPU)")
    print(f"{'data':22s} {'MiB':>6s} {'ratio':>7s} {'decode GB/s':>12s}  round trip")
    bad = 0
    for path in sorted(data_dir.glob("*.BF16.bin")):
        block = torch.from_numpy(np.fromfile(path, dtype=np.int16))
        reps = max(1, int(mib * 2**20) // (2 * block.numel()))
        w = block.repeat(reps).view(torch.bfloat16)
        n = w.numel()
        with contextlib.redirect_stdout(io.StringIO()):  # DFloat11's functions print their tables
            _, counter = utils.get_codec(w)
            codec, _, table = utils.get_32bit_codec(counter)
            luts = utils.get_luts(table)
            encoded, sign_mantissa, positions, gaps, _ = utils.encode_weights([w], codec, BYTES_PER_THREAD, THREADS_PER_BLOCK)
        ratio = (encoded.numel() + sign_mantissa.numel() + positions.numel() * 4 + gaps.numel()) / (2 * n)
        pos = positions.numpy().astype(np.int64)
        shared = THREADS_PER_BLOCK * 4 + 4 + int((pos[1:] - pos[:-1]).max()) * 2
        d_luts, d_enc, d_sm, d_pos, d_gaps = (t.to(dev) for t in (luts, encoded, sign_mantissa, positions.view(torch.uint8), gaps))
        out = torch.empty(n, dtype=torch.bfloat16, device=dev)
        grid = (int(np.ceil(encoded.numel() / (THREADS_PER_BLOCK * BYTES_PER_THREAD))),)
        if shared > 48 * 1024:
            kernel.max_dynamic_shared_size_bytes = shared

        def decode():
            kernel(grid=grid, block=(THREADS_PER_BLOCK,), shared_mem=shared,
                   args=[d_luts.data_ptr(), d_enc.data_ptr(), d_sm.data_ptr(), d_pos.data_ptr(), d_gaps.data_ptr(),
                         out.data_ptr(), luts.shape[0], encoded.numel(), n])

        try:
            seconds = timed(decode)
        except Exception as e:  # e.g. more shared memory than the GPU has
            print(f"{path.name.split('.')[0]:22s} {2 * n / 2**20:6.0f} {ratio:7.4f} {'failed':>12s}  {e}")
            bad += 1
            continue
        same = torch.equal(out.view(torch.int16).cpu(), w.view(torch.int16))
        bad += 0 if same else 1
        print(f"{path.name.split('.')[0]:22s} {2 * n / 2**20:6.0f} {ratio:7.4f} {2 * n / seconds / 1e9:12.1f}  {same}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
