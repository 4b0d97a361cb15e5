#!/usr/bin/env bash
# The project's test command (CI runs exactly this): set up, lint, check the Python floor,
# compile the CUDA sources when nvcc exists, run the CPU test suite, then (with no pytest arguments) the plugin
# tests in KoboldAI United's pinned Python 3.8 environment (scripts/test_united.sh).
# pytest runs in a private temporary folder, removed afterwards, that also holds every cache the tests could
# touch (docs/testing.md): nothing outside the checkout and that folder is read or left behind.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test

if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; then
  echo "test: the web page tests use $(/usr/bin/chromium --version 2>/dev/null || echo /usr/bin/chromium)" >&2
elif [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "test: installing Debian's chromium and chromium-driver for the web page tests (about 100 MB) ..." >&2
  start=$SECONDS
  if (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver) \
      >/dev/null 2>&1; then
    echo "test: installed $(/usr/bin/chromium --version 2>/dev/null) in $((SECONDS - start)) s" >&2
  else
    echo "test: chromium could not be installed (apt-get failed); the web page tests will be skipped" >&2
  fi
else
  echo "test: no /usr/bin/chromium and chromedriver, and apt-get needs root here; the web page tests will be" \
       "skipped (install the chromium and chromium-driver packages to run them)" >&2
fi

VPY=.venv/bin/python
echo "test: ruff" >&2
"$VPY" -m ruff check kobold_backend tests tools scripts
echo "test: vermin (Python >= 3.8)" >&2
.venv/bin/vermin -q -t=3.8- --no-tips --violations kobold_backend scripts >/dev/null
if command -v nvcc >/dev/null 2>&1; then
  echo "test: compiling the CUDA sources with $(nvcc --version | tail -1)" >&2
  "$VPY" -m kobold_backend.ops.build --check-cuda
fi

private=$(mktemp -d "${TMPDIR:-/tmp}/kobold-backend-test.XXXXXX")
trap 'rm -rf "$private"' EXIT
echo "test: pytest (temporary files and caches in $private, removed afterwards)" >&2
start=$SECONDS
status=0
TMPDIR=$private "$VPY" -m pytest -q -p no:cacheprovider "$@" || status=$?
echo "test: pytest took $((SECONDS - start)) s" >&2
# The whole run (no pytest arguments) also runs the plugin tests in KoboldAI United's pinned environment.
if [ "$#" -eq 0 ]; then
  start=$SECONDS
  united_status=0
  bash scripts/test_united.sh "$private" || united_status=$?
  echo "test: United job took $((SECONDS - start)) s (exit $united_status)" >&2
  [ "$status" -ne 0 ] || status=$united_status
fi
exit "$status"
