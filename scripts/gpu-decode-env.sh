# Sourced by scripts/gpu-decode-scaling.sh and scripts/gpu-decode-profile.sh (from the repository root): the log folder
# OUT (default /tmp/out), GPU_TEST (gpu_test of scripts/gpu-check.sh), NVCC, and SC, the stream_copy benchmark
# (cuda/bench/stream_copy.cu): the native build's, else built here for sm_90. Returns non-zero when it cannot build it.
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
GPU_TEST=${GPU_TEST:-build/gpu-check/gpu_test}
NVCC=${NVCC:-$(command -v nvcc || echo .venv/cuda/bin/nvcc)}
SC=build/Release/stream_copy
if [ ! -x "$SC" ]; then
  SC=build/stream_copy
  [ -x "$SC" ] || "$NVCC" -O3 -std=c++17 -arch=sm_90 -Icuda/include cuda/bench/stream_copy.cu -o "$SC" || return 1
fi
