"""Speed of this engine on one checkpoint: prompt, decode at two contexts, chat turn, memory, roofline."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import torch

from kobold_backend.bench.timing import copy_bandwidth, random_ids, sync, timed
from kobold_backend.engine.decode_graph import GraphDecoder, graphs_supported
from kobold_backend.engine.lane import Lane
from kobold_backend.engine.loader import load_model


def _decode(model: Any, cache: Any, graph: Any, first: int, steps: int) -> List[int]:
    """Greedy decode with one host read per token (the chosen id), as the generator does."""
    token = first
    out = []
    for _ in range(steps):
        if graph is not None:
            logits = graph.step(token)
        else:
            x = torch.tensor([[token]], device=model.device)
            logits = model.forward(x, cache)[0, -1]
        token = int(torch.argmax(logits).item())
        out.append(token)
    return out


def bench_engine(path: str, device: str = "auto", prompt_lengths: Sequence[int] = (512, 2048),
                 contexts: Sequence[int] = (128, 4000),
                 decode_steps: int = 128, chat_context: int = 3500, chat_new: int = 50,
                 use_graphs: bool = True, max_seq_len: int = 4608, cache_dtype: str = "fp16",
                 threads: Optional[int] = None) -> Dict[str, Any]:
    lm = load_model(path, device=device, max_seq_len=max_seq_len, with_tokenizer=False, cache_dtype=cache_dtype,
                    threads=threads)
    model = lm.model
    dev = model.device
    vocab = lm.config.vocab_size
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    cache = model.new_cache()
    graph = GraphDecoder(model, cache) if use_graphs and graphs_supported(model) else None
    result: Dict[str, Any] = {"device": str(dev), "graphs": graph is not None,
                              "weights_bytes": model.nbytes, "cache_bytes": cache.nbytes, "cache_dtype": cache_dtype}

    prompt = {}
    for n in prompt_lengths:
        ids = random_ids(n, vocab, n, dev)
        cache.reset()
        model.forward(ids, cache)  # warm-up
        runs = []
        for _ in range(3):
            cache.reset()
            runs.append(timed(lambda ids=ids: model.forward(ids, cache), dev))
        prompt[str(n)] = n / min(runs)
    result["prompt_tokens_per_s"] = prompt

    decode = {}
    for ctx in contexts:
        ids = random_ids(ctx, vocab, ctx, dev)
        cache.reset()
        model.forward(ids[:, :-1], cache)
        cache.snapshot()  # a linear-attention model's states return here (no-op for a KV cache)
        _decode(model, cache, graph, int(ids[0, -1]), 4)  # warm-up and graph capture for this bucket
        cache.truncate(ctx - 1)
        first = int(ids[0, -1])
        secs = timed(lambda first=first: _decode(model, cache, graph, first, decode_steps), dev)
        decode[str(ctx)] = decode_steps / secs
    result["decode_tokens_per_s"] = decode

    conversation = random_ids(chat_context + chat_new, vocab, 7, dev)
    cache.reset()
    model.forward(conversation, cache)
    cache.reset()
    full = timed(lambda: torch.argmax(model.forward(conversation, cache)[0, -1]).item(), dev)
    new = conversation[0, chat_context:].tolist()
    cache.reset()
    model.forward(conversation[:, :chat_context], cache)
    cache.snapshot()  # the turn's cached context, restorable for a linear-attention model
    lane = Lane(model, cache, graph is not None)  # the generator's path: a graph replay for a short chunk

    def turn_once(feed: Any) -> float:
        cache.truncate(chat_context)
        return timed(lambda: torch.argmax(feed()).item(), dev)

    first = turn_once(lambda: lane.feed(new, None))
    turn = min(turn_once(lambda: lane.feed(new, None)) for _ in range(3))  # warm: kernels picked, graph captured
    eager = min(turn_once(lambda: model.forward(conversation[:, chat_context:], cache)[0, -1]) for _ in range(3))
    result["chat_turn"] = {"cached_tokens": chat_context, "new_tokens": chat_new, "ttft_s": turn,
                           "first_call_ttft_s": first, "eager_ttft_s": eager, "full_prefill_s": full,
                           "ratio": turn / full}

    if graph is not None:
        ids = random_ids(64, vocab, 11, dev)
        cache.reset()
        model.forward(ids[:, :-1], cache)
        cache.snapshot()
        with_graph = _decode(model, cache, graph, int(ids[0, -1]), 32)
        cache.truncate(63)
        eager = _decode(model, cache, None, int(ids[0, -1]), 32)
        result["graph_tokens_match_eager"] = with_graph == eager

    if dev.type == "cuda":
        sync(dev)
        result["peak_memory_bytes"] = torch.cuda.max_memory_allocated(dev)
    bandwidth = copy_bandwidth(dev)
    # a decode step reads every weight but the embedding table, and of routed experts only the chosen ones
    unread = sum(layer.mlp.unread_bytes_per_token() for layer in model.layers
                 if getattr(layer.mlp, "unread_bytes_per_token", None) is not None)
    read_per_token = model.nbytes - unread - lm.model.embed_tokens.numel() * lm.model.embed_tokens.element_size()
    result["copy_bandwidth_bytes_per_s"] = bandwidth
    result["roofline_tokens_per_s"] = bandwidth / read_per_token
    result["decode_fraction_of_roofline"] = {k: v / result["roofline_tokens_per_s"] for k, v in decode.items()}
    lm.unload()
    return result
