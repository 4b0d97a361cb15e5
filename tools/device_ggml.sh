#!/usr/bin/env bash
# One device call for the GGML kernels: build the extension for sm_90, run the GGML/GGUF GPU tests, time the
# kernels (tools/ggml_timing.py), then `kobold-backend bench` on a synthetic 7B Q4_K_M GGUF and on the GPTQ
# preset of the same shape, for the decode ratio (BENCH_GPTQ=0 skips it when device time is short: the timing
# table still compares the two GEMVs). Carry .whl (the gguf wheel). Logs and JSON go to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kb-device}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MAX_JOBS=16 KOBOLD_BACKEND_CUDA_ARCH=9.0
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/gguf-*.whl
export PYTHONPATH="$PWD:/tmp/site"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u
echo "== build (sm_90)"; t=$SECONDS
python3 -m kobold_backend.ops.build --cpu --cuda > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
echo "built in $((SECONDS - t)) s"
echo "== GPU tests"; t=$SECONDS
timeout "${TEST_LIMIT:-75}" python3 -m pytest -q -p no:cacheprovider -m gpu -rfE ${GPU_TESTS:-tests/test_ggml_kernels.py \
  tests/test_gguf_model.py} > "$OUT/gpu_tests.log" 2>&1; echo "rc=$? in $((SECONDS - t)) s"
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu_tests.log" | cut -c1-300 | tail -12
echo "== kernel timings"; timeout 40 python3 tools/ggml_timing.py 2>&1 | tee "$OUT/timing.txt" | tail -30
echo "== bench GGUF Q4_K_M"; t=$SECONDS
timeout "${BENCH_LIMIT:-150}" python3 -m kobold_backend.bench --preset llama2-7b --format gguf --json "$OUT/gguf.json" 2>&1 \
  | grep -v -i warn | tail -5; echo "in $((SECONDS - t)) s"
[ "${BENCH_GPTQ:-1}" = 0 ] && exit 0
echo "== bench GPTQ"; t=$SECONDS
timeout "${BENCH_LIMIT:-150}" python3 -m kobold_backend.bench --preset llama2-7b --json "$OUT/gptq.json" 2>&1 \
  | grep -v -i warn | tail -5; echo "in $((SECONDS - t)) s"
