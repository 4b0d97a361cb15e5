#!/usr/bin/env bash
# Sets up .venv with kobold-backend and its native extension. `--test` adds the test tools.
# Re-running is cheap: installed pieces are kept.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
extras=""
[ "${1:-}" = "--test" ] && extras="[test]"

if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv with $($PY --version)" >&2
  "$PY" -m venv .venv
fi
VPY=.venv/bin/python
"$VPY" -m pip install -q --upgrade "pip>=23" "setuptools>=61" wheel "pybind11>=2.10" >&2

if ! "$VPY" -c "import torch" 2>/dev/null; then
  # A CPU-only machine gets the newest CPU build the package index offers below 2.14;
  # set KOBOLD_BACKEND_TORCH to choose another (e.g. a CUDA build on a GPU machine).
  spec=${KOBOLD_BACKEND_TORCH:-}
  if [ -z "$spec" ]; then
    if command -v nvidia-smi >/dev/null 2>&1; then spec="torch>=2.1"; else spec="torch>=2.1,<2.14"; fi
  fi
  echo "setup: installing $spec (this can take a few minutes)" >&2
  "$VPY" -m pip install -q "$spec" >&2
fi

# Without a GPU the CUDA module would be built for nothing (the tests compile-check it separately).
if ! command -v nvidia-smi >/dev/null 2>&1; then export KOBOLD_BACKEND_NO_CUDA=1; fi
echo "setup: installing kobold-backend$extras and building its extension" >&2
"$VPY" -m pip install -q --no-build-isolation -e ".$extras" >&2
echo "setup: done; run .venv/bin/kobold-backend --help" >&2
