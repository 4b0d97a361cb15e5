#!/usr/bin/env bash
# The KoboldAI United job (scripts/test.sh runs it after the main suite): a Python 3.8 virtual environment with
# United's pins and kobold-backend's other dependencies at their lower bounds (tests/united/requirements.txt), the
# prebuilt CPU kernels, then the plugin tests in it: discovery, is_valid, load, raw_generate with sentencepiece and
# byte-level BPE tokenizers, hooks and stoppers, unload, install-plugin into a United-shaped checkout with the pins
# left unchanged, tokenizer.json files of the newest layout under tokenizers 0.15, and GGUF files under gguf 0.6.0
# (against transformers in the project's .venv: test_tokenizer_versions.py, test_gguf_versions.py).
# Usage: scripts/test_united.sh FOLDER  (a temporary folder the caller removes; the venv, about 4 GB, goes there).
# pip downloads (about 2.5 GB the first time: torch 2.1 from PyPI is its CUDA build) are cached where pip caches.
set -euo pipefail
cd "$(dirname "$0")/.."
work=${1:?usage: scripts/test_united.sh TEMPORARY_FOLDER}
FILES=(tests/test_united_pins.py tests/test_host_backend.py tests/test_host_install.py tests/test_host_tokenizer.py
       tests/test_host_parameters.py tests/test_host_passthrough.py tests/test_tokenizer_compat.py
       tests/test_tokenizer_versions.py tests/test_gguf_versions.py)

python38=${KOBOLD_BACKEND_UNITED_PYTHON:-}
if [ -z "$python38" ]; then
  for candidate in python3.8 "$(pyenv root 2>/dev/null)"/versions/3.8*/bin/python3.8 /root/.pyenv/versions/3.8*/bin/python3.8; do
    if "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 8)' >/dev/null 2>&1; then
      python38=$candidate
      break
    fi
  done
fi
if [ -z "$python38" ]; then
  echo "test: United job: no Python 3.8 found (United runs 3.8); set KOBOLD_BACKEND_UNITED_PYTHON to one" >&2
  exit 1
fi

start=$SECONDS
venv=$work/united-venv
echo "test: United job: a Python 3.8 venv with United's pins (tests/united/requirements.txt) ..." >&2
"$python38" -m venv "$venv"
UPY=$venv/bin/python
if ! "$UPY" -m pip --disable-pip-version-check install -q -r tests/united/requirements.txt >"$work/united-pip.log" 2>&1; then
  grep -v "is ignored: it is neither a file nor a directory" "$work/united-pip.log" | tail -20 >&2
  exit 1
fi
echo "test: United job: installed $("$UPY" -c 'import torch, tokenizers, transformers; print("torch", torch.__version__, "tokenizers", tokenizers.__version__, "transformers", transformers.__version__)') in $((SECONDS - start)) s" >&2
PYTHONPATH=$PWD "$UPY" -m kobold_backend.cli.main install-ext >"$work/united-ext.log" 2>&1 \
  || { tail -5 "$work/united-ext.log" >&2; exit 1; }

# test_tokenizer_versions.py's and test_gguf_versions.py's oracle: the newest tokenizers and transformers, in the project's own .venv.
if [ -x .venv/bin/python ]; then export KOBOLD_BACKEND_REFERENCE_PYTHON=$PWD/.venv/bin/python; fi

start=$SECONDS
status=0
KOBOLD_BACKEND_UNITED_ENV=tests/united/requirements.txt TMPDIR=$work PYTHONPATH=$PWD \
  "$UPY" -m pytest -q -p no:cacheprovider "${FILES[@]}" || status=$?
echo "test: United job: pytest took $((SECONDS - start)) s" >&2
exit "$status"
