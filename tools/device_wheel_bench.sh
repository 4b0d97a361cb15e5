#!/usr/bin/env bash
# GPU call when device time is short: the committed cu130 wheel for this Python serves the kernels (nvcc hidden,
# JIT impossible), the CUDA kernel tests run on it, then the 7B bench (ours, then side by side).
# Carry .whl (the exllamav2 wheel). Results in $OUT.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kb-device}; mkdir -p "$OUT"
PY=$(command -v python3); T=cp$($PY -c 'import sys;print("%d%d"%sys.version_info[:2])')
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
$PY -c "import sys,torch;print(sys.version.split()[0],torch.__version__,torch.version.cuda)"
rm -f kobold_backend/_ext_*.so; rm -rf /tmp/kbext
$PY -m pip install -q --no-deps --no-index --target /tmp/kbext $(ls wheels/kobold_backend_ext-*+cu130-$T-$T-*.whl | head -1) || exit 1
if ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
fi
P=""; for d in $(echo "$PATH" | tr : ' '); do [ -x "$d/nvcc" ] || P="$P${P:+:}$d"; done
export PATH="$P" CXX=/nonexistent/no-jit KOBOLD_BACKEND_EXT=prebuilt PYTHONPATH="$PWD:/tmp/kbext:/tmp/site"
export KOBOLD_BACKEND_CACHE=/tmp/kb-nojit PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16
unset CUDA_HOME CUDA_PATH
command -v nvcc || echo "nvcc hidden from PATH"
$PY -c "from kobold_backend.ops import native as n; r=n.load('cuda'); print(r.path, r.file, r.fingerprint)"
echo "== GPU tests on the prebuilt wheel"; t=$SECONDS
timeout 100 $PY -m pytest -q -p no:cacheprovider -m gpu -rfE tests/test_ext_cuda.py tests/test_host_backend.py \
  > "$OUT/gpu_tests.log" 2>&1; echo "rc=$? in $((SECONDS - t)) s"; tail -12 "$OUT/gpu_tests.log"
echo "== bench (ours)"
timeout 90 $PY -m kobold_backend.bench --preset llama2-7b --json "$OUT/h200_ours.json" 2>&1 | grep -v -i warn | tail -5
[ -n "${SKIP_COMPARE:-}" ] && exit 0
echo "== bench --compare"
# exllamav2 JIT-builds its own extension: it needs nvcc back on PATH
export PATH="$PATH:/usr/local/cuda/bin" CXX=g++
timeout 200 $PY -m kobold_backend.bench --preset llama2-7b --compare --json "$OUT/h200.json" 2>&1 | grep -v -i warn | tail -10
