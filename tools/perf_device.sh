#!/usr/bin/env bash
# One device call for the GPTQ GEMV work: build the CUDA extension (JIT, sm_90), check and time every GEMV
# kernel (tools/gptq_gemv_bench.py), run the GPU tests touching GPTQ, then the 7B decode bench with and
# without act-order. Logs and JSON go to $OUT. Usage: bash tools/perf_device.sh [quick]
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kb-perf}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MAX_JOBS=16 KOBOLD_BACKEND_CUDA_ARCH=9.0 PYTHONPATH="$PWD"
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader
python3 -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__)"
t=$SECONDS
python3 -m kobold_backend.ops.build --cuda > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
echo "built in $((SECONDS - t)) s"
t=$SECONDS
timeout 150 python3 tools/gptq_gemv_bench.py ${1:+--quick} 2>&1 | tee "$OUT/gemv.txt" | grep -v "^ "
echo "gemv bench $((SECONDS - t)) s"
t=$SECONDS
timeout ${TEST_LIMIT:-100} python3 -m pytest -q -p no:cacheprovider -m gpu -rfE -x tests/test_ext_cuda.py ${GPU_TESTS:-} \
  > "$OUT/tests.log" 2>&1; echo "tests rc=$? $((SECONDS - t)) s: $(tail -1 "$OUT/tests.log")"
grep -h "^FAILED\|^ERROR" "$OUT/tests.log" | cut -c1-300 | head -10
for act in "" "--act-order"; do
  t=$SECONDS
  timeout 150 python3 -m kobold_backend.bench --preset llama2-7b $act --json "$OUT/bench$act.json" \
    > "$OUT/bench$act.log" 2>&1; echo "bench $act rc=$? $((SECONDS - t)) s"
  grep -v "^INFO\|^WARNING" "$OUT/bench$act.log" | tail -25
done
