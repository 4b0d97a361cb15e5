#!/usr/bin/env bash
# One device call for the GPTQ GEMV work: build the CUDA extension (JIT, sm_90), check and time every GEMV
# kernel (tools/gptq_gemv_bench.py), run the GPU tests touching GPTQ, then the 7B decode bench with and
# without act-order; with BASE=DIR, the 7B bench (no act-order) on the checkout DIR (before the change) too.
# Logs and JSON go to $OUT. Usage: [BASE=DIR] bash tools/perf_device.sh [quick]
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kb-perf}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MAX_JOBS=16 KOBOLD_BACKEND_CUDA_ARCH=9.0
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__)"
bench() {  # bench TREE TAG [ACT-ORDER TOO]
  for act in "" ${3:+--act-order}; do
    local t=$SECONDS
    (cd "$1" && PYTHONPATH="$PWD" timeout 150 python3 -m kobold_backend.bench --preset llama2-7b $act \
      --json "$OUT/bench-$2$act.json" > "$OUT/bench-$2$act.log" 2>&1); echo "bench $2 $act rc=$? $((SECONDS - t)) s"
    grep -v "^INFO\|^WARNING\|^kobold_backend:" "$OUT/bench-$2$act.log" | tail -4
  done
}
t=$SECONDS
PYTHONPATH="$PWD" python3 -m kobold_backend.ops.build --cuda > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
echo "built in $((SECONDS - t)) s"
export PYTHONPATH="$PWD"
timeout 150 python3 tools/gptq_gemv_bench.py ${1:+--quick} 2>&1 | tee "$OUT/gemv.txt" | grep -v "^ "
t=$SECONDS
timeout "${TEST_LIMIT:-200}" python3 -m pytest -q -p no:cacheprovider -m gpu -rfE ${GPU_TESTS:-tests/test_ext_cuda.py tests/test_model_oracle.py tests/test_gptq_format.py} \
  > "$OUT/tests.log" 2>&1
echo "tests rc=$? $((SECONDS - t)) s: $(tail -1 "$OUT/tests.log")"
grep -h "^FAILED\|^ERROR" "$OUT/tests.log" | cut -c1-300 | head -10
bench "$PWD" after yes
if [ -n "${BASE:-}" ]; then
  (cd "$BASE" && PYTHONPATH="$PWD" python3 -m kobold_backend.ops.build --cuda > "$OUT/build-base.log" 2>&1) || tail -5 "$OUT/build-base.log"
  bench "$BASE" before
fi
