#!/usr/bin/env bash
# Why the whole-GPU decode stops at about half the copy kernel (issue 32 goal 4), on a machine with an NVIDIA GPU
# (sm_90) and nvcc; offline. From the repository root, after scripts/gpu-check.sh built build/gpu-check/gpu_test and
# `bash scripts/gpu-data.sh` wrote data/gpu:
#
#   bash scripts/gpu-decode-scaling.sh [WARPS...]          # default: 0 8 12 16 (0: each class kernel's own count)
#
# DATA: the files of step 2 (default: every data/gpu/*.bin).
#
# 1. stream_copy (cuda/bench/stream_copy.cu: build/Release/stream_copy, or built here when missing): the copy
#    patterns a decoder can have (one sequential stream per warp, through a bulk-copy ring, per block) against the
#    grid-stride copy, 10 SMs and all.
# 2. gpu_test's benchmark of `fast` and `raw` on every data/gpu file at 1 GiB, once per decode warp count
#    (TZIP_GPU_DECODE_WARPS, Tuning::decode_warps): decode GB/s on 10 SMs and on all, against the copy kernel.
# Logs in ${OUT:-/tmp/out}; the table of step 2 last.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
source scripts/gpu-decode-env.sh || exit 1  # OUT, GPU_TEST, NVCC, SC (stream_copy)
warps=("$@")
[ ${#warps[@]} = 0 ] && warps=(0 8 12 16)
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
"$SC" 1024 | tee "$OUT/stream_copy.txt"
for w in "${warps[@]}"; do
  TZIP_GPU_DECODE_WARPS=$w "$GPU_TEST" --bench-only --no-cpu-check --codecs fast,raw --bench-mib 1024 ${DATA:-data/gpu/*.bin} \
    >"$OUT/bench-w$w.log" 2>&1 || { echo "gpu_test failed with $w warps (log: $OUT/bench-w$w.log)"; tail -5 "$OUT/bench-w$w.log"; }
done
echo
printf '%-30s %-5s' data codec
for w in "${warps[@]}"; do printf ' | w=%-2s dec10 dec-all' "$w"; done
echo
python3 - "$OUT" "${warps[@]}" <<'PY'
import re, sys
out, warps = sys.argv[1], sys.argv[2:]
rows = {}
for w in warps:
    name = None
    for line in open(f"{out}/bench-w{w}.log", errors="replace"):
        m = re.match(r"bench (\S+) \(", line)
        if m:
            name = m.group(1)
        m = re.match(r"\s+(\w+)\s+ratio [\d.]+ \| encode .*\| decode\s+([\d.]+) /\s+([\d.]+) GB/s.*copy\s+([\d.]+) /\s+([\d.]+)", line)
        if m and name:
            rows.setdefault((name, m.group(1)), {})[w] = (m.group(2), m.group(3), m.group(4), m.group(5))
for (name, codec), by_w in rows.items():
    cells = "".join(f" | {by_w[w][0]:>12} {by_w[w][1]:>7}" if w in by_w else " | " + " " * 20 for w in warps)
    c = next(iter(by_w.values()))  # gpu_test prints the copy kernel's reads + writes: halved, bytes copied
    print(f"{name[:30]:<30} {codec:<5}{cells} | copy {float(c[2]) / 2:.0f} / {float(c[3]) / 2:.0f}")
PY
