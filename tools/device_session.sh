#!/usr/bin/env bash
# The lead's one GPU call for a whole wave: build the extension for sm_90 (exllamav2 JIT-builds beside it), run
# every `-m gpu` test file in parallel processes (one file per process, so a kernel fault cannot hide the other
# files), time the GEMV variants, then the benches one at a time on an otherwise idle GPU: 7B GPTQ / GGUF Q4_K_M /
# EXL2 4.0 bpw (GPTQ and EXL2 beside exllamav2 on the same folders), quantized KV caches and speculation.
# Carry .whl (gguf, flask, waitress, exllamav2 wheels). Logs and JSON go to $OUT; a summary is printed last.
# Sections are skipped once the call's time is spent (LIMIT, seconds; default 560); SECTIONS (words: tests gemv
# gptq gguf exl2 exllamav2 kv spec act) runs only those. Optional sections, run only when named in SECTIONS:
#   exl2logits  exllamav2's causal logits for tests/data/exl2 (tools/exl2_reference_logits.py; results.tgz holds
#               reference-logits-causal.safetensors, to be committed under tests/data/exl2/)
#   ggml        GGML block-kernel timings, classic, q8, q8-pdl and q8-pdl on re-laid-out rows (tools/ggml_timing.py)
#   ggmlrepack  7B Q4_0 and Q8_0 files benched with Q4_0/Q8_0/Q6_K re-laid out at load (the default) and with the
#               file's blocks (KOBOLD_BACKEND_GGML_REPACK=0)
#   mma         the tensor-core GPTQ product against dequantize + cuBLAS for 9..128 rows (tools/mma_timing.py)
#   kvtiming    decode attention and decode steps per cache dtype, new and old kernels (tools/kv_quant_timing.py)
#   ext         the doctor report and the kernel timing table (tools/ext_timing.py)
#   compare     `bench --preset llama2-7b --compare` (this engine beside exllamav2 and transformers)
#   base        with BASE=DIR (a checkout of the commit before the change): the 7B GPTQ bench from that tree on
#               the same folder, for a before/after pair
# SKIP_BUILD=1 keeps the modules an earlier command of the same machine built in place.
# GPU_FILES (test files) narrows the tests section, e.g. one branch's:
#   SECTIONS="tests kvtiming" GPU_FILES=tests/test_kv_quant_gpu.py bash tools/device_session.sh
# Everything ends up in $OUT/results.tgz (the device tool brings back a few files only).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kb-device}; mkdir -p "$OUT"
LIMIT=${LIMIT:-560}
export PATH="$PATH:/usr/local/cuda/bin" PYTHONUNBUFFERED=1 MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=9.0 \
  KOBOLD_BACKEND_CUDA_ARCH=9.0
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH="$PWD:/tmp/site"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u
python3 -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__)"
left() { echo $((LIMIT - SECONDS)); }
want() { [ -z "${SECTIONS:-}" ] || [[ " $SECTIONS " == *" $1 "* ]]; }
named() { [[ " ${SECTIONS:-} " == *" $1 "* ]]; }  # optional sections: only when named
want_any() { local w; for w in "$@"; do want "$w" && return 0; done; return 1; }
finish() { (cd "$OUT" && tar czf /tmp/results.tgz --exclude=results.tgz . && rm -rf ./* && mv /tmp/results.tgz .); }
trap finish EXIT
section() { echo "== $1 at ${SECONDS} s"; }

section "exllamav2 JIT build (background)"
(want exllamav2 || named exl2logits) && { (python3 -c "import exllamav2.ext" > "$OUT/exllamav2_build.log" 2>&1
  echo "rc=$?" >> "$OUT/exllamav2_build.log"
  named exl2logits && { timeout 200 python3 tools/exl2_reference_logits.py "$OUT/reference-logits-causal.safetensors" \
    > "$OUT/exl2_logits.log" 2>&1; echo "exl2 reference logits rc=$?" >> "$OUT/exl2_logits.log"; }) &
  exllamav2_job=$!; }

section "build (sm_90)"  # SKIP_BUILD=1: the modules a command before this one built in place
[ -n "${SKIP_BUILD:-}" ] || python3 -m kobold_backend.ops.build --cpu --cuda > "$OUT/build.log" 2>&1 \
  || { tail -30 "$OUT/build.log"; exit 1; }

want tests && {
section "GPU tests"
LOGS=/tmp/kb-gpu-logs; rm -rf "$LOGS"; mkdir -p "$LOGS"
FIRST="${GPU_FIRST:-}"
FILES=${GPU_FILES:-$( (for f in $FIRST; do echo "$f"; done; grep -l "mark.gpu" tests/test_*.py) | awk '!seen[$0]++')}
echo "$FILES" | xargs -P "${TEST_WORKERS:-4}" -I{} sh -c \
  'n=$(basename {} .py); s=$(date +%s); timeout '"${PER_FILE_LIMIT:-200}"' python3 -m pytest -q -p no:cacheprovider -m gpu -rfE {} > '"$LOGS"'/$n.log 2>&1; echo "$n rc=$? $(( $(date +%s) - s ))s: $(grep -E "passed|failed|error|no tests ran" '"$LOGS"'/$n.log | tail -1)" >> '"$LOGS"'/summary.txt'
sort "$LOGS/summary.txt"; cat "$LOGS"/test_*.log > "$OUT/gpu_tests.log"
grep -h "^FAILED\|^ERROR" "$LOGS"/test_*.log | cut -c1-300 | head -40
grep -h -B2 -A12 "^E  " "$LOGS"/test_*.log | cut -c1-240 | head -80
}

want gemv && { section "GEMV variants"
timeout 60 python3 tools/gptq_gemv_bench.py --quick > "$OUT/gemv.txt" 2>&1; grep -v "^ " "$OUT/gemv.txt" | tail -30; }

bench_model() {  # bench_model NAME PATH [extra bench flags...]: our bench on a written checkpoint
  local name=$1 path=$2; shift 2
  [ "$(left)" -lt 40 ] && { echo "skip $name (time)"; return; }
  local t=$SECONDS
  timeout $(( $(left) < 120 ? $(left) : 120 )) python3 -m kobold_backend.bench --model "$path" "$@" \
    --json "$OUT/$name.json" > "$OUT/$name.log" 2>&1
  echo "$name rc=$? $((SECONDS - t)) s"; grep -v "^INFO\|^WARNING\|^kobold_backend:" "$OUT/$name.log" | tail -6
}
exllamav2_on() {  # exllamav2_on NAME PATH: exllamav2 on the same folder
  [ "$(left)" -lt 40 ] && { echo "skip exllamav2 $1 (time)"; return; }
  timeout $(( $(left) < 90 ? $(left) : 90 )) python3 - "$2" "$OUT/$1-exllamav2.json" <<'EOF' 2>&1 | grep -v -i warn | tail -3
import json, sys
from kobold_backend.bench.compare import bench_exllamav2
r = bench_exllamav2(sys.argv[1])
json.dump(r, open(sys.argv[2], "w"), indent=1)
print("exllamav2", json.dumps({k: r.get(k) for k in ("decode_tokens_per_s", "prompt_tokens_per_s", "chat_turn",
                                                      "skipped")}))
EOF
}

named ext && { section "doctor and kernel timings"
python3 -c "from kobold_backend.doctor import doctor_report; print(doctor_report())" 2>&1 | tail -12
timeout 60 python3 tools/ext_timing.py > "$OUT/ext_timing.txt" 2>&1; tail -20 "$OUT/ext_timing.txt"; }

named ggml && { section "GGML kernel timings"
timeout 150 python3 tools/ggml_timing.py > "$OUT/ggml_timing.txt" 2>&1; tail -60 "$OUT/ggml_timing.txt"; }

named mma && { section "tensor-core GPTQ product timings"
timeout 90 python3 tools/mma_timing.py > "$OUT/mma_timing.txt" 2>&1; tail -22 "$OUT/mma_timing.txt"; }

named kvtiming && { section "quantized KV cache timings"
timeout 170 python3 tools/kv_quant_timing.py --layers 2 --steps 16 > "$OUT/kv_timing.txt" 2>&1
echo "kv_quant_timing rc=$?"; grep -v -i warn "$OUT/kv_timing.txt" | tail -55; }

want_any gptq gguf exl2 exllamav2 kv spec act base && { section "write 7B checkpoints"
python3 - <<'EOF' > "$OUT/write.log" 2>&1; tail -3 "$OUT/write.log"; }
import os, time
from pathlib import Path
from kobold_backend.bench.checkpoint import PRESETS, write_synthetic_gptq
from kobold_backend.bench.exl2_checkpoint import write_synthetic_exl2
from kobold_backend.bench.gguf_checkpoint import write_synthetic_gguf
shape = PRESETS["llama2-7b"]
sections = os.environ.get("SECTIONS", "").split()  # only the checkpoints the named sections bench
for name, users, write in (
        ("gptq", "gptq exllamav2 kv spec base",
         lambda: write_synthetic_gptq(Path("/tmp/gptq-7b"), shape, max_position_embeddings=32768)),
        ("gguf", "gguf", lambda: write_synthetic_gguf(Path("/tmp/q4km-7b.gguf"), shape)),
        ("exl2", "exl2 exllamav2", lambda: write_synthetic_exl2(Path("/tmp/exl2-7b"), shape)),
        ("gptq act-order", "act", lambda: write_synthetic_gptq(Path("/tmp/gptq-7b-act"), shape, act_order=True))):
    if sections and not set(users.split()) & set(sections):
        continue
    t = time.time(); write(); print(f"{name} written in {time.time() - t:.1f} s", flush=True)
EOF

section "benches"
want gptq && bench_model gptq-7b /tmp/gptq-7b
want gptq && KOBOLD_BACKEND_GEMV_RULE=classic bench_model gptq-7b-classic /tmp/gptq-7b
want gguf && bench_model gguf-7b /tmp/q4km-7b.gguf
want gguf && KOBOLD_BACKEND_GGML_KERNEL=q8 bench_model gguf-7b-q8 /tmp/q4km-7b.gguf
want gguf && KOBOLD_BACKEND_GGML_KERNEL=classic bench_model gguf-7b-classic /tmp/q4km-7b.gguf
want gguf && KOBOLD_BACKEND_GGML_REPACK=0 bench_model gguf-7b-q8-pdl-stored /tmp/q4km-7b.gguf
want exl2 && bench_model exl2-7b /tmp/exl2-7b
want exllamav2 && tail -2 "$OUT/exllamav2_build.log"
want exllamav2 && exllamav2_on exl2-7b /tmp/exl2-7b
want exllamav2 && exllamav2_on gptq-7b /tmp/gptq-7b
want kv && bench_model gptq-7b-cache-fp16 /tmp/gptq-7b --contexts 4000,16000
want kv && for c in q8 q4; do bench_model "gptq-7b-cache-$c" /tmp/gptq-7b --cache-dtype "$c" --contexts 4000,16000; done
want spec && bench_model gptq-7b-speculative /tmp/gptq-7b --speculative --draft-preset qwen2.5-0.5b ${SPEC_FLAGS:-}
want spec && grep -q "Error" "$OUT/gptq-7b-speculative.log" && CUDA_LAUNCH_BLOCKING=1 bench_model gptq-7b-speculative-sync \
  /tmp/gptq-7b --speculative --draft-preset qwen2.5-0.5b ${SPEC_FLAGS:-}
want act && bench_model gptq-7b-act /tmp/gptq-7b-act
want act && KOBOLD_BACKEND_GEMV_RULE=classic bench_model gptq-7b-act-classic /tmp/gptq-7b-act
named ggmlrepack && { section "GGML Q4_0 / Q8_0 files, re-laid out and as stored"
for r in Q4_0 Q8_0; do
  python3 -c "from pathlib import Path; from kobold_backend.bench.checkpoint import PRESETS
from kobold_backend.bench.gguf_checkpoint import write_synthetic_gguf
write_synthetic_gguf(Path('/tmp/$r-7b.gguf'), PRESETS['llama2-7b'], recipe='$r')" > "$OUT/write-$r.log" 2>&1
  bench_model "gguf-7b-$r" "/tmp/$r-7b.gguf"
  KOBOLD_BACKEND_GGML_REPACK=0 bench_model "gguf-7b-$r-stored" "/tmp/$r-7b.gguf"
  rm -f "/tmp/$r-7b.gguf"
done; }

named base && [ -n "${BASE:-}" ] && { section "the 7B GPTQ bench from BASE=$BASE"
  (cd "$BASE" && PYTHONPATH="$BASE:/tmp/site" python3 -m kobold_backend.ops.build --cuda > "$OUT/build-base.log" 2>&1 \
    && PYTHONPATH="$BASE:/tmp/site" timeout $(( $(left) < 120 ? $(left) : 120 )) python3 -m kobold_backend.bench \
      --model /tmp/gptq-7b --json "$OUT/gptq-7b-base.json" > "$OUT/gptq-7b-base.log" 2>&1)
  echo "base rc=$?"; tail -4 "$OUT/gptq-7b-base.log" 2>/dev/null || tail -5 "$OUT/build-base.log"; }
named compare && [ "$(left)" -gt 120 ] && { section "bench --compare (exllamav2, transformers)"
  timeout $(( $(left) - 20 )) python3 -m kobold_backend.bench --preset llama2-7b --compare --json "$OUT/compare.json" \
    2>&1 | grep -v -i warn | tail -12; }
named exl2logits && { wait "${exllamav2_job:-}" 2>/dev/null; tail -3 "$OUT/exl2_logits.log"; }
section "done"
