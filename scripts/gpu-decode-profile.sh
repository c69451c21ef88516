#!/usr/bin/env bash
# Nsight Compute profile of the whole-GPU decode against the copy patterns it is built from (issue 32 goal 4: the
# decode of every codec, `raw` included, stops near 680 GB/s on an H100 while each of its copy patterns in
# cuda/bench/stream_copy.cu moves 1.40-1.48 TB/s; docs/benchmarks.md, "The whole-GPU decode cap is not the access
# pattern"). On a machine with an NVIDIA GPU (sm_90), ncu and nvcc; offline. From the repository root, after
# scripts/gpu-check.sh built build/gpu-check/gpu_test and `bash scripts/gpu-data.sh` wrote data/gpu:
#
#   bash scripts/gpu-decode-profile.sh [DATA FILE]      # default: data/gpu/minilm-weights-bf16.BF16.bin
#
# 1. gpu_test's benchmark of `raw` and `fast` on DATA at 1 GiB, every SM: the decode kernels (the five class kernels,
#    each profiled once; only the classes with chunks do work) under ncu.
# 2. stream_copy's kernels (grid-stride copy, a warp per chunk, the bulk-copy ring) under ncu, the same sections.
# The sections say what the decode kernel does that the copies do not: occupancy and what limits it (shared memory per
# block, registers), achieved warps per SM, DRAM throughput, and where the warps stall (long scoreboard = waiting on
# memory, barrier, mbarrier waits). Logs and the .ncu-rep files in ${OUT:-/tmp/out}; a table of the key metrics last.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
source scripts/gpu-decode-env.sh || exit 1  # OUT, GPU_TEST, NVCC, SC (stream_copy)
NCU=${NCU:-$(command -v ncu || echo /usr/local/cuda/bin/ncu)}
DATA=${1:-data/gpu/minilm-weights-bf16.BF16.bin}
sections=(--section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats
          --section MemoryWorkloadAnalysis)
metrics=gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,sm__warps_active.avg.pct_of_peak_sustained_active,launch__occupancy_limit_shared_mem,launch__occupancy_limit_registers,launch__registers_per_thread,launch__shared_mem_per_block_dynamic,launch__block_size,launch__grid_size
for codec in raw fast; do
  # (gpu_test runs each kernel several times: the first launch of each class kernel is enough)
  "$NCU" "${sections[@]}" --metrics "$metrics" --kernel-name regex:decode_kernel --launch-count 5 -f \
    -o "$OUT/decode-$codec" "$GPU_TEST" --bench-only --no-cpu-check --codecs "$codec" --bench-mib 1024 "$DATA" \
    >"$OUT/decode-$codec.log" 2>&1 || { echo "ncu of the $codec decode failed (log: $OUT/decode-$codec.log)"; tail -5 "$OUT/decode-$codec.log"; }
done
"$NCU" "${sections[@]}" --metrics "$metrics" --kernel-name regex:'copy|ring' --launch-count 24 -f -o "$OUT/stream_copy" \
  "$SC" 1024 >"$OUT/stream_copy.log" 2>&1 || { echo "ncu of stream_copy failed (log: $OUT/stream_copy.log)"; tail -5 "$OUT/stream_copy.log"; }
for rep in decode-raw decode-fast stream_copy; do
  [ -f "$OUT/$rep.ncu-rep" ] || continue
  "$NCU" --import "$OUT/$rep.ncu-rep" --csv --page raw --print-units base --metrics "$metrics" >"$OUT/$rep.csv" 2>/dev/null
done
python3 - "$OUT" <<'PY'
import csv, sys
from pathlib import Path
out = Path(sys.argv[1])
cols = [("gpu__time_duration.sum", "us", 1e-3), ("dram__bytes_read.sum", "read MB", 1e-6),
        ("dram__bytes_write.sum", "write MB", 1e-6), ("sm__warps_active.avg.pct_of_peak_sustained_active", "warps %", 1),
        ("launch__occupancy_limit_shared_mem", "blk lim smem", 1), ("launch__occupancy_limit_registers", "blk lim regs", 1),
        ("launch__registers_per_thread", "regs", 1), ("launch__shared_mem_per_block_dynamic", "smem KB", 1e-3),
        ("launch__block_size", "threads", 1), ("launch__grid_size", "blocks", 1)]
print(f"{'report':12} {'kernel':44} " + " ".join(f"{c[1]:>12}" for c in cols) + f" {'GB/s r+w':>9}")
for rep in ("decode-raw", "decode-fast", "stream_copy"):
    f = out / f"{rep}.csv"
    if not f.exists():
        continue
    rows = list(csv.DictReader(open(f, errors="replace")))
    for r in rows[1:] if rows and not rows[0].get("ID", "0").isdigit() else rows:  # (row 0: units)
        def val(key):
            try:
                return float(str(r.get(key, "nan")).replace(",", ""))
            except ValueError:
                return float("nan")
        t = val("gpu__time_duration.sum")  # ns (ncu's default unit for this metric)
        gbs = (val("dram__bytes_read.sum") + val("dram__bytes_write.sum")) / t if t == t and t > 0 else float("nan")
        cells = " ".join(f"{val(k) * s:12.1f}" for k, _, s in cols)
        print(f"{rep:12} {r.get('Kernel Name', '?')[:44]:44} {cells} {gbs:9.0f}")
PY
