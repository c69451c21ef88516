#!/usr/bin/env bash
# Does a change to the CUDA sources change any device code? For restructures (files split, code moved) checked on a
# machine without a GPU: compiles each named translation unit at BASE and in the working tree to a cubin (sm_90, -O3,
# the flags of scripts/gpu-check.sh) and compares them byte for byte, after blanking the hash nvcc puts in the names
# of anonymous-namespace and internal symbols (it changes with the file's text). From the repository root:
#
#   bash scripts/cubin-diff.sh BASE [cuda/src/gpu/X.cu ...]     # default: every cuda/src/gpu/*.cu of the working tree
#
# REV: compare BASE with that commit instead of the working tree.
# NORMALIZE: a sed script applied to both trees' CUDA sources first, for what a move changes on purpose: code that
# compiles __LINE__ in (decode's kBadAt) and messages naming a file, e.g.
#   NORMALIZE='s/__LINE__/0/g; s/at decode[_a-z]*[.]cuh*:/at X:/' bash scripts/cubin-diff.sh cb265f1~1 cuda/src/gpu/decode_k3.cu
#
# Prints one line per file: "same" or "DIFFERENT" (or "new" / "gone" where one side lacks it); exit status 1 when any
# file differs. Needs nvcc (NVCC, else PATH, else .venv/cuda/bin/nvcc); no GPU.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
base=${1:?usage: cubin-diff.sh BASE [FILES...]}
shift
NVCC=${NVCC:-$(command -v nvcc || echo .venv/cuda/bin/nvcc)}
NVCC=$(realpath "$NVCC") || exit 2  # the compiles run in the temporary trees
files=("$@")
[ ${#files[@]} = 0 ] && files=(cuda/src/gpu/*.cu)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/base" "$tmp/head"
git archive "$base" cuda | tar x -C "$tmp/base" || exit 2
if [ -n "${REV:-}" ]; then git archive "$REV" cuda | tar x -C "$tmp/head" || exit 2; else cp -r cuda "$tmp/head/"; fi
if [ -n "${NORMALIZE:-}" ]; then
  find "$tmp/base/cuda" "$tmp/head/cuda" -type f \( -name '*.cu' -o -name '*.cuh' -o -name '*.h' \) \
    -exec sed -i "$NORMALIZE" {} + || exit 2
fi
flags=(-std=c++17 -O3 -arch=sm_90 -cubin -Icuda/include -Icuda/src --expt-relaxed-constexpr)
status=0
for f in "${files[@]}"; do
  name=$(basename "$f" .cu)
  built=1
  for side in base head; do
    if [ -f "$tmp/$side/$f" ]; then
      (cd "$tmp/$side" && "$NVCC" "${flags[@]}" "$f" -o "$name.cubin" 2>"$name.log") ||
        { echo "$f: does not compile at $side"; cat "$tmp/$side/$name.log"; status=1; built=0; }
    fi
  done
  [ $built = 1 ] || continue
  python3 - "$tmp/base/$name.cubin" "$tmp/head/$name.cubin" "$f" <<'PY' || status=1
import os, re, sys
a, b, f = sys.argv[1:]
if not os.path.exists(a) or not os.path.exists(b):
    print(f"{f}: {'new' if not os.path.exists(a) else 'gone'}")
    sys.exit(0)
blank = lambda data: re.sub(rb"(_GLOBAL__N__|_INTERNAL_)[0-9a-f]{8}_", rb"\1XXXXXXXX_", data)
same = blank(open(a, "rb").read()) == blank(open(b, "rb").read())
print(f"{f}: {'same' if same else 'DIFFERENT'}")
sys.exit(0 if same else 1)
PY
done
exit $status
