#!/usr/bin/env bash
# llama.cpp's llama-bench beside this engine on the same GGUF files (issue #27), in two device calls of one lease
# (the machine and its /tmp stay while calls follow within 30 s). Carry .whl (the gguf wheel) and .llamacpp
# (llama.cpp.tar.gz: the trimmed llama.cpp source; docs/performance.md says how it is made).
#   build  starts the CUDA build of llama-bench in the background (about 5.5 min at -j 10) and returns at once:
#          put it first in call 1, before tools/device_session.sh, and `wait` last.
#   wait   waits for that build (at most WAIT seconds, default 400) and prints its end.
#   bench  call 2: waits for the build (or builds, resuming from its objects, when none is running), writes the
#          synthetic 7B GGUF file of each run under /tmp unless there, then one `bench --compare llamacpp` per run
#          of RUNS, in order (default "q4km kv-q8 kv-q4 q4_0 q8_0"; also q5km, and gptq: call 1's /tmp/gptq-7b
#          beside exllamav2; at most 6 runs, as 8 files come back),
#          each JSON to $OUT/<run>.json, all of them merged into $OUT/h200-formats.json, logs in $OUT/logs.tgz, and
#          the table of `python -m kobold_backend.bench.report` printed last. LIMIT (seconds, default 560) ends
#          the runs early, one run at a time.
# The binary lands in /tmp/llamacpp/build/bin/llama-bench with llama-bench.build.json beside it (commit and
# CMake flags, which the bench copies into its JSON).
set -u
cd "$(dirname "$0")/.."
LC=${LLAMACPP_DIR:-/tmp/llamacpp}
BIN=$LC/build/bin/llama-bench
TARBALL=$PWD/${LLAMACPP_TARBALL:-.llamacpp/llama.cpp.tar.gz}
OUT=${OUT:-/tmp/kb-device}; mkdir -p "$OUT" "$LC"
LIMIT=${LIMIT:-560}
GGUF_DIR=${GGUF_DIR:-/tmp}  # and PRESET (default llama2-7b): where the files are written, and their shape
export PATH="$PATH:/usr/local/cuda/bin" PYTHONUNBUFFERED=1
FLAGS=(-DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90
       "-DGGML_CUDA_FA_QUANTS=f16-f16,bf16-bf16,q8_0-q8_0,q4_0-q4_0,q8_0-q4_0"
       -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF
       -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DBUILD_SHARED_LIBS=OFF -DCMAKE_BUILD_TYPE=Release)
command -v ninja > /dev/null && FLAGS=(-G Ninja "${FLAGS[@]}")

building() { [ -f $LC/build.pid ] && kill -0 "$(cat $LC/build.pid)" 2> /dev/null; }

build_now() {  # the build itself (foreground); its status in $LC/build.rc, its log in $LC/build.log
  rm -f $LC/build.rc
  { [ -d $LC/llama.cpp ] || tar xzf "$TARBALL" -C $LC; } > $LC/build.log 2>&1 &&
    cmake -S $LC/llama.cpp -B $LC/build "${FLAGS[@]}" >> $LC/build.log 2>&1 &&
    cmake --build $LC/build --target llama-bench -j "${JOBS:-10}" >> $LC/build.log 2>&1 &&
    python3 -c 'import json, sys; json.dump({"commit": sys.argv[2], "cmake_flags": sys.argv[3:]},
                open(sys.argv[1], "w"), indent=1)' "$BIN.build.json" "$(cat $LC/llama.cpp/LLAMACPP_COMMIT)" "${FLAGS[@]}"
  echo $? > $LC/build.rc
}

start_build() {
  if [ -x $BIN ] && [ -f $BIN.build.json ]; then echo "llama-bench already built: $BIN"; return; fi
  if building; then echo "llama-bench build already running (pid $(cat $LC/build.pid))"; return; fi
  [ -f "$TARBALL" ] || { echo "no $TARBALL here: carry .llamacpp"; return 1; }
  export -f build_now; export LC BIN TARBALL JOBS="${JOBS:-10}"
  FLAGS_TEXT=$(printf '%q ' "${FLAGS[@]}")
  setsid nohup bash -c "FLAGS=($FLAGS_TEXT); build_now" > /dev/null 2>&1 < /dev/null &
  echo $! > $LC/build.pid
  echo "llama-bench build started (pid $!), log $LC/build.log"
}

wait_build() {  # wait_build SECONDS: 0 once the binary is there
  local until=$((SECONDS + $1))
  while building && [ $SECONDS -lt $until ]; do sleep 5; done
  if [ -x $BIN ] && [ -f $BIN.build.json ]; then echo "llama-bench ready after ${SECONDS} s"; return 0; fi
  building && echo "llama-bench still building after $1 s" || { echo "llama-bench build failed (rc $(cat $LC/build.rc \
    2> /dev/null || echo ?)):"; tail -15 $LC/build.log; }
  return 1
}

left() { echo $((LIMIT - SECONDS)); }

gguf() {  # gguf RECIPE: $GGUF_DIR/<recipe>-7b.gguf, written unless it is there with no_vocab (an older file, e.g. from
          # tools/device_session.sh before this change, does not load in llama.cpp)
  [ "$(left)" -lt 120 ] && { echo "skip writing the $1 file (time)"; return 1; }
  python3 - "$1" "$GGUF_DIR" "${PRESET:-llama2-7b}" <<'EOF' 2>&1 | tail -3
import sys, time
from pathlib import Path
from kobold_backend.bench.checkpoint import PRESETS
from kobold_backend.bench.gguf_checkpoint import write_synthetic_gguf
recipe = sys.argv[1]
path = Path(sys.argv[2]) / f"{recipe.lower().replace('_k_m', 'km')}-7b.gguf"
if path.exists():
    with open(path, "rb") as f:
        if b"no_vocab" in f.read(4096):
            sys.exit(0)
t = time.time()
write_synthetic_gguf(path, PRESETS[sys.argv[3]], recipe=recipe)
print(f"{path} written in {time.time() - t:.1f} s")
EOF
}

run_bench() {  # run_bench NAME MODEL [bench flags...]
  local name=$1 model=$2; shift 2
  [ "$(left)" -lt 60 ] && { echo "skip $name (time)"; return; }
  local t=$SECONDS
  timeout $(( $(left) - 10 )) python3 -m kobold_backend.bench --model "$model" --llamacpp-bench $BIN "$@" \
    --json "$OUT/$name.json" > "$LOGS/$name.log" 2>&1
  echo "$name rc=$? $((SECONDS - t)) s"; grep -i "^vs \|skipped\|error" "$LOGS/$name.log" | cut -c1-300 | tail -4
}

bench() {
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="$PWD:/tmp/site"
  LOGS=/tmp/kb-llamacpp-logs; rm -rf "$LOGS"; mkdir -p "$LOGS"
  ls kobold_backend/_ext_cuda*.so > /dev/null 2>&1 || ! python3 -c "import torch; assert torch.cuda.is_available()" 2> /dev/null \
    || KOBOLD_BACKEND_CUDA_ARCH=9.0 MAX_JOBS=16 python3 -m kobold_backend.ops.build --cpu --cuda \
    > "$LOGS/ext_build.log" 2>&1 || tail -20 "$LOGS/ext_build.log"
  building || [ -x $BIN ] || { echo "no llama-bench build running: building now"; start_build; }
  wait_build $(( $(left) - 120 )) || return 1
  local runs=" ${RUNS:-q4km kv-q8 kv-q4 q4_0 q8_0} " run
  for run in $runs; do
    case $run in
      q4km) gguf Q4_K_M && run_bench q4km-7b $GGUF_DIR/q4km-7b.gguf --compare llamacpp --contexts 128,4000,16000 ;;
      kv-q8|kv-q4) gguf Q4_K_M && run_bench "q4km-7b-$run" $GGUF_DIR/q4km-7b.gguf --compare llamacpp \
        --cache-dtype "${run#kv-}" --contexts 4000,16000 ;;
      q4_0) gguf Q4_0 && run_bench q4_0-7b $GGUF_DIR/q4_0-7b.gguf --compare llamacpp ;;
      q8_0) gguf Q8_0 && run_bench q8_0-7b $GGUF_DIR/q8_0-7b.gguf --compare llamacpp ;;
      q5km) gguf Q5_K_M && run_bench q5km-7b $GGUF_DIR/q5km-7b.gguf --compare llamacpp ;;
      gptq) [ -d /tmp/gptq-7b ] && run_bench gptq-7b /tmp/gptq-7b --compare exllamav2 ;;
      *) echo "unknown run $run" ;;
    esac
  done
  (cd "$LOGS" && tar czf "$OUT/logs.tgz" .)
  local jsons; jsons=$(ls "$OUT"/*.json 2> /dev/null | grep -v h200-formats.json)
  [ -n "$jsons" ] && python3 -m kobold_backend.bench.report $jsons --merge "$OUT/h200-formats.json"
}

case "${1:-}" in
  build) start_build ;;
  wait) wait_build "${WAIT:-400}" ;;
  bench) bench ;;
  *) echo "usage: bash tools/device_llamacpp.sh build|wait|bench"; exit 2 ;;
esac
