#!/usr/bin/env bash
# The project's test command (CI runs exactly this): set up, lint, check the Python floor,
# compile the CUDA sources when nvcc exists, then run the CPU test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test

if [ ! -x /usr/bin/chromium ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "test: installing Debian's chromium for the web page tests" >&2
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver) >/dev/null 2>&1 \
    || echo "test: chromium could not be installed; the browser tests will be skipped" >&2
fi

VPY=.venv/bin/python
echo "test: ruff" >&2
"$VPY" -m ruff check kobold_backend tests tools
echo "test: vermin (Python >= 3.8)" >&2
.venv/bin/vermin -q -t=3.8- --no-tips --violations kobold_backend >/dev/null
if command -v nvcc >/dev/null 2>&1; then
  echo "test: compiling the CUDA sources with $(nvcc --version | tail -1)" >&2
  "$VPY" -m kobold_backend.ops.build --check-cuda
fi
echo "test: pytest" >&2
exec "$VPY" -m pytest -q -p no:cacheprovider "$@"
