"""llama.cpp's figures on the same GGUF file, from its own `llama-bench` binary run as a subprocess.

Two `llama-bench -o json` runs: prompt speed (`-p 512,2048 -n 0`) and decode speed after a filled cache
(`-p 0 -n 128 -d CONTEXT,...`), all layers on the GPU with flash attention (`-ngl 99 -fa on`) and the KV-cache
types that match the engine's --cache-dtype. Each test's `avg_ts` (tokens/s averaged over the repetitions) is
the figure; the binary's commit and, when its build wrote `llama-bench.build.json` beside it, the CMake flags are
recorded with them.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from kobold_backend.errors import KoboldBackendError

# The engine's --cache-dtype as llama.cpp's (-ctk, -ctv) cache types.
CACHE_TYPES: Dict[str, Tuple[str, str]] = {
    "fp16": ("f16", "f16"), "q8": ("q8_0", "q8_0"), "q4": ("q4_0", "q4_0"), "k8v4": ("q8_0", "q4_0"),
}
BUILD_INFO_SUFFIX = ".build.json"  # beside the binary: {"commit": ..., "cmake_flags": [...]} written at build time


class LlamaBenchError(KoboldBackendError):
    """llama-bench could not be run or its output could not be read."""


def find_llama_bench(flag: Optional[str]) -> Optional[str]:
    """The llama-bench binary: --llamacpp-bench, else the LLAMA_BENCH environment variable, else None."""
    return flag or os.environ.get("LLAMA_BENCH") or None


def check_llama_bench(binary: str) -> str:
    """`binary` if it is an executable file; otherwise one sentence saying what is wrong with it."""
    path = Path(binary)
    if not path.is_file():
        raise LlamaBenchError(f"llama-bench {binary} does not exist (build the llama-bench target of llama.cpp; "
                              "docs/performance.md says how).")
    if not os.access(path, os.X_OK):
        raise LlamaBenchError(f"llama-bench {binary} is not executable.")
    return binary


def bench_args(model: str, cache_dtype: str, *, prompts: Sequence[int] = (), depths: Sequence[int] = (),
               decode_steps: int = 128, repetitions: int = 3) -> List[str]:
    """llama-bench's arguments for prompt tests (`prompts`) or decode tests after `depths` cached tokens."""
    if bool(prompts) == bool(depths):
        raise ValueError("give prompt lengths or decode depths, one of the two")
    ctk, ctv = CACHE_TYPES[cache_dtype]
    args = ["-m", model, "-ngl", "99", "-fa", "on", "-ctk", ctk, "-ctv", ctv, "-r", str(repetitions), "-o", "json"]
    if prompts:
        return args + ["-p", ",".join(map(str, prompts)), "-n", "0"]
    return args + ["-p", "0", "-n", str(decode_steps), "-d", ",".join(map(str, depths))]


def run_llama_bench(binary: str, args: Sequence[str], timeout: float = 900) -> List[Dict[str, Any]]:
    """Run llama-bench and return its JSON records (one per test); a failure is one LlamaBenchError sentence."""
    try:
        done = subprocess.run([binary, *args], capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        raise LlamaBenchError(f"llama-bench {binary} does not exist.") from None
    except PermissionError:
        raise LlamaBenchError(f"llama-bench {binary} is not executable.") from None
    except subprocess.TimeoutExpired:
        raise LlamaBenchError(f"llama-bench {' '.join(args)} ran past {timeout:.0f} s.") from None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output on stderr"])[-1]
        raise LlamaBenchError(f"llama-bench exited with status {done.returncode} ({last}).")
    try:
        records = json.loads(done.stdout)
    except ValueError as exc:
        raise LlamaBenchError(f"llama-bench printed no JSON on stdout ({exc}).") from None
    if not isinstance(records, list) or not all(isinstance(r, dict) and "avg_ts" in r for r in records):
        raise LlamaBenchError("llama-bench's JSON is not a list of test records with avg_ts.")
    return records


def build_info(binary: str) -> Dict[str, Any]:
    """The commit and CMake flags the device script wrote beside the binary, if it did."""
    path = Path(binary + BUILD_INFO_SUFFIX)
    if not path.is_file():
        return {}
    try:
        info = json.loads(path.read_text())
    except ValueError as exc:
        raise LlamaBenchError(f"{path} is not JSON ({exc}).") from None
    return info if isinstance(info, dict) else {}


def bench_llamacpp(binary: str, model: str, cache_dtype: str = "fp16", prompt_lengths: Sequence[int] = (512, 2048),
                   contexts: Sequence[int] = (128, 4000), decode_steps: int = 128,
                   repetitions: int = 3) -> Dict[str, Any]:
    """llama.cpp's prompt and decode tokens/s on `model` (a GGUF file), keyed like bench_engine's figures: prompt
    length, and decode context (the tokens already in the cache, llama-bench's depth)."""
    ctk, ctv = CACHE_TYPES[cache_dtype]
    prompt = run_llama_bench(binary, bench_args(model, cache_dtype, prompts=prompt_lengths,
                                                repetitions=repetitions))
    decode = run_llama_bench(binary, bench_args(model, cache_dtype, depths=contexts, decode_steps=decode_steps,
                                                repetitions=repetitions))
    first = (prompt + decode)[0]
    return {
        "build_commit": first.get("build_commit"), "build_number": first.get("build_number"),
        "build": build_info(binary), "gpu_info": first.get("gpu_info"), "model_type": first.get("model_type"),
        "cache_types": [ctk, ctv], "flash_attn": True, "repetitions": repetitions,
        "prompt_tokens_per_s": {str(r["n_prompt"]): float(r["avg_ts"]) for r in prompt if r.get("n_prompt")},
        "decode_tokens_per_s": {str(r["n_depth"]): float(r["avg_ts"]) for r in decode if r.get("n_gen")},
        "prompt_stddev_tokens_per_s": {str(r["n_prompt"]): float(r.get("stddev_ts", 0.0))
                                       for r in prompt if r.get("n_prompt")},
        "decode_stddev_tokens_per_s": {str(r["n_depth"]): float(r.get("stddev_ts", 0.0))
                                       for r in decode if r.get("n_gen")},
    }


def gguf_file_type(path: str) -> Optional[str]:
    """The GGUF file's general.file_type as llama.cpp names the recipe, lower case (`q4_k_m`), or None."""
    import gguf

    from kobold_backend.engine.gguf.file import GGUFFile

    file = GGUFFile(Path(path))
    meta = file.metadata
    file.close()
    try:
        name = gguf.LlamaFileType(int(meta["general.file_type"])).name
    except (KeyError, ValueError, TypeError):
        return None
    return name.replace("MOSTLY_", "").lower()


def variant_label(file_type: Optional[str], cache_dtype: str) -> str:
    """The second key of `ratios.llamacpp`: the GGUF file type (`q4_k_m`) with an fp16 cache, the cache dtype
    (`q8`) with a quantized one, so a cache comparison reads `ratios.llamacpp.q8.decode_tokens_per_s.16000`."""
    if cache_dtype != "fp16":
        return cache_dtype
    return file_type or "gguf"


def llamacpp_ratios(ours: Dict[str, Any], theirs: Dict[str, Any]) -> Dict[str, Dict[str, float]]:
    """ours ÷ theirs (> 1: this engine is faster) per figure and size, where both have the figure."""
    out: Dict[str, Dict[str, float]] = {}
    for figure in ("prompt_tokens_per_s", "decode_tokens_per_s"):
        pairs = {n: ours[figure][n] / value for n, value in theirs.get(figure, {}).items()
                 if n in ours.get(figure, {}) and value}
        if pairs:
            out[figure] = pairs
    return out
