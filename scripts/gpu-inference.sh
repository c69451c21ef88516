#!/usr/bin/env bash
# GPU check and benchmark of tzip.inference on a machine with an NVIDIA GPU, PyTorch and transformers; offline. From the
# repository root, after `npm run build:native` (or scripts/setup.sh) here or on another machine of the same kind:
#
#   bash scripts/gpu-inference.sh [BENCH ARGS...]        # e.g. --layers 8 --batches 1,8
#
# Needs build/Release/libtzip.so (or TZIP_LIBRARY) and the bf16 weights of the bundled model,
# data/demo/minilm-weights-bf16.safetensors (python -m tzip.demo_data --out data/demo). Uses .venv/bin/python when
# there is one, else python3 with python-bridge on PYTHONPATH (a GPU host with its own PyTorch).
# Steps (logs in ${OUT:-/tmp/out}):
#   1. pytest of the in-process library and of tzip.inference (GPU and CPU paths)   -> tests.log
#   2. python -m tzip.bench.inference (table last)                                   -> bench.log, bench.json
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
source scripts/gpu-python-env.sh  # OUT, PY, PYTHONPATH; the GPU in $OUT/gpu.txt
export TZIP_LIBRARY=${TZIP_LIBRARY:-$PWD/build/Release/libtzip.so}
"$PY" -m pytest -q -rs -p no:cacheprovider python-bridge/tests/test_native.py python-bridge/tests/test_inference.py python-bridge/tests/test_files.py \
  2>&1 | tee "$OUT/tests.log"
tests=${PIPESTATUS[0]}
"$PY" -m tzip.bench.inference --json "$OUT/bench.json" "$@" 2>&1 | tee "$OUT/bench.log"
bench=${PIPESTATUS[0]}
echo "gpu-inference: tests rc $tests, bench rc $bench"
[ "$tests" = 0 ] && [ "$bench" = 0 ]
