#!/usr/bin/env bash
# Whole-process times of the `tzip` command (bin/tzip: the native CLI when built) against zstd on every demo file
# (issue 36): `tzip compress --codec fast`, `tzip compress` (auto), `tzip decompress`, `zstd -q -3 -T2`, `zstd -q -d`,
# and the Node CLI (node dist/src/cli/main.js) for compress --codec fast and decompress as the baseline. hyperfine -N
# (no shell), each command's runs one after another, each run writing a new file (its output is deleted before);
# prints one Markdown table with the mean, sigma, median and the compressed/original ratio. The table in docs/benchmarks.md is this script's output.
#
#   scripts/bench-cli.sh [RUNS] [FILES...]     (default: 10 runs, data/demo/*.safetensors)
#
# Needs hyperfine, zstd, node, a built dist/ and (for the native rows) build/Release/tzip-native.
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${1:-10}
shift || true
files=("$@")
[ ${#files[@]} -gt 0 ] || files=(data/demo/*.safetensors)
work=$(mktemp -d "${TMPDIR:-/tmp}/tzip-bench-cli.XXXXXX")
trap 'rm -rf "$work"' EXIT
tzip=$PWD/bin/tzip
node_cli="node $PWD/dist/src/cli/main.js"
[ -x build/Release/tzip-native ] || echo "note: build/Release/tzip-native is not built: the tzip rows run the Node CLI" >&2

echo "| file | command | mean ms | σ ms | median ms | ratio |"
echo "|---|---|---:|---:|---:|---:|"
for f in "${files[@]}"; do
  name=$(basename "$f")
  size=$(stat -c %s "$f")
  # The outputs the decompress rows read, and the sizes the ratio column gives.
  "$tzip" compress "$f" -o "$work/fast.tzip" --codec fast >/dev/null
  "$tzip" compress "$f" -o "$work/auto.tzip" >/dev/null
  zstd -q -f -3 -T2 "$f" -o "$work/in.zst"
  declare -A ratio=(
    [fast]=$(stat -c %s "$work/fast.tzip") [auto]=$(stat -c %s "$work/auto.tzip") [zstd]=$(stat -c %s "$work/in.zst"))
  labels=("tzip compress --codec fast" "tzip decompress (fast)" "zstd -q -3 -T2" "zstd -q -d" "tzip compress (auto)"
    "tzip decompress (auto)" "node CLI compress --codec fast" "node CLI decompress (fast)")
  keys=(fast "" zstd "" auto "" fast "")
  # Each run creates its output afresh, as a user's run would (no file to replace), as in the issue's measurements.
  hyperfine -N -w 2 -r "$runs" --export-json "$work/h.json" --style none \
    -p "rm -f $work/o-fast.tzip" -p "rm -f $work/o-fast.safetensors" -p "rm -f $work/o.zst" -p "rm -f $work/o.out" \
    -p "rm -f $work/o-auto.tzip" -p "rm -f $work/o-auto.safetensors" -p "rm -f $work/n-fast.tzip" \
    -p "rm -f $work/n.safetensors" \
    "$tzip compress $f -o $work/o-fast.tzip --codec fast" \
    "$tzip decompress $work/fast.tzip -o $work/o-fast.safetensors" \
    "zstd -q -f -3 -T2 $f -o $work/o.zst" \
    "zstd -q -f -d $work/in.zst -o $work/o.out" \
    "$tzip compress $f -o $work/o-auto.tzip" \
    "$tzip decompress $work/auto.tzip -o $work/o-auto.safetensors" \
    "$node_cli compress $f -o $work/n-fast.tzip --codec fast" \
    "$node_cli decompress $work/fast.tzip -o $work/n.safetensors" >/dev/null
  for out in o-fast.safetensors o-auto.safetensors n.safetensors o.out; do
    cmp -s "$work/$out" "$f" || { echo "round trip of $f failed ($out)" >&2; exit 1; }
  done
  cmp -s "$work/o-fast.tzip" "$work/n-fast.tzip" || { echo "native and Node CLI wrote different bytes for $f" >&2; exit 1; }
  for i in "${!labels[@]}"; do
    key=${keys[$i]}
    r=-
    [ -n "$key" ] && r=$(node -e "console.log((${ratio[$key]} / $size).toFixed(4))")
    node -e '
      const h = JSON.parse(require("fs").readFileSync(process.argv[1], "utf8")).results[Number(process.argv[2])];
      const ms = (s) => (s * 1000).toFixed(1);
      console.log(`| ${process.argv[3]} | ${process.argv[4]} | ${ms(h.mean)} | ${ms(h.stddev ?? 0)} | ${ms(h.median)} | ${process.argv[5]} |`);
    ' "$work/h.json" "$i" "$name" "${labels[$i]}" "$r"
  done
  unset ratio
done
