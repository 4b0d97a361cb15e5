#!/usr/bin/env bash
# One device call: build the extension for sm_90 from csrc/, then every `-m gpu` test file, each with its own
# time limit, so one slow or broken file cannot hide the others. Carry .whl (gguf, flask, waitress: the device
# image lacks them). Logs go to $OUT; a table of files, exit codes and pass/fail counts is printed last.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kb-device}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MAX_JOBS=16 KOBOLD_BACKEND_CUDA_ARCH=9.0
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH="$PWD:/tmp/site"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import sys, torch, transformers; print('python', sys.version.split()[0], 'torch', torch.__version__, \
'cuda', torch.version.cuda, 'transformers', transformers.__version__)"
t=$SECONDS
python3 -m kobold_backend.ops.build --cpu --cuda > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
echo "extension built for sm_90 in $((SECONDS - t)) s"
FILES=${GPU_FILES:-$(grep -l "mark.gpu" tests/test_*.py)}
LOGS=/tmp/kb-gpu-logs; rm -rf "$LOGS"; mkdir -p "$LOGS"
summary=""
for f in $FILES; do
  name=$(basename "$f" .py)
  if [ $SECONDS -gt "${TOTAL_LIMIT:-500}" ]; then summary="$summary\n$name not run (time)"; continue; fi
  t=$SECONDS
  timeout "${PER_FILE_LIMIT:-180}" python3 -m pytest -q -p no:cacheprovider -m gpu -rfE "$f" > "$LOGS/$name.log" 2>&1
  rc=$?
  line=$(grep -E "passed|failed|error|no tests ran" "$LOGS/$name.log" | tail -1)
  summary="$summary\n$name rc=$rc $((SECONDS - t))s: $line"
done
cat "$LOGS"/*.log > "$OUT/gpu_tests.log" 2>/dev/null
grep -h "^FAILED\|^ERROR" "$LOGS"/*.log | cut -c1-240 | head -40
printf "%b\n" "$summary"
