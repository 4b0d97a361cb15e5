"""Speed of CPU offload levels on one GPU: loads a checkpoint with its first N layers on the CPU (a plan of
kobold_backend.engine.device_map) and times a prompt and decode steps; docs/performance.md "Layer split and CPU
offload" has the numbers and the command.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

import torch

from kobold_backend.bench.checkpoint import PRESETS, write_synthetic_gptq
from kobold_backend.bench.timing import timed
from kobold_backend.engine.config import ModelConfig
from kobold_backend.engine.device_map import GIB, normalize_device, plan_device_map
from kobold_backend.engine.loader import load_model

log = logging.getLogger(__name__)


def measure_split(
    path: Union[str, Path],
    cpu_layers: int,
    gpu: str = "cuda:0",
    max_seq_len: int = 2048,
    prompt_len: int = 512,
    context: int = 1024,
    decode_steps: int = 16,
    embed_on_cpu: bool = False,
) -> Dict[str, Any]:
    """Load `path` with its first `cpu_layers` layers on the CPU and the rest on `gpu`, then time a prompt
    and greedy decode steps at `context` tokens; reports tokens/s, the plan and the GPU's peak memory."""
    config = ModelConfig.from_dir(path)
    if max(prompt_len, context + decode_steps) > max_seq_len:
        raise ValueError(f"prompt {prompt_len} or context {context} + {decode_steps} steps exceed {max_seq_len}")
    gpu = normalize_device(gpu)
    counts = {"cpu": cpu_layers, gpu: config.num_layers - cpu_layers}
    plan = plan_device_map(path, None, max_seq_len, layer_counts=counts, embed_on_cpu=embed_on_cpu,
                           head_device=gpu)
    log.info("%s", plan.describe())
    dev = torch.device(gpu)
    torch.cuda.reset_peak_memory_stats(dev)
    start = time.perf_counter()
    lm = load_model(path, with_tokenizer=False, **plan.load_kwargs())
    load_s = time.perf_counter() - start
    model = lm.model
    cache = model.new_cache()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, config.vocab_size, (1, max(prompt_len, context)), generator=gen)
    ids = ids.to(model.embed_tokens.device)
    model.forward(ids[:, :8], cache)  # warm-up
    cache.reset()
    prompt_s = timed(lambda: model.forward(ids[:, :prompt_len], cache), dev)
    cache.reset()
    model.forward(ids[:, : context - 1], cache)
    token = int(ids[0, context - 1])

    def decode() -> None:
        nonlocal token
        for _ in range(decode_steps):
            x = torch.tensor([[token]], device=model.embed_tokens.device)
            token = int(torch.argmax(model.forward(x, cache)[0, -1]).item())

    decode_s = timed(decode, dev)
    planned = {u.device: u.used_bytes for u in plan.usage}
    result = {
        "cpu_layers": cpu_layers, "gpu_layers": config.num_layers - cpu_layers, "threads": torch.get_num_threads(),
        "load_s": load_s, "prompt_tokens": prompt_len, "prompt_tokens_per_s": prompt_len / prompt_s,
        "context": context, "decode_tokens_per_s": decode_steps / decode_s,
        "planned_bytes": planned, "gpu_peak_bytes": int(torch.cuda.max_memory_allocated(dev)),
        "cache_bytes": cache.nbytes, "plan": plan.describe(),
    }
    lm.unload()
    return result


def main(argv: Optional[List[str]] = None) -> int:
    """`python -m kobold_backend.bench.split --preset llama2-7b --levels 0,8,16`: the offload table."""
    p = argparse.ArgumentParser(prog="python -m kobold_backend.bench.split",
                                description="speed of CPU offload levels on one GPU")
    p.add_argument("--model", help="checkpoint folder (default: a synthetic GPTQ one of --preset's shape)")
    p.add_argument("--preset", default="llama2-7b", choices=sorted(PRESETS))
    p.add_argument("--levels", default="0,8,16", help="numbers of layers on the CPU, comma-separated")
    p.add_argument("--gpu", default="cuda:0")
    p.add_argument("--max-context", type=int, default=2048)
    p.add_argument("--prompt", type=int, default=512, help="prompt tokens timed")
    p.add_argument("--context", type=int, default=1024, help="context the decode steps run at")
    p.add_argument("--steps", type=int, default=16, help="decode steps timed")
    p.add_argument("--json", metavar="FILE", help="write the results as JSON to FILE")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    if not torch.cuda.is_available():
        sys.stderr.write("measuring a split needs a CUDA GPU\n")
        return 2
    levels = [int(x) for x in args.levels.split(",")]
    gpu = normalize_device(args.gpu)
    results: List[Dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kobold-split-") as tmp:
        path = args.model or str(write_synthetic_gptq(Path(tmp) / args.preset, PRESETS[args.preset]))
        for n in levels:
            r = measure_split(path, n, gpu, args.max_context, args.prompt, args.context, args.steps)
            results.append(r)
            sys.stdout.write(f"cpu layers {n:3d}/{n + r['gpu_layers']}: prompt {r['prompt_tokens_per_s']:9.1f} tok/s, "
                             f"decode {r['decode_tokens_per_s']:7.2f} tok/s at {r['context']} tokens, GPU peak "
                             f"{r['gpu_peak_bytes'] / GIB:.2f} GiB (planned {r['planned_bytes'][gpu] / GIB:.2f} GiB)\n")
            sys.stdout.flush()
            if args.json:
                Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
