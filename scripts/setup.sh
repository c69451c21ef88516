#!/usr/bin/env bash
# Idempotent setup for a fresh clone: npm packages, Python venv (+ bridge),
# a CUDA compiler, the native addon and the TypeScript build. Safe to rerun;
# each step is skipped when its inputs have not changed.
# Reaches nothing but the package registries (npm, PyPI).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
say() { printf 'setup: %s\n' "$*"; }

# --- Node headers -----------------------------------------------------------
# node-gyp (zstd-napi's install script) would download headers from nodejs.org,
# which is unreachable here. It wants the install prefix (PREFIX/include/node),
# so /usr, not /usr/include/node. cmake-js needs nothing: package.json's
# binary.napi_versions makes it use the node-api-headers npm package.
if [ -z "${npm_config_nodedir:-}" ]; then
  prefix=$(dirname "$(dirname "$(readlink -f "$(command -v node)")")")
  if [ -f "$prefix/include/node/node_api.h" ]; then
    export npm_config_nodedir=$prefix
  else
    say "warning: no Node headers under $prefix/include/node; node-gyp may try to download them"
  fi
fi

# --- npm packages -----------------------------------------------------------
npm_stamp=node_modules/.tzip-setup-stamp
if [ ! -f "$npm_stamp" ] || [ package.json -nt "$npm_stamp" ] || [ package-lock.json -nt "$npm_stamp" ]; then
  if [ -f package-lock.json ]; then
    say "installing npm packages (npm ci)"
    npm ci --no-audit --no-fund --no-update-notifier --loglevel=error
  else
    say "installing npm packages (npm install: no package-lock.json)"
    npm install --no-audit --no-fund --no-update-notifier --loglevel=error
  fi
  touch "$npm_stamp"
fi

# --- Python venv --------------------------------------------------------------
if [ ! -x .venv/bin/python ]; then
  say "creating .venv"
  python3 -m venv .venv
fi
pip() { .venv/bin/python -m pip --disable-pip-version-check --no-input -q "$@"; }
site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')

# --- CUDA compiler ------------------------------------------------------------
# Kernels are always compiled, GPU or not. Without a system toolkit, take
# nvcc, headers and libcudart_static.a from NVIDIA's PyPI wheels (CUDA 13.0,
# the versions torch 2.11.0's cuda-toolkit 13.0.2 pins).
nvcc=$(command -v nvcc || true)
[ -z "$nvcc" ] && [ -x /usr/local/cuda/bin/nvcc ] && nvcc=/usr/local/cuda/bin/nvcc
if [ -z "$nvcc" ]; then
  cuda_pins="nvidia-cuda-nvcc==13.0.88 nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85 nvidia-cuda-crt==13.0.88 nvidia-nvvm==13.0.88"
  if [ "$(cat .venv/.cuda-stamp 2>/dev/null)" != "$cuda_pins" ] || [ ! -x .venv/cuda/bin/nvcc ]; then
    say "installing CUDA 13.0 compiler wheels into .venv"
    # shellcheck disable=SC2086
    pip install $cuda_pins
    # The wheels unpack a flat toolkit into nvidia/cu13, but nvcc.profile
    # links from TOP/lib64: give it one. .venv/cuda is the toolkit root.
    ln -sfn lib "$site/nvidia/cu13/lib64"
    ln -sfn "$(realpath --relative-to=.venv "$site/nvidia/cu13")" .venv/cuda
    echo "$cuda_pins" > .venv/.cuda-stamp
  fi
  nvcc=$ROOT/.venv/cuda/bin/nvcc
fi
export CUDACXX=$nvcc

# --- Python bridge ------------------------------------------------------------
if [ -f python-bridge/pyproject.toml ]; then
  want=$(sha256sum python-bridge/pyproject.toml | cut -d' ' -f1)
  if [ "$(cat .venv/.bridge-stamp 2>/dev/null)" != "$want" ]; then
    say "installing python-bridge[demo,test] into .venv (torch and its CUDA wheels: several GiB the first time)"
    pip install --progress-bar off -e 'python-bridge[demo,test]'
    echo "$want" > .venv/.bridge-stamp
  fi
else
  say "python-bridge/pyproject.toml not there yet: skipping the Python bridge"
fi

# --- native addon -------------------------------------------------------------
# cmake-js configures on first use; later runs are an incremental ninja build
# (sources are globbed with CONFIGURE_DEPENDS). Output kept in build/native.log.
mkdir -p build
if ! npx --no-install cmake-js build --log-level warn >build/native.log 2>&1; then
  cat build/native.log
  say "native build FAILED (log above, also in build/native.log)"
  exit 1
fi
grep -q 'no work to do' build/native.log || say "built build/Release/tzip.node (compiler output: build/native.log)"

# --- TypeScript ---------------------------------------------------------------
if [ -n "$(find src -name '*.ts' -print -quit 2>/dev/null)" ]; then
  npx --no-install tsc -p tsconfig.json || { say "TypeScript build FAILED"; exit 1; }
else
  say "no TypeScript under src/ yet: skipping tsc"
fi
