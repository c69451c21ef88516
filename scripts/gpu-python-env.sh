# Sourced by the GPU scripts that run Python (gpu-daemon.sh, gpu-inference.sh), from the repository root: OUT (the log
# folder, made), PY (.venv's Python when there is one, else python3: a GPU host with its own PyTorch), python-bridge
# on PYTHONPATH, unbuffered output, and the GPU's name, driver and memory in $OUT/gpu.txt (printed too).
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
PY=python3
[ -x .venv/bin/python ] && PY=.venv/bin/python
export PYTHONPATH=$PWD/python-bridge${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | tee "$OUT/gpu.txt"
