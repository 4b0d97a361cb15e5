#!/usr/bin/env bash
# One device call for the quantized KV cache: build the extension for sm_90, run tests/test_kv_quant_gpu.py (the
# kernels of csrc/cuda/kv_quant.cu against the torch definitions, graphs vs eager, CUDA vs CPU, demo perplexity)
# then time attention and decode steps (tools/kv_quant_timing.py). Fits in four minutes; logs go to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kb-device}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MAX_JOBS=16 KOBOLD_BACKEND_CUDA_ARCH=9.0
if ls .whl/*.whl >/dev/null 2>&1; then  # carry .whl: gguf (the loader imports it), absent from the device image
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH="$PWD:/tmp/site"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
echo "== build (sm_90)"; t=$SECONDS
timeout 120 python3 -m kobold_backend.ops.build --cpu --cuda > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
echo "built in $((SECONDS - t)) s"
echo "== GPU tests"; t=$SECONDS
timeout "${TEST_LIMIT:-60}" python3 -m pytest -q -p no:cacheprovider -m gpu -rfE tests/test_kv_quant_gpu.py \
  > "$OUT/kvq_tests.log" 2>&1; echo "kv_quant rc=$? in $((SECONDS - t)) s"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/kvq_tests.log" | cut -c1-300 | tail -25
echo "== timings"; t=$SECONDS
timeout "${TIMING_LIMIT:-30}" python3 tools/kv_quant_timing.py --layers 2 --steps 16 2>&1 | grep -v -i warn | tail -14
echo "timings in $((SECONDS - t)) s"
