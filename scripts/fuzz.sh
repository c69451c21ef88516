#!/usr/bin/env bash
# Fuzzes every decoder entry point and fails on a crash (docs/reliability.md):
#   native  cuda/test/fuzz_*.cpp, libFuzzer targets (clang, ASan + UBSan) built from the codec core's sources;
#   JS      fuzz/js/run.mjs targets (container reader, safetensors reader, daemon protocol decoder): fast-check,
#           coverage-blind (jazzer.js does not run here: see fuzz/README.md);
#   Python  fuzz/python/fuzz_*.py, atheris (libFuzzer for Python), when atheris is installed in .venv.
# First every reproducer under fuzz/regressions/<target>/ is replayed (a crash fixed once stays fixed), then each
# target runs for its share of TZIP_FUZZ_SECONDS (default 120 s in all) on seeds made from real streams
# (fuzz/make-seeds.mjs: golden frames, frames and .tzip files of the bundled MiniLM model; fuzz/seeds/protocol:
# messages recorded from the real Python client) plus the corpus it grew before (build/fuzz-corpus/<target>).
# Long run (the >= 10^7 executions per target of issue 15): TZIP_FUZZ_SECONDS=36000 bash scripts/fuzz.sh
# One target: TZIP_FUZZ_TARGETS="fuzz_chunk js_protocol" bash scripts/fuzz.sh
# A crash leaves its reproducer at build/fuzz/<target>-crash-*; copy it to fuzz/regressions/<target>/ with the fix.
set -euo pipefail
cd "$(dirname "$0")/.."
shopt -s nullglob
say() { printf 'fuzz: %s\n' "$*"; }
mkdir -p build/fuzz

if ! command -v clang++ >/dev/null; then
  say "installing clang (Debian's clang ships libFuzzer)"
  sudo=; [ "$(id -u)" -eq 0 ] || sudo=sudo
  export DEBIAN_FRONTEND=noninteractive
  if ! { $sudo apt-get update -qq && $sudo apt-get install -y -qq clang; } >build/fuzz/apt.log 2>&1; then
    cat build/fuzz/apt.log; say "could not install clang"; exit 1
  fi
fi

# ---- the targets -------------------------------------------------------------------------------------------------
native=(); for f in cuda/test/fuzz_*.cpp; do native+=("$(basename "$f" .cpp)"); done
js=(js_container js_safetensors js_protocol)
py=()
if .venv/bin/python -c 'import atheris' 2>/dev/null; then
  for f in fuzz/python/fuzz_*.py; do py+=("py_$(basename "$f" .py | sed 's/^fuzz_//')"); done
else
  say "atheris is not installed in .venv: the Python targets are skipped (pin: atheris==3.0.0)"
fi
all=("${native[@]}" "${js[@]}" "${py[@]}")
if [ -n "${TZIP_FUZZ_TARGETS:-}" ]; then
  chosen=(); for t in "${all[@]}"; do [[ " $TZIP_FUZZ_TARGETS " == *" $t "* ]] && chosen+=("$t"); done
  all=("${chosen[@]}")
fi
[ ${#all[@]} -gt 0 ] || { say "no targets"; exit 1; }
total=${TZIP_FUZZ_SECONDS:-120}
per=$(( total / ${#all[@]} )); [ "$per" -ge 1 ] || per=1

# ---- native build: the core once, then one binary per target ----------------------------------------------------
# The core is compiled from source with clang so that it carries the same sanitizer and coverage instrumentation as
# the harness.
# shellcheck disable=SC2054  # commas belong to -fsanitize=
flags=(-std=c++17 -O1 -g -fno-omit-frame-pointer -pthread -fno-sanitize-recover=undefined -Icuda/include -Icuda/src)
status=0
objs=()
# (the core, the native CLI's container reader, and the submission ring's SQE parser: plain C++ without N-API)
for f in cuda/src/core/*.cpp cuda/src/container/*.cpp cuda/src/addon/ring_sqe.cpp; do
  o=build/fuzz/obj/$(basename "$(dirname "$f")")_$(basename "$f" .cpp).o; objs+=("$o")
  # Rebuilt when the source or a header of the core changes (not for the GPU files under cuda/src/gpu).
  if [ ! -f "$o" ] || [ -n "$(find "$f" cuda/src/core/*.h cuda/src/container/*.h cuda/src/addon/ring_sqe.h cuda/include/tzip -newer "$o" -print -quit)" ]; then
    mkdir -p build/fuzz/obj
    clang++ "${flags[@]}" -fsanitize=fuzzer-no-link,address,undefined -c "$f" -o "$o" || { say "core BUILD FAILED"; exit 1; }
  fi
done
for name in "${native[@]}"; do
  [[ " ${all[*]} " == *" $name "* ]] || continue
  bin=build/fuzz/$name src=cuda/test/$name.cpp
  if [ ! -x "$bin" ] || [ -n "$(find "$src" cuda/test/fuzz_*.h "${objs[@]}" -newer "$bin" -print -quit)" ]; then
    say "building $name"
    clang++ "${flags[@]}" -fsanitize=fuzzer,address,undefined "$src" "${objs[@]}" -o "$bin" || { say "$name: BUILD FAILED"; status=1; }
  fi
done

# ---- seeds -------------------------------------------------------------------------------------------------------
seeds=build/fuzz-seeds
if [ ! -f "$seeds/.done" ] || [ -n "$(find fuzz/make-seeds.mjs test/golden -newer "$seeds/.done" -print -quit)" ]; then
  say "making seeds from real streams ($seeds)"
  node fuzz/make-seeds.mjs "$seeds" || { say "seed generation FAILED"; exit 1; }
  touch "$seeds/.done"
fi
seed_dir() {  # the seed folder a target reads
  case $1 in
    fuzz_frame|fuzz_header|fuzz_roundtrip|py_reference) echo "$seeds/frame" ;;
    fuzz_chunk) echo "$seeds/chunk" ;;
    fuzz_codec_*) echo "$seeds/codec_${1#fuzz_codec_}" ;;
    js_container|py_container|fuzz_native_container) echo "$seeds/container" ;;
    js_safetensors) echo "$seeds/safetensors" ;;
    js_protocol) echo "fuzz/seeds/protocol" ;;
    fuzz_ring) echo "fuzz/seeds/ring" ;;  # ring file SQEs (docs/ring.md), made by hand: a region table and SQEs
  esac
}

# ---- replay and run ----------------------------------------------------------------------------------------------
stats() {  # name execs seconds corpus
  local rate=$(( $2 / ($3 > 0 ? $3 : 1) ))
  say "$1: $2 executions in $3 s ($rate exec/s), corpus $4 inputs"
  printf '%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$rate" "$4" >>build/fuzz/stats.tsv
}
: >build/fuzz/stats.tsv
for name in "${all[@]}"; do
  corpus=build/fuzz-corpus/$name; mkdir -p "$corpus"
  regress=(fuzz/regressions/"$name"/*)
  log=build/fuzz/$name.log
  sd=$(seed_dir "$name")
  case $name in
    fuzz_*)
      [ -x "build/fuzz/$name" ] || continue
      if [ ${#regress[@]} -gt 0 ] && ! "build/fuzz/$name" "${regress[@]}" >"$log" 2>&1; then
        tail -n 40 "$log"; say "$name: a REGRESSION reproducer crashes again (log $log)"; status=1; continue
      fi
      say "running $name for ${per}s"
      if "build/fuzz/$name" -max_total_time="$per" -timeout=10 -rss_limit_mb=2048 -malloc_limit_mb=1024 \
           -max_len=70000 -print_final_stats=1 -artifact_prefix="build/fuzz/$name-" "$corpus" "$sd" >"$log" 2>&1; then
        stats "$name" "$(sed -n 's/^stat::number_of_executed_units: *//p' "$log")" "$per" "$(grep -o 'corp: [0-9]*' "$log" | tail -n 1 | cut -d' ' -f2)"
      else
        tail -n 60 "$log"
        say "$name: CRASH (log $log; reproducer build/fuzz/$name-*; rerun with: build/fuzz/$name <file>)"
        status=1
      fi
      # The C++ and the Python reference decoder must agree on every frame the fuzzer kept (fuzz/differential.py).
      if [ "$name" = fuzz_frame ] && ! .venv/bin/python fuzz/differential.py "$corpus" "$sd" | sed 's/^/fuzz: /'; then
        say "fuzz_frame: the C++ and reference decoders DISAGREE (lines above)"; status=1
      fi ;;
    js_*)
      say "running $name for ${per}s"
      if node fuzz/js/run.mjs --target "${name#js_}" --seconds "$per" --seeds "$sd" \
           --regressions "fuzz/regressions/$name" --artifacts "build/fuzz/$name-" >"$log" 2>&1; then
        read -r execs secs n < <(sed -n 's/^stats: executions \([0-9]*\) seconds \([0-9]*\) corpus \([0-9]*\)$/\1 \2 \3/p' "$log")
        stats "$name" "$execs" "$secs" "$n"
      else
        tail -n 40 "$log"; say "$name: CRASH (log $log; reproducer build/fuzz/$name-*)"; status=1
      fi ;;
    py_*)
      script=fuzz/python/fuzz_${name#py_}.py
      export TZIP_FUZZ_SCRATCH=build/fuzz/scratch-$name  # libFuzzer exits without atexit: a folder that is reused
      if [ ${#regress[@]} -gt 0 ] && ! .venv/bin/python "$script" "${regress[@]}" >"$log" 2>&1; then
        tail -n 40 "$log"; say "$name: a REGRESSION reproducer crashes again (log $log)"; status=1; continue
      fi
      say "running $name for ${per}s"
      if .venv/bin/python "$script" -max_total_time="$per" -timeout=10 -rss_limit_mb=4096 -max_len=70000 \
           -print_final_stats=1 -artifact_prefix="build/fuzz/$name-" "$corpus" "$sd" >"$log" 2>&1; then
        stats "$name" "$(sed -n 's/^stat::number_of_executed_units: *//p' "$log")" "$per" "$(grep -o 'corp: [0-9]*' "$log" | tail -n 1 | cut -d' ' -f2)"
      else
        tail -n 60 "$log"; say "$name: CRASH (log $log; reproducer build/fuzz/$name-*)"; status=1
      fi ;;
  esac
done
exit $status
