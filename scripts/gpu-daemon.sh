#!/usr/bin/env bash
# The daemon's GPU paths on a machine with an NVIDIA GPU; offline. CI has no GPU, so this is where the client's CUDA
# routes (the ring's GPU half, the one-tensor path, CUDA IPC through ZeroMQ) and the integrations on CUDA tensors
# run. From the repository root, with the addon and dist/ built (npm run build, here or on a machine of the same
# kind) and the benchmark samples in data/gpu (scripts/gpu-data.sh); on a host without Node.js or pyzmq, run
# `source .device/enter.sh` first (DESIGN.md, the GPU-machine workflow).
#
#   bash scripts/gpu-daemon.sh [PYTEST ARGS...]     # default: every test file with GPU cases
#
# Steps (logs in ${OUT:-/tmp/out}; a summary table is printed last):
#   1. pytest of the test files that have GPU cases (their CPU cases run too)                        -> tests.log
#   2. python -m tzip.bench.collectives --device cuda --data data/gpu --no-ddp: all-reduce of CUDA buckets over gloo
#      on this GPU (codec fast, the default for CUDA tensors), tzip.distributed in pieces of 8 and 32 MB against one
#      piece (a 100 MB bucket in 32 MiB pieces, PIECE_BYTES, is the default never yet measured) -> collectives-8.log,
#      -32.log
# Environment: OUT (log folder), SKIP_BENCH=1, RANKS (default 2), TZIP_TEST_WEIGHTS: on a GPU host without the demo
# model's package (88 MB, over what a device call carries) the ring tests read their real weights from this
# safetensors file instead; make it where the package is installed (7 MB, one layer of all-MiniLM-L6-v2):
#   .venv/bin/python -c "from tzip.demo_data import source_weights_path as p; from safetensors.torch import (load_file,
#     save_file); w = load_file(str(p())); save_file({k: w[k] for k in w if 'layer.0.' in k}, 'weights.safetensors')"
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
source scripts/gpu-python-env.sh  # OUT, PY, PYTHONPATH; the GPU in $OUT/gpu.txt

files=(test_client_cuda test_ring_one test_ring test_sm_budget test_staging_copies test_faults_gpu test_client_hostile
       test_security_limits test_distributed test_ddp test_fsdp test_optim test_saving test_checkpoint test_attach test_load)
args=("$@")
if [ ${#args[@]} -eq 0 ]; then
  for f in "${files[@]}"; do args+=("python-bridge/tests/$f.py"); done
fi
"$PY" -m pytest -q -rs -p no:cacheprovider "${args[@]}" 2>&1 | tee "$OUT/tests.log"
tests=${PIPESTATUS[0]}

declare -A bench
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  for mb in 8 32; do
    "$PY" -m tzip.bench.collectives --device cuda --data data/gpu --ranks "${RANKS:-2}" --sizes 25,100 --repeat 5 \
      --piece-mb "$mb" --no-ddp > "$OUT/collectives-$mb.log" 2>&1
    bench[$mb]=$?
  done
fi

echo
echo "gpu-daemon: $(tail -n 1 "$OUT/tests.log")"
echo "gpu-daemon: pytest rc $tests"
for mb in "${!bench[@]}"; do
  echo "gpu-daemon: collectives, pieces of $mb MB: rc ${bench[$mb]}"
  grep -A 4 '│    dtype │' "$OUT/collectives-$mb.log" | head -n 5
done
[ "$tests" = 0 ] && for rc in "${bench[@]}"; do [ "$rc" = 0 ] || exit 1; done
