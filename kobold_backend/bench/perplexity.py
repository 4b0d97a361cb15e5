"""`kobold-backend bench --perplexity FILE`: the perplexity of a model on a text with each KV cache dtype, the
quality side of the quantized caches (engine/perplexity.py does the scoring)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Dict

from kobold_backend.engine.loader import load_model
from kobold_backend.engine.perplexity import perplexity


def run_perplexity(args: argparse.Namespace) -> int:
    if args.model is None:
        sys.stderr.write("bench --perplexity needs --model (a checkpoint with its tokenizer)\n")
        return 2
    text = Path(args.perplexity).read_text(encoding="utf-8", errors="replace")
    lm = load_model(args.model, device=args.device)
    try:
        ids = lm.tokenizer.encode(text)
        if len(ids) < 2:
            sys.stderr.write(f"{args.perplexity} holds fewer than 2 tokens\n")
            return 2
        results: Dict[str, Any] = {}
        for name in args.cache_dtype:
            r = perplexity(lm.model, ids, cache_dtype=name)
            results[name] = {"perplexity": r.perplexity, "tokens": r.tokens,
                             "cache_bytes": lm.model.new_cache(cache_dtype=name).nbytes}
    finally:
        lm.unload()
    base = results.get("fp16", {}).get("perplexity")
    for name, r in results.items():
        if base:
            r["vs_fp16_percent"] = (r["perplexity"] / base - 1) * 100
        delta = f"  {r['vs_fp16_percent']:+.3f} % vs fp16" if base else ""
        sys.stderr.write(f"{name:5s} perplexity {r['perplexity']:.4f} over {r['tokens']} tokens, cache "
                         f"{r['cache_bytes'] / 2**20:,.2f} MiB{delta}\n")
    out = {"model": args.model, "text": str(args.perplexity), "perplexity": results}
    if args.json == "-":
        sys.stdout.write(json.dumps(out, indent=2) + "\n")
    elif args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0
