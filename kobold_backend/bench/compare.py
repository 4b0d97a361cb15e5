"""The same figures for other engines in the same process: exllamav2 (if importable) and transformers fp16.

Neither is a dependency of this package; each is skipped with a reason when it cannot run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict

import torch

from kobold_backend.bench.timing import random_ids, sync, timed


def bench_exllamav2(path: str, prompt_lengths=(512, 2048), contexts=(128, 4000), decode_steps: int = 128,
                    chat_context: int = 3500, chat_new: int = 50) -> Dict[str, Any]:
    try:
        from exllamav2 import ExLlamaV2, ExLlamaV2Cache, ExLlamaV2Config
    except Exception as exc:  # any import failure (missing, or its JIT build failing) means: not compared
        return {"skipped": f"exllamav2 is not importable here ({type(exc).__name__}: {exc})"}
    torch.backends.cuda.enable_cudnn_sdp(False)
    dev = torch.device("cuda")
    torch.cuda.reset_peak_memory_stats(dev)
    config = ExLlamaV2Config(path)
    model = ExLlamaV2(config)
    cache = ExLlamaV2Cache(model, max_seq_len=4608, lazy=True)
    model.load_autosplit(cache)
    vocab = config.vocab_size
    out: Dict[str, Any] = {"version": _version("exllamav2")}

    def prefill(ids: torch.Tensor) -> None:
        cache.current_seq_len = 0
        model.forward(ids, cache, preprocess_only=True)

    prompt = {}
    for n in prompt_lengths:
        ids = random_ids(n, vocab, n)
        prefill(ids)
        prompt[str(n)] = n / min(timed(lambda ids=ids: prefill(ids), dev) for _ in range(3))
    out["prompt_tokens_per_s"] = prompt

    def decode(first: int, steps: int) -> None:
        token = torch.tensor([[first]])
        for _ in range(steps):
            logits = model.forward(token, cache)
            token = torch.argmax(logits[:, -1, :], dim=-1, keepdim=True).cpu()

    decode_rates = {}
    for ctx in contexts:
        ids = random_ids(ctx, vocab, ctx)
        prefill(ids[:, :-1])
        decode(int(ids[0, -1]), 4)
        cache.current_seq_len = ctx - 1
        first = int(ids[0, -1])
        decode_rates[str(ctx)] = decode_steps / timed(lambda first=first: decode(first, decode_steps), dev)
    out["decode_tokens_per_s"] = decode_rates

    conv = random_ids(chat_context + chat_new, vocab, 7)

    def full_prefill() -> None:
        cache.current_seq_len = 0
        model.forward(conv, cache, last_id_only=True)

    full = timed(full_prefill, dev)
    cache.current_seq_len = chat_context
    turn = timed(lambda: model.forward(conv[:, chat_context:], cache, last_id_only=True), dev)
    out["chat_turn"] = {"ttft_s": turn, "full_prefill_s": full, "ratio": turn / full}
    sync(dev)
    out["peak_memory_bytes"] = torch.cuda.max_memory_allocated(dev)
    model.unload()
    torch.cuda.empty_cache()
    return out


def bench_transformers(
    path: str, prompt_length: int = 2048, context: int = 128, decode_steps: int = 64
) -> Dict[str, Any]:
    """transformers fp16 on a dense model of the same architecture and shape, random weights built on the GPU
    (no disk)."""
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except Exception as exc:
        return {"skipped": f"transformers is not importable here ({type(exc).__name__}: {exc})"}
    torch.backends.cuda.enable_cudnn_sdp(False)
    dev = torch.device("cuda")
    raw = json.loads((Path(path) / "config.json").read_text())
    raw.pop("quantization_config", None)
    config = AutoConfig.for_model(raw["model_type"],
                                  **{k: v for k, v in raw.items() if k not in ("architectures", "model_type")})
    torch.cuda.reset_peak_memory_stats(dev)
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(config).half().eval()
    vocab = config.vocab_size
    out: Dict[str, Any] = {"version": _version("transformers")}
    with torch.inference_mode():
        ids = random_ids(prompt_length, vocab, 1).to(dev)
        model(ids)
        out["prompt_tokens_per_s"] = {str(prompt_length): prompt_length / timed(lambda: model(ids), dev)}
        ctx_ids = random_ids(context, vocab, 2).to(dev)

        def decode() -> None:
            res = model(ctx_ids, use_cache=True)
            past = res.past_key_values
            token = torch.argmax(res.logits[:, -1:], dim=-1)
            for _ in range(decode_steps):
                res = model(token, past_key_values=past, use_cache=True)
                past = res.past_key_values
                token = torch.argmax(res.logits[:, -1:], dim=-1)
                token.item()

        decode()
        prefill_s = timed(lambda: model(ctx_ids), dev)
        total = timed(decode, dev)
        out["decode_tokens_per_s"] = {str(context): decode_steps / max(total - prefill_s, 1e-9)}
    out["peak_memory_bytes"] = torch.cuda.max_memory_allocated(dev)
    model.to("meta")
    torch.cuda.empty_cache()
    return out


def _version(package: str) -> str:
    try:
        from importlib.metadata import version

        return version(package)
    except Exception:
        return "unknown"
