#!/usr/bin/env bash
# Checks what users get on a GPU machine (issue 34): the committed kernel wheels for this Python, installed with
# nvcc hidden so nothing can be JIT-built, run every `-m gpu` test file and bench the synthetic 7B Q4_K_M file; the
# same bench from a source build (nvcc, sm_90) in the same call gives the figure the wheels must match (within 3 %).
# Carry .whl (gguf, flask, waitress, blinker, itsdangerous, jsonschema and its needs: the image lacks them).
#   SECTIONS="tests" VARIANTS="cu130 cu118" bash tools/device_shipped_check.sh   # every -m gpu file per wheel
#   SECTIONS="bench" bash tools/device_shipped_check.sh                          # shipped wheels beside a source build
# Tests of the variants run side by side (one pytest process per file, TEST_WORKERS per variant); benches one at a
# time on an otherwise idle GPU. Logs and JSON in $OUT (results.tgz); a table is printed last.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kb-device}; mkdir -p "$OUT"
SECTIONS=${SECTIONS:-tests bench}
VARIANTS=${VARIANTS:-cu130 cu118}
export PYTHONUNBUFFERED=1
PY=$(command -v python3); T=cp$($PY -c 'import sys;print("%d%d"%sys.version_info[:2])')
$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u
$PY -c "import sys,torch;print('python',sys.version.split()[0],'torch',torch.__version__,'cuda',torch.version.cuda)"
want() { [[ " $SECTIONS " == *" $1 "* ]]; }
finish() { (cd "$OUT" && tar czf /tmp/results.tgz --exclude=results.tgz . && rm -rf ./* && mv /tmp/results.tgz .); }
trap finish EXIT
rm -f kobold_backend/_ext_*.so
NO_NVCC=""; for d in $(echo "$PATH" | tr : ' '); do [ -x "$d/nvcc" ] || NO_NVCC="$NO_NVCC${NO_NVCC:+:}$d"; done

# install_variant V: the committed wheel of variant V for this Python into /tmp/kbext-V; prints its folder
install_variant() {
  local wheel; wheel=$(ls wheels/kobold_backend_ext-*+"$1"-$T-$T-*.whl 2>/dev/null | head -1)
  [ -n "$wheel" ] || { echo "no $1 wheel for $T" >&2; return 1; }
  rm -rf "/tmp/kbext-$1"
  $PY -m pip install -q --no-deps --no-index --target "/tmp/kbext-$1" "$wheel" >&2 || return 1
  echo "/tmp/kbext-$1"
}
# shipped V CMD...: run CMD with the wheel of V and no way to compile (nvcc hidden, no C++ compiler, prebuilt only)
shipped() {
  local v=$1; shift
  env PATH="$NO_NVCC" CXX=/nonexistent/no-jit KOBOLD_BACKEND_EXT=prebuilt KOBOLD_BACKEND_CACHE="/tmp/kb-nojit-$v" \
    PYTHONPATH="$PWD:/tmp/kbext-$v:/tmp/site" CUDA_HOME= CUDA_PATH= "$@"
}

if want tests; then
  echo "== GPU tests per wheel at ${SECONDS} s"
  FILES=${GPU_FILES:-$(grep -l "mark.gpu" tests/test_*.py)}
  cat > /tmp/kb-run-one.sh <<RUN
v=\$1; f=\$2; n=\$(basename \$f .py); s=\$(date +%s)
env PATH="$NO_NVCC" CXX=/nonexistent/no-jit KOBOLD_BACKEND_EXT=prebuilt KOBOLD_BACKEND_CACHE=/tmp/kb-nojit-\$v \
  PYTHONPATH="$PWD:/tmp/kbext-\$v:/tmp/site" CUDA_HOME= CUDA_PATH= timeout ${PER_FILE_LIMIT:-400} \
  $PY -m pytest -q -p no:cacheprovider -m gpu -rfE \$f > /tmp/kb-gpu-\$v/\$n.log 2>&1
echo "\$n rc=\$? \$(( \$(date +%s) - s ))s: \$(grep -E "passed|failed|error|no tests ran" /tmp/kb-gpu-\$v/\$n.log | tail -1)" \
  >> /tmp/kb-gpu-\$v/summary.txt
RUN
  for v in $VARIANTS; do
    install_variant "$v" > /dev/null || continue
    shipped "$v" $PY -c "from kobold_backend.ops import native as n; r=n.load('cuda'); print('$v', r.path, r.file)" \
      2>&1 | tail -1
    rm -rf "/tmp/kb-gpu-$v"; mkdir -p "/tmp/kb-gpu-$v"
    (echo "$FILES" | xargs -P "${TEST_WORKERS:-4}" -I{} bash /tmp/kb-run-one.sh "$v" {}) &
  done
  wait
  for v in $VARIANTS; do
    [ -f "/tmp/kb-gpu-$v/summary.txt" ] || continue
    echo "-- $v"; sort "/tmp/kb-gpu-$v/summary.txt" | tee "$OUT/gpu-$v-summary.txt"
    cat /tmp/kb-gpu-"$v"/test_*.log > "$OUT/gpu-$v.log"
    grep -h "^FAILED\|^ERROR" /tmp/kb-gpu-"$v"/test_*.log | cut -c1-300 | head -20
  done
fi

if want bench; then
  echo "== benches at ${SECONDS} s: the 7B Q4_K_M file, each wheel with nvcc hidden, then a source build"
  $PY -m kobold_backend.ops.build --cpu --cuda > "$OUT/source-build.log" 2>&1 &  # sm_90 only: KOBOLD_BACKEND_CUDA_ARCH
  build_job=$!
  PYTHONPATH="$PWD:/tmp/site" $PY -c "from pathlib import Path; from kobold_backend.bench.checkpoint import PRESETS
from kobold_backend.bench.gguf_checkpoint import write_synthetic_gguf
write_synthetic_gguf(Path('/tmp/q4km-7b.gguf'), PRESETS['llama2-7b'])" > "$OUT/write.log" 2>&1
  wait "$build_job" || { echo "source build failed"; tail -20 "$OUT/source-build.log"; }
  mkdir -p /tmp/kb-source && mv kobold_backend/_ext_*.so /tmp/kb-source/  # out of the wheels' way until its turn
  for v in $VARIANTS; do install_variant "$v" > /dev/null; done
  # ROUNDS passes over the builds in turn (the first bench of a call runs cold), the best pass of each reported
  for r in $(seq "${ROUNDS:-2}"); do
    for b in source $VARIANTS; do
      if [ "$b" = source ]; then
        cp /tmp/kb-source/_ext_*.so kobold_backend/
        PYTHONPATH="$PWD:/tmp/site" KOBOLD_BACKEND_EXT=prebuilt timeout 150 $PY -m kobold_backend.bench \
          --model /tmp/q4km-7b.gguf --json "$OUT/bench-$b-$r.json" > "$OUT/bench-$b-$r.log" 2>&1
        echo "$b pass $r rc=$?"; rm -f kobold_backend/_ext_*.so
      else
        shipped "$b" timeout 150 $PY -m kobold_backend.bench --model /tmp/q4km-7b.gguf --json "$OUT/bench-$b-$r.json" \
          > "$OUT/bench-$b-$r.log" 2>&1; echo "$b pass $r rc=$?"
      fi
    done
  done
  $PY - "$OUT" $VARIANTS <<'EOF'
import json, sys
from pathlib import Path
out, variants = Path(sys.argv[1]), sys.argv[2:]
def decode(name):
    best = {}
    for f in sorted(out.glob(f"bench-{name}-*.json")):
        for k, v in json.loads(f.read_text())["kobold_backend"].get("decode_tokens_per_s", {}).items():
            best[k] = max(best.get(k, 0.0), v)
    return best
base = decode("source")
print("build   decode tok/s by context, best pass (ratio to the source build; PASS within 3 %)")
for name in ["source"] + variants:
    d = decode(name)
    ratios = {k: d[k] / base[k] for k in d if base.get(k)}
    ok = bool(ratios) and all(r >= 0.97 for r in ratios.values())
    cells = "  ".join(f"ctx {k}: {d[k]:7.1f} ({ratios.get(k, 0):.3f})" for k in d)
    print(f"{name:7} {'PASS' if ok else 'FAIL'}  {cells or 'no result'}")
EOF
fi
echo "== done at ${SECONDS} s"
