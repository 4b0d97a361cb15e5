#!/usr/bin/env bash
# One GPU call (issue 21's check): each committed CUDA wheel for this Python in turn (default: cu130, then cu118)
# serves the kernels with nvcc hidden (no JIT possible), under the device's own torch (whatever CUDA it was built
# with): the loader's choice, `pytest -m gpu tests/test_ext_cuda.py`, then the 7B bench. Last, one table: tests
# passed, decode tok/s per context and the ratio to the first wheel's figure (PASS within 5 %).
# About 2 x (100 s tests + 90 s bench) + start-up: under 8 minutes. Results and logs in $OUT.
#   bash tools/device_wheel_matrix.sh            # VARIANTS="cu118" or "cu130 cu118" (default) to choose
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kb-device}; mkdir -p "$OUT"
PY=$(command -v python3); T=cp$($PY -c 'import sys;print("%d%d"%sys.version_info[:2])')
VARIANTS=${VARIANTS:-cu130 cu118}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
$PY -c "import sys,torch;print('python',sys.version.split()[0],'torch',torch.__version__,'cuda',torch.version.cuda)"
rm -f kobold_backend/_ext_*.so
P=""; for d in $(echo "$PATH" | tr : ' '); do [ -x "$d/nvcc" ] || P="$P${P:+:}$d"; done
export PATH="$P" CXX=/nonexistent/no-jit KOBOLD_BACKEND_EXT=prebuilt KOBOLD_BACKEND_CACHE=/tmp/kb-nojit
export PYTHONUNBUFFERED=1
unset CUDA_HOME CUDA_PATH
command -v nvcc || echo "nvcc hidden from PATH"
for v in $VARIANTS; do
  wheel=$(ls wheels/kobold_backend_ext-*+$v-$T-$T-*.whl 2>/dev/null | head -1)
  if [ -z "$wheel" ]; then echo "== $v: no wheel for $T" | tee "$OUT/$v.status"; continue; fi
  echo "== $v: $wheel"
  rm -rf "/tmp/kbext-$v"
  $PY -m pip install -q --no-deps --no-index --target "/tmp/kbext-$v" "$wheel" || { echo "install failed" > "$OUT/$v.status"; continue; }
  export PYTHONPATH="$PWD:/tmp/kbext-$v"
  $PY -c "from kobold_backend.ops import native as n; r=n.load('cuda'); print(r.path, r.file, r.fingerprint)" \
    2>&1 | tail -2 | tee "$OUT/$v.load"
  t=$SECONDS
  timeout 110 $PY -m pytest -q -p no:cacheprovider -m gpu -rfE tests/test_ext_cuda.py > "$OUT/${v}_gpu_tests.log" 2>&1
  echo "rc=$? in $((SECONDS - t)) s: $(tail -1 "$OUT/${v}_gpu_tests.log")" | tee "$OUT/$v.status"
  timeout 120 $PY -m kobold_backend.bench --preset llama2-7b --json "$OUT/${v}_bench.json" 2>&1 | grep -v -i warn | tail -4
done
echo "== comparison (decode tok/s; ratio to the first wheel's figure, PASS within 5 %)"
$PY - "$OUT" $VARIANTS <<'EOF'
import json, sys
from pathlib import Path
out, variants = Path(sys.argv[1]), sys.argv[2:]
rows, base = [], None
for v in variants:
    status = (out / f"{v}.status").read_text().strip() if (out / f"{v}.status").is_file() else "not run"
    bench = out / f"{v}_bench.json"
    decode = json.loads(bench.read_text())["kobold_backend"].get("decode_tokens_per_s", {}) if bench.is_file() else {}
    base = base if base is not None else decode
    ratios = {k: decode[k] / base[k] for k in decode if base.get(k)}
    ok = bool(ratios) and all(r >= 0.95 for r in ratios.values())
    cells = "  ".join(f"ctx {k}: {decode[k]:7.1f} ({ratios.get(k, 0):.3f})" for k in decode)
    rows.append(f"{v:6} {'PASS' if ok else 'FAIL'}  {cells or 'no bench result'}  | tests {status}")
print("\n".join(rows))
EOF
