#!/usr/bin/env bash
# Builds every cuda/test/fuzz_*.cpp as a libFuzzer target (ASan + UBSan) from
# the codec core's sources and runs each for its share of TZIP_FUZZ_SECONDS
# (default 60 s in all). Exits non-zero when a target fails to build or finds
# a crash; the reproducer is kept under build/fuzz/.
set -euo pipefail
cd "$(dirname "$0")/.."
shopt -s nullglob
say() { printf 'fuzz: %s\n' "$*"; }

targets=(cuda/test/fuzz_*.cpp)
if [ ${#targets[@]} -eq 0 ]; then
  say "no cuda/test/fuzz_*.cpp yet: nothing to fuzz"
  exit 0
fi

if ! command -v clang++ >/dev/null; then
  say "installing clang (Debian's clang ships libFuzzer)"
  sudo=; [ "$(id -u)" -eq 0 ] || sudo=sudo
  export DEBIAN_FRONTEND=noninteractive
  mkdir -p build/fuzz
  if ! { $sudo apt-get update -qq && $sudo apt-get install -y -qq clang; } >build/fuzz/apt.log 2>&1; then
    cat build/fuzz/apt.log; say "could not install clang"; exit 1
  fi
fi

# The core is compiled from source with clang so that it carries the same
# sanitizer and coverage instrumentation as the harness.
core=()
for f in cuda/src/*.cpp; do [ "$(basename "$f")" = addon.cpp ] || core+=("$f"); done
# shellcheck disable=SC2054  # commas belong to -fsanitize=
flags=(-std=c++17 -O1 -g -fno-omit-frame-pointer -pthread
       -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined
       -Icuda/include -Icuda/src)

total=${TZIP_FUZZ_SECONDS:-60}
per=$(( total / ${#targets[@]} )); [ "$per" -ge 1 ] || per=1
mkdir -p build/fuzz
status=0
for src in "${targets[@]}"; do
  name=$(basename "$src" .cpp)
  bin=build/fuzz/$name
  if [ ! -x "$bin" ] || [ -n "$(find "$src" cuda/include cuda/src -newer "$bin" -print -quit)" ]; then
    say "building $name"
    if ! clang++ "${flags[@]}" "$src" "${core[@]}" -o "$bin"; then
      say "$name: BUILD FAILED"; status=1; continue
    fi
  fi
  corpus=build/fuzz-corpus/$name
  mkdir -p "$corpus"
  seeds=(test/golden/*.tzf)
  [ ${#seeds[@]} -eq 0 ] || cp -n "${seeds[@]}" "$corpus"/
  say "running $name for ${per}s (corpus $corpus)"
  log=build/fuzz/$name.log
  if "$bin" -max_total_time="$per" -timeout=10 -rss_limit_mb=4096 -print_final_stats=1 \
       -artifact_prefix="build/fuzz/$name-" "$corpus" >"$log" 2>&1; then
    grep -E '^(Done|stat::number_of_executed_units|stat::new_units_added)' "$log" | sed "s/^/fuzz: $name: /"
  else
    tail -n 60 "$log"
    say "$name: CRASH (full log $log; reproducer build/fuzz/$name-*; rerun with: $bin <file>)"
    status=1
  fi
done
exit $status
