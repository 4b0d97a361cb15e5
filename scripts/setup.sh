#!/usr/bin/env bash
# Sets up .venv with kobold-backend and its native kernels. `--test` adds the test tools.
# The kernels come from the committed prebuilt wheel that fits this Python, torch and GPU (scripts/setup_kernels.py,
# the selection of `kobold-backend install-ext`); only when none fits are they compiled here, which needs a C++
# compiler. Each step says what it does and how long it took. Re-running is cheap: installed pieces are kept.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
extras=""
[ "${1:-}" = "--test" ] && extras="[test]"
VPY=.venv/bin/python
PIP=("$VPY" -m pip --disable-pip-version-check)

# step DESCRIPTION COMMAND...: announce, run, and report the time taken (the command's own output shows in between).
step() {
  local what=$1 start=$SECONDS
  shift
  echo "setup: $what ..." >&2
  "$@"
  echo "setup: $what: done in $((SECONDS - start)) s" >&2
}

if [ ! -x "$VPY" ]; then
  step "creating .venv with $($PY --version 2>&1)" "$PY" -m venv .venv
fi
step "installing the build tools (pip, setuptools, wheel, pybind11, packaging)" \
  "${PIP[@]}" install -q "pip>=23" "setuptools>=61.2" wheel "pybind11>=2.10" "packaging>=20.9" >&2
# Before the large torch download: fail now when neither a prebuilt wheel nor a compiler can provide the kernels.
step "checking for a prebuilt kernel wheel or a C++ compiler" "$VPY" scripts/setup_kernels.py --check

if torch_version=$("$VPY" -c "import torch; print(torch.__version__)" 2>/dev/null); then
  echo "setup: torch $torch_version is already installed" >&2
else
  # A CPU-only machine gets the newest CPU build the package index offers below 2.14;
  # set KOBOLD_BACKEND_TORCH to choose another (e.g. a CUDA build on a GPU machine).
  spec=${KOBOLD_BACKEND_TORCH:-}
  if [ -z "$spec" ]; then
    if command -v nvidia-smi >/dev/null 2>&1; then spec="torch>=2.1"; else spec="torch>=2.1,<2.14"; fi
  fi
  step "installing $spec (a download of several hundred MB)" "${PIP[@]}" install "$spec" >&2
fi

# The Python package alone (editable); the kernels are the next step's business. pip's lines about what it
# downloads and installs are shown; those about what is already there, and setuptools' note on editable installs
# (a block between "!!" lines), are not.
install_package() {
  KOBOLD_BACKEND_NO_NATIVE=1 "${PIP[@]}" install --no-build-isolation -e ".$extras" 2>&1 \
    | awk '/^ *!!$/ { banner = !banner; next } banner || /Requirement already satisfied|Warning: Editable installation|with strategy, WheelFile/ { next } { print; fflush() }' >&2
}
step "installing kobold-backend$extras and its dependencies" install_package
step "installing the native kernels" "$VPY" scripts/setup_kernels.py
echo "setup: done; run .venv/bin/kobold-backend --help (.venv/bin/kobold-backend doctor says which kernels are in use and why)" >&2
