#!/usr/bin/env bash
# One device call for EXL2: build the extension for sm_90 while exllamav2 JIT-builds its own and writes its causal
# logits for tests/data/exl2; then the EXL2 GPU tests, a synthetic 7B-shaped 4.0 bpw EXL2 folder timed by this
# engine's bench and by exllamav2 on the same folder. Carry .whl (the exllamav2 wheel). Results in $OUT.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kb-device}; mkdir -p "$OUT"
export PATH="$PATH:/usr/local/cuda/bin" CXX=g++
export OUT PYTHONUNBUFFERED=1 MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=9.0 KOBOLD_BACKEND_CUDA_ARCH=9.0
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH="$PWD:/tmp/site"
t0=$SECONDS
(timeout 200 python3 tools/exl2_reference_logits.py "$OUT/reference-logits.safetensors" > "$OUT/exllamav2_logits.log" 2>&1;
 echo "exllamav2 logits rc=$? at $((SECONDS - t0)) s" >> "$OUT/exllamav2_logits.log") &
logits_job=$!
python3 -m kobold_backend.ops.build --cpu --cuda > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
echo "== built at $((SECONDS - t0)) s"
python3 - <<'EOF' > "$OUT/write.log" 2>&1
from pathlib import Path
from kobold_backend.bench.checkpoint import PRESETS
from kobold_backend.bench.exl2_checkpoint import write_synthetic_exl2
write_synthetic_exl2(Path("/tmp/exl2-7b"), PRESETS["llama2-7b"])
EOF
echo "== 7B EXL2 written at $((SECONDS - t0)) s"; tail -2 "$OUT/write.log"
timeout 80 python3 -m kobold_backend.bench --model /tmp/exl2-7b --json "$OUT/ours.json" 2>&1 | grep -v -i warn | tail -5
echo "== ours benched at $((SECONDS - t0)) s"
wait $logits_job; tail -4 "$OUT/exllamav2_logits.log"
[ -f "$OUT/reference-logits.safetensors" ] && cp "$OUT/reference-logits.safetensors" tests/data/exl2/reference-logits-causal.safetensors
timeout 50 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE tests/test_exl2.py > "$OUT/gpu_tests.log" 2>&1
echo "== GPU tests rc=$? at $((SECONDS - t0)) s"; tail -12 "$OUT/gpu_tests.log"
timeout 70 python3 - <<'EOF' 2>&1 | grep -v -i warn | tail -6
import json, os
from kobold_backend.bench.compare import bench_exllamav2
r = bench_exllamav2("/tmp/exl2-7b")
json.dump(r, open(os.environ["OUT"] + "/exllamav2.json", "w"), indent=1)
print("exllamav2", json.dumps({k: r.get(k) for k in ("prompt_tokens_per_s", "decode_tokens_per_s", "skipped")}))
EOF
echo "== done at $((SECONDS - t0)) s"
