#!/usr/bin/env bash
# One-shot check of the native extension on a GPU machine (run from anywhere; uses python3 with torch):
# builds _ext_cpu and _ext_cuda for sm_90 alone (-gencode arch=compute_90,code=sm_90), then for the default
# arch list, runs the GPU tests and the CPU kernel tests, and prints the timing table of tools/ext_timing.py.
# Logs go to $OUT (or /tmp/kb-ext-check). Every step runs even if an earlier one failed; the exit status
# is non-zero if any failed.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LOGS=${OUT:-/tmp/kb-ext-check}
mkdir -p "$LOGS"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" MAX_JOBS=${MAX_JOBS:-16}
failed=()

step() {  # step NAME LOGFILE COMMAND...
  local name=$1 log=$2
  shift 2
  echo "== $name"
  local start=$SECONDS
  if "$@" 2>&1 | tee "$LOGS/$log"; then
    echo "-- $name: ok ($((SECONDS - start)) s)"
  else
    echo "-- $name: FAILED ($((SECONDS - start)) s, log $LOGS/$log)"
    failed+=("$name")
  fi
}

elf_list() { command -v cuobjdump >/dev/null && cuobjdump --list-elf --list-ptx kobold_backend/_ext_cuda*.so; true; }

echo "== machine"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader || true
$PY -c "import sys, torch; print('python', sys.version.split()[0], '| torch', torch.__version__, '| cuda', torch.version.cuda)"
nvcc --version | tail -2

step "build sm_90 only" build_sm90.log env KOBOLD_BACKEND_CUDA_ARCH=9.0 $PY -m kobold_backend.ops.build --cpu --cuda
elf_list
step "build default arch list" build_default.log $PY -m kobold_backend.ops.build --cuda
elf_list
step "doctor" doctor.log $PY -c "from kobold_backend.doctor import doctor_report; print(doctor_report())"
step "GPU tests" pytest_gpu.log $PY -m pytest -m gpu tests/test_ext_cuda.py -q -p no:cacheprovider -rfE
step "CPU kernel tests (AVX2/AVX-512 clones)" pytest_cpu.log $PY -m pytest tests/test_ext_cpu.py -q -p no:cacheprovider -rfE
step "timings" timing.txt $PY tools/ext_timing.py

if [ ${#failed[@]} -gt 0 ]; then
  echo "FAILED steps: ${failed[*]}"
  exit 1
fi
echo "all steps passed"
