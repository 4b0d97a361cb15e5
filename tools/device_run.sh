#!/usr/bin/env bash
# The lead's one GPU call: build the extension for sm_90, run the CUDA kernel and GPU engine tests, time the
# kernels, then `kobold-backend bench --compare` (exllamav2 + transformers) and an act-order bench.
# Carry .whl (the exllamav2 wheel). Logs and JSON go to $OUT (at most 8 files come back).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kb-device}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=9.0 KOBOLD_BACKEND_CUDA_ARCH=9.0
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH="$PWD:/tmp/site"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)"
echo "== build (sm_90)"; t=$SECONDS
python3 -m kobold_backend.ops.build --cpu --cuda > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
echo "built in $((SECONDS - t)) s"
python3 -c "from kobold_backend.doctor import doctor_report; print(doctor_report())" 2>&1 | tail -12
echo "== GPU tests"; t=$SECONDS
timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE ${GPU_TESTS:-tests/test_ext_cuda.py tests/test_host_backend.py tests/test_passthrough_gpu.py} \
  > "$OUT/gpu_tests.log" 2>&1; echo "rc=$? in $((SECONDS - t)) s"; tail -15 "$OUT/gpu_tests.log"
echo "== bench"; t=$SECONDS
timeout 300 python3 -m kobold_backend.bench --preset llama2-7b ${BENCH_COMPARE---compare} --json "$OUT/h200.json" 2>&1 \
  | grep -v -i warn | tail -12; echo "bench in $((SECONDS - t)) s"
timeout 75 python3 -m kobold_backend.bench --preset llama2-7b --act-order --json "$OUT/h200_act_order.json" 2>&1 \
  | grep -v -i warn | tail -4
echo "== kernel timings"; timeout 40 python3 tools/ext_timing.py > "$OUT/timing.txt" 2>&1; tail -20 "$OUT/timing.txt"
