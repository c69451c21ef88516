#!/usr/bin/env bash
# GPU check of the CUDA codec, on a machine with an NVIDIA GPU (sm_90) and nvcc; offline. From the repository root:
#
#   bash scripts/gpu-check.sh [DATA_DIR]
#
# DATA_DIR holds raw little-endian tensors named NAME.DTYPE.bin (DTYPE: BF16, F16, F32, U8, I32, ...). Without it the
# benchmark uses synthetic weight-like bf16/fp16/fp32 tensors.
#
# Steps (logs in ${OUT:-/tmp/out}; a summary table is printed last):
#   1. build build/gpu-check/gpu_test with nvcc (-gencode arch=compute_90,code=sm_90 -O3 -lineinfo) plus the CPU core
#      (cuda/src/core/frame.cpp, chunk_codec.cpp, entropy.cpp); the .cu files compile in parallel
#   2. correctness: GPU vs CPU frames byte for byte, cross decoding, views at odd offsets, golden vectors, corrupt
#      frames, the data files                                                              -> test.log
#   3. compute-sanitizer memcheck and racecheck on a small correctness run (--small)       -> memcheck.log, racecheck.log
#   4. benchmark: each data file tiled to >= 2 GiB, every codec, 10 SMs and all SMs, next to a copy kernel -> bench.log
# Environment: NVCC (compiler), OUT (log folder), BENCH_MIB (benchmark size, default 2048), BENCH_FILES (at most this
# many data files in the benchmark, default 16), BENCH_CODECS (comma-separated, e.g. fast,raw; default all),
# SKIP_SANITIZER=1, SKIP_BENCH=1, GPU_TEST (use this binary, no build).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
say() { printf 'gpu-check: %s\n' "$*"; }
t_start=$(date +%s)

data_dir=${1:-}
files=()
if [ -n "$data_dir" ]; then
  if [ ! -d "$data_dir" ]; then say "no folder $data_dir"; exit 2; fi
  while IFS= read -r f; do files+=("$f"); done < <(find "$data_dir" -maxdepth 1 -name '*.bin' | sort)
  say "${#files[@]} data file(s) in $data_dir"
fi
bench_files=("${files[@]:0:${BENCH_FILES:-16}}")
[ -n "$data_dir" ] && cp "$data_dir/manifest.json" "$OUT/" 2>/dev/null  # so every log names its data (scripts/gpu-data.sh)

# ---------------------------------------------------------------- 1. build
BIN=${GPU_TEST:-build/gpu-check/gpu_test}
declare -A status
if [ -z "${GPU_TEST:-}" ]; then
  NVCC=${NVCC:-$(command -v nvcc || true)}
  [ -z "$NVCC" ] && [ -x /usr/local/cuda/bin/nvcc ] && NVCC=/usr/local/cuda/bin/nvcc
  [ -z "$NVCC" ] && [ -x .venv/cuda/bin/nvcc ] && NVCC=.venv/cuda/bin/nvcc
  if [ -z "$NVCC" ]; then say "nvcc not found (set NVCC)"; exit 2; fi
  say "building with $NVCC ($("$NVCC" --version | tail -1))"
  obj=build/gpu-check/obj
  mkdir -p "$obj"
  flags=(-std=c++17 -O3 -gencode arch=compute_90,code=sm_90 -lineinfo -Icuda/include -Icuda/src
         --expt-relaxed-constexpr -Xcompiler=-O3)
  srcs=(cuda/src/gpu/*.cu cuda/test/gpu_test.cu cuda/src/core/frame.cpp cuda/src/core/chunk_codec.cpp cuda/src/core/entropy.cpp)
  pids=() objs=()
  t0=$(date +%s)
  for s in "${srcs[@]}"; do
    o=$obj/$(basename "$s").o
    objs+=("$o")
    # Rebuild when the source or any header is newer than the object.
    if [ -f "$o" ] && [ -z "$(find "$s" cuda/include cuda/src/core/*.h cuda/src/gpu/*.h cuda/src/gpu/*.cuh -newer "$o" -print -quit)" ]; then
      continue
    fi
    case "$s" in
      *.cu) "$NVCC" "${flags[@]}" -Xptxas -v -c "$s" -o "$o" >"$obj/$(basename "$s").log" 2>&1 & ;;
      *)    "$NVCC" -x c++ -std=c++17 -O3 -Icuda/include -Icuda/src -c "$s" -o "$o" >"$obj/$(basename "$s").log" 2>&1 & ;;
    esac
    pids+=("$!:$s")
  done
  build_ok=1
  for p in "${pids[@]}"; do
    if ! wait "${p%%:*}"; then build_ok=0; say "compile FAILED: ${p#*:}"; cat "$obj/$(basename "${p#*:}").log"; fi
  done
  if [ $build_ok = 1 ]; then
    "$NVCC" -gencode arch=compute_90,code=sm_90 "${objs[@]}" -o "$BIN" -lpthread >"$OUT/link.log" 2>&1 || { build_ok=0; cat "$OUT/link.log"; }
  fi
  cat "$obj"/*.log >"$OUT/build.log" 2>/dev/null
  grep -E 'registers|spill' "$OUT/build.log" >"$OUT/ptxas.txt" 2>/dev/null
  if [ $build_ok = 0 ]; then say "build FAILED (log: $OUT/build.log)"; exit 1; fi
  say "built $BIN in $(( $(date +%s) - t0 )) s"
fi
status[build]=ok
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used,memory.total --format=csv >"$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"

# ---------------------------------------------------------------- 2. correctness
say "correctness (log: $OUT/test.log)"
t0=$(date +%s)
"$BIN" --no-bench "${files[@]}" >"$OUT/test.log" 2>&1
rc=$?
grep -E '^(FAIL|cases|batch|views|odd|decoder|golden|corrupt|data files|correctness|RESULT)' "$OUT/test.log" | head -60
status[correctness]=$([ $rc = 0 ] && echo PASS || echo "FAIL (rc $rc)")
status[correctness_s]=$(( $(date +%s) - t0 ))

# ---------------------------------------------------------------- 3. sanitizers
if [ -z "${SKIP_SANITIZER:-}" ]; then
  SAN=$(command -v compute-sanitizer || true)
  [ -z "$SAN" ] && [ -x /usr/local/cuda/bin/compute-sanitizer ] && SAN=/usr/local/cuda/bin/compute-sanitizer
  if [ -z "$SAN" ]; then
    status[memcheck]="skipped (no compute-sanitizer)"; status[racecheck]="skipped (no compute-sanitizer)"
  else
    for tool in memcheck racecheck; do
      say "compute-sanitizer --tool $tool (log: $OUT/$tool.log)"
      t0=$(date +%s)
      extra=()
      [ $tool = memcheck ] && extra=(--leak-check full)
      timeout 240 "$SAN" --tool $tool "${extra[@]}" --error-exitcode 9 "$BIN" --small --no-bench --no-cpu-check \
        >"$OUT/$tool.log" 2>&1
      rc=$?
      tail -3 "$OUT/$tool.log"
      case $rc in
        0) status[$tool]="PASS ($(( $(date +%s) - t0 )) s)" ;;
        124) status[$tool]="TIMEOUT after 240 s" ;;
        9) status[$tool]="ERRORS (see $tool.log)" ;;
        *) status[$tool]="FAIL (rc $rc)" ;;
      esac
    done
  fi
else
  status[memcheck]=skipped; status[racecheck]=skipped
fi

# ---------------------------------------------------------------- 4. benchmark
if [ -z "${SKIP_BENCH:-}" ]; then
  say "benchmark (log: $OUT/bench.log)"
  t0=$(date +%s)
  codec_args=()
  [ -n "${BENCH_CODECS:-}" ] && codec_args=(--codecs "$BENCH_CODECS")
  "$BIN" --bench-only --bench-mib "${BENCH_MIB:-2048}" "${codec_args[@]}" "${bench_files[@]}" >"$OUT/bench.log" 2>&1
  rc=$?
  status[bench]=$([ $rc = 0 ] && echo "ok ($(( $(date +%s) - t0 )) s)" || echo "FAIL (rc $rc)")
else
  status[bench]=skipped
fi

# ---------------------------------------------------------------- summary
echo
echo "================ gpu-check summary ($(( $(date +%s) - t_start )) s; logs in $OUT) ================"
head -1 "$OUT/test.log" 2>/dev/null
printf '%-12s %s\n' build "${status[build]}" correctness "${status[correctness]} (${status[correctness_s]} s)" \
  memcheck "${status[memcheck]}" racecheck "${status[racecheck]}" bench "${status[bench]}"
if [ -f "$OUT/bench.log" ]; then
  echo
  sed -n '/^data  *codec/,$p' "$OUT/bench.log"
  grep -E '^FAIL' "$OUT/bench.log" | head
fi
ok=1
[[ ${status[correctness]} == PASS ]] || ok=0
[[ ${status[memcheck]} == PASS* || ${status[memcheck]} == skipped* ]] || ok=0
[[ ${status[racecheck]} == PASS* || ${status[racecheck]} == skipped* ]] || ok=0
[[ ${status[bench]} == ok* || ${status[bench]} == skipped ]] || ok=0
[ $ok = 1 ] && echo "gpu-check: PASS" || echo "gpu-check: FAIL"
[ $ok = 1 ]
